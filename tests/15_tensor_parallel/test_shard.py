"""The tensor-parallel layout: whole GQA groups per rank, slices that tile every matrix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.distributed.shard import ALIGN, plan, shard_for, split
from minillm.model.config import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      intermediate_size=1536, tie_word_embeddings=True)


def test_smollm2_over_three_ranks_is_one_group_each():
    shards = plan(SMOLLM2, 3)
    assert [(s.kv_heads, s.q_heads) for s in shards] == [
        (range(1), range(3)), (range(1, 2), range(3, 6)), (range(2, 3), range(6, 9))]
    assert [s.q_rows for s in shards] == [slice(0, 192), slice(192, 384), slice(384, 576)]
    assert [len(s.ffn) for s in shards] == [512, 512, 512]
    assert [len(s.vocab) for s in shards] == [16384] * 3


def test_smollm2_over_two_ranks_is_two_groups_then_one():
    first, second = plan(SMOLLM2, 2)
    assert (len(first.q_heads), len(first.kv_heads), len(second.q_heads), len(second.kv_heads)) == (6, 2, 3, 1)
    assert first.kv_rows == slice(0, 128) and second.kv_rows == slice(128, 192)
    assert first.ffn == range(768) and second.ffn == range(768, 1536)  # 24 blocks of 32 each
    local = second.local_config(SMOLLM2)
    assert (local.n_heads, local.n_kv_heads, local.head_dim, local.intermediate_size, local.vocab_size) == (3, 1, 64, 768, 49152)


def test_parts_name_the_slice_of_each_tensor():
    shard = shard_for(SMOLLM2, 2, 1)
    assert shard.part("model.layers.3.self_attn.q_proj.weight") == (0, slice(384, 576))
    assert shard.part("layers.3.self_attn.k_proj.bias") == (0, slice(128, 192))
    assert shard.part("model.layers.3.self_attn.o_proj.weight") == (1, slice(384, 576))
    assert shard.part("model.layers.0.mlp.up_proj.weight") == (0, slice(768, 1536))
    assert shard.part("model.layers.0.mlp.down_proj.weight") == (1, slice(768, 1536))
    assert shard.part("model.embed_tokens.weight") == shard.part("lm_head.weight") == (0, slice(24576, 49152))
    assert shard.part("model.norm.weight") is None
    assert shard.part("model.layers.7.post_attention_layernorm.weight") is None
    with pytest.raises(ValueError, match="rope_freqs"):
        shard.part("rope_freqs.weight")


def test_a_world_size_that_cannot_split_names_the_head_counts():
    with pytest.raises(ValueError, match=r"9 query heads in 3 KV heads .* over 4 ranks.* at most 3"):
        plan(SMOLLM2, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            plan(SMOLLM2, bad)
    with pytest.raises(ValueError, match="rank must be"):
        shard_for(SMOLLM2, 2, 2)


def test_split_gives_the_extra_to_the_first_ranks():
    assert split(3, 2) == [range(2), range(2, 3)]
    assert split(320, 3) == [range(107), range(107, 214), range(214, 320)]


@settings(max_examples=200, deadline=None)
@given(n_kv=st.integers(1, 8), group=st.integers(1, 4), head_dim=st.sampled_from([2, 8, 64]),
       ffn=st.integers(1, 400), vocab=st.integers(1, 500), world=st.integers(1, 9))
def test_shards_tile_every_dimension(n_kv, group, head_dim, ffn, vocab, world):
    config = ModelConfig(vocab_size=vocab, hidden_size=32, n_layers=1, n_heads=n_kv * group, n_kv_heads=n_kv,
                         intermediate_size=ffn, head_dim=head_dim)
    if world > n_kv or world > vocab or world > ffn:
        with pytest.raises(ValueError, match="cannot split"):
            plan(config, world)
        return
    shards = plan(config, world)
    for field in ("kv_heads", "q_heads", "ffn", "vocab"):
        ranges = [getattr(s, field) for s in shards]
        assert [i for r in ranges for i in r] == list(range(getattr(config, {"kv_heads": "n_kv_heads",
                "q_heads": "n_heads", "ffn": "intermediate_size", "vocab": "vocab_size"}[field])))
        assert all(len(r) >= 1 for r in ranges)
        assert max(map(len, ranges)) - min(map(len, ranges)) <= (ALIGN if field == "ffn" else group if field == "q_heads" else 1)
    for s in shards:
        assert s.q_heads == range(s.kv_heads.start * group, s.kv_heads.stop * group)  # whole GQA groups
        if ffn % ALIGN == 0 and ffn // ALIGN >= world:
            assert s.ffn.start % ALIGN == 0 and len(s.ffn) % ALIGN == 0  # packed blocks stay whole
        local = s.local_config(config)
        assert local.n_heads // local.n_kv_heads == group and local.head_dim == head_dim
