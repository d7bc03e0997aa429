"""The engine's backends (``minillm/engine/backends``) and the model runner (``engine/runner.py``);
notebook 10.

The law every backend obeys: it computes the eager backend's logits. Where the math allows
exactness (the eager and compiled backends on a float64 model) the logits agree to float64
rounding; where it does not (float32 sums in another order, packed weights multiplied by C++
kernels) they agree within a bound relative to the logits' scale, and the packed ones are also
held to the same model in float64 on the dequantized weights. Greedy tokens are compared
across implementations only in float64 (or against transformers, the reference). Within one
implementation the packed kernels are batch invariant: a row's logits do not depend on the
rows that share its step, bit for bit.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from minillm import Engine, SamplingParams, load_model
from minillm.cache.paged import PagedKVCache
from minillm.engine.backends import compiled as compiled_backend
from minillm.engine.backends import packed_cpu, why_not_compiled
from minillm.engine.runner import ModelRunner
from minillm.model import kernels, quant
from minillm.model.layers import FEW_ROWS, Linear, RMSNorm, SwiGLU
from minillm.model.quant import FORMATS, QuantizedLinear

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.greedy import NEW_TOKENS

VOCAB = 300
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(40, 90)), [7]]


def _compiles() -> bool:
    """Whether ``torch.compile`` can run on this CPU (a C++ compiler is found)."""
    return not why_not_compiled(torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama checkpoint (2 layers, hidden 64, 4 query heads sharing 2 KV heads)."""
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), tiny_tokenizer, "llama", vocab_size=VOCAB,
                              tie_word_embeddings=False, max_position_embeddings=512)  # every id decodes


def _load(folder, fmt: str | None = None, dtype: torch.dtype = torch.float32, calibration: list[int] | None = None):
    """A fresh model and tokenizer (an engine owns its model: each test edits its own); with
    ``fmt``, every matrix packed in that format (the table and the head in Q8_0)."""
    model, tok = load_model(folder, device="cpu", dtype=dtype)
    if fmt is not None:
        quant.quantize_model(model, fmt, calibration=None if calibration is None else torch.tensor([calibration]))
    return model, tok


def _reserve(cache: PagedKVCache, seqs: list[int], counts: list[int]) -> None:
    """What the scheduler does before each step: room for ``counts[i]`` more tokens of ``seqs[i]``."""
    cache.copy_blocks(cache.manager.reserve(seqs, counts))


def _script(model, backend: str, block_size: int = 8, steps: int = 20) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The same steps for every backend, on a fresh cache: ``PROMPTS`` prefilled in one packed
    step, then ``steps`` decode steps that alternate one row and all four, fed fixed tokens (not
    sampled, so every backend sees the same inputs). Returns each step's logits and each
    sequence's tokens at the end."""
    cache = PagedKVCache(model.config, 64, block_size, "cpu", model.dtype)
    runner = ModelRunner(model, cache, backend)
    assert runner.backend.name == backend
    seqs, tokens = list(range(len(PROMPTS))), [list(p) for p in PROMPTS]
    for seq in seqs:
        cache.add_sequence(seq)
    _reserve(cache, seqs, [len(p) for p in PROMPTS])
    logits = [runner.prefill(seqs, PROMPTS)]
    for i in range(steps):
        rows = seqs if i % 3 else seqs[:1]
        new = [(i * 37 + row * 11) % VOCAB for row in rows]
        _reserve(cache, rows, [1] * len(rows))
        logits.append(runner.decode(rows, new))
        for row, token in zip(rows, new):
            tokens[row].append(token)
    assert [cache.lengths[s] for s in seqs] == [len(t) for t in tokens]
    return logits, tokens


def _max_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> tuple[float, float]:
    """The largest |difference| over every step's logits, and the logits' scale (largest |logit|)."""
    assert [g.shape for g in got] == [e.shape for e in expected]
    error = max((g.double() - e.double()).abs().max().item() for g, e in zip(got, expected))
    return error, max(e.abs().max().item() for e in expected)


def _assert_equal_in_float64(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Two backends' float64 logits: the same up to float64 rounding (~1e-16 relative)."""
    error, scale = _max_error(got, expected)
    assert error <= 1e-10 * max(scale, 1.0), f"off by {error:.3g} (logits up to {scale:.3g})"


# --------------------------------------------------------------------------- Linear
@pytest.mark.parametrize("rows, d_out, d_in", [(1, 200, 96), (2, 7, 5), (8, 1536, 576), (16, 300, 64),
                                               (3, 49152, 64), (FEW_ROWS, 96, 96), (FEW_ROWS + 1, 96, 96)])
def test_linear_stays_within_float32_rounding_of_the_exact_product(rows, d_out, d_in):
    """Whichever product runs (the few-row kernel or ``F.linear``): any order of float32
    multiply-adds over d_in terms is within gamma_n * sum|x_i w_i| of the exact dot product
    (Higham's bound, u = 2**-24), plus the final rounding and the bias's."""
    torch.manual_seed(rows)
    layer = Linear(d_in, d_out, bias=True).requires_grad_(False)
    x = torch.randn(rows, d_in)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    u = 2.0**-24
    bound = (d_in + 1) * u / (1 - (d_in + 1) * u) * (x.abs().double() @ layer.weight.abs().double().T
                                                     + layer.bias.abs().double()) + u * exact.abs()
    assert ((layer(x).double() - exact).abs() <= bound).all()
    assert ((layer(x.view(1, rows, d_in))[0].double() - exact).abs() <= bound).all()  # [batch, seq, in] alike


def test_linear_compiled_computes_what_it_computes_eagerly(cxx_compiler):
    """The few-row kernel is called the same way eager or compiled (no branch on compiling): on
    a CPU with the vector kernels, the very same numbers; elsewhere, float32 rounding apart."""
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).requires_grad_(False)
    compiled = torch.compile(layer, fullgraph=True)
    for x in (torch.randn(1, 1, 96), torch.randn(3, 96)):
        eager = layer(x)
        got = compiled(x)
        assert got.shape == eager.shape
        if kernels.vectorized():
            assert torch.equal(got, eager)
            assert torch.equal(eager.view(-1, 200), kernels.f32_linear(x.reshape(-1, 96), layer.weight) + layer.bias)
        else:
            assert (got - eager).abs().max() <= 1e-5 * eager.abs().max()


# --------------------------------------------------------------------------- choosing a backend
def test_a_float_model_is_compiled_and_a_packed_one_runs_packed_unless_asked_otherwise(tiny_folder):
    model, tok = _load(tiny_folder)
    assert Engine(model, tok).backend == ("compiled" if _compiles() else "eager")  # (nothing compiles yet)
    assert Engine(model, tok, backend="eager").backend == "eager"
    with pytest.raises(ValueError, match=r"backend must be one of eager, compiled, packed-cpu, got 'fast'"):
        Engine(model, tok, backend="fast")
    with pytest.raises(ValueError, match=r"the packed-cpu backend cannot run this model: (not every matrix is packed|"
                                         r"the vector kernels \(AVX-512 or AVX2\) are not built here)"):
        Engine(model, tok, backend="packed-cpu")


def test_a_packed_model_runs_packed_on_a_cpu_with_the_vector_kernels(tiny_folder, vector_kernels, monkeypatch,
                                                                     capsys):
    model, tok = _load(tiny_folder, "q4_1")
    assert Engine(model, tok).backend == "packed-cpu"
    assert Engine(model, tok, backend="eager").backend == "eager"
    with pytest.raises(ValueError, match=r"the KV cache is not float32"):
        ModelRunner(model, PagedKVCache(model.config, 4, 16, "cpu", torch.float64), "packed-cpu")

    with monkeypatch.context() as patch:  # packed-cpu compiles nothing: it needs no C++ compiler
        patch.setattr(shutil, "which", lambda name: None)
        assert Engine(model, tok).backend == "packed-cpu"
        assert "no C++ compiler" not in capsys.readouterr().err

    hooked, tok = _load(tiny_folder, "q4_1")  # a hook the C++ step would never call: the modules run
    hooked.embed_tokens.register_forward_hook(lambda module, args, out: None)
    assert Engine(hooked, tok).backend == ("compiled" if _compiles() else "eager")
    with pytest.raises(ValueError, match=r"the packed-cpu backend cannot run this model"):
        Engine(hooked, tok, backend="packed-cpu")

    with monkeypatch.context() as patch:
        patch.setattr(kernels, "vectorized", lambda: False)
        assert Engine(model, tok).backend == ("compiled" if _compiles() else "eager")
        with pytest.raises(ValueError, match=r"the vector kernels \(AVX-512 or AVX2\) are not built here"):
            Engine(model, tok, backend="packed-cpu")


def test_without_a_cxx_compiler_a_float_model_runs_eagerly_and_says_why(tiny_folder, monkeypatch, capsys):
    model, tok = _load(tiny_folder)
    kernels.available()  # (built or refused now: with the compiler hidden it could never be built later)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    engine = Engine(model, tok)
    assert engine.backend == "eager"
    assert "no C++ compiler found (torch.compile writes C++ for the CPU); running eagerly" in capsys.readouterr().err
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids) == 5
    assert engine.runner.compile_seconds == {}
    with pytest.raises(ValueError, match=r"the compiled backend cannot run here: no C\+\+ compiler found"):
        Engine(model, tok, backend="compiled")


# --------------------------------------------------------------------------- compiled
def test_compiled_backend_equals_eager_in_float64_and_compiles_two_programs_per_region(tiny_folder, cxx_compiler):
    """Float64, where both compute the same function to rounding: mixed prompt lengths, batch
    sizes 1..4, growing block tables, three block sizes and pool sizes give the eager engine's
    greedy tokens; for each compiled region (a group of layers, the LM head) one program for a
    single row and one for every other shape, never one per size; the compile times of the two
    are reported. Run step by step from the same inputs, the logits equal the eager ones to
    float64 rounding."""
    from torch._dynamo.utils import counters

    model, tok = _load(tiny_folder, dtype=torch.float64)
    assert compiled_backend.uniform(model, PagedKVCache(model.config, 4, 8, "cpu", model.dtype))  # (regions)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (150, 90, 60, 30)]
    eager = Engine(model, tok, backend="eager", block_size=8)
    expected = [c.token_ids for c in eager.generate(PROMPTS, params)]
    assert eager.runner.compile_seconds == {}
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, tok, backend="compiled", block_size=8)
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == expected
    assert engine.generate([PROMPTS[0]], params[0])[0].token_ids == expected[0]  # batch 1
    for block_size, pool_tokens in ((16, 700), (5, 900)):  # other block and pool sizes: the same programs
        other = Engine(model, tok, backend="compiled", block_size=block_size, kv_cache_tokens=pool_tokens)
        other_eager = Engine(model, tok, backend="eager", block_size=block_size, kv_cache_tokens=pool_tokens)
        assert [c.token_ids for c in other.generate(PROMPTS, params)] == \
            [c.token_ids for c in other_eager.generate(PROMPTS, params)]
    assert counters["stats"]["unique_graphs"] <= 4  # {layers, head} x {rows=1, rows>1}
    assert set(engine.runner.compile_seconds) == {"rows=1", "rows>1"}

    for block_size in (8, 5):
        _assert_equal_in_float64(_script(model, "compiled", block_size)[0], _script(model, "eager", block_size)[0])


def test_regions_check_the_guards_of_each_new_signature_once(tiny_folder, monkeypatch, cxx_compiler):
    """A program's guards run the first time a signature (the step tensors' shapes) comes by,
    never again for it: they cost about a layer's arithmetic, so checking them at every step
    would cost a layer per group."""
    model, tok = _load(tiny_folder, dtype=torch.float64)
    engine = Engine(model, tok, backend="compiled", block_size=8)
    short = ([[3, 1, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.generate(*short)  # builds (or finds) the programs
    checks: list[object] = []
    # The guard checks are internal to the compiled backend (nothing public counts them): the
    # private helper is patched to count them, the only way to see that a step skips them.
    original = compiled_backend._guards_pass
    monkeypatch.setattr(compiled_backend, "_guards_pass", lambda program, args: checks.append(program) or
                        original(program, args))
    engine.generate(*short)  # the same signatures
    assert checks == []
    longer = ([list(range(5, 30))], SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.generate(*longer)  # wider block tables: new signatures, each checked
    assert checks
    seen = len(checks)
    engine.generate(*longer)  # and never again
    assert len(checks) == seen


def test_a_model_whose_layers_differ_is_compiled_as_one_step_and_equals_eager(tiny_folder, cxx_compiler):
    """The regions share one program between groups of layers that look alike; a model whose
    layers differ (here layer 1's feed-forward is narrower) is compiled whole, and computes the
    eager logits all the same (float64). Whole, the compiled step computes the rotary angles
    too, which are float32 in any model (as transformers computes them): its cos and sin may
    differ from eager PyTorch's by an ulp, so the logits agree to float32 rounding, not float64's."""
    model, tok = _load(tiny_folder, dtype=torch.float64)
    torch.manual_seed(0)
    model.layers[1].mlp = SwiGLU(model.config.hidden_size, 48).double().requires_grad_(False)
    for p in model.layers[1].mlp.parameters():
        p.normal_(0, 0.2)
    engine = Engine(model, tok, backend="compiled", block_size=8)
    assert not compiled_backend.uniform(model, engine.cache)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:3]
    assert [c.token_ids for c in engine.generate(prompts, params)] == \
        [c.token_ids for c in Engine(model, tok, backend="eager").generate(prompts, params)]
    assert set(engine.runner.compile_seconds) == {"rows>1"}  # three rows from the first step to the last
    error, scale = _max_error(_script(model, "compiled", steps=8)[0], _script(model, "eager", steps=8)[0])
    assert error <= 1e-6 * scale, f"off by {error:.3g} (logits up to {scale:.3g})"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases in the compiled Linear
def test_compiled_engine_matches_transformers_on_tiny_checkpoints(tmp_path, tiny_tokenizer, model_type,
                                                                 cxx_compiler):
    from minillm.reference import hf_causal_lm

    folder = tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, tie_word_embeddings=False, vocab_size=VOCAB)
    model, tok = load_model(folder, device="cpu")
    reference = hf_causal_lm(folder)
    prompts = ["To be, or not to be", "The king", "Now is the winter of our discontent made glorious"]
    engine = Engine(model, tok, backend="compiled")
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for prompt, completion in zip(prompts, ours):
        x = torch.tensor([tok.encode(prompt)])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40,
                                      min_new_tokens=40, do_sample=False, pad_token_id=0)
        assert completion.token_ids == expected[0, x.shape[1]:].tolist()


# --------------------------------------------------------------------------- packed-cpu
def _float64_twin(model, folder):
    """The float model of ``folder`` with ``model``'s packed weights dequantized into it, in float64."""
    twin, _ = load_model(folder, device="cpu")
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and name != "embed_tokens.table":
            twin.get_submodule(name).weight = torch.nn.Parameter(module.dequantize(), requires_grad=False)
    twin.embed_tokens.weight = torch.nn.Parameter(model.embed_tokens.table.dequantize(), requires_grad=False)
    return twin.double()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: biases on q, k and v
def test_the_packed_backend_computes_the_float64_model_on_the_dequantized_weights(tmp_path, tiny_tokenizer,
                                                                                 model_type, vector_kernels):
    """A packed model (each format, with float32 outlier columns from a calibration text) on the
    packed-cpu backend: every step's logits (a packed prefill, then decode steps of one and of
    four rows, blocks of 4 that the rows cross) equal the same model in float64 on the
    dequantized weights to float32 rounding through the layers, and so do the eager backend's;
    the two agree with each other within the same bound."""
    folder = tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, vocab_size=VOCAB, tie_word_embeddings=False,
                                max_position_embeddings=512)
    for fmt in FORMATS:
        model, _ = _load(folder, fmt, calibration=PROMPTS[2])
        assert model.layers[0].mlp.down_proj.outlier_cols is not None
        twin = _float64_twin(model, folder)
        packed, tokens = _script(model, "packed-cpu", block_size=4, steps=9)
        eager, _ = _script(model, "eager", block_size=4, steps=9)
        with torch.inference_mode():  # the same steps by full recompute: each row's last logits
            exact = [twin(torch.tensor([t[: len(p)]]))[0, -1] for t, p in zip(tokens, PROMPTS)]
            expected = [torch.stack(exact)]
            lengths = [len(p) for p in PROMPTS]
            for i in range(9):
                rows = range(4) if i % 3 else range(1)
                for row in rows:
                    lengths[row] += 1
                expected.append(torch.stack([twin(torch.tensor([tokens[row][: lengths[row]]]))[0, -1] for row in rows]))
        for name, got in (("packed-cpu", packed), ("eager", eager)):
            error, scale = _max_error(got, expected)
            assert error <= 1e-5 * scale, f"{fmt} {name}: off by {error:.3g} (logits up to {scale:.3g})"
        error, scale = _max_error(packed, eager)
        assert error <= 1e-5 * scale, f"{fmt}: packed-cpu off eager by {error:.3g} (logits up to {scale:.3g})"


def test_a_short_prefill_runs_as_one_call_and_equals_the_eager_prefill(tiny_folder, vector_kernels, monkeypatch):
    """On the packed-cpu backend a prefill of up to ``STEP_PREFILL_TOKENS`` tokens, whose rows read
    up to ``STEP_PREFILL_KEYS`` keys, is the decode step with a row per token (nothing runs module
    by module): two prompts packed, one of them after a prefix already in the cache, blocks of 4.
    Its logits and the keys and values it writes equal the eager prefill's to float32 rounding,
    and the lengths move on alike. A longer prompt, or one whose rows would read more keys, runs
    the eager forward."""
    model, tok = _load(tiny_folder, "q4_1")
    modules: list[int] = []  # tokens run module by module (``model.run``: the eager forward)
    run = model.run
    monkeypatch.setattr(model, "run", lambda ids, *a, **k: modules.append(ids.numel()) or run(ids, *a, **k))
    prompts = {100: [5, 9, 2, 7, 1], 101: [3, 8, 8, 4, 6, 2, 9, 11, 250]}
    results = {}
    for backend in ("packed-cpu", "eager"):
        cache = PagedKVCache(model.config, 16, 4)
        runner = ModelRunner(model, cache, backend)
        prefix = ModelRunner(model, cache, "eager")
        cache.add_sequence(100)
        _reserve(cache, [100], [6])
        prefix.prefill([100], [[7, 3, 9, 4, 4, 1]])  # a prefix already stored
        cache.add_sequence(101)
        _reserve(cache, list(prompts), [len(p) for p in prompts.values()])
        modules.clear()
        logits = runner.prefill(list(prompts), list(prompts.values()))
        results[backend] = logits, [pool.clone() for pool in cache.k + cache.v], dict(cache.lengths), list(modules)
    (packed, packed_pools, packed_lengths, packed_modules), (eager, eager_pools, eager_lengths, eager_modules) = \
        results["packed-cpu"], results["eager"]
    assert packed_modules == [] and eager_modules == [14]
    assert packed.shape == eager.shape == (2, VOCAB) and packed_lengths == eager_lengths == {100: 11, 101: 9}
    assert (packed - eager).abs().max() <= 1e-5 * eager.abs().max()
    for got, expected in zip(packed_pools, eager_pools):
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()

    engine = Engine(model, tok, backend="packed-cpu", block_size=4)
    one_token = SamplingParams(max_new_tokens=1)  # the prefill alone
    monkeypatch.setattr(packed_cpu, "STEP_PREFILL_TOKENS", 32)
    modules.clear()
    engine.generate([list(range(1, 34))], one_token)  # 33 tokens: the eager forward
    engine.generate([list(range(1, 33))], one_token)  # 32: the one-call step
    assert modules == [33]
    monkeypatch.setattr(packed_cpu, "STEP_PREFILL_KEYS", 32 * 33 // 2 - 1)  # its rows read 1 + 2 + ... + 32 keys
    engine.generate([list(range(1, 33))], one_token)
    assert modules == [33, 32]
    monkeypatch.setattr(packed_cpu, "STEP_PREFILL_KEYS", 32 * 33 // 2)
    engine.generate([list(range(1, 33))], one_token)
    assert modules == [33, 32]


def test_on_the_packed_path_a_rows_logits_do_not_depend_on_the_batch(tiny_folder, vector_kernels):
    """Batch invariance of the packed step: every kernel sums a row in the same order whatever
    rows share the call (products, attention, norms), so a decode step's logits for four rows
    of different lengths equal, bit for bit, each row's step alone from the same cache; and so
    do the greedy tokens of four requests batched and one at a time. Nothing is compiled."""
    model, tok = _load(tiny_folder, "q4_1")
    engine = Engine(model, tok, backend="packed-cpu", block_size=4)
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 6, 2, 9, 1, 5, 3, 11, 12], [40, 41]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    together = [c.token_ids for c in engine.generate(prompts, params)]
    assert together == [engine.generate([p], params)[0].token_ids for p in prompts]
    assert engine.runner.compile_seconds == {}

    seqs, tokens = [0, 1, 2, 3], [17, 250, 4, 99]

    def prefilled() -> ModelRunner:  # the same cache contents every time (the same calls, one prompt each)
        cache = PagedKVCache(model.config, 32, 4)
        runner = ModelRunner(model, cache, "packed-cpu")
        for seq, prompt in zip(seqs, prompts):
            cache.add_sequence(seq)
            _reserve(cache, [seq], [len(prompt)])
            runner.prefill([seq], [prompt])
        return runner

    runner = prefilled()
    _reserve(runner.cache, seqs, [1] * 4)
    batched = runner.decode(seqs, tokens)
    for row, (seq, token) in enumerate(zip(seqs, tokens)):
        runner = prefilled()
        _reserve(runner.cache, [seq], [1])
        assert torch.equal(runner.decode([seq], [token])[0], batched[row]), f"row {row}"


# --------------------------------------------------------------------------- runner
def test_the_runner_counts_the_new_tokens_as_stored_and_traces_its_steps(tiny_folder):
    model, _ = _load(tiny_folder)
    cache = PagedKVCache(model.config, 16, 4)
    runner = ModelRunner(model, cache, "eager")
    runner.trace = []
    for seq in (0, 1):
        cache.add_sequence(seq)
    _reserve(cache, [0, 1], [5, 3])
    assert runner.prefill([0, 1], [[3, 1, 4, 1, 5], [9, 2, 6]]).shape == (2, VOCAB)
    assert cache.lengths == {0: 5, 1: 3}
    _reserve(cache, [1, 0], [1, 1])
    assert runner.decode([1, 0], torch.tensor([7, 8])).shape == (2, VOCAB)
    assert cache.lengths == {0: 6, 1: 4}
    assert runner.trace == [("prefill", 2), ("decode", 2)]


def test_bench_model_reads_a_checkpoint_folder_with_transformers(tiny_folder):
    from minillm.bench import bench_model

    r = bench_model("cpu", "float32", new_tokens=8, prompt_tokens=16, repeats=1, source=tiny_folder, hf_compiled=False)
    assert r["model"] == str(tiny_folder)
    assert min(r["decode_tok_s_minillm"], r["decode_tok_s_hf"], r["prefill_tok_s_hf"]) > 0


# --------------------------------------------------------------------------- the real model
@pytest.mark.parametrize("backend", ["compiled", "eager"])
def test_compiled_and_eager_engines_match_transformers_greedy_on_a_mixed_batch(smollm, prompt_ids,
                                                                              transformers_greedy,
                                                                              backend, request):
    if backend == "compiled":
        request.getfixturevalue("cxx_compiler")
    model, tok = smollm
    engine = Engine(model, tok, backend=backend)
    completions = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    for completion, expected in zip(completions, transformers_greedy):
        assert completion.token_ids[: len(expected)] == expected
