"""Rotary position embeddings (RoPE).

RoPE encodes a token's position by *rotating* pairs of coordinates of q and k by an angle
proportional to the position: pair i turns at frequency ``theta ** (-2i / head_dim)``. A dot
product of two rotated vectors depends only on the *difference* of their angles, so attention
scores see relative positions, with nothing added to the embeddings.

Two memory layouts pair the coordinates differently:

* **rotate-half** (HF / Llama checkpoints): pair i is (x[i], x[i + head_dim/2]).
* **interleaved** (Meta's original code, llama.cpp / GGUF): pair i is (x[2i], x[2i+1]).

They compute the same thing on permuted coordinates; the loader turns GGUF's interleaved
q/k weights back into rotate-half layout (see ``gguf_weights.unpermute``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies (radians per position), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None and scaling.get("rope_type") == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rule: slow down low frequencies, keep high ones, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos and sin of the rotation angles (rotate-half layout), for the positions asked for.

    Only the ``head_dim / 2`` frequencies are stored; each call computes ``position * frequency``
    for the positions it gets, as transformers does. A precomputed table of every position up to
    the context costs ``8 * head_dim`` bytes per position: hundreds of MB for a real 1M-token
    context, and 4 TB for a config that claims 2**40 positions — allocated before a single token
    is seen. Computing on demand gives the very same numbers (each angle is the same float32
    product) and costs a few element-wise operations per forward pass.

    ``cos`` and ``sin`` still give the whole ``[max_positions, head_dim]`` table, built when read:
    the table is the clearest picture of RoPE, and notebook 04 compares its own against it.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_frequencies(head_dim, theta, scaling), persistent=False)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles [..., head_dim] for integer ``positions`` [...]: pair i turns by ``position * inv_freq[i]``
        and sits at coordinates i and i + head_dim/2 (rotate-half)."""
        angles = positions.float()[..., None] * self.inv_freq
        return torch.cat([angles, angles], dim=-1)

    @property
    def cos(self) -> torch.Tensor:
        """The cos table of every position up to ``max_positions`` [max_positions, head_dim] (built on each read)."""
        return self.angles(torch.arange(self.max_positions, device=self.inv_freq.device)).cos()

    @property
    def sin(self) -> torch.Tensor:
        """The sin table of every position up to ``max_positions`` [max_positions, head_dim] (built on each read)."""
        return self.angles(torch.arange(self.max_positions, device=self.inv_freq.device)).sin()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``position_ids`` [batch, seq] -> each [batch, 1, seq, head_dim].

        The angles are float32 whatever the model's dtype; the result is cast to the caller's
        dtype, as transformers does.
        """
        angles = self.angles(position_ids).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k ([batch, heads, seq, head_dim]) in the rotate-half layout.

    Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin): a 2-D rotation.
    """
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """The same rotation in the interleaved layout, written as a complex multiply.

    Adjacent coordinates (x[2i], x[2i+1]) are read as one complex number and multiplied by
    ``exp(i * position * freq_i)``: a rotation by that angle.
    """
    head_dim = x.shape[-1]
    inv_freq = rope_frequencies(head_dim, theta)
    angles = position_ids.float()[..., None] * inv_freq  # [batch, seq, head_dim/2]
    rotation = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)  # [batch, 1, seq, head_dim/2]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], head_dim // 2, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def interleaved_to_half(head_dim: int) -> torch.Tensor:
    """Index that reorders interleaved coordinates into rotate-half order:
    ``x_half = x_interleaved[..., interleaved_to_half(head_dim)]``."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
