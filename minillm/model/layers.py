"""The two small layers of a Llama block: RMSNorm and the SwiGLU feed-forward network."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
