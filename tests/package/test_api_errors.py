"""Bad arguments to the public API fail at once with an error that names the parameter, and
leave the engine serving (issue: hostile inputs). A tiny random checkpoint keeps these fast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm import Engine, SamplingParams, load_model
from minillm.cache import PagedKVCache

from helpers.checkpoints import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_tokenizer, "llama", max_position_embeddings=512,
                                vocab_size=300)
    return load_model(folder, device="cpu")


IDS = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_ids=torch.zeros((0, 3), dtype=torch.long)), ValueError, r"batch >= 1 and seq >= 1, got \[0, 3\]"),
    (dict(input_ids=IDS, position_ids=torch.tensor([[-1, 0, 1]])), ValueError, "position_ids must be >= 0, got -1"),
    (dict(input_ids=IDS, position_ids=torch.tensor([[0.0, 1.5, 2.0]])), TypeError, "position_ids must be integers"),
    (dict(input_ids=IDS, attention_mask=torch.tensor([[2, 1, 1]])), ValueError, r"only 0 \(padding\) and 1"),
    (dict(input_ids=IDS, attention_mask=torch.tensor([[0.5, 1.0, 1.0]])), ValueError, r"got values \[0.5, 1.0\]"),
    (dict(input_ids=IDS, attention_mask=torch.tensor([[-1, 1, 1]])), ValueError, "only 0"),
])
def test_forward_refuses_malformed_inputs(tiny, kwargs, error, match):
    model, _ = tiny
    with pytest.raises(error, match=match):
        model(**kwargs)
    assert model(IDS, attention_mask=torch.tensor([[0, 1, 1]])).shape == (1, 3, 300)  # 0/1 masks still work


def test_forward_refuses_a_cache_of_another_dtype(tiny):
    model, _ = tiny
    cache = PagedKVCache(model.config, 4, 16, "cpu", torch.float64)
    cache.add_sequence(0)
    with pytest.raises(TypeError, match="the KV cache holds torch.float64 but the model computes in torch.float32"):
        model(IDS, paged=cache.prepare([0], 3))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_cache_tokens=0), ValueError, "kv_cache_tokens must be >= 1, got 0"),
    (dict(kv_cache_tokens=-5), ValueError, "kv_cache_tokens must be >= 1, got -5"),
    (dict(kv_cache_tokens=10**15), ValueError, r"a KV cache of 62,500,000,000,000 blocks of 16 tokens \(kv_cache_tokens\) needs .* GiB free"),
    (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
    (dict(block_size=2.5), TypeError, r"block_size must be an int, got 2.5 \(float\)"),
    (dict(max_batch_size=True), TypeError, r"max_batch_size must be an int, got True \(bool\)"),
    (dict(max_batch_size=2.0), TypeError, "max_batch_size must be an int"),
])
def test_engine_arguments_are_checked(tiny, kwargs, error, match):
    model, tok = tiny
    with pytest.raises(error, match=match):
        Engine(model, tok, backend="eager", **kwargs)


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.generate(None), TypeError, "prompts must be a list of prompts"),
    (lambda e: e.generate(b"abc"), TypeError, "a prompt must be a str or a list of token ids, got bytes"),
    (lambda e: e.generate([b"abc"]), TypeError, "a prompt must be a str or a list of token ids, got bytes"),
    (lambda e: e.generate(["a"], {"max_new_tokens": 2}), TypeError, "params must be a SamplingParams or a list"),
    (lambda e: e.stream("a", {"max_new_tokens": 2}), TypeError, "params must be a SamplingParams"),
    (lambda e: e.add_request(None), TypeError, "a prompt must be a str or a list of token ids, got NoneType"),
    (lambda e: e.chat("hi"), TypeError, "messages must be a list"),
    (lambda e: e.generate(["a " * 3_000_000], SamplingParams(max_new_tokens=1)), ValueError,
     r"the prompt \(6,000,000 characters\) is at least [\d,]+ tokens, more than the context window of 512"),
])
def test_engine_calls_are_checked_and_the_engine_keeps_serving(tiny, call, error, match):
    model, tok = tiny
    engine = Engine(model, tok, backend="eager")
    with pytest.raises(error, match=match):
        call(engine)
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_stop_must_be_text():
    with pytest.raises(TypeError, match=r"stop must be a str or a list of str, got b'x' \(bytes\)"):
        SamplingParams(stop=b"x")


def test_decode_takes_numpy_and_torch_integers(tiny):
    _, tok = tiny
    ids = tok.encode("the king")
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == tok.decode([np.int64(i) for i in ids]) == "the king"
