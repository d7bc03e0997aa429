"""Which part of every weight a rank holds under tensor parallelism (plain Python, no torch).

Tensor parallelism cuts each layer's matrices so that every rank multiplies by a slice and
the ranks talk twice per layer (Megatron-LM's layout):

* **column-parallel** q/k/v and gate/up: a rank holds some *output rows* (some heads, some
  feed-forward channels) and computes those outputs from the whole input, with no talking;
* **row-parallel** o_proj and down_proj: a rank holds the *input columns* that match the
  outputs it computed, so its product is a partial sum of the full output; one all-reduce
  adds the ranks' partial sums.

Attention needs no talking at all if a rank holds whole grouped-query groups: a KV head and
the query heads that read it. So heads split by whole GQA groups — SmolLM2-135M's 9 query
heads in 3 KV groups go 1 + 1 + 1 groups over 3 ranks and 2 + 1 over 2 — and a world size
larger than the number of KV heads cannot split (replicating KV heads would be the way out;
it is not done here). The feed-forward channels split in whole blocks of 32 where they can,
so a packed (Q8_0 / Q4_x) ``down_proj`` splits between blocks. The vocabulary splits too:
each rank holds some rows of the embedding table and of the LM head.

``plan(config, world_size)`` lists every rank's ``Shard``; ``Shard.part(name)`` says which
slice of a checkpoint tensor the rank loads, ``Shard.local_config(config)`` the config of the
rank's model (its head counts and feed-forward width), a normal minillm ``Transformer``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minillm.model.config import ModelConfig

ALIGN = 32  # a packed block's width: feed-forward channels split between blocks of this many where they can


def split(total: int, parts: int) -> list[range]:
    """``range(total)`` in ``parts`` consecutive pieces whose sizes differ by at most one, the
    larger first (3 over 2 -> 2 + 1)."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(a, b) for a, b in pairwise(bounds)]


@dataclass(frozen=True)
class Shard:
    """One rank's share: global index ranges of its KV heads, query heads, feed-forward
    channels and vocabulary rows."""

    rank: int
    world_size: int
    head_dim: int
    kv_heads: range
    q_heads: range
    ffn: range
    vocab: range

    @property
    def q_rows(self) -> slice:
        """Rows of q_proj (and input columns of o_proj) that the rank holds."""
        return slice(self.q_heads.start * self.head_dim, self.q_heads.stop * self.head_dim)

    @property
    def kv_rows(self) -> slice:
        """Rows of k_proj and v_proj that the rank holds."""
        return slice(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)

    def part(self, name: str) -> tuple[int, slice] | None:
        """Which slice of the checkpoint tensor ``name`` the rank holds: ``(dim, slice)`` (dim 0
        = output rows, dim 1 = input columns), or None for a tensor every rank holds whole
        (the norms). ``name`` is a transformers name, with or without the leading ``model.``."""
        short = name.removeprefix("model.")
        leaf = short.rsplit(".", 2)[-2:] if short.startswith("layers.") else short.split(".")
        module = leaf[0]
        if module in ("embed_tokens", "lm_head"):
            return 0, slice(self.vocab.start, self.vocab.stop)
        if module == "q_proj":
            return 0, self.q_rows
        if module in ("k_proj", "v_proj"):
            return 0, self.kv_rows
        if module == "o_proj":
            return 1, self.q_rows
        if module in ("gate_proj", "up_proj"):
            return 0, slice(self.ffn.start, self.ffn.stop)
        if module == "down_proj":
            return 1, slice(self.ffn.start, self.ffn.stop)
        if module in ("norm", "input_layernorm", "post_attention_layernorm"):
            return None
        raise ValueError(f"{name}: not a tensor of a Llama-family model, no tensor-parallel layout for it")

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of the rank's own model: its query and KV heads, its feed-forward width
        (the vocabulary and hidden size stay whole: the model still reads and writes full
        hidden states and returns logits over every token, through the collectives)."""
        return dataclasses.replace(config, n_heads=len(self.q_heads), n_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.ffn), head_dim=self.head_dim)


def plan(config: ModelConfig, world_size: int) -> list[Shard]:
    """Every rank's ``Shard`` of ``config`` over ``world_size`` ranks.

    Raises ValueError, naming the counts, when a rank would get no whole GQA group (more
    ranks than KV heads), no feed-forward channel or no vocabulary row.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    n_heads, n_kv, group = config.n_heads, config.n_kv_heads, config.n_heads // config.n_kv_heads
    if world_size > n_kv:
        raise ValueError(
            f"cannot split {n_heads} query heads in {n_kv} KV heads (GQA groups of {group}) over {world_size} ranks: "
            f"each rank needs at least one whole group, so the world size can be at most {n_kv}")
    unit = ALIGN if config.intermediate_size % ALIGN == 0 and config.intermediate_size // ALIGN >= world_size else 1
    if config.intermediate_size // unit < world_size or config.vocab_size < world_size:
        raise ValueError(f"cannot split intermediate_size={config.intermediate_size} and vocab_size="
                         f"{config.vocab_size} over {world_size} ranks: each rank needs a share of both")
    kv_parts = split(n_kv, world_size)
    ffn_parts = split(config.intermediate_size // unit, world_size)
    vocab_parts = split(config.vocab_size, world_size)
    return [Shard(rank=r, world_size=world_size, head_dim=config.head_dim, kv_heads=kv,
                  q_heads=range(kv.start * group, kv.stop * group),
                  ffn=range(ffn.start * unit, ffn.stop * unit), vocab=vocab)
            for r, (kv, ffn, vocab) in enumerate(zip(kv_parts, ffn_parts, vocab_parts))]


def shard_for(config: ModelConfig, world_size: int, rank: int) -> Shard:
    """``plan(config, world_size)[rank]``, with the rank checked."""
    shards = plan(config, world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")
    return shards[rank]
