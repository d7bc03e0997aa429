"""Exercises of notebook 07 (the KV cache): a cache's ``update`` and ``mask``, its size, when its
reads overtake the weights', and what fits on a GPU.

The expected answers come from the package (``minillm.cache``): the learner's cache is driven
through the same steps as ``ContiguousKVCache``, fed the same keys and values. Each classic
mistake is written out as the code a learner would write (the cache mistakes as subclasses of
the package's cache that get one method wrong), so a wrong answer of that kind is named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minillm.cache import ContiguousKVCache, kv_bytes_per_token, memory_budget, parameter_count
from minillm.exercises import Mistake, check
from minillm.model.config import ModelConfig

# ------------------------------------------------------------------ the configs the cases use

SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           intermediate_size=1536, max_position_embeddings=8192, rope_theta=100000.0,
                           tie_word_embeddings=True)
LLAMA_31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          intermediate_size=14336, max_position_embeddings=131072, rope_theta=500000.0)
MHA_TINY = ModelConfig(vocab_size=100, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=128)
# the cache exercise: 2 layers, 2 KV heads of 4 numbers, 12 slots (small enough to print)
CACHE_CONFIG = ModelConfig(vocab_size=8, hidden_size=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=8)
CACHE_MAX_LEN = 12

# ------------------------------------------------------------------ exercise: update() and mask()


@dataclass(frozen=True)
class Steps:
    """A forward pass of ``q_len`` new tokens after forward passes of ``earlier`` tokens each."""

    earlier: tuple[int, ...]
    q_len: int

    def __repr__(self) -> str:
        stored = sum(self.earlier)
        before = f"{stored} tokens stored (steps of {list(self.earlier)})" if self.earlier else "an empty cache"
        return f"{before}, then a step of q_len={self.q_len}"


CACHE_STEPS = [Steps((), 5), Steps((5,), 1), Steps((5, 1), 1), Steps((5, 1, 1), 3), Steps((), 1)]

MakeCache = Callable[[ModelConfig, int], Any]


def _by_layer(per_layer: list[Any]) -> Any:
    """The layers' tensors stacked, ``[n_layers, ...]`` (index 0 of a difference is the layer); as a
    tuple when they cannot be stacked (then the comparison says what came back instead)."""
    if all(isinstance(t, torch.Tensor) for t in per_layer) and len({t.shape for t in per_layer}) == 1:
        return torch.stack(per_layer)
    return tuple(per_layer)


def _drive(make: MakeCache, steps: Steps) -> tuple[Any, Any, torch.Tensor]:
    """Run ``steps`` as the model does (``mask``, then ``update`` in every layer, then ``advance``)
    with seeded random keys and values; return the last step's keys and values of *every* layer,
    ``[n_layers, 1, kv_heads, past_length + q_len, head_dim]``, as ``update`` returned them and
    attention would read them right then (copied before the next layer's update, so a buffer
    shared between layers shows), and its mask."""
    cache = make(CACHE_CONFIG, CACHE_MAX_LEN)
    g = torch.Generator().manual_seed(sum(steps.earlier) * 10 + steps.q_len)
    shape = (CACHE_CONFIG.n_kv_heads, CACHE_CONFIG.head_dim)
    for q_len in (*steps.earlier, steps.q_len):
        mask = cache.mask(None, q_len)
        keys, values = [], []
        for layer in range(CACHE_CONFIG.n_layers):
            k = torch.randn(1, shape[0], q_len, shape[1], generator=g)
            v = torch.randn(1, shape[0], q_len, shape[1], generator=g)
            layer_keys, layer_values = cache.update(layer, k, v)
            keys.append(layer_keys.clone() if isinstance(layer_keys, torch.Tensor) else layer_keys)
            values.append(layer_values.clone() if isinstance(layer_values, torch.Tensor) else layer_values)
        cache.advance(q_len)
    return _by_layer(keys), _by_layer(values), mask


def _package(config: ModelConfig, max_len: int) -> ContiguousKVCache:
    return ContiguousKVCache(config, batch_size=1, max_len=max_len)


class _WritesAtZero(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_len = k.shape[2]
        self.k[layer][:, :, :q_len] = k
        self.v[layer][:, :, :q_len] = v
        return self.k[layer][:, :, : self.length + q_len], self.v[layer][:, :, : self.length + q_len]


class _ReturnsOnlyOld(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        super().update(layer, k, v)
        return self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]


class _ReturnsOneMore(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2] + 1
        super().update(layer, k, v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class _ReturnsOnlyNew(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        super().update(layer, k, v)
        return k, v


class _MaskAtStart(ContiguousKVCache):
    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        return torch.ones(q_len, self.length + q_len, dtype=torch.bool).tril()[None, None]


class _MaskNotCausal(ContiguousKVCache):
    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        return torch.ones(1, 1, q_len, self.length + q_len, dtype=torch.bool)


class _MaskHidesDiagonal(ContiguousKVCache):
    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        q_pos = torch.arange(self.length, self.length + q_len)[:, None]
        return (torch.arange(self.length + q_len)[None, :] < q_pos)[None, None]


class _MaskSeesTheNextKey(ContiguousKVCache):
    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        q_pos = torch.arange(self.length, self.length + q_len)[:, None]
        return (torch.arange(self.length + q_len)[None, :] <= q_pos + 1)[None, None]


class _MaskOverOldKeys(ContiguousKVCache):
    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        return torch.ones(1, 1, q_len, self.length, dtype=torch.bool)


class _OneBufferForAllLayers(ContiguousKVCache):
    def __init__(self, config: ModelConfig, batch_size: int, max_len: int) -> None:
        super().__init__(config, batch_size, max_len)
        self.k = [self.k[0]] * config.n_layers  # n references to one tensor, not n tensors
        self.v = [self.v[0]] * config.n_layers


class _ValuesNeverWritten(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class _KeysAsValues(ContiguousKVCache):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = k
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def _as_mistake(cls: type[ContiguousKVCache], message: str) -> Mistake:
    return Mistake(lambda steps: _drive(lambda c, n: cls(c, 1, n), steps), message)


CACHE_MISTAKES = [
    _as_mistake(_WritesAtZero, "your update() writes every step's keys at column 0, over the ones already "
                "stored: write them at columns past_length .. past_length + q_len."),
    _as_mistake(_ReturnsOnlyOld, "off by the new tokens: update() returns the keys stored *before* this step; "
                "the new queries attend to their own keys too, so return columns 0 .. past_length + q_len."),
    _as_mistake(_ReturnsOneMore, "off by one: update() returns one column too many (an empty slot of zeros that "
                "the queries would attend to); return exactly past_length + q_len columns."),
    _as_mistake(_ReturnsOnlyNew, "update() returns only the new keys: attention needs every key so far, the "
                "stored ones and the new ones (columns 0 .. past_length + q_len of the buffer)."),
    _as_mistake(_OneBufferForAllLayers, "every layer reads and writes one and the same buffer, so each layer's "
                "update() overwrites the keys of the layer before it (a list made with [buffer] * n_layers holds "
                "n_layers references to one tensor, and an update() that ignores `layer` does the same): "
                "each layer needs its own K and V buffers, self.k[layer] and self.v[layer]."),
    _as_mistake(_ValuesNeverWritten, "the keys are right but the values are zeros: update() never writes v "
                "into self.v[layer] (attention would average zeros)."),
    _as_mistake(_KeysAsValues, "the values returned are the keys: write v, not k, into self.v[layer]."),
    _as_mistake(_MaskAtStart, "your mask puts the new queries at positions 0 .. q_len-1; they are the *last* "
                "q_len of the past_length + q_len positions (query i sits at past_length + i), so in decode "
                "the one new query sees every key."),
    _as_mistake(_MaskNotCausal, "every new query sees every key: in a prefill (or a chunk of several tokens) a "
                "query must not see the tokens after it (key j is visible to query i when j <= past_length + i)."),
    _as_mistake(_MaskHidesDiagonal, "your mask hides the diagonal (key < query position instead of <=): a token "
                "must see itself."),
    _as_mistake(_MaskSeesTheNextKey, "your mask lets each new query see the key right after it (key <= query "
                "position + 1): a token sees itself and the tokens before it, never one after (key j <= past_length + i)."),
    _as_mistake(_MaskOverOldKeys, "your mask covers only the keys stored before this step: it needs "
                "past_length + q_len columns, the new keys included."),
]

CACHE_HINTS = [
    "The model calls mask() first, then update() in every layer, then advance(): in mask() and update() "
    "self.length is still the number of tokens stored *before* this step. The new tokens take columns "
    "self.length .. self.length + q_len.",
    "update: end = self.length + k.shape[2]; write k and v into self.k[layer] and self.v[layer] at "
    "[:, :, self.length:end]; return both buffers up to end. mask: query i is at position self.length + i "
    "and sees key j when j <= that position.",
    "mask: q_pos = torch.arange(self.length, end)[:, None]; return (torch.arange(end)[None, :] <= q_pos)[None, None] "
    "(a bool [1, 1, q_len, end]). update: self.k[layer][:, :, self.length:end] = k, the same for v, then "
    "return self.k[layer][:, :, :end], self.v[layer][:, :, :end].",
]


def _writes_in_place(cls: type) -> Callable[[Callable[..., Any], tuple[Any, ...]], str | None]:
    """A rule: the keys and values returned are the preallocated buffers' own columns (no new tensor per step)."""

    def rule(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
        try:
            cache = cls(CACHE_CONFIG, CACHE_MAX_LEN)
            buffers = {"keys": [t.data_ptr() for t in cache.k], "values": [t.data_ptr() for t in cache.v]}
            for q_len in (5, 1):
                cache.mask(None, q_len)
                for layer in range(CACHE_CONFIG.n_layers):
                    k = torch.randn(1, CACHE_CONFIG.n_kv_heads, q_len, CACHE_CONFIG.head_dim)
                    returned = dict(zip(("keys", "values"), cache.update(layer, k, k.clone())))
                    held = {"keys": cache.k[layer], "values": cache.v[layer]}
                    for what, tensor in returned.items():
                        if tensor.data_ptr() != buffers[what][layer] or held[what].data_ptr() != buffers[what][layer]:
                            return (f"the {what} it returns are not a slice of the preallocated buffer (torch.cat "
                                    "or .clone() makes a new tensor and copies the whole cache every step): write "
                                    "into self.k[layer][:, :, past_length:end] (and self.v[layer]) and return "
                                    "self.k[layer][:, :, :end], self.v[layer][:, :, :end].")
                cache.advance(q_len)
        except Exception:  # the values already passed; a rule only reports what it saw
            return None
        return None

    return rule


def check_kv_cache(cls: type, hint: int = 0) -> bool:
    """``cls(config, max_len)``: a contiguous cache whose ``update`` and ``mask`` match
    ``ContiguousKVCache`` over a prefill, two decode steps and a 3-token chunk (and a 1-token prompt).

    Each case compares ``(keys, values, mask)`` of the last step: the keys and the values of every
    layer as ``update()`` returned them (taken before the next layer's update), stacked
    ``[n_layers, ...]``, and the mask ``mask()`` returned.
    """

    def run(steps: Steps) -> tuple[Any, Any, torch.Tensor]:
        return _drive(cls, steps)

    run.__name__ = getattr(cls, "__name__", "cache")
    cases = [((steps,), _drive(_package, steps)) for steps in CACHE_STEPS]
    return check("kv_cache", run, cases, hint=hint, hints=CACHE_HINTS, mistakes=CACHE_MISTAKES,
                 rules=[_writes_in_place(cls)])


# ------------------------------------------------------------------ exercise: bytes per token

BYTES_CASES_IN = [(SMOLLM2_135M, torch.float32), (SMOLLM2_135M, torch.bfloat16),
                  (LLAMA_31_8B, torch.bfloat16), (LLAMA_31_8B, torch.float8_e4m3fn), (MHA_TINY, torch.float16)]


def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


BYTES_MISTAKES = [
    Mistake(lambda c, d: 2 * c.n_layers * c.n_heads * c.head_dim * _bytes_of(d),
            "you counted the *query* heads: the cache stores one key and one value per *KV* head "
            "(grouped-query attention: SmolLM2's 9 query heads share 3 KV heads)."),
    Mistake(lambda c, d: c.n_layers * c.n_kv_heads * c.head_dim * _bytes_of(d),
            "you stored only K (or only V): both are cached, hence the factor 2."),
    Mistake(lambda c, d: 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4,
            "the bytes per number depend on the dtype (4 for float32, 2 for bfloat16, 1 for fp8): "
            "torch.empty((), dtype=dtype).element_size()."),
    Mistake(lambda c, d: 2 * c.n_kv_heads * c.head_dim * _bytes_of(d),
            "that is one layer's worth: every layer keeps its own keys and values (times n_layers)."),
]

BYTES_HINTS = [
    "Per token, each layer stores one key vector and one value vector for each KV head.",
    "2 (K and V) * n_layers * n_kv_heads * head_dim numbers, times the bytes of one number in this dtype.",
    "return 2 * config.n_layers * config.n_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()",
]


def check_kv_bytes_per_token(fn: Callable[[ModelConfig, torch.dtype], int], hint: int = 0) -> bool:
    """``fn(config, dtype)`` -> bytes of K and V one token occupies (``minillm.cache.kv_bytes_per_token``)."""
    cases = [((c, d), kv_bytes_per_token(c, d)) for c, d in BYTES_CASES_IN]
    return check("kv_bytes_per_token", fn, cases, hint=hint, hints=BYTES_HINTS, mistakes=BYTES_MISTAKES)


# ------------------------------------------------------------------ exercise: the crossover

CROSSOVER_CASES_IN = [(SMOLLM2_135M, 1), (SMOLLM2_135M, 8), (LLAMA_31_8B, 1), (LLAMA_31_8B, 32), (MHA_TINY, 3)]


def _crossover(config: ModelConfig, batch: int) -> float:
    """Tokens per sequence at which a decode step's K/V reads equal its weight reads (same dtype)."""
    weights = parameter_count(config) * _bytes_of(torch.float32)
    return weights / (batch * kv_bytes_per_token(config, torch.float32))


def _kv_numbers(c: ModelConfig, heads: int, factor: int = 2) -> int:
    return factor * c.n_layers * heads * c.head_dim


CROSSOVER_MISTAKES = [
    Mistake(lambda c, b: b * parameter_count(c) / _kv_numbers(c, c.n_kv_heads),
            "you multiplied by the batch: the weights are read once per step for the whole batch, but every "
            "sequence reads its own cache, so the KV side grows with batch * t: divide by the batch."),
    Mistake(lambda c, b: parameter_count(c) / _kv_numbers(c, c.n_kv_heads),
            "the batch is missing: B sequences read B caches per step, so the crossover is at t / B."),
    Mistake(lambda c, b: parameter_count(c) / (b * _kv_numbers(c, c.n_heads)),
            "you counted the query heads: the cache holds the *KV* heads only (GQA)."),
    Mistake(lambda c, b: parameter_count(c) / (b * _kv_numbers(c, c.n_kv_heads, factor=1)),
            "both K and V are read for every cached token: the factor 2. (Or the weights and the cache are counted "
            "in different number formats, 4-byte weights against 2-byte K/V: a step reads both in the model's one "
            "format, so the bytes per number cancel; count numbers.)"),
    Mistake(lambda c, b: float(parameter_count(c) // (b * _kv_numbers(c, c.n_kv_heads))),
            "keep the fraction: the crossover is a ratio of bytes (a float), not a whole number of tokens."),
]

CROSSOVER_HINTS = [
    "A decode step reads every weight once (whatever the batch), and each of the B sequences reads its "
    "own t cached tokens. Set the two byte counts equal and solve for t.",
    "weights: parameter_count(config) * bytes per number; KV: batch * t * kv_bytes_per_token(config, dtype). "
    "Both in the same dtype, so the bytes per number cancel.",
    "return parameter_count(config) / (batch * 2 * config.n_layers * config.n_kv_heads * config.head_dim)",
]


def check_decode_crossover(fn: Callable[[ModelConfig, int], float], hint: int = 0) -> bool:
    """``fn(config, batch)`` -> the context length (tokens per sequence, a float) at which a decode
    step reads as many bytes of K/V as of weights."""
    cases = [((c, b), _crossover(c, b)) for c, b in CROSSOVER_CASES_IN]
    return check("decode_crossover", fn, cases, hint=hint, hints=CROSSOVER_HINTS, mistakes=CROSSOVER_MISTAKES,
                 atol=1e-6)


# ------------------------------------------------------------------ exercise: how many sequences fit

GiB = 2**30
FIT_CASES_IN = [(LLAMA_31_8B, 24 * GiB, 8192, torch.bfloat16), (LLAMA_31_8B, 80 * GiB, 131072, torch.bfloat16),
                (LLAMA_31_8B, 16 * GiB, 8192, torch.bfloat16), (LLAMA_31_8B, 8 * GiB, 1024, torch.bfloat16),
                (SMOLLM2_135M, 24 * GiB, 8192, torch.float32)]


def _fits(config: ModelConfig, gpu_bytes: int, context: int, dtype: torch.dtype) -> int:
    one = memory_budget(config, 1, context, dtype)
    return max(0, (gpu_bytes - one.weights) // one.kv_cache)


FIT_MISTAKES = [
    Mistake(lambda c, g, n, d: g // memory_budget(c, 1, n, d).kv_cache,
            "the weights are missing: they take their share of the GPU first; only the rest holds KV caches."),
    Mistake(lambda c, g, n, d: g // memory_budget(c, 1, n, d).total,
            "you counted the weights once per sequence (gpu_bytes // one sequence's weights + KV cache): the weights "
            "are loaded once and shared by the whole batch; subtract them once, then divide what is left."),
    Mistake(lambda c, g, n, d: (g - memory_budget(c, 1, n, d).weights) // memory_budget(c, 1, n, d).kv_cache,
            "not even one sequence fits here: return 0, not a negative batch."),
    Mistake(lambda c, g, n, d: -(-(g - memory_budget(c, 1, n, d).weights) // memory_budget(c, 1, n, d).kv_cache),
            "you rounded up: a sequence that does not fit whole does not fit (round down, //)."),
]

FIT_HINTS = [
    "memory_budget(config, 1, context, dtype) gives the weights and one sequence's KV cache, in bytes.",
    "What is left after the weights, divided by one sequence's KV cache, rounded down; never below 0.",
    "one = memory_budget(config, 1, context, dtype); return max(0, (gpu_bytes - one.weights) // one.kv_cache)",
]


def check_max_batch(fn: Callable[[ModelConfig, int, int, torch.dtype], int], hint: int = 0) -> bool:
    """``fn(config, gpu_bytes, context, dtype)`` -> the largest batch of ``context``-token sequences
    whose weights + KV cache fit in ``gpu_bytes`` (an int, 0 when none fits)."""
    cases = [(args, _fits(*args)) for args in FIT_CASES_IN]
    return check("max_batch", fn, cases, hint=hint, hints=FIT_HINTS, mistakes=FIT_MISTAKES)
