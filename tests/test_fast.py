"""The fast decode path: the static KV cache, the one-row Linear, and the compiled FastDecoder.

The compiled decoder is checked against transformers' greedy tokens and against the eager
model's logits; the static cache against the contiguous cache's attention; and the compiler
must see a handful of programs, not one per token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache import ContiguousKVCache
from minillm.cache.static import StaticKVCache
from minillm.engine import fast as fast_module
from minillm.engine.fast import FastDecoder
from minillm.model.config import ModelConfig
from minillm.model.layers import Linear
from minillm.model.llama import Transformer
from minillm.sampling import SamplingParams

from test_generate import NEW_TOKENS, prompt_ids, transformers_greedy  # noqa: F401  (fixtures)
from test_model_units import _tiny_hf_checkpoint, tiny_tokenizer  # noqa: F401  (a fixture)

TINY = ModelConfig(vocab_size=64, hidden_size=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=32,
                   max_position_embeddings=512)


@pytest.fixture(scope="module")
def compiled(smollm):
    """One compiled decoder on the real model, shared (compiling takes ~30-60 s on 2 cores).

    Notebook 10 builds the same one (max_len=256), so the second to run finds the generated
    code in torch's on-disk cache."""
    model, _ = smollm
    return FastDecoder(model, max_len=256)


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(TINY).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)
    return model


# --------------------------------------------------------------------------- Linear
def test_linear_one_row_compiled_equals_f_linear():
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).requires_grad_(False)
    x = torch.randn(1, 1, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), expected)  # eager: exactly F.linear
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-5  # the same sum, added up in another order
    rows = torch.randn(3, 96)  # more than one row: F.linear, compiled or not
    assert (compiled(rows) - torch.nn.functional.linear(rows, layer.weight, layer.bias)).abs().max() < 1e-5


# --------------------------------------------------------------------------- StaticKVCache
def test_static_window_grows_in_steps_and_masks_beyond_the_position():
    cache = StaticKVCache(TINY, max_len=100, window=16)
    step = cache.at(5, 1)
    assert step.key_positions.tolist() == list(range(16))
    assert step.mask(None, 1)[0, 0, 0].tolist() == [True] * 6 + [False] * 10
    assert cache.at(15, 1).key_positions.shape[0] == 16
    assert cache.at(16, 1).key_positions.shape[0] == 32  # position 16 needs a 17th slot
    assert cache.at(95, 1).key_positions.shape[0] == 96
    assert cache.at(96, 1).key_positions.shape[0] == 100  # the last window stops at max_len
    prefill = cache.at(0, 3).mask(None, 3)[0, 0, :, :4].int().tolist()
    assert prefill == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]  # causal


def test_static_cache_refuses_out_of_range_positions_and_padding():
    cache = StaticKVCache(TINY, max_len=10)
    with pytest.raises(ValueError, match="holds 10 tokens; positions 8..10"):
        cache.at(8, 3)
    with pytest.raises(ValueError, match="max_len must be in 1..512"):
        StaticKVCache(TINY, max_len=513)
    with pytest.raises(ValueError, match="attention_mask must be None"):
        cache.at(0, 2).mask(torch.ones(1, 2), 2)


@settings(max_examples=20, deadline=None)
@given(prompt=st.integers(1, 40), steps=st.integers(1, 30), window=st.sampled_from([1, 7, 16, 64]),
       seed=st.integers(0, 2**16))
def test_static_cache_gives_the_contiguous_cache_logits(prompt, steps, window, seed):
    """Prefill then one-token steps: the same logits through either cache (tiny random model)."""
    model = tiny_model(seed)
    ids = torch.randint(0, TINY.vocab_size, (1, prompt + steps), generator=torch.Generator().manual_seed(seed))
    contiguous = ContiguousKVCache(TINY, 1, prompt + steps)
    static = StaticKVCache(TINY, prompt + steps, window=window)
    with torch.inference_mode():
        a = model(ids[:, :prompt], cache=contiguous, last_only=True)
        b = model(ids[:, :prompt], cache=static.at(0, prompt), last_only=True)
        assert (a - b).abs().max() < 1e-5
        for pos in range(prompt, prompt + steps):
            a = model(ids[:, pos : pos + 1], cache=contiguous)
            b = model(ids[:, pos : pos + 1], cache=static.at(pos, 1))
            assert (a - b).abs().max() < 1e-5


# --------------------------------------------------------------------------- FastDecoder, tiny model
def test_tiny_compiled_decoder_equals_eager_and_compiles_a_handful_of_graphs():
    from torch._dynamo.utils import counters

    model = tiny_model(1)
    torch._dynamo.reset()
    counters.clear()
    fast = FastDecoder(model, max_len=300, window=16, compile=True)
    eager = FastDecoder(model, max_len=300, window=16, compile=False)
    prompt = [3, 1, 4, 1, 5]
    assert fast.greedy(prompt, 200) == eager.greedy(prompt, 200)
    # 200 tokens cross 13 window sizes; the window length is symbolic: at most two programs
    # (the first, specialised call and the dynamic one), never one per size.
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def test_decoder_errors_name_the_sizes():
    fast = FastDecoder(tiny_model(), max_len=20, compile=False)
    with pytest.raises(ValueError, match=r"prompt \(15 tokens\) \+ max_new_tokens \(10\) needs 24 cache slots; this FastDecoder holds 20"):
        fast.greedy(list(range(15)), 10)
    with pytest.raises(ValueError, match="at least one token"):
        fast.greedy([], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        fast.greedy([1], -1)
    with pytest.raises(ValueError, match="num_beams and n must be 1"):
        list(fast.stream([1], SamplingParams(num_beams=2)))
    assert fast.greedy([1, 2], 19) == FastDecoder(tiny_model(), max_len=20, compile=False).greedy([1, 2], 19)  # still usable


def test_no_compiler_falls_back_to_eager_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(fast_module.shutil, "which", lambda name: None)
    fast = FastDecoder(tiny_model(), max_len=32)
    assert not fast.compiled
    assert "no C++ compiler found" in capsys.readouterr().err
    assert len(fast.greedy([1, 2, 3], 5)) == 5


def test_stream_greedy_equals_greedy_and_stops_at_eos():
    fast = FastDecoder(tiny_model(2), max_len=64, compile=False)
    tokens = fast.greedy([7, 8, 9], 20)
    assert list(fast.stream([7, 8, 9], SamplingParams(max_new_tokens=20))) == tokens
    eos = tokens[5]
    stopped = list(fast.stream([7, 8, 9], SamplingParams(max_new_tokens=20), eos_token_id=eos))
    assert stopped == tokens[: tokens.index(eos) + 1]
    ignored = list(fast.stream([7, 8, 9], SamplingParams(max_new_tokens=20, ignore_eos=True), eos_token_id=eos))
    assert ignored == tokens


def test_stream_sampling_is_reproducible_with_a_seed():
    fast = FastDecoder(tiny_model(3), max_len=64, compile=False)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=7)
    first = list(fast.stream([1, 2], params))
    assert first == list(fast.stream([1, 2], params))
    assert first != list(fast.stream([1, 2], SamplingParams(max_new_tokens=30, temperature=1.0, seed=8)))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases in the compiled Linear
def test_compiled_decoder_matches_transformers_on_tiny_checkpoints(tmp_path, tiny_tokenizer, model_type):  # noqa: F811
    from minillm import load_model
    from minillm.reference import hf_causal_lm

    folder = _tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, tie_word_embeddings=False)
    model, tok = load_model(folder, device="cpu")
    ids = tok.encode("To be, or not to be")
    x = torch.tensor([ids])
    expected = hf_causal_lm(folder).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40,
                                             min_new_tokens=40, do_sample=False, pad_token_id=0)
    assert FastDecoder(model, max_len=128, window=16).greedy(ids, 40) == expected[0, len(ids):].tolist()


def test_bench_model_reads_a_checkpoint_folder_with_transformers(tmp_path, tiny_tokenizer):  # noqa: F811
    from minillm.bench import bench_model

    folder = _tiny_hf_checkpoint(tmp_path, tiny_tokenizer, "llama")
    r = bench_model("cpu", "float32", new_tokens=8, prompt_tokens=16, repeats=1, source=folder)
    assert r["model"] == str(folder) and r["compiled"] and r["same_tokens_as_eager"]
    assert min(r["decode_tok_s_minillm"], r["decode_tok_s_hf"], r["prefill_tok_s_hf"]) > 0


# --------------------------------------------------------------------------- FastDecoder, real model
def test_compiled_decoder_matches_transformers_greedy(compiled, prompt_ids, transformers_greedy):  # noqa: F811
    assert compiled.compiled
    for ids, expected in zip(prompt_ids, transformers_greedy):
        assert compiled.greedy(ids, NEW_TOKENS)[: len(expected)] == expected


def test_eager_decoder_matches_transformers_greedy(smollm, prompt_ids, transformers_greedy):  # noqa: F811
    model, _ = smollm
    eager = FastDecoder(model, max_len=512, compile=False)
    for ids, expected in zip(prompt_ids, transformers_greedy):
        assert eager.greedy(ids, NEW_TOKENS)[: len(expected)] == expected


def test_compiled_step_logits_match_the_eager_model_across_window_edges(smollm, compiled):
    """Positions 62..66 cross the first window edge (64): logits within 1e-4 of the eager model."""
    model, tok = smollm
    ids = tok.encode("The history of the printing press begins in the fifteenth century, when")
    prompt = ids[:8]
    cache = ContiguousKVCache(model.config, 1, 80)
    with torch.inference_mode():
        model(torch.tensor([prompt]), cache=cache)
        compiled.prefill(prompt)
        filler = [ids[i % len(ids)] for i in range(8, 67)]
        worst = 0.0
        for position, token in enumerate(filler, start=8):
            token_t = torch.tensor([[token]])
            expected = model(token_t, cache=cache)[:, -1]
            got = compiled.step(token_t, position)
            if position >= 62:
                worst = max(worst, float((got - expected).abs().max()))
    assert worst < 1e-4, worst


# --------------------------------------------------------------------------- CUDA (skipped without a GPU)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graph_decoder_matches_transformers_greedy_in_float32(prompt_ids, transformers_greedy):  # noqa: F811
    """On a GPU the step is compiled with mode="reduce-overhead" (a CUDA graph per window size)."""
    from minillm import load_model

    model, _ = load_model(device="cuda", dtype=torch.float32)
    fast = FastDecoder(model, max_len=512)
    for ids, expected in zip(prompt_ids, transformers_greedy):
        assert fast.greedy(ids, NEW_TOKENS)[: len(expected)] == expected
        assert fast.greedy(ids, NEW_TOKENS)[: len(expected)] == expected  # replays, not recordings


@cuda
def test_cuda_bfloat16_stream_runs_and_matches_greedy():
    from minillm import load_model

    model, tok = load_model(device="cuda", dtype=torch.bfloat16)
    fast = FastDecoder(model, max_len=256)
    ids = tok.encode("The capital of France is")
    assert list(fast.stream(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))) == fast.greedy(ids, 24)
