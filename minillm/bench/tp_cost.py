"""What tensor parallelism costs per token, on paper: the bytes on the wire and an alpha-beta model.

A decode step of a tensor-parallel Llama talks at fixed places (``minillm.distributed.layers``):

* one all-reduce of the token embeddings (the vocabulary-parallel table: each rank's masked rows, summed);
* two all-reduces per decoder layer (o_proj and down_proj, row-parallel), each of the [batch, hidden]
  activations;
* one all-gather of the logits (each rank's vocabulary columns, padded to the largest share);
* the step's inputs, broadcast from rank 0 (a few int64 per row: latency, not bandwidth).

So a step all-reduces ``(2 L + 1) x hidden x batch x dtype bytes`` and gathers ``W x ceil(V / W) x
batch x dtype bytes`` of logits, whatever the link (``step_bytes``).

Time, in the alpha-beta model: a collective is a sequence of messages, each costing a latency
``alpha`` plus its bytes over the bandwidth ``beta``. A ring all-reduce of ``S`` bytes over ``W``
ranks is a reduce-scatter then an all-gather, ``2 (W - 1)`` messages of ``S / W`` bytes per rank:
``2 (W - 1) alpha + 2 (W - 1) / W x S / beta`` (``ring_all_reduce_bytes``: what each rank sends). An
all-gather of an ``S``-byte result: ``(W - 1) alpha + (W - 1) / W x S / beta``. Compute: a decode
step reads every weight once, so a rank's compute is the single process's times the share of the
weights the busiest rank reads (``rank_share``: SmolLM2's 3 GQA groups split 2 + 1 over two ranks,
so that share is a little over a half). The ring's ``2 (W - 1)`` latencies are the pessimistic
count: for small messages NCCL switches to trees, about ``2 log2 W`` of them.

Per token at ``W`` ranks: ``compute(1) x share(W) + collectives(W)``. Splitting pays when
``compute(1) x (1 - share(W)) > collectives(W)``: ``break_even_seconds`` is the single-process
compute per step above which it does. The links below are stated PARAMETERS (datasheet bandwidths,
typical small-message latencies), not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minillm.distributed.shard import plan
from minillm.model.config import ModelConfig


@dataclass(frozen=True)
class Link:
    """A link between ranks: ``bandwidth`` in bytes per second (one direction, per rank) and
    ``latency`` in seconds per message (one step of a ring, software included)."""

    name: str
    bandwidth: float
    latency: float


# PARAMETERS, not measurements: rounded datasheet bandwidths, and the order of magnitude of one
# small message's latency through the usual library (NCCL over NVLink or PCIe, TCP over Ethernet).
LINKS = (
    Link("NVLink 4 (H100 SXM)", 450e9, 3e-6),
    Link("PCIe 4.0 x16", 25e9, 10e-6),
    Link("10 Gb Ethernet", 1.25e9, 30e-6),
)
HBM_BANDWIDTH = 3.35e12  # bytes/s, an H100 SXM's memory (a PARAMETER): the GPU example's compute
# A larger model to put the default one in perspective (a PARAMETER: Llama-3-8B's shape, bfloat16).
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        intermediate_size=14336)


@dataclass(frozen=True)
class StepBytes:
    """The collectives of one decode step: how many, and the bytes of the tensors they carry."""

    all_reduces: int  # calls per step: 2 per layer + 1 for the embedding
    all_reduce_bytes: int  # the tensor summed by each all-reduce: batch x hidden x dtype bytes
    all_gather_bytes: int  # the gathered logits, padded: world x ceil(vocab / world) x batch x dtype bytes

    @property
    def total_all_reduce_bytes(self) -> int:
        return self.all_reduces * self.all_reduce_bytes


def step_bytes(config: ModelConfig, world: int, batch: int, dtype_bytes: int) -> StepBytes:
    """The bytes a decode step of ``batch`` rows all-reduces and all-gathers over ``world`` ranks."""
    widest = -(-config.vocab_size // world)  # the shares differ by at most one row; the largest is gathered
    return StepBytes(all_reduces=2 * config.n_layers + 1,
                     all_reduce_bytes=batch * config.hidden_size * dtype_bytes,
                     all_gather_bytes=world * widest * batch * dtype_bytes)


def step_messages(config: ModelConfig, world: int) -> int:
    """The messages each rank sends in a decode step's ring collectives (the broadcast aside)."""
    return (2 * config.n_layers + 1) * 2 * (world - 1) + (world - 1)


def sent_per_rank(config: ModelConfig, world: int, batch: int, dtype_bytes: int) -> float:
    """The bytes each rank sends in a decode step's ring all-reduces and all-gather."""
    b = step_bytes(config, world, batch, dtype_bytes)
    return b.all_reduces * ring_all_reduce_bytes(b.all_reduce_bytes, world) + ring_all_gather_bytes(b.all_gather_bytes, world)


def fit_link(name: str, messages: int, sent: list[float], seconds: list[float]) -> Link:
    """The link that explains ``seconds[i]`` per step for ``sent[i]`` bytes per rank in ``messages``
    messages: ``seconds = messages x latency + sent / bandwidth``, fitted by least squares; latency
    alone (an infinite bandwidth) when the points do not show the time growing with the bytes."""
    n = len(sent)
    mean_b, mean_t = sum(sent) / n, sum(seconds) / n
    var = sum((b - mean_b) ** 2 for b in sent)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sent, seconds)) / var if var else 0.0
    if slope <= 0 or mean_t - slope * mean_b <= 0:
        return Link(name, math.inf, mean_t / messages)
    return Link(name, 1 / slope, (mean_t - slope * mean_b) / messages)


def ring_all_reduce_bytes(size: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes: ``2 (W - 1) / W x size``."""
    return 2 * (world - 1) / world * size


def ring_all_gather_bytes(size: float, world: int) -> float:
    """Bytes each rank sends in a ring all-gather whose result is ``size`` bytes: ``(W - 1) / W x size``."""
    return (world - 1) / world * size


def all_reduce_seconds(size: float, world: int, link: Link) -> float:
    return 2 * (world - 1) * link.latency + ring_all_reduce_bytes(size, world) / link.bandwidth


def all_gather_seconds(size: float, world: int, link: Link) -> float:
    return (world - 1) * link.latency + ring_all_gather_bytes(size, world) / link.bandwidth


def communication_seconds(config: ModelConfig, world: int, batch: int, dtype_bytes: int, link: Link) -> float:
    """The collectives of one decode step over ``link``: the all-reduces, the logits' all-gather
    and the step's broadcast (two small messages down a tree of ``ceil(log2 W)`` hops)."""
    if world == 1:
        return 0.0
    b = step_bytes(config, world, batch, dtype_bytes)
    return (b.all_reduces * all_reduce_seconds(b.all_reduce_bytes, world, link)
            + all_gather_seconds(b.all_gather_bytes, world, link)
            + 2 * math.ceil(math.log2(world)) * link.latency)


def weight_elements(config: ModelConfig, world: int) -> list[int]:
    """The weights each rank reads in a decode step (elements): its slices of q/k/v/o and of the
    feed-forward, in every layer, and its rows of the LM head (the embedding lookup reads one row
    per token; norms are negligible)."""
    h, d = config.hidden_size, config.head_dim
    out = []
    for s in plan(config, world):
        attention = 2 * len(s.q_heads) * d * h + 2 * len(s.kv_heads) * d * h  # q and o; k and v
        feed_forward = 3 * len(s.ffn) * h
        out.append(config.n_layers * (attention + feed_forward) + len(s.vocab) * h)
    return out


def rank_share(config: ModelConfig, world: int) -> float:
    """The busiest rank's share of the weights one process reads: its compute relative to one process's."""
    return max(weight_elements(config, world)) / sum(weight_elements(config, 1))


def predict_seconds(compute_seconds: float, config: ModelConfig, world: int, batch: int, dtype_bytes: int,
                    link: Link) -> float:
    """Predicted seconds per decode step at ``world`` ranks, from one process's ``compute_seconds``."""
    return compute_seconds * rank_share(config, world) + communication_seconds(config, world, batch, dtype_bytes, link)


def break_even_seconds(config: ModelConfig, world: int, batch: int, dtype_bytes: int, link: Link) -> float:
    """One process's compute per step above which ``world`` ranks over ``link`` are faster."""
    return communication_seconds(config, world, batch, dtype_bytes, link) / (1 - rank_share(config, world))


def roofline_seconds(config: ModelConfig, dtype_bytes: int, bandwidth: float = HBM_BANDWIDTH) -> float:
    """A memory-bound decode step's compute on one device: every weight read once at ``bandwidth``."""
    return sum(weight_elements(config, 1)) * dtype_bytes / bandwidth
