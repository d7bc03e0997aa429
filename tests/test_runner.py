"""The model runner: the one-row Linear, the compiled decode step on the paged cache against
the eager step and transformers, on tiny checkpoints and on the real model."""

from __future__ import annotations

import pytest
import torch

from minillm import Engine, SamplingParams, load_model
from minillm.engine import runner as runner_module
from minillm.model import kernels
from minillm.model.layers import Linear

from test_generate import NEW_TOKENS, prompt_ids, transformers_greedy  # noqa: F401  (fixtures)
from test_model_units import _tiny_hf_checkpoint, tiny_tokenizer  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    folder = _tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), tiny_tokenizer, "llama", vocab_size=300,
                                 tie_word_embeddings=False, max_position_embeddings=512)  # every id decodes
    return folder, *load_model(folder, device="cpu")


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


# --------------------------------------------------------------------------- tiny checkpoints
@pytest.mark.parametrize("rows, d_out, d_in", [(2, 7, 5), (8, 1536, 576), (16, 300, 64), (3, 49152, 64)])
def test_small_batch_linear_is_f_linear(rows, d_out, d_in):
    """The oneDNN product batched decode steps use equals F.linear to float32 rounding."""
    from minillm.model.layers import small_batch_linear

    torch.manual_seed(rows)
    x, weight = torch.randn(rows, d_in), torch.randn(d_out, d_in)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    # Any order of float32 multiply-adds over d_in terms is within gamma_n * sum|x_i w_i| of the
    # exact dot product (Higham's bound, u = 2**-24), plus the final rounding.
    u = 2.0**-24
    bound = d_in * u / (1 - d_in * u) * (x.abs().double() @ weight.abs().double().T) + u * exact.abs()
    assert ((small_batch_linear(x, weight).double() - exact).abs() <= bound).all()


def test_compiled_engine_equals_eager_engine_and_compiles_two_programs(tiny_llama):
    """Mixed prompt lengths, batch sizes 1..4, growing block tables, three block sizes and pool
    sizes: for each compiled region (a layer, the LM head), one program for a single row and
    one for every other shape — never one per size, nor one per layer."""
    from torch._dynamo.utils import counters

    _, model, tok = tiny_llama
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(40, 90)), [7]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (150, 90, 60, 30)]
    eager = Engine(model, tok, backend="eager", block_size=8).generate(prompts, params)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, tok, backend="compiled", block_size=8)
    compiled = engine.generate(prompts, params)
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    assert engine.generate([prompts[0]], params[0])[0].token_ids == eager[0].token_ids  # batch 1
    for block_size, pool_tokens in ((16, 700), (5, 900)):  # other block and pool sizes: the same programs
        other = Engine(model, tok, backend="compiled", block_size=block_size, kv_cache_tokens=pool_tokens)
        other_eager = Engine(model, tok, backend="eager", block_size=block_size, kv_cache_tokens=pool_tokens)
        assert [c.token_ids for c in other.generate(prompts, params)] == \
            [c.token_ids for c in other_eager.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] <= 4  # {layer, head} x {rows=1, rows>1}
    assert set(engine.runner.compile_seconds) == {"rows=1", "rows>1"}


def test_a_model_changed_under_a_running_engine_is_planned_again_and_a_model_whose_layers_differ_keeps_every_guard(
        tiny_llama):
    """The regions check their programs' guards once per signature, so the runner checks the
    model itself: a model quantized in place *after* an engine compiled its step (every layer
    changes) is seen before the next step, by that same engine, which then runs a program for
    the new structure. A model whose later layers differ from its first (one Q8_0 matrix in
    layer 1) is not run by the groups at all (the whole step is compiled, every guard kept).
    Each answers like the eager engine."""
    from minillm.model import quant

    folder, _, _ = tiny_llama
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [7]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    model, tok = load_model(folder, device="cpu")
    first = Engine(model, tok, backend="compiled")
    assert first.runner.regions is not None
    first.generate(prompts, params)
    programs = {kind: len(built) for kind, built in runner_module.CompiledRegions._built.items()}

    quant.quantize_model(model, "q8_0")  # every layer changes, under the running engine
    assert runner_module.uniform(model, first.cache)
    eager = [c.token_ids for c in Engine(model, tok, backend="eager").generate(prompts, params)]
    assert [c.token_ids for c in first.generate(prompts, params)] == eager
    if kernels.vectorized():  # every matrix packed, the table too: the whole step is one C++ call
        assert isinstance(first.runner.regions, runner_module.KernelLayers) and first.runner.regions.whole_step
        assert first.runner._decode == first.runner.regions.decode_step
    else:
        assert all(len(runner_module.CompiledRegions._built[kind]) > programs[kind] for kind in programs)  # new ones
    assert [c.token_ids for c in Engine(model, tok, backend="compiled").generate(prompts, params)] == eager

    mixed, tok = load_model(folder, device="cpu")
    down = mixed.layers[1].mlp.down_proj
    quant.use_blocks(mixed, {"layers.1.mlp.down_proj": ("q8_0", quant.quantize(down.weight, "q8_0"))})
    engine = Engine(mixed, tok, backend="compiled")
    assert not runner_module.uniform(mixed, engine.cache)
    assert engine.runner.regions is None  # the whole step
    assert [c.token_ids for c in engine.generate(prompts, params)] == \
        [c.token_ids for c in Engine(mixed, tok, backend="eager").generate(prompts, params)]


@pytest.mark.skipif(not kernels.vectorized(), reason="the packed layer kernel needs the AVX-512 or AVX2 kernels")
def test_kernel_layers_see_a_matrix_swapped_into_a_later_layer(tiny_llama):
    """The fingerprint checks the first layer only; a packed model's runner also checks, before
    every step, that each layer's matrices and tensors are the ones it collected: a matrix swapped
    into layer 1 under a running engine (new weights, another format) is the one the next step
    passes to the kernel."""
    from minillm.model import quant

    folder, _, _ = tiny_llama
    model, tok = load_model(folder, device="cpu")
    quant.quantize_model(model, "q8_0")
    engine = Engine(model, tok, backend="compiled")
    prompts, params = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.generate(prompts, params)
    regions = engine.runner.regions
    assert isinstance(regions, runner_module.KernelLayers) and regions.still_current()
    down = model.layers[1].mlp.down_proj
    model.layers[1].mlp.down_proj = quant.QuantizedLinear.from_float(down.dequantize() * 40, "q4_0")
    assert not regions.still_current() and runner_module.structure_fingerprint(model) == engine.runner._fingerprint
    engine.generate(prompts, params)
    planned = engine.runner.regions  # planned again, from the new matrix's own tensors
    assert isinstance(planned, runner_module.KernelLayers) and planned is not regions and planned.still_current()
    qs = planned._stack.matrices(1)  # the packed integers the C++ object reads for layer 1
    assert qs[6] is model.layers[1].mlp.down_proj.qs and qs[6] is not down.qs


def _one_call_equals_the_python_step(engine: Engine, model) -> tuple[tuple, list[torch.Tensor]]:
    """Run one decode step of three rows of different lengths (blocks of the engine's cache) through
    the engine's one C++ call and through ``decode_step`` in Python from the same cache state, and
    assert the laws: the same keys and values written, bit for bit (the same layer kernels on the
    same table rows), and logits equal to float32 rounding (the final norm sums in its own order).
    Returns the step's arguments and the pools as they were before it."""
    cache = engine.cache
    with torch.inference_mode():
        for seq, prompt in enumerate([[5, 9, 2, 7, 1], [3], [8, 8, 4, 6, 2, 9, 1, 5, 3]]):
            cache.add_sequence(100 + seq)
            model(torch.tensor([prompt]), cache=cache.prepare([100 + seq], len(prompt)))
    step = cache.prepare([100, 101, 102], 1)
    args = (model, torch.tensor([[17], [250], [4]]), step.positions_flat, step.write_blocks, step.write_offsets,
            step.block_tables, step.context_lens, cache.k, cache.v)
    before = [pool.clone() for pool in cache.k + cache.v]
    with torch.inference_mode():
        one_call = engine.runner.regions.decode_step(*args)
        written = [pool.clone() for pool in cache.k + cache.v]
        for pool, saved in zip(cache.k + cache.v, before):
            pool.copy_(saved)
        in_python = runner_module.decode_step(*args)
    assert all(torch.equal(a, b) for a, b in zip(written, cache.k + cache.v))
    assert (one_call - in_python).abs().max() <= 1e-5 * in_python.abs().max()
    return args, before


@pytest.mark.skipif(not kernels.vectorized(), reason="the packed layer kernel needs the AVX-512 or AVX2 kernels")
def test_a_packed_models_whole_decode_step_is_one_call_and_equals_the_step_in_python(tiny_llama):
    """With the table, the final norm and the head packed too, the runner's decode step is one C++
    call from token ids to logits. On the same cache it writes exactly the keys and values the
    Python step (``decode_step`` without regions: the table looked up in PyTorch, each layer's
    kernel, the norm and head in PyTorch) writes, and its logits equal them to float32 rounding;
    a token id outside the table is refused by name, the cache untouched; a head swapped under a
    running engine is the one the next step reads."""
    from minillm.model import quant

    folder, _, _ = tiny_llama
    model, tok = load_model(folder, device="cpu")
    quant.quantize_model(model, "q4_1")  # the table and the head in Q8_0 (quant.TABLE_FORMAT)
    engine = Engine(model, tok, backend="compiled")
    engine.generate([[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    regions = engine.runner.regions
    assert isinstance(regions, runner_module.KernelLayers) and regions.whole_step

    args, before = _one_call_equals_the_python_step(engine, model)
    cache = engine.cache

    for pool, saved in zip(cache.k + cache.v, before):
        pool.copy_(saved)
    with pytest.raises(RuntimeError, match=r"row 1 has token id 300, outside the embedding table's 300 rows"):
        regions.decode_step(model, torch.tensor([[17], [300], [4]]), *args[2:])
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, before))

    head = model.lm_head
    model.lm_head = quant.QuantizedLinear.from_float(head.dequantize().flip(0), "q8_0")
    assert not regions.still_current()
    engine.generate([[3, 1, 4]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert engine.runner.regions is not regions and engine.runner.regions.whole_step


@pytest.mark.skipif(not kernels.vectorized(), reason="the packed layer kernel needs the AVX-512 or AVX2 kernels")
def test_a_short_prefill_runs_as_the_one_call_step_and_agrees_with_the_layer_by_layer_prefill(tiny_llama, monkeypatch):
    """On the packed whole-step path a prefill of up to ``STEP_PREFILL_TOKENS`` tokens is the decode
    step, a row per token (two prompts packed, one of them after a prefix already in the cache,
    blocks of 4): its logits and the keys and values it writes agree with the layer-by-layer
    prefill's to float32 rounding, and the lengths move on alike. A longer prompt, or one whose rows
    would read more keys than ``STEP_PREFILL_KEYS``, goes layer by layer. ``logits_rows`` naming a
    row the step does not have is refused by name, pools untouched."""
    from minillm.model import quant

    folder, _, _ = tiny_llama
    model, tok = load_model(folder, device="cpu")
    quant.quantize_model(model, "q4_1")
    engine = Engine(model, tok, backend="compiled", block_size=4)
    runner, cache = engine.runner, engine.cache
    assert runner.decode_kind == "one C++ call"
    steps: list[int] = []
    one_call = runner.regions.decode_step
    monkeypatch.setattr(runner.regions, "decode_step", lambda *a, **k: steps.append(len(a[1])) or one_call(*a, **k))
    with torch.inference_mode():
        cache.add_sequence(100)
        model(torch.tensor([[7, 3, 9, 4, 4, 1]]), cache=cache.prepare([100], 6))  # a prefix already stored
        cache.add_sequence(101)
        prompts = {100: [5, 9, 2, 7, 1], 101: [3, 8, 8, 4, 6, 2, 9, 11, 250]}
        cache.copy_blocks(cache.manager.reserve(list(prompts), [len(p) for p in prompts.values()]))
        before, lengths = [pool.clone() for pool in cache.k + cache.v], dict(cache.lengths)
        as_step = runner.prefill(list(prompts), list(prompts.values()))
        written, lengths_after = [pool.clone() for pool in cache.k + cache.v], dict(cache.lengths)
        assert steps == [14] and as_step.shape == (2, 300)
        for pool, saved in zip(cache.k + cache.v, before):
            pool.copy_(saved)
        cache.manager.lengths.update(lengths)
        monkeypatch.setattr(runner_module, "STEP_PREFILL_TOKENS", 0)
        by_layers = runner.prefill(list(prompts), list(prompts.values()))
    assert steps == [14] and dict(cache.lengths) == lengths_after
    assert (as_step - by_layers).abs().max() <= 1e-4 * by_layers.abs().max()
    for got, expected in zip(written, cache.k + cache.v):
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()

    monkeypatch.setattr(runner_module, "STEP_PREFILL_TOKENS", 32)
    engine.generate([list(range(1, 34))], SamplingParams(max_new_tokens=1))  # 33 tokens: layer by layer
    assert steps == [14]
    engine.generate([list(range(1, 33))], SamplingParams(max_new_tokens=1))  # 32: the step
    assert steps == [14, 32]
    monkeypatch.setattr(runner_module, "STEP_PREFILL_KEYS", 32 * 33 // 2 - 1)  # its rows read 1 + 2 + ... + 32 keys
    engine.generate([list(range(1, 33))], SamplingParams(max_new_tokens=1))
    assert steps == [14, 32]
    monkeypatch.setattr(runner_module, "STEP_PREFILL_KEYS", 32 * 33 // 2)
    engine.generate([list(range(1, 33))], SamplingParams(max_new_tokens=1))
    assert steps == [14, 32, 32]

    step = cache.prepare([101], 1)
    args = (model, torch.tensor([[17]]), step.positions_flat, step.write_blocks, step.write_offsets,
            step.block_tables, step.context_lens, cache.k, cache.v)
    before = [pool.clone() for pool in cache.k + cache.v]
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"logits_rows\[0\] is 1, not one of the step's 1 rows"):
        one_call(*args, logits_rows=torch.tensor([1]))
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, before))


@pytest.mark.skipif(not kernels.vectorized(), reason="the packed layer kernel needs the AVX-512 or AVX2 kernels")
def test_on_the_one_call_path_a_rows_logits_do_not_depend_on_the_batch(tiny_llama):
    """Batch invariance of the packed step: every kernel sums a row in the same order whatever rows
    share the call (products, attention, norms), so a decode step's logits for four rows of
    different lengths equal, bit for bit, each row's step alone from the same cache; and so do the
    greedy tokens of four requests batched and one at a time."""
    from minillm.model import quant

    folder, _, _ = tiny_llama
    model, tok = load_model(folder, device="cpu")
    quant.quantize_model(model, "q4_1")
    engine = Engine(model, tok, backend="compiled", block_size=4)
    prompts, params = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 6, 2, 9, 1, 5, 3, 11, 12], [40, 41]], \
        SamplingParams(max_new_tokens=12, ignore_eos=True)
    together = [c.token_ids for c in engine.generate(prompts, params)]
    assert together == [engine.generate([p], params)[0].token_ids for p in prompts]
    runner, cache, seqs, tokens = engine.runner, engine.cache, [100, 101, 102, 103], [17, 250, 4, 99]
    with torch.inference_mode():
        for seq, prompt in zip(seqs, prompts):
            cache.add_sequence(seq)
            model(torch.tensor([prompt]), cache=cache.prepare([seq], len(prompt)))
        cache.copy_blocks(cache.manager.reserve(seqs, [1] * 4))
        saved, lengths = [pool.clone() for pool in cache.k + cache.v], dict(cache.lengths)
        batched = runner.decode(seqs, tokens)
        alone = []
        for seq, token in zip(seqs, tokens):
            for pool, before in zip(cache.k + cache.v, saved):
                pool.copy_(before)
            cache.manager.lengths.update(lengths)
            alone.append(runner.decode([seq], [token]))
    assert torch.equal(batched, torch.cat(alone))


@pytest.mark.skipif(not kernels.vectorized(), reason="the packed layer kernel needs the AVX-512 or AVX2 kernels")
def test_the_one_call_step_sees_what_no_hook_counts_and_runs_layers_of_different_sizes(tiny_llama):
    """What PyTorch's registration hooks do not count is still seen by a running engine: a norm's
    eps set to another number, the layer list replaced or a layer deleted. A fully packed model
    whose layers differ in FFN width runs as one call too; a model with a forward hook on its
    embedding keeps the hook (its embedding runs in Python, in eager PyTorch)."""
    import copy

    from minillm.model import quant

    folder, _, _ = tiny_llama
    prompts, params = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_new_tokens=6, ignore_eos=True)

    def packed() -> tuple:
        model, tok = load_model(folder, device="cpu")
        return quant.quantize_model(model, "q4_1"), tok

    def fresh(model, tok) -> list[list[int]]:  # a new engine plans from the model as it is now
        return [c.token_ids for c in Engine(model, tok, backend="compiled").generate(prompts, params)]

    model, tok = packed()
    engine = Engine(model, tok, backend="compiled")
    engine.generate(prompts, params)
    regions = engine.runner.regions
    assert isinstance(regions, runner_module.KernelLayers) and regions.whole_step and regions.still_current()
    for block in model.layers:
        block.input_layernorm.eps = block.post_attention_layernorm.eps = 10.0
    model.norm.eps = 0.5
    assert not regions.still_current()
    assert [c.token_ids for c in engine.generate(prompts, params)] == fresh(model, tok)
    regions = engine.runner.regions
    assert regions.still_current()

    layer = copy.deepcopy(model.layers[1])
    layer.mlp.down_proj.qs.copy_(layer.mlp.down_proj.qs.flip(0))
    model.layers = torch.nn.ModuleList([model.layers[0], layer])
    assert not regions.still_current()
    assert [c.token_ids for c in engine.generate(prompts, params)] == fresh(model, tok)
    regions = engine.runner.regions
    del model.layers[1]
    assert not regions.still_current()

    model, tok = packed()
    mlp = model.layers[1].mlp
    for name, shape in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
        setattr(mlp, name, quant.QuantizedLinear.from_float(torch.randn(*shape) * 0.1, "q4_1"))
    engine = Engine(model, tok, backend="compiled")
    engine.generate(prompts, params)
    assert isinstance(engine.runner.regions, runner_module.KernelLayers) and engine.runner.regions.whole_step
    _one_call_equals_the_python_step(engine, model)

    model, tok = packed()
    calls = []
    model.embed_tokens.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    engine = Engine(model, tok, backend="compiled")
    engine.generate(prompts, params)
    assert not engine.runner.regions.whole_step and len(calls) >= params.max_new_tokens


def test_the_structure_fingerprint_sees_swapped_modules_and_converted_tensors(tiny_llama):
    from minillm.model import quant

    folder, _, _ = tiny_llama
    model, _ = load_model(folder, device="cpu")
    before = runner_module.structure_fingerprint(model)
    assert runner_module.structure_fingerprint(model) == before  # nothing changed
    model.layers[0].input_layernorm.to(torch.float64)  # a tensor converted in place (the same Parameter)
    converted = runner_module.structure_fingerprint(model)
    assert converted != before
    down = model.layers[0].mlp.down_proj
    quant.use_blocks(model, {"layers.0.mlp.down_proj": ("q8_0", quant.quantize(down.weight, "q8_0"))})
    assert runner_module.structure_fingerprint(model) != converted  # a module swapped


def test_regions_check_the_guards_of_each_new_signature_once(tiny_llama, monkeypatch):
    """A program's guards run the first time a signature (the step tensors' shapes) comes by,
    never again for it; a signature no program accepts gets a program of its own."""
    _, model, tok = tiny_llama
    engine = Engine(model, tok, backend="compiled", block_size=8)
    engine.generate([[3, 1, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # builds (or finds) the programs
    checks: list[object] = []
    original = runner_module._guards_pass

    def counting(program, args):
        checks.append(program)
        return original(program, args)

    monkeypatch.setattr(runner_module, "_guards_pass", counting)
    accepted = len(engine.runner.regions._accepted)
    engine.generate([[3, 1, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # the same signatures
    assert checks == [] and len(engine.runner.regions._accepted) == accepted
    longer = ([list(range(5, 30))], SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.generate(*longer)  # wider block tables: new signatures, each checked
    assert checks and len(engine.runner.regions._accepted) > accepted
    seen = len(checks)
    engine.generate(*longer)  # and never again
    assert len(checks) == seen


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases in the compiled Linear
def test_compiled_engine_matches_transformers_on_tiny_checkpoints(tmp_path, tiny_tokenizer, model_type):  # noqa: F811
    from minillm.reference import hf_causal_lm

    folder = _tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, tie_word_embeddings=False, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    reference = hf_causal_lm(folder)
    prompts = ["To be, or not to be", "The king", "Now is the winter of our discontent made glorious"]
    ours = Engine(model, tok, backend="compiled").generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for prompt, completion in zip(prompts, ours):
        x = torch.tensor([tok.encode(prompt)])
        expected = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40,
                                      min_new_tokens=40, do_sample=False, pad_token_id=0)
        assert completion.token_ids == expected[0, x.shape[1]:].tolist()


def test_no_compiler_falls_back_to_eager_and_says_so(monkeypatch, capsys, tiny_llama):
    _, model, tok = tiny_llama
    monkeypatch.setattr(runner_module.shutil, "which", lambda name: None)
    engine = Engine(model, tok)
    assert not engine.runner.compiled
    assert "no C++ compiler found" in capsys.readouterr().err
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids) == 5


def test_bench_model_reads_a_checkpoint_folder_with_transformers(tiny_llama):
    from minillm.bench import bench_model

    folder, _, _ = tiny_llama
    r = bench_model("cpu", "float32", new_tokens=8, prompt_tokens=16, repeats=1, source=folder, hf_compiled=False)
    assert r["model"] == str(folder) and r["compiled"] and r["same_tokens_as_eager"]
    assert min(r["decode_tok_s_minillm"], r["decode_tok_s_hf"], r["prefill_tok_s_hf"]) > 0


# --------------------------------------------------------------------------- the real model
def test_compiled_and_eager_engines_match_transformers_greedy_on_a_mixed_batch(smollm, prompt_ids,  # noqa: F811
                                                                              transformers_greedy):  # noqa: F811
    model, tok = smollm
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for compile in (True, False):
        completions = Engine(model, tok, compile=compile).generate(prompt_ids, params)
        for completion, expected in zip(completions, transformers_greedy):
            assert completion.token_ids[: len(expected)] == expected, f"compile={compile}"
