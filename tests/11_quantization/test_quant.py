"""Quantized weights (notebook 11): the block formats equal ggml's, bit for bit; a quantized
layer equals a float layer on the dequantized weights (exactly when it dequantizes, within a
float32 bound when the packed kernel multiplies by the blocks, eager or compiled); the layer
kernels of the packed-cpu backend (``packed_decoder_layer``, ``packed_layers``); whole models
load packed; bad files and arguments fail clearly, naming the tensor and its type; the packed
kernel is built once per machine and its absence only costs speed. (A packed model's steps on
each backend against the float64 model: ``tests/10_engine_on_gpu/test_backends.py``.)

References: the ``gguf`` package's quantizers (bit-exact with llama.cpp's reference code) and
float64 products. Nothing here compares one float32 kernel's rounding with another's.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm import FileFormatError
from minillm.model import kernels
from minillm.model.quant import (FORMATS, QuantizedEmbedding, QuantizedLinear, dequantize, from_gguf_blocks,
                                 quantize, to_gguf_blocks, weight_bytes)

from helpers.checkpoints import tiny_hf_checkpoint, write_gguf

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def _matrix(rows: int, blocks: int, seed: int, scale_exp: int, special: str) -> np.ndarray:
    """Random weights with the cases a quantizer gets wrong: an all-zero block, a constant block,
    an exact tie between +max and -max, values at a rounding half, tiny and huge scales."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, blocks * 32)) * 2.0 ** scale_exp).astype(np.float32)
    if special == "zero":
        w[0, :32] = 0
    elif special == "constant":
        w[0, :32] = 3.0
    elif special == "tie":
        w[0, 0], w[0, 1] = 5.0, -5.0
    elif special == "halves":  # q = x / d lands on .5 for Q8_0's d = 127 / 127
        w[0, :32] = np.arange(32, dtype=np.float32) - 15.5
        w[0, 0] = 127.0
    return w


matrices = st.builds(_matrix, rows=st.integers(1, 5), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
                     scale_exp=st.integers(-20, 12), special=st.sampled_from(["none", "zero", "constant", "tie",
                                                                              "halves"]))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None)
@given(w=matrices)
def test_quantizers_equal_gguf_bit_for_bit(fmt, w):
    ours = to_gguf_blocks(fmt, **quantize(torch.from_numpy(w), fmt))
    np.testing.assert_array_equal(ours, gguf.quants.quantize(w, GGML[fmt]))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=20, deadline=None)
@given(w=matrices)
def test_blocks_read_from_a_file_dequantize_like_gguf_and_write_back_the_same_bytes(fmt, w):
    raw = gguf.quants.quantize(w, GGML[fmt])
    blocks = from_gguf_blocks(raw, fmt)
    np.testing.assert_array_equal(to_gguf_blocks(fmt, **blocks), raw)
    np.testing.assert_array_equal(dequantize(fmt, **blocks).numpy(), gguf.quants.dequantize(raw, GGML[fmt]))


def _through_layers(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """A whole model in float32 against the same weights in float64: each layer's products round
    differently (the packed kernel sums in its own order), and the roundings pass through the
    layers, so the bound is relative to the logits' scale, not per product."""
    return (got.double() - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 rounding bound for x @ w.T: a few ulps of the sum of |products| per output."""
    return 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-30


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) in float64: exact enough to measure float32 rounding against."""
    return x.double() @ w.double().T + (0 if b is None else b.double())


def _within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    return bool(((got.double() - _exact(x, w, b)).abs() <= _bound(x, w) + (0 if b is None else 1e-6 * b.abs())).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features, in_features, bias", [(1, 32, False), (37, 96, True), (130, 64, False)])
def test_a_quantized_layer_equals_a_float_layer_on_the_dequantized_weights(fmt, out_features, in_features, bias):
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features) * 0.1
    b = torch.randn(out_features) if bias else None
    layer = QuantizedLinear.from_float(weight, fmt, bias=b)
    dense = layer.dequantize()
    # 1 row (decode), 15 (a batch: tiles of 4, 2, 1 rows) and 90 (prefill: dequantize, then a float product)
    for x in (torch.randn(1, 1, in_features), torch.randn(3, 5, in_features), torch.randn(2, 45, in_features)):
        got = layer(x)
        assert got.shape == (*x.shape[:-1], out_features)
        assert _within_rounding(got.reshape(-1, out_features), x.reshape(-1, in_features), dense, b)


needs_kernels = pytest.mark.usefixtures("kernels_built")  # (built when such a test runs, not at collection)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=25, deadline=None)
@given(w=matrices, rows=st.sampled_from([*range(1, 10), 15, 32, 47, 80, 81, 90]), extra_blocks=st.integers(0, 30),
       seed=st.integers(0, 2**16))
def test_the_packed_kernel_stays_within_float32_rounding_of_the_exact_product(fmt, w, rows, extra_blocks, seed):
    """Every tile shape (4/2/1 input rows), chunks of 16 blocks and a partial last one, zero and
    constant blocks, tiny and huge scales; past 80 rows the dequantize-then-multiply path."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.from_numpy(w)
    weight = torch.cat([weight, torch.randn(weight.shape[0], extra_blocks * 32, generator=gen) * weight.abs().max()], 1)
    blocks = quantize(weight, fmt)
    dense = dequantize(fmt, **blocks)
    x = torch.randn(rows, weight.shape[1], generator=gen)
    got = kernels.linear(fmt, x, blocks["qs"], blocks["d"], blocks.get("m"))
    assert got.dtype == torch.float32 and got.shape == (rows, weight.shape[0])
    assert _within_rounding(got, x, dense)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_packed_product_does_not_depend_on_the_rows_sharing_its_call(fmt):
    """Batch invariance: up to 80 input rows (the packed tiles; more go through a float matrix
    product), each row's sums run in the same order whatever the tile it lands in, so row i of a
    call with n rows is bit for bit the product of row i alone -- a request's tokens do not depend
    on who else is in the batch. 37 outputs (tiles and a remainder), 9 blocks (a partial chunk)."""
    gen = torch.Generator().manual_seed(7)
    blocks = quantize(torch.randn(37, 9 * 32, generator=gen) * 0.1, fmt)
    x = torch.randn(80, 9 * 32, generator=gen)
    alone = torch.cat([kernels.linear(fmt, x[i:i + 1], blocks["qs"], blocks["d"], blocks.get("m")) for i in range(80)])
    for n in (2, 3, 4, 5, 7, 8, 15, 32, 80):
        together = kernels.linear(fmt, x[:n], blocks["qs"], blocks["d"], blocks.get("m"))
        assert torch.equal(together, alone[:n]), f"{n} rows: {(together != alone[:n]).sum().item()} outputs differ"


def test_a_quantized_layer_names_its_sizes_when_the_input_does_not_fit():
    layer = QuantizedLinear.from_float(torch.randn(8, 64), "q4_1")
    with pytest.raises(ValueError, match=r"a Q4_1 layer of 64 inputs and 8 outputs got an input of shape \[2, 3, 32\]"):
        layer(torch.randn(2, 3, 32))
    assert layer(torch.randn(2, 3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16  # activations keep their dtype


@needs_kernels
def test_the_packed_kernel_refuses_what_it_cannot_read_naming_the_sizes():
    blocks = quantize(torch.randn(8, 64), "q4_1")
    with pytest.raises(RuntimeError, match=r"q4_linear: x has 32 features, the weight takes 64 \(2 blocks of 32\)"):
        kernels.linear("q4_1", torch.randn(1, 32), blocks["qs"], blocks["d"], blocks["m"])
    with pytest.raises(RuntimeError, match=r"q4_linear: x must be a contiguous float32 CPU matrix.*Double"):
        kernels.linear("q4_1", torch.randn(1, 64, dtype=torch.float64), blocks["qs"], blocks["d"], blocks["m"])
    with pytest.raises(RuntimeError, match=r"q8_0_linear: qs must be int8, got Byte"):
        kernels.linear("q8_0", torch.randn(1, 64), blocks["qs"], blocks["d"], None)
    with pytest.raises(RuntimeError, match=r"q4_linear: m must be contiguous float16 on the CPU, shaped like d"):
        kernels.linear("q4_1", torch.randn(1, 64), blocks["qs"], blocks["d"], blocks["m"][:, :1].contiguous())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 40, 90])  # decode, batched decode, prefill (> 80 rows: dequantize + MKL)
def test_matrices_that_share_an_input_run_in_one_call_with_each_ones_own_result(rows):
    """``layers.linears`` on packed layers: one kernel call for q/k/v-like groups (here of three
    formats and odd sizes), each result exactly what the layer alone computes — the kernel's sum
    for an output row does not depend on which rows it shares the call with."""
    from minillm.model.layers import linears

    torch.manual_seed(rows)
    group = [QuantizedLinear.from_float(torch.randn(out, 96), fmt, bias=torch.randn(out) if out == 5 else None)
             for out, fmt in [(70, "q4_1"), (5, "q8_0"), (131, "q4_0"), (64, "q4_1")]]
    x = torch.randn(rows, 96)
    together = linears(x, group)
    alone = [layer(x) for layer in group]
    assert [tuple(y.shape) for y in together] == [(rows, 70), (rows, 5), (rows, 131), (rows, 64)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    compiled = torch.compile(lambda x: linears(x, group), fullgraph=True, dynamic=False)
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), alone))
    mixed = [group[0], torch.nn.Linear(96, 7)]  # not all packed: each layer on its own
    assert torch.equal(linears(x, mixed)[1], mixed[1](x))


@needs_kernels
def test_one_call_for_several_matrices_refuses_what_it_cannot_read():
    a, b = quantize(torch.randn(8, 64), "q4_1"), quantize(torch.randn(4, 32), "q8_0")
    with pytest.raises(RuntimeError, match=r"packed_linears: x has 64 features, the weight takes 32 \(1 blocks of 32\)"):
        kernels.linears(torch.randn(1, 64), [a["qs"], b["qs"]], [a["d"], b["d"]], [a["m"], None])
    with pytest.raises(RuntimeError, match=r"packed_linears: one qs, d, m, cols and w_cols per matrix, got 2, 1, 2, 2 and 2"):
        kernels.linears(torch.randn(1, 64), [a["qs"], a["qs"]], [a["d"]], [a["m"], a["m"]])
    out = a["qs"].shape[0]
    with pytest.raises(RuntimeError, match=r"packed_linears: column 64 of matrix 0 is outside its 64 inputs"):
        kernels.linears(torch.randn(1, 64), [a["qs"]], [a["d"]], [a["m"]], [torch.tensor([64])], [torch.ones(1, out)])
    with pytest.raises(RuntimeError, match=rf"packed_linears: w_cols of matrix 0 must be contiguous float32 on the CPU \[1, {out}\]"):
        kernels.linears(torch.randn(1, 64), [a["qs"]], [a["d"]], [a["m"]], [torch.tensor([3])], [torch.ones(2, out)])
    with pytest.raises(RuntimeError, match=r"packed_linears: matrix 0 has cols without w_cols"):
        kernels.linears(torch.randn(1, 64), [a["qs"]], [a["d"]], [a["m"]], [torch.tensor([3])], [None])
    with pytest.raises(RuntimeError, match=r"packed_linears: Q8_0 blocks have no minimums"):
        kernels.linears(torch.randn(1, 32), [b["qs"]], [b["d"]], [b["d"]])
    with pytest.raises(ValueError, match=r"a Q8_0 layer of 32 inputs and 4 outputs got an input of shape \[1, 64\]"):
        QuantizedLinear.many(torch.randn(1, 64), [QuantizedLinear("q4_1", **a), QuantizedLinear("q8_0", **b)])


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


PROBE = """
import torch
from minillm.model import kernels
from minillm.model.quant import QuantizedLinear
layer = QuantizedLinear.from_float(torch.randn(40, 64), "q4_1")
x = torch.randn(2, 64)
same = torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantize()))
print(kernels.available(), same, kernels.why_unavailable().splitlines()[0] if kernels.why_unavailable() else "")
"""


def test_without_the_kernels_quantized_layers_fall_back_to_dequantizing_and_say_why(tmp_path):
    off = _python(PROBE, MINILLM_KERNELS="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split(maxsplit=2) == ["False", "True", "MINILLM_KERNELS=0: the hand-written kernels are switched off\n"]
    # a compiler that fails (here: `false`): the build error is kept, nothing half-built is left behind
    broken = _python(PROBE, CXX="false", MINILLM_CACHE=str(tmp_path))
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.split(maxsplit=2)[:2] == ["False", "True"] and "building quant.cpp, paged_attention.cpp, linear.cpp, decoder_layer.cpp with false failed" in broken.stdout
    assert list((tmp_path / "kernels").iterdir()) == []


@needs_kernels
def test_the_kernel_library_is_built_once_and_reused(tmp_path):
    first = _python(PROBE, MINILLM_CACHE=str(tmp_path))
    assert first.stdout.split()[0] == "True", first.stderr  # built here
    [library] = (tmp_path / "kernels").iterdir()
    built = library.stat().st_mtime_ns
    again = _python(PROBE, MINILLM_CACHE=str(tmp_path))
    assert again.stdout.split()[0] == "True", again.stderr
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [built]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("outliers", [False, True], ids=["blocks", "float32-columns"])
def test_a_compiled_quantized_layer_stays_within_rounding(fmt, outliers, cxx_compiler):
    """Compiled (a model whose layers mix float and packed matrices is compiled whole), the layer
    calls the same packed kernel (or, without the kernels, the same dequantized product), its
    float32 columns included."""
    torch.manual_seed(1)
    weight = torch.randn(70, 160)
    cols = None
    if outliers:
        weight[:, 64] *= 300
        cols = torch.tensor([5, 64, 127])
    layer = QuantizedLinear.from_float(weight, fmt, bias=torch.randn(70), outlier_cols=cols)
    x = torch.randn(1, 1, 160)
    with torch.inference_mode():
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert compiled.shape == (1, 1, 70)
    assert _within_rounding(compiled[0], x[0], layer.dequantize(), layer.bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_outlier_columns_stay_float32_and_the_rest_quantizes_like_gguf(fmt):
    """``quantize_with_outliers``: the chosen input columns are the float weights (exactly where
    zero is on the format's grid; to float32 rounding for Q4_1, whose blocks add their level
    nearest zero), the others ggml's blocks of the matrix with those columns zeroed, bit for bit;
    the layer (kernel, batched and prefill paths; compiled: above) computes ``F.linear`` on that
    matrix."""
    torch.manual_seed(3)
    weight = torch.randn(37, 128) * 0.1
    weight[:, 64] *= 300  # an outlier column would set its blocks' scales
    cols = torch.tensor([5, 64, 127])
    layer = QuantizedLinear.from_float(weight, fmt, bias=torch.randn(37), outlier_cols=cols)
    dense = layer.dequantize()
    zeroed = weight.index_fill(1, cols, 0).numpy()
    reference = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(zeroed, GGML[fmt]), GGML[fmt]))
    if fmt == "q4_1":  # the blocks' level there, eps, plus (w - eps): two float32 roundings
        assert ((dense[:, cols] - weight[:, cols]).abs()
                <= 2 ** -22 * (weight[:, cols].abs() + reference[:, cols].abs())).all()
    else:
        assert torch.equal(dense[:, cols], weight[:, cols])
    rest = torch.ones(128, dtype=torch.bool)
    rest[cols] = False
    assert torch.equal(dense[:, rest], reference[:, rest])
    assert layer.nbytes == sum(t.numel() * t.element_size() for t in (layer.qs, layer.d, layer.m) if t is not None) \
        + 3 * 8 + 37 * 3 * 4
    for x in (torch.randn(1, 1, 128), torch.randn(3, 5, 128), torch.randn(2, 20, 128)):
        got = layer(x).reshape(-1, 37)
        assert _within_rounding(got, x.reshape(-1, 128), dense, layer.bias)
    with pytest.raises(ValueError, match="outlier columns of w must be a 1-D list of input indices below 128"):
        QuantizedLinear.from_float(weight, fmt, name="w", outlier_cols=torch.tensor([128]))


def test_calibration_finds_the_channel_that_carries_outlier_activations(pristine):
    """A hidden channel made 1000x larger in every token's embedding is the channel layer 0's
    q/k/v read largest after RMSNorm: ``outlier_columns`` picks it for all three (one list for
    layers that share an input), at most one column per block of 32."""
    from minillm.model.quant import outlier_columns

    model, tok = minillm.load_model(pristine, device="cpu")
    model.embed_tokens.weight.data[:, 17] *= 1000
    columns = outlier_columns(model, torch.tensor([tok.encode("To be, or not to be: that is the question")]), k=16)
    hidden = model.config.hidden_size
    first = columns["layers.0.self_attn.q_proj"]
    assert 17 in first.tolist() and len(first) == hidden // 32
    assert torch.equal(first, columns["layers.0.self_attn.k_proj"]) and torch.equal(first, columns["layers.0.self_attn.v_proj"])
    assert set(columns) == {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def test_a_quantized_embedding_looks_up_dequantized_rows():
    table = QuantizedLinear.from_float(torch.randn(50, 64), "q8_0")
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(QuantizedEmbedding(table)(ids), table.dequantize()[ids])


def test_rows_that_are_not_whole_blocks_and_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight of shape \[4, 40\] to Q8_0.*blocks of 32"):
        quantize(torch.randn(4, 40), "q8_0", "layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(torch.tensor([[float("nan")] * 32]), "q4_0", "w")
    with pytest.raises(ValueError, match=r"w to Q8_0: its block scales are past float16's range \(65504\)"):
        quantize(torch.full((1, 32), 1e7), "q8_0", "w")
    with pytest.raises(ValueError, match="unknown quantization format 'q5_k'"):
        quantize(torch.randn(2, 32), "q5_k")


# --------------------------------------------------------------------------- whole models
def test_quantizing_a_checkpoint_at_load_packs_every_matrix(pristine):
    float_model, tok = minillm.load_model(pristine, device="cpu")
    ids = torch.tensor([tok.encode("To be, or not to be")])
    for fmt in FORMATS:
        model, _ = minillm.load_model(pristine, device="cpu", weights=fmt)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears == [], f"{fmt}: float linear layers left: {len(linears)}"
        assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.table.fmt == "q8_0"
        assert weight_bytes(model) < weight_bytes(float_model) / 3
        # the law: a quantized model computes what a float model on the dequantized weights computes
        twin, _ = minillm.load_model(pristine, device="cpu")
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear) and name != "embed_tokens.table":
                twin.get_submodule(name).weight = torch.nn.Parameter(module.dequantize(), requires_grad=False)
        twin.embed_tokens.weight = torch.nn.Parameter(model.embed_tokens.table.dequantize(), requires_grad=False)
        with torch.inference_mode():
            assert _through_layers(model(ids), twin.double()(ids)), fmt


@needs_kernels
def test_the_layer_kernel_refuses_what_does_not_fit_naming_the_matrix_and_the_slot(pristine):
    from minillm.cache.paged import PagedKVCache
    from minillm.engine.backends.packed_cpu import layer_arguments

    model, _ = minillm.load_model(pristine, device="cpu", weights="q8_0")
    config = model.config
    cache = PagedKVCache(config, num_blocks=4, block_size=4)
    cache.add_sequence(0)
    step = cache.prepare([0], 1)
    x = torch.randn(1, config.hidden_size)
    cos, sin = torch.ones(1, config.head_dim), torch.zeros(1, config.head_dim)

    def run(arguments: tuple, write_offsets: torch.Tensor = step.write_offsets) -> torch.Tensor:
        return kernels.packed_decoder_layer(x, arguments, cos, sin, step.k_pools[0], step.v_pools[0], step.write_blocks,
                                            write_offsets, step.block_tables, step.context_lens)

    arguments = layer_arguments(model.layers[0])
    assert run(arguments).shape == (1, config.hidden_size)
    swapped = arguments[:3] + tuple([*part[:4], part[6], part[5], part[4]] for part in arguments[3:])  # gate <-> down
    with pytest.raises(RuntimeError, match=rf"gate_proj is \[{config.hidden_size}, {config.intermediate_size}\], "
                                           rf"expected \[any, {config.hidden_size}\]"):
        run(swapped)
    with pytest.raises(RuntimeError, match=r"row 0 writes to block \d+ offset 4 of a pool of \d+ blocks of 4"):
        run(arguments, write_offsets=torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"one qs, d, m, cols, w_cols and bias for each of q, k, v, o, gate, up, down"):
        run(arguments[:3] + tuple(part[:6] for part in arguments[3:]))
    with pytest.raises(RuntimeError, match=r"q_proj's bias must be a contiguous float32 CPU tensor"):
        run(arguments[:8] + ([torch.zeros(3)] + arguments[8][1:],))
    # a refused step leaves the cache as it was: the tables and lengths are checked before any write
    pools = [pool.clone() for pool in (step.k_pools[0], step.v_pools[0])]
    for bad in ({"context_lens": torch.tensor([99])}, {"block_tables": step.block_tables.int()},
                {"block_tables": torch.full_like(step.block_tables, 1000)}):
        with pytest.raises(RuntimeError, match=r"packed_decoder_layer: (row 0 has context length 99|block_tables must|"
                                               r"row 0 reads block 1000)"):
            kernels.packed_decoder_layer(x, arguments, cos, sin, step.k_pools[0], step.v_pools[0], step.write_blocks,
                                         step.write_offsets, bad.get("block_tables", step.block_tables),
                                         bad.get("context_lens", step.context_lens))
        assert torch.equal(step.k_pools[0], pools[0]) and torch.equal(step.v_pools[0], pools[1])
    empty = torch.zeros(4, config.n_kv_heads, 4, 0)  # a head_dim of 0: an error, not a division by zero
    with pytest.raises(RuntimeError, match=r"need KV heads, blocks and an even head_dim"):
        kernels.packed_decoder_layer(x, arguments, cos, sin, empty, empty, step.write_blocks, step.write_offsets,
                                     step.block_tables, step.context_lens)


@needs_kernels
def test_all_layers_in_one_call_equal_the_layer_kernel_layer_by_layer(tmp_path, tiny_tokenizer):
    """``kernels.packed_layers`` (the engine's one call per decode step) runs the very layer code
    of ``packed_decoder_layer``: its output and every layer's pools equal calling the op layer by
    layer, bit for bit (qwen2: biases; three rows of different lengths on blocks of 4). A bad step
    is refused before any layer's pool is written; a tensor changed in place, even given new
    memory (``.data = ...``), is what the next call reads. With the ends set (the table, the final
    norm, the head), ``logits`` is the whole decode step, token ids to logits: a token id outside
    the table or a row to keep that the step does not have is refused by name, every pool as it was."""
    from minillm.cache.paged import PagedKVCache
    from minillm.engine.backends.packed_cpu import ends_arguments, layer_arguments
    from minillm.model import quant

    folder = tiny_hf_checkpoint(tmp_path, tiny_tokenizer, "qwen2", vocab_size=300, tie_word_embeddings=False)
    model, _ = minillm.load_model(folder, device="cpu")
    quant.quantize_model(model, "q4_1", calibration=torch.tensor([[5, 9, 2, 7, 1, 3]]))
    config = model.config
    arguments = [layer_arguments(block) for block in model.layers]
    stack = kernels.packed_layers(arguments, config.n_kv_heads, config.head_dim)
    assert stack.size() == config.n_layers and stack.matrices(0)[0] is model.layers[0].self_attn.q_proj.qs
    cache = PagedKVCache(config, num_blocks=16, block_size=4)
    for seq, length in enumerate([5, 1, 9]):
        cache.add_sequence(seq)
        cache.prepare([seq], length)
    step = cache.prepare([0, 1, 2], 1)
    torch.manual_seed(0)
    x = torch.randn(3, config.hidden_size)
    for pool in step.k_pools + step.v_pools:
        pool.copy_(torch.randn_like(pool))
    angles = torch.randn(3, config.head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    slots_and_tables = (step.write_blocks, step.write_offsets, step.block_tables, step.context_lens)
    before = [pool.clone() for pool in step.k_pools + step.v_pools]

    def one_by_one(pools: list[torch.Tensor]) -> torch.Tensor:
        h = x
        for i, layer in enumerate(arguments):
            h = kernels.packed_decoder_layer(h, layer, cos, sin, pools[i], pools[config.n_layers + i], *slots_and_tables)
        return h

    expected_pools = [pool.clone() for pool in before]
    expected = one_by_one(expected_pools)
    got = stack.forward(x, cos, sin, step.k_pools, step.v_pools, *slots_and_tables)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(step.k_pools + step.v_pools, expected_pools))

    for pool, saved in zip(step.k_pools + step.v_pools, before):
        pool.copy_(saved)
    bad_offsets = torch.tensor([0, 1, 4])  # row 2 writes past its block: refused before layer 0 writes
    with pytest.raises(RuntimeError, match=r"row 2 writes to block \d+ offset 4 of a pool of \d+ blocks of 4"):
        stack.forward(x, cos, sin, step.k_pools, step.v_pools, step.write_blocks, bad_offsets, *slots_and_tables[2:])
    with pytest.raises(RuntimeError, match=r"2 layers need as many k_pools and v_pools, got 1 and 2"):
        stack.forward(x, cos, sin, step.k_pools[:1], step.v_pools, *slots_and_tables)
    with pytest.raises(RuntimeError, match=r"the pools, block_tables and context_lens must be on the CPU, got meta"):
        stack.forward(x, cos, sin, [pool.to("meta") for pool in step.k_pools], step.v_pools, *slots_and_tables)
    assert all(torch.equal(a, b) for a, b in zip(step.k_pools + step.v_pools, before))
    with pytest.raises(RuntimeError, match=r"two norms and an eps per layer and 7 qs"):
        kernels.packed_layers(arguments[:1] + [arguments[1][:3] + tuple(part[:6] for part in arguments[1][3:])],
                              config.n_kv_heads, config.head_dim)
    swapped = arguments[1][:3] + tuple([*part[:4], part[6], part[5], part[4]] for part in arguments[1][3:])
    with pytest.raises(RuntimeError, match=rf"layer 1: PackedLayers: gate_proj is \[{config.hidden_size}, "):
        kernels.packed_layers([arguments[0], swapped], config.n_kv_heads, config.head_dim)
    with pytest.raises(RuntimeError, match=r"PackedLayers.logits: no embedding table and LM head"):
        stack.logits(torch.tensor([1, 2, 3]), cos, sin, step.k_pools, step.v_pools, *slots_and_tables)
    ends = ends_arguments(model)
    stack.set_ends(*ends)
    with pytest.raises(RuntimeError, match=rf"the final norm must be a contiguous float32 CPU tensor \[{config.hidden_size}\]"):
        stack.set_ends(*ends[:3], torch.ones(3), *ends[4:])
    assert stack.logits(torch.tensor([1, 2, 3]), cos, sin, step.k_pools, step.v_pools, *slots_and_tables).shape == \
        (3, config.vocab_size)  # (the refused set kept the ends there were)
    for pool, saved in zip(step.k_pools + step.v_pools, before):
        pool.copy_(saved)
    with pytest.raises(RuntimeError, match=r"PackedLayers.logits: row 1 has token id 300, outside the embedding "
                                           r"table's 300 rows"):
        stack.logits(torch.tensor([1, 300, 3]), cos, sin, step.k_pools, step.v_pools, *slots_and_tables)
    with pytest.raises(RuntimeError, match=r"PackedLayers.logits: logits_rows\[0\] is 3, not one of the step's 3 rows"):
        stack.logits(torch.tensor([1, 2, 3]), cos, sin, step.k_pools, step.v_pools, *slots_and_tables, torch.tensor([3]))
    assert all(torch.equal(a, b) for a, b in zip(step.k_pools + step.v_pools, before))
    last = stack.logits(torch.tensor([1, 2, 3]), cos, sin, step.k_pools, step.v_pools, *slots_and_tables,
                        torch.tensor([2]))  # the final norm and the head on the rows asked for only
    assert last.shape == (1, config.vocab_size)
    for pool, saved in zip(step.k_pools + step.v_pools, before):
        pool.copy_(saved)

    down = model.layers[1].mlp.down_proj
    down.qs.data = torch.flip(down.qs, dims=[0]).contiguous()  # new memory behind the same tensor
    expected_pools = [pool.clone() for pool in before]
    expected = one_by_one(expected_pools)
    assert not torch.equal(expected, got)
    assert torch.equal(stack.forward(x, cos, sin, step.k_pools, step.v_pools, *slots_and_tables), expected)


def test_native_weights_keep_a_gguf_files_blocks_and_equal_its_float_load(tmp_path, pristine, tiny_tokenizer):
    def kind(name: str):
        return gguf.GGMLQuantizationType.Q4_1 if name.startswith("blk.") and "norm" not in name else (
            gguf.GGMLQuantizationType.Q8_0 if name in ("token_embd.weight", "output.weight") else None)

    path = write_gguf(tmp_path / "q.gguf", pristine, tiny_tokenizer, types=kind)
    float_model, tok = minillm.load_model(path, device="cpu")  # dequantized to float32
    native, _ = minillm.load_model(path, device="cpu", weights="native")
    assert native.layers[0].self_attn.q_proj.fmt == "q4_1" and native.embed_tokens.table.fmt == "q8_0"
    assert native.lm_head.fmt == "q8_0"
    q = native.layers[1].self_attn.q_proj  # un-permuted like the float weights, rows with their scales
    assert torch.equal(q.dequantize(), float_model.layers[1].self_attn.q_proj.weight)
    ids = torch.tensor([tok.encode("To be, or not to be")])
    assert _through_layers(native(ids), float_model.double()(ids))  # the same products on the same weights


def test_native_refuses_types_it_cannot_keep_packed_and_damaged_scales(tmp_path, pristine, tiny_tokenizer):
    q5 = write_gguf(tmp_path / "q5.gguf", pristine, tiny_tokenizer,
                    types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0})
    minillm.load_model(q5, device="cpu")  # the float path dequantizes any type gguf knows
    with pytest.raises(FileFormatError, match=r"q5\.gguf: tensor blk\.0\.ffn_up\.weight is Q5_0.*Q8_0, Q4_0, Q4_1"):
        minillm.load_model(q5, device="cpu", weights="native")

    bad = write_gguf(tmp_path / "nan.gguf", pristine, tiny_tokenizer, types={"blk.1.attn_v.weight": gguf.GGMLQuantizationType.Q8_0})
    reader = minillm.gguf_io.open_gguf(bad)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    with open(bad, "r+b") as f:  # the first block's float16 scale := NaN
        f.seek(tensor.data_offset)
        f.write(np.array([np.nan], dtype=np.float16).tobytes())
    with pytest.raises(FileFormatError, match=r"nan\.gguf: tensor blk\.1\.attn_v\.weight \(Q8_0\) (has|holds) NaN"):
        minillm.load_model(bad, device="cpu", weights="native")


def test_weight_choices_are_checked(pristine):
    with pytest.raises(ValueError, match="weights='int3' is not one of float32, bfloat16, native, q8_0"):
        minillm.load_model(pristine, device="cpu", weights="int3")
    with pytest.raises(ValueError, match="disagree"):
        minillm.load_model(pristine, device="cpu", weights="bfloat16", dtype="float32")
    with pytest.raises(ValueError, match="weights='native' keeps a GGUF file's blocks.*'q8_0'"):
        minillm.load_model(pristine, device="cpu", weights="native")
    model, _ = minillm.load_model(pristine, device="cpu", weights="bfloat16")
    assert model.dtype == torch.bfloat16


def test_the_default_model_native_is_the_files_size_and_answers_like_float32(smollm):
    from minillm.gguf_io import open_gguf

    float_model, tok = smollm
    native, _ = minillm.load_model(device="cpu", weights="native")
    file_bytes = sum(t.n_bytes for t in open_gguf(minillm.assets.default_gguf_path()).tensors)
    assert weight_bytes(native) <= 1.2 * file_bytes
    assert native.lm_head.qs is native.embed_tokens.table.qs  # tied: the table is stored once
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        got, exact = native(ids), copy.deepcopy(float_model).double()(ids)
    # float32 *is* the dequantized file: the same weights, the same products up to rounding
    assert _through_layers(got, exact)
    engine = minillm.Engine(native, tok, backend="eager")  # the compiled packed product: tested on small layers above
    assert engine.generate(["The capital of France is"], minillm.SamplingParams(max_new_tokens=2))[0].text.startswith(" Paris")


def test_the_cli_offers_load_models_weight_formats_and_runs_one(capsys):
    from minillm import __main__ as cli
    from minillm.model import loading

    assert cli.WEIGHTS == loading.WEIGHTS
    assert cli.main(["generate", "--weights", "native", "--max-new-tokens", "3",
                     "--prompt", "The capital of France is"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(" Paris") and "(native weights)" in out.err


def test_the_default_format_is_the_files_own_blocks_where_they_run_packed(tmp_path, pristine, tiny_tokenizer):
    from minillm.model.loading import default_weights

    assert default_weights(pristine) == "float32"  # a checkpoint of floats
    q5 = write_gguf(tmp_path / "q5.gguf", pristine, tiny_tokenizer,
                    types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0})
    assert default_weights(q5) == "float32"  # a block type that cannot run packed
    q4 = write_gguf(tmp_path / "q4.gguf", pristine, tiny_tokenizer,
                    types=lambda name: gguf.GGMLQuantizationType.Q4_1 if name.startswith("blk.") and "norm" not in name
                    else None)
    assert default_weights(q4) == ("native" if kernels.available() else "float32")
    assert default_weights(None, "cpu") == ("native" if kernels.available() else "float32")  # SmolLM2's Q4_1 file
