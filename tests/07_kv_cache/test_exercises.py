"""Notebook 07's exercises: a right answer passes, each classic wrong answer fails with its message.

The wrong answers here are written independently of the ones in ``minillm.exercises.nb07`` (as a
learner would write them), so these tests also show that the diagnosis does not depend on the
exact code of the mistake.
"""

from __future__ import annotations

import pytest
import torch

from minillm.cache import memory_budget
from minillm.exercises import nb07


class RightCache:
    def __init__(self, config, max_len):
        shape = (1, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.length = 0

    @property
    def past_length(self):
        return self.length

    def positions(self, q_len):
        return torch.arange(self.length, self.length + q_len)[None]

    def mask(self, attention_mask, q_len):
        end = self.length + q_len
        return (torch.arange(end)[None, :] <= torch.arange(self.length, end)[:, None])[None, None]

    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, q_len):
        self.length += q_len


class AtOffsetZero(RightCache):
    def update(self, layer, k, v):
        n = k.shape[2]
        self.k[layer][:, :, 0:n] = k
        self.v[layer][:, :, 0:n] = v
        return self.k[layer][:, :, : self.length + n], self.v[layer][:, :, : self.length + n]


class KeysBeforeThisStep(RightCache):
    def update(self, layer, k, v):
        super().update(layer, k, v)
        return self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]


class OneColumnTooMany(RightCache):
    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        super().update(layer, k, v)
        return self.k[layer][:, :, : end + 1], self.v[layer][:, :, : end + 1]


class QueriesAtTheStart(RightCache):
    def mask(self, attention_mask, q_len):
        k_len = self.length + q_len
        return (torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None])[None, None]


class NoCausality(RightCache):
    def mask(self, attention_mask, q_len):
        return torch.ones(1, 1, q_len, self.length + q_len, dtype=torch.bool)


class MaskWithoutTheNewKeys(RightCache):
    def mask(self, attention_mask, q_len):
        return torch.ones(1, 1, q_len, self.length, dtype=torch.bool)


class SeesOneKeyAhead(RightCache):
    def mask(self, attention_mask, q_len):
        end = self.length + q_len
        return (torch.arange(end)[None, :] <= torch.arange(self.length, end)[:, None] + 1)[None, None]


class MaskWithoutBatchAndHeadDims(RightCache):
    def mask(self, attention_mask, q_len):
        return super().mask(attention_mask, q_len)[0, 0]


class LengthAdvancedInUpdate(RightCache):
    """Counts the new tokens in layer 0's update, so every later layer writes them one step too far."""

    def update(self, layer, k, v):
        keys, values = super().update(layer, k, v)
        if layer == 0:
            self.length += k.shape[2]
        return keys, values

    def advance(self, q_len):
        pass


class Concatenating(RightCache):
    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        super().update(layer, k, v)
        keys = torch.cat([self.k[layer][:, :, : self.length], k], dim=2)
        return keys, torch.cat([self.v[layer][:, :, : self.length], v], dim=2)


class OneBufferSharedByTheLayers(RightCache):
    def __init__(self, config, max_len):
        super().__init__(config, max_len)
        shape = (1, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape)] * config.n_layers  # the same tensor n_layers times
        self.v = [torch.zeros(shape)] * config.n_layers


class UpdateIgnoresTheLayer(RightCache):
    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        self.k[0][:, :, self.length : end] = k
        self.v[0][:, :, self.length : end] = v
        return self.k[0][:, :, :end], self.v[0][:, :, :end]


class ValuesNeverWritten(RightCache):
    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class ConcatenatingValues(RightCache):
    def update(self, layer, k, v):
        keys, _ = super().update(layer, k, v)
        return keys, torch.cat([self.v[layer][:, :, : self.length], v], dim=2)


def test_right_cache_passes(capsys):
    assert nb07.check_kv_cache(RightCache) is True
    assert "✅ kv_cache: all 5 checks pass" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (AtOffsetZero, "writes every step's keys at column 0"),
        (KeysBeforeThisStep, "returns the keys stored *before* this step"),
        (OneColumnTooMany, "one column too many"),
        (QueriesAtTheStart, "they are the *last* q_len"),
        (NoCausality, "must not see the tokens after it"),
        (MaskWithoutTheNewKeys, "the new keys included"),
        (Concatenating, "the keys it returns are not a slice of the preallocated buffer"),
        (ConcatenatingValues, "the values it returns are not a slice of the preallocated buffer"),
        (OneBufferSharedByTheLayers, "every layer reads and writes one and the same buffer"),
        (UpdateIgnoresTheLayer, "every layer reads and writes one and the same buffer"),
        (ValuesNeverWritten, "update() never writes v"),
        (SeesOneKeyAhead, "see the key right after it"),
    ],
    ids=["offset-0", "off-by-one-short", "off-by-one-long", "queries-at-start", "not-causal", "mask-too-short", "cat",
         "cat-values", "shared-buffer", "ignores-layer", "values-never-written", "sees-next-key"],
)
def test_cache_mistakes_are_named(capsys, wrong, says):
    assert nb07.check_kv_cache(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [MaskWithoutBatchAndHeadDims, LengthAdvancedInUpdate], ids=["mask-2d", "length-in-update"])
def test_other_wrong_caches_fail(capsys, wrong):
    """Wrong in ways no named mistake describes: the check still fails them, and says what differs."""
    assert nb07.check_kv_cache(wrong) is False
    assert "❌ kv_cache" in capsys.readouterr().out


def test_every_layer_is_compared(capsys):
    """A shared buffer leaves the last layer's keys right (it wrote last): the first layer's show it."""
    assert nb07.check_kv_cache(OneBufferSharedByTheLayers) is False
    out = capsys.readouterr().out
    assert "at index (0, " in out  # the difference is in layer 0


def test_cache_stub_is_waiting(capsys):
    class Stub(RightCache):
        def update(self, layer, k, v):
            raise NotImplementedError

    assert nb07.check_kv_cache(Stub) is False
    assert "⏳ kv_cache: not attempted yet" in capsys.readouterr().out


def test_cache_hints_come_in_three_tiers(capsys):
    nb07.check_kv_cache(AtOffsetZero, hint=3)
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 3/3" in out


def _bytes(config, dtype):
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def test_bytes_per_token_other_right_answers(capsys):
    assert nb07.check_kv_bytes_per_token(lambda c, d: 2 * c.n_layers * c.n_kv_heads * c.head_dim * d.itemsize) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda c, d: _bytes(c, d) * c.n_heads // c.n_kv_heads, "*query* heads"),
        (lambda c, d: _bytes(c, d) // 2, "factor 2"),
        (lambda c, d: 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4, "depend on the dtype"),
        (lambda c, d: 2 * c.n_layers * c.hidden_size * torch.empty((), dtype=d).element_size(), "*query* heads"),
    ],
    ids=["query-heads", "no-factor-2", "always-4-bytes", "hidden-size"],
)
def test_bytes_per_token(capsys, wrong, says):
    assert nb07.check_kv_bytes_per_token(_bytes) is True
    assert nb07.check_kv_bytes_per_token(wrong) is False
    assert says in capsys.readouterr().out


def _crossover(config, batch):
    from minillm.cache import parameter_count

    return parameter_count(config) / (batch * 2 * config.n_layers * config.n_kv_heads * config.head_dim)


def test_crossover_is_11_7k_tokens_for_smollm2_at_batch_1():
    assert round(_crossover(nb07.SMOLLM2_135M, 1)) == 11677
    assert round(_crossover(nb07.SMOLLM2_135M, 8)) == 1460


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda c, b: _crossover(c, 1) * b, "multiplied by the batch"),
        (lambda c, b: _crossover(c, 1), "the batch is missing"),
        (lambda c, b: _crossover(c, b) * c.n_kv_heads / c.n_heads, "query heads"),
        (lambda c, b: int(_crossover(c, b)), "keep the fraction"),
        (lambda c, b: _crossover(c, b) * 2, "different number formats"),
    ],
    ids=["times-batch", "no-batch", "query-heads", "rounded", "mixed-formats"],
)
def test_crossover(capsys, wrong, says):
    assert nb07.check_decode_crossover(_crossover) is True
    assert nb07.check_decode_crossover(wrong) is False
    assert says in capsys.readouterr().out


def _fits(config, gpu_bytes, context, dtype):
    one = memory_budget(config, 1, context, dtype)
    return max(0, (gpu_bytes - one.weights) // one.kv_cache)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda c, g, n, d: g // memory_budget(c, 1, n, d).kv_cache, "the weights are missing"),
        (lambda c, g, n, d: (g - memory_budget(c, 1, n, d).weights) // memory_budget(c, 1, n, d).kv_cache, "return 0"),
        (lambda c, g, n, d: float(_fits(c, g, n, d)), "expected an int, got a float"),
        (lambda c, g, n, d: g // memory_budget(c, 1, n, d).total, "weights once per sequence"),
    ],
    ids=["no-weights", "negative", "float", "weights-per-sequence"],
)
def test_max_batch(capsys, wrong, says):
    assert nb07.check_max_batch(_fits) is True
    assert nb07.check_max_batch(wrong) is False
    assert says in capsys.readouterr().out


def test_max_batch_by_trying_each_batch_passes():
    """A loop that grows the batch until the budget no longer fits is right too (just slower)."""

    def by_trying(config, gpu_bytes, context, dtype):
        batch = 0
        while memory_budget(config, batch + 1, context, dtype).total <= gpu_bytes:
            batch += 1
        return batch

    assert nb07.check_max_batch(by_trying) is True
