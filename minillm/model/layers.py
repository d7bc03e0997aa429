"""The small layers of a Llama block: Linear, RMSNorm and the SwiGLU feed-forward network."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minillm.model import kernels


_ONEDNN = torch.backends.mkldnn.is_available()


@torch.library.custom_op("minillm::small_batch_linear", mutates_args=())
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a few rows on the CPU through oneDNN's matmul (``F.linear``'s MKL
    path is 2-3x slower at 2-16 rows). A custom op, so the compiler calls it as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@small_batch_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Linear(torch.nn.Linear):
    """``torch.nn.Linear``, plus faster products for decode steps when compiled on a CPU.

    Decoding one token multiplies one row vector by every weight matrix: a matrix-vector
    product (GEMV), whose cost is reading the weights from memory once. MKL's one-row product
    runs on one core and streams ~12 GB/s on the course machine, a third of what the memory
    delivers. Written as ``(weight * x).sum(-1)``, the same product becomes a reduction that
    ``torch.compile`` turns into one vectorized pass over the weights on every core, without
    ever materializing ``weight * x``. Run eagerly, that form *would* materialize it, so the
    rewrite applies only while compiling.

    A batched decode step multiplies a handful of rows (2-16), where MKL's matrix product
    reads the weights at only 5-19 GB/s here (6 GB/s for the 49152-row LM head) and took three
    quarters of a batch-8 step. oneDNN's matmul (``small_batch_linear``) reads them 1.4-2.3x
    faster (the batch-8 step: 88 -> 62 ms); the hand-written ``kernels.f32_linear``, which reads
    each weight once for all the rows while it is in registers, is 1.5-2.5x faster again at 8
    rows (measured: 40-55 ms vs 70-87 ms per batch-8 step, interleaved), so it runs wherever its
    AVX-512 or AVX2 version is built (``kernels.vectorized()``), oneDNN elsewhere. One row stays the
    compiled reduction: the kernel was slower there (28-31 vs 20-25 ms per token). Everything
    else — eager calls, prefill, other devices and dtypes — calls ``F.linear`` as usual.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type == "cpu" and x.shape[:-1].numel() == 1:
            y = (self.weight * x.reshape(1, -1)).sum(-1)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], -1)
        few_rows_float32 = torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
        if few_rows_float32 and (kernels.vectorized() or _ONEDNN):
            rows = x.reshape(-1, x.shape[-1])
            y = kernels.f32_linear(rows, self.weight) if kernels.vectorized() else small_batch_linear(rows, self.weight)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


def linears(x: torch.Tensor, layers: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``: the projections that read the same input (an
    attention layer's q, k and v; the feed-forward's gate and up).

    A layer type may run such a group in one call, through a static ``many(x, layers)``: the
    packed-weight layers do (``QuantizedLinear.many``), one kernel call in which the cores split
    all the group's output rows — a decode step makes 30 x 7 products of one row, each paying a
    call and a fork/join of the threads, so 4 calls per layer instead of 7 is worth it there.
    (A decode step of a model whose every matrix is packed goes further: each whole layer is one
    kernel call, ``quant.decode_layer``.) Any other group is called layer by layer.
    """
    kind = type(layers[0])
    if hasattr(kind, "many") and all(type(layer) is kind for layer in layers):
        return kind.many(x, layers)
    return [layer(x) for layer in layers]


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * weight``.

    Unlike LayerNorm it neither subtracts the mean nor adds a bias: cheaper, and in practice
    just as good. The statistic is computed in float32 even when x is half precision.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(torch.nn.Module):
    """The feed-forward network: ``down(silu(gate(x)) * up(x))``.

    Two parallel projections up to ``intermediate_size``; one passes through SiLU and *gates*
    the other elementwise. Three matrices instead of the classic two, hence the odd
    intermediate sizes (1536 = 8/3 * 576) that keep the parameter count comparable.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)
