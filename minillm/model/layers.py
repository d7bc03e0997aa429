"""The small layers of a Llama block: Linear, RMSNorm and the SwiGLU feed-forward network."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minillm.model import kernels


# At most this many rows go through the hand-written float32 kernel (a decode step's rows);
# more (a prefill) are a matrix-matrix product, which MKL already runs at full speed.
FEW_ROWS = 32


class Linear(torch.nn.Linear):
    """``torch.nn.Linear``, with the products of a few rows on a CPU through a kernel made for them.

    Decoding one token multiplies one row vector by every weight matrix: a matrix-vector
    product (GEMV), whose cost is reading the weights from memory once. MKL's one-row product
    runs on one core and streams a fraction of what the memory delivers, and for a handful of
    rows (a batched decode step) it still reads the weights at a fraction of the bandwidth. The
    hand-written ``kernels.f32_linear`` reads each weight once for all the rows while it is in
    registers, splitting the output rows over the cores, so it runs wherever its AVX-512 or
    AVX2 version is built (``kernels.vectorized()``) for up to ``FEW_ROWS`` float32 rows — eager
    or compiled alike, the same numbers either way. Everything else calls ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if x.device.type == "cpu" and x.dtype == torch.float32 and rows <= FEW_ROWS and kernels.vectorized():
            y = kernels.f32_linear(x.reshape(rows, -1).contiguous(), self.weight)
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
    kernel call: the ``packed-cpu`` backend.) Any other group is called layer by layer.
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
        x = x.to(torch.promote_types(dtype, torch.float32))  # float32 at least, float64 stays float64
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
