"""Tensor parallelism on 2 and 3 gloo processes: the same numbers as one process, and failures named.

The tiny model has 6 query heads in 3 KV groups: 2 ranks split it 2 + 1 groups (uneven), 3 ranks
1 + 1 + 1; its 320-token vocabulary splits unevenly over 3 (107 + 107 + 106). In float64 the
only difference from one process is the order in which the row-parallel partial sums are
added, so the logits agree to ~1e-15 and the greedy tokens exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import tiny_hf_checkpoint, write_gguf
from helpers.tp_ranks import BLOCK_SIZE, NUM_BLOCKS, dies, greedy, logits_and_tokens

from minillm.assets import cache_dir
from minillm.cache.paged import PagedKVCache
from minillm.distributed.launch import run_ranks
from minillm.distributed.loader import load_tensor_parallel
from minillm.engine.runner import ModelRunner
from minillm.model.loading import load_model

PROMPTS = [[5, 17, 42, 7, 99, 3, 250], [11, 12], [300, 8, 1, 64, 64]]
NEW_TOKENS = 5
SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
         "intermediate_size": 96}


@pytest.fixture(scope="module")
def untied(tmp_path_factory, tiny_tokenizer) -> Path:
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tp") / "untied", tiny_tokenizer, "llama", **SHAPE)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tiny_tokenizer) -> Path:
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tp") / "tied", tiny_tokenizer, "llama",
                              tie_word_embeddings=True, **SHAPE)


def one_process(source: Path, dtype: str = "float64", weights: str | None = None) -> dict:
    model, _ = load_model(source, device="cpu", dtype=dtype, weights=weights)
    with torch.inference_mode():
        logits = [model(torch.tensor([p]))[0] for p in PROMPTS]
    cache = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype=model.dtype)
    tokens = greedy(ModelRunner(model, cache, backend="eager"), cache, PROMPTS, NEW_TOKENS)
    return {"logits": logits, "tokens": tokens}


def ranks_ok(outcomes) -> list:
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error or o.exitcode]
    assert not errors, "\n".join(errors)
    return [o.value for o in outcomes]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tiny_tokenizer) -> Path:
    """Qwen2's q/k/v have biases: column-parallel, they split with the rows."""
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2", tiny_tokenizer, "qwen2", **SHAPE)


@pytest.mark.parametrize("world, checkpoint", [(2, "untied"), (3, "tied"), (2, "qwen2")])
def test_logits_and_greedy_tokens_match_one_process(world, checkpoint, request):
    source = request.getfixturevalue(checkpoint)
    values = ranks_ok(run_ranks(logits_and_tokens, world, (str(source), "float64", PROMPTS, NEW_TOKENS),
                                timeout=30, deadline=90))
    expected = one_process(source)
    got = values[0]
    for mine, theirs in zip(got["logits"], expected["logits"]):
        assert mine.dtype == torch.float64 and mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() <= 1e-10
    assert got["tokens"] == expected["tokens"]
    assert got["tokens"][0] == got["tokens"][-1]  # the fork continues like its parent
    assert got["backend"] == f"eager x{world} ranks"
    assert [v["steps"] for v in values[1:]] == [NEW_TOKENS] * (world - 1)  # one prefill + the decodes


def test_native_blocks_split_by_rows_and_by_whole_blocks(tmp_path, monkeypatch, untied, tiny_tokenizer,
                                                         kernels_built):
    """A GGUF of Q8_0 matrices: each rank holds slices of the file's blocks, and the run matches
    one process holding them all (the packed product runs in float32: compared within bounds)."""
    import gguf

    (tmp_path / "cache").mkdir()  # the GGUF's conversion goes here, the kernels already built stay where they are
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    meta = {"llama.embedding_length": 96, "llama.feed_forward_length": 96, "llama.attention.head_count": 6,
            "llama.attention.head_count_kv": 3, "llama.attention.key_length": 16, "llama.attention.value_length": 16,
            "llama.rope.dimension_count": 16}
    path = write_gguf(tmp_path / "tiny.gguf", untied, tiny_tokenizer, meta=meta,
                      types=lambda name: gguf.GGMLQuantizationType.Q8_0 if name.endswith("weight") and "norm" not in name
                      else gguf.GGMLQuantizationType.F32, heads=(6, 3))
    values = ranks_ok(run_ranks(logits_and_tokens, 2, (str(path), "float32", PROMPTS, NEW_TOKENS, "native"),
                                timeout=30, deadline=90))
    expected = one_process(path, "float32", "native")
    assert values[0]["packed"] == 2 * 7 + 2  # every layer's seven matrices, the table and the (untied) head
    for mine, theirs in zip(values[0]["logits"], expected["logits"]):
        assert (mine - theirs).abs().max().item() <= 1e-4
    assert values[0]["tokens"] == expected["tokens"]


def test_quantized_at_load_each_rank_its_slices(untied, kernels_built):
    """weights="q8_0": each rank quantizes its float slices, calibrated by a tensor-parallel forward."""
    values = ranks_ok(run_ranks(logits_and_tokens, 2, (str(untied), "float32", PROMPTS, NEW_TOKENS, "q8_0"),
                                timeout=30, deadline=90))
    expected = one_process(untied, "float32", "q8_0")
    assert values[0]["packed"] == 2 * 7 + 2
    for mine, theirs in zip(values[0]["logits"], expected["logits"]):
        assert (mine - theirs).abs().max().item() <= 1e-4
    assert values[0]["tokens"] == expected["tokens"]


@pytest.mark.parametrize("world, victim, idle", [(3, 1, False), (2, 0, True)])
def test_a_rank_that_dies_is_named_by_the_others(untied, world, victim, idle):
    """A rank killed in the middle of a forward, or rank 0 killed while the workers wait for its
    next step: every other rank raises a RankFailure naming it (within the group's timeout)."""
    outcomes = run_ranks(dies, world, (str(untied), victim, idle), timeout=20, grace=2, deadline=60)
    assert outcomes[victim].exitcode == 3
    for survivor in outcomes:
        if survivor.rank != victim:
            assert survivor.error is not None and "RankFailure" in survivor.error, survivor.error
            assert f"rank {survivor.rank}: rank {victim} stopped answering" in survivor.error


class OneOfFour:
    """Just enough of a ``Group`` for the loader to reach the shard plan (which needs no talking)."""

    rank, world_size = 0, 4


def test_a_world_size_that_cannot_split_is_refused_before_loading(untied):
    with pytest.raises(ValueError, match=r"6 query heads in 3 KV heads \(GQA groups of 2\) over 4 ranks"):
        load_tensor_parallel(untied, OneOfFour())
