"""Quantized weights: llama.cpp's block formats kept packed in memory (notebook 11).

Decoding one token reads every weight once, so on a memory-bound step the bytes per weight
set the speed: float32 costs 4 bytes, Q8_0 1.06, Q4_1 0.63. A *block format* cuts a row of
weights into blocks of 32 and stores, per block, small integers plus a float16 scale:

* **Q8_0** (34 bytes per 32 weights): ``w = d * q``, ``q`` an int8 in [-127, 127], ``d =
  absmax / 127``. Symmetric ("absmax"): zero stays exactly zero.
* **Q4_0** (18 bytes): ``w = d * (q - 8)``, ``q`` 4 bits in [0, 15], ``d = max / -8`` where
  ``max`` is the block's entry of largest magnitude, with its sign (that entry maps to -8).
* **Q4_1** (20 bytes): ``w = d * q + m``, ``q`` 4 bits, ``m`` the block's minimum, ``d =
  (max - min) / 15``. Asymmetric ("min-max"): it spends a second scale to use all 16 levels
  on the block's actual range.

In the file, a 4-bit block packs two weights per byte: byte ``j`` holds weight ``j`` in its low
nibble and weight ``j + 16`` in its high nibble. Here a quantized matrix is kept as tensors,
``qs`` [out, blocks, 32] int8 (Q8_0) or [out, blocks, 16] uint8 (Q4), and ``d`` (and ``m``)
[out, blocks] float16 — the file's bytes, rearranged, not expanded.

``QuantizedLinear`` multiplies by such a matrix. On a CPU it calls the packed kernel of
``minillm/model/kernels`` (C++, built on the machine at first use): it reads each packed byte
once and turns 16 codes into weights per instruction with AVX-512 — a 4-bit block has only 16
possible weights, ``d * k + m``, computed into one register and *looked up* by the codes — or 8
per instruction with AVX2 (converted, not looked up), then multiplies in float32, so the float matrix never exists and the result is ``F.linear(x,
dequantize(W))`` up to float32 rounding. Where the kernel cannot be built (no C++ compiler) and
on other devices, the layer dequantizes into a float matrix and calls ``F.linear``: correct,
not fast.

``quantize_model`` with a calibration text (what ``load_model(weights="q8_0" | "q4_0")`` does)
keeps each matrix's few outlier input channels in float32 beside the blocks
(``quantize_with_outliers``); the kernel adds their share in the same pass.

The quantizers reproduce ggml's reference code bit for bit (checked against the ``gguf``
package), including its rounding: half away from zero for Q8_0, ``trunc(x + 0.5)`` for Q4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from minillm.model import kernels

BLOCK_SIZE = 32
FORMATS = ("q8_0", "q4_0", "q4_1")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # bytes per block of 32 weights, as in a GGUF file


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (halves away from zero), as ggml rounds; ``torch.round`` rounds halves to even."""
    a = x.abs()
    floored = a.floor()
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, and 0 where ``d`` is 0 (an all-zero block quantizes to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values in [0, 15] -> [..., 16] bytes: weight j low, weight j + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values in [0, 15], in the weights' order."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def quantize(w: torch.Tensor, fmt: str, name: str = "weight") -> dict[str, torch.Tensor]:
    """Quantize a float matrix [out, in] into ``fmt`` blocks along ``in``: ``{"qs", "d"[, "m"]}``.

    The arithmetic follows ggml's reference quantizers step by step in float32, so the result
    equals ``gguf.quants.quantize`` bit for bit. ``in`` must be a multiple of 32.
    """
    _check_format(fmt)
    if w.dim() != 2 or w.shape[1] % BLOCK_SIZE:
        raise ValueError(f"cannot quantize {name} of shape {list(w.shape)} to {fmt.upper()}: its rows must be "
                         f"whole blocks of {BLOCK_SIZE} values")
    blocks = w.detach().to("cpu", torch.float32).reshape(w.shape[0], -1, BLOCK_SIZE)
    if not torch.isfinite(blocks).all():
        raise ValueError(f"cannot quantize {name}: it holds NaN or infinite values")
    if fmt == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = _round_half_away(blocks * _reciprocal_or_zero(d)).to(torch.int8)
        return _checked({"qs": q, "d": d[..., 0].half()}, fmt, name)
    if fmt == "q4_0":
        index = blocks.abs().argmax(-1, keepdim=True)  # the first entry of largest magnitude
        d = torch.gather(blocks, -1, index) / -8
        q = torch.trunc(blocks * _reciprocal_or_zero(d) + 8.5).clamp(0, 15).to(torch.uint8)
        return _checked({"qs": pack_nibbles(q), "d": d[..., 0].half()}, fmt, name)
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15
    q = torch.trunc((blocks - low) * _reciprocal_or_zero(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return _checked({"qs": pack_nibbles(q), "d": d[..., 0].half(), "m": low[..., 0].half()}, fmt, name)


def quantize_with_outliers(w: torch.Tensor, fmt: str, name: str = "weight",
                           outlier_cols: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """``quantize``, except for the input columns ``outlier_cols``: they are zeroed in the blocks,
    so a block's scale is not set by them, and kept float32 as ``outlier_w`` [k, out] (a row per
    column: what the blocks leave out there): the layer's matrix is ``dequantize(blocks)`` plus
    these columns.

    Why: a few input channels of a transformer's layers carry activations tens to thousands of
    times larger than the rest ("outlier features", Dettmers et al. 2022, LLM.int8()). A weight's
    rounding error reaches the output multiplied by its input, so those channels' errors dominate
    the output's; kept exact, they cost k columns of floats per matrix (see ``outlier_columns``).
    """
    if outlier_cols is None:
        return quantize(w, fmt, name)
    cols = outlier_cols.to(w.device, torch.int64)
    if cols.dim() != 1 or cols.numel() and not (0 <= int(cols.min()) and int(cols.max()) < w.shape[-1]):
        raise ValueError(f"outlier columns of {name} must be a 1-D list of input indices below {w.shape[-1]}")
    blocks = quantize(w.index_fill(1, cols, 0), fmt, name)
    # What the blocks leave out in those columns: all of w for Q8_0 / Q4_0 (zero is on their grids),
    # w minus the block's nearest level for Q4_1 (a min-max grid need not hold zero).
    held = dequantize(fmt, **blocks)[:, cols.cpu()]
    columns = w[:, cols].detach().to("cpu", torch.float32) - held
    return {**blocks, "outlier_cols": cols.cpu(), "outlier_w": columns.t().contiguous()}


def _checked(blocks: dict[str, torch.Tensor], fmt: str, name: str) -> dict[str, torch.Tensor]:
    """Refuse blocks whose float16 scales overflowed (weights beyond float16's range)."""
    for key in ("d", "m"):
        if key in blocks and not torch.isfinite(blocks[key]).all():
            raise ValueError(f"cannot quantize {name} to {fmt.upper()}: its block scales are past float16's range "
                             f"({torch.finfo(torch.float16).max:.0f})")
    return blocks


def dequantize(fmt: str, qs: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix [out, in] that blocks stand for (``gguf.quants.dequantize``'s numbers)."""
    _check_format(fmt)
    scale = d.float()[..., None]
    if fmt == "q8_0":
        w = qs.float() * scale
    elif fmt == "q4_0":
        w = (unpack_nibbles(qs).float() - 8) * scale
    else:
        w = unpack_nibbles(qs).float() * scale + m.float()[..., None]
    return w.reshape(qs.shape[0], -1).to(dtype)


def from_gguf_blocks(raw: np.ndarray, fmt: str) -> dict[str, torch.Tensor]:
    """A GGUF tensor's bytes, uint8 [rows, bytes per row], as ``{"qs", "d"[, "m"]}`` tensors (a copy)."""
    _check_format(fmt)
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[fmt])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if fmt == "q8_0":
        return {"qs": torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), "d": d}
    if fmt == "q4_0":
        return {"qs": torch.from_numpy(blocks[..., 2:].copy()), "d": d}
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    return {"qs": torch.from_numpy(blocks[..., 4:].copy()), "d": d, "m": m}


def to_gguf_blocks(fmt: str, qs: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None) -> np.ndarray:
    """The inverse of ``from_gguf_blocks``: the bytes a GGUF file stores, uint8 [rows, bytes per row]."""
    _check_format(fmt)
    parts = [d.numpy()[..., None].view(np.uint8)]
    if fmt == "q4_1":
        parts.append(m.numpy()[..., None].view(np.uint8))
    parts.append(qs.numpy().view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(qs.shape[0], -1)


class QuantizedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept in a block format (see the module docstring).

    Args:
        fmt: "q8_0", "q4_0" or "q4_1".
        qs, d, m: the blocks (``quantize`` or ``from_gguf_blocks``); ``m`` only for Q4_1.
        bias: an optional float bias, kept as it is.
    """

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, outlier_cols: Optional[torch.Tensor] = None,
                 outlier_w: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        _check_format(fmt)
        if (m is not None) != (fmt == "q4_1"):
            raise ValueError(f"{fmt.upper()} blocks {'need' if fmt == 'q4_1' else 'have no'} minimums (m)")
        if (outlier_cols is None) != (outlier_w is None) or (
                outlier_w is not None and outlier_w.shape != (outlier_cols.numel(), qs.shape[0])):
            raise ValueError("outlier_cols [k] and outlier_w [k, out] come together")
        self.fmt = fmt
        self.out_features = qs.shape[0]
        self.in_features = qs.shape[1] * BLOCK_SIZE
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.register_buffer("outlier_cols", outlier_cols)
        self.register_buffer("outlier_w", outlier_w)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: str, bias: Optional[torch.Tensor] = None,
                   name: str = "weight", outlier_cols: Optional[torch.Tensor] = None) -> QuantizedLinear:
        """Quantize ``weight``; the input columns ``outlier_cols`` (if any) stay float32 beside the
        blocks, which hold zeros there (see ``outlier_columns``)."""
        blocks = quantize_with_outliers(weight, fmt, name, outlier_cols)
        blocks = {key: value.to(weight.device) for key, value in blocks.items()}
        return cls(fmt, **blocks, bias=bias)

    def extra_repr(self) -> str:
        outliers = "" if self.outlier_cols is None else f", float32 columns={self.outlier_cols.numel()}"
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.upper()}{outliers}"

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory (the blocks and any float columns, not a float copy)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.outlier_cols, self.outlier_w)
                   if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix this layer multiplies by: the blocks' numbers, plus the float columns."""
        w = dequantize(self.fmt, self.qs, self.d, self.m)
        if self.outlier_cols is not None:
            w = w.index_add(1, self.outlier_cols, self.outlier_w.t())
        return w.to(dtype)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"a {self.fmt.upper()} layer of {self.in_features} inputs and {self.out_features} outputs "
                             f"got an input of shape {list(x.shape)}")

    @staticmethod
    def many(x: torch.Tensor, layers: Sequence[QuantizedLinear]) -> list[torch.Tensor]:
        """``[layer(x) for layer in layers]`` in one kernel call on a CPU (``layers.linears``):
        a layer's q/k/v or gate/up, whatever their formats."""
        for layer in layers:
            layer._check_input(x)
        if x.device.type == "cpu" and kernels.available():
            return QuantizedLinear._packed(x, layers)
        return [layer(x) for layer in layers]

    @staticmethod
    def _packed(x: torch.Tensor, layers: Sequence[QuantizedLinear]) -> list[torch.Tensor]:
        """The kernel's products of ``x`` with each layer's blocks (the CPU path of ``forward``
        and ``many``), in ``x``'s dtype and shape."""
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        # the float columns, if any, are added by the kernel in the same pass
        if len(layers) == 1:  # the single-matrix op: no lists to convert (~5 µs less per call)
            layer = layers[0]
            ys = [kernels.linear(layer.fmt, rows, layer.qs, layer.d, layer.m, layer.outlier_cols, layer.outlier_w)]
        else:
            ys = kernels.linears(rows, [layer.qs for layer in layers], [layer.d for layer in layers],
                                 [layer.m for layer in layers], [layer.outlier_cols for layer in layers],
                                 [layer.outlier_w for layer in layers])
        return [layer._add_bias(y.to(x.dtype)).view(*x.shape[:-1], -1) for layer, y in zip(layers, ys)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.device.type == "cpu" and kernels.available():
            return self._packed(x, [self])[0]
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

class QuantizedEmbedding(torch.nn.Module):
    """A token embedding table in a block format: each looked-up row is dequantized on the fly.

    With tied embeddings the LM head is a ``QuantizedLinear`` over the very same blocks
    (``as_linear``), so the table is stored once, as in the file.
    """

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype  # the activations' dtype, which the rows are dequantized into

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        m = None if t.m is None else t.m[ids]
        rows = dequantize(t.fmt, t.qs[ids].reshape(-1, *t.qs.shape[1:]), t.d[ids].reshape(-1, t.d.shape[-1]),
                          None if m is None else m.reshape(-1, m.shape[-1]), self.dtype)
        return rows.view(*ids.shape, -1)


# --------------------------------------------------------------------------- whole models
# The table and the LM head steer every logit: a 4-bit request keeps them at 8 bits, as
# llama.cpp keeps its output tensor at higher precision (SmolLM2's own Q4_1 file has a Q8_0
# table). Norms and biases stay float: they are tiny and every token passes through them.
TABLE_FORMAT = "q8_0"


# Input channels kept float32 per matrix when a calibration text is given (notebook 11 plots the
# KL from float32 against this number: on SmolLM2-135M, Q8_0's mean KL falls from 0.0014 to
# ~0.0005 nats with 16, for ~7 % more bytes).
OUTLIER_COLUMNS = 16


def quantize_model(model: torch.nn.Module, fmt: str, calibration: Optional[torch.Tensor] = None,
                   outliers: int = OUTLIER_COLUMNS) -> torch.nn.Module:
    """Replace every linear layer's weight (and the embedding table) by ``fmt`` blocks, in place.

    With ``calibration`` token ids [1, n], the model first runs on them in float and each linear
    layer keeps the ``outliers`` input channels whose activations peaked highest in float32
    (``outlier_columns``, ``quantize_with_outliers``); the table is quantized whole.
    """
    _check_format(fmt)
    columns = outlier_columns(model, calibration, outliers) if calibration is not None and outliers else {}
    blocks = {name: quantize_with_outliers(module.weight, TABLE_FORMAT if _is_table(name) else fmt,
                                           f"{name}.weight", columns.get(name))
              for name, module in _weight_modules(model)}
    return use_blocks(model, {name: (TABLE_FORMAT if _is_table(name) else fmt, b) for name, b in blocks.items()})


def outlier_columns(model: torch.nn.Module, calibration: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """For each linear layer (not the table), the ``k`` input channels (at most one per block of
    32) whose absolute activation peaked highest while the float model ran on ``calibration``
    ids [1, n], in ascending order.

    Layers that read the same input (q/k/v, gate/up) get the same channels."""
    layers = [(name, module) for name, module in _weight_modules(model)
              if isinstance(module, torch.nn.Linear) and not _is_table(name)]
    peaks: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[torch.nn.Module, tuple], None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float().cpu()
            peaks[name] = torch.maximum(peaks[name], x) if name in peaks else x
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in layers]
    try:
        with torch.inference_mode():
            model(calibration.to(model.norm.weight.device))
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name, _ in layers if name not in peaks]
    if missing:
        raise RuntimeError(f"the calibration pass did not reach {missing[:3]}: cannot pick their outlier columns")
    # at most one column per block: on a small matrix, k columns of floats would outweigh the blocks
    return {name: peak.topk(min(k, peak.numel() // BLOCK_SIZE)).indices.sort().values for name, peak in peaks.items()}


def use_blocks(model: torch.nn.Module, blocks: dict[str, tuple[str, dict[str, torch.Tensor]]]) -> torch.nn.Module:
    """Swap the modules named in ``blocks`` (module name -> (format, {"qs", "d"[, "m"]})) for
    quantized ones, in place. A tied LM head shares the embedding's blocks."""
    device = model.norm.weight.device
    tied = model.lm_head.weight is model.embed_tokens.weight
    for name, (fmt, tensors) in blocks.items():
        module = model.get_submodule(name)
        tensors = {key: value.to(device) for key, value in tensors.items()}
        bias = getattr(module, "bias", None)
        quantized = QuantizedLinear(fmt, **tensors, bias=bias)
        if isinstance(module, torch.nn.Embedding):
            _set_submodule(model, name, QuantizedEmbedding(quantized, model.norm.weight.dtype))
            if tied:
                model.lm_head = quantized
        else:
            _set_submodule(model, name, quantized)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all weights as stored in memory (quantized blocks, float tensors), shared ones once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *(b for name, b in model.named_buffers() if "rotary" not in name)]:
        if tensor is not None:
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _is_table(name: str) -> bool:
    return name in ("embed_tokens", "lm_head")


def _weight_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose weight is a matrix to quantize: every linear layer and the embedding
    table (a tied LM head is the table itself, listed once)."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not (tied and name == "lm_head")]


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
