"""The classic wrong answers to notebook 05's exercises: RMSNorm, attention, block and forward.

Each is the code a learner would plausibly write, with one thing wrong, so ``nb05``'s checks can
name the mistake: an RMSNorm that squares in float16 or puts eps outside the root; an attention
forward built by :func:`attention_with` (no RoPE, RoPE on v, the KV heads tiled instead of
grouped, ...); blocks that differ from Llama's pre-norm block in one place (post-norm, a missing
residual, ...), which :func:`forward_with` also runs as whole forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minillm.model.attention import Attention, build_mask, repeat_kv
from minillm.model.llama import Block, Transformer
from minillm.model.rope import apply_rope

AttentionFn = Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BlockFn = Callable[[Block, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
ForwardFn = Callable[[Transformer, torch.Tensor], torch.Tensor]

# --- RMSNorm in half precision ----------------------------------------------------------------------


def rms_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_stays_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rms_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 - x32.mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_wrong_axis(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + eps)).to(x.dtype)


def rms_no_gain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_eps_outside(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


# --- the attention forward -------------------------------------------------------------------------


def attention_with(rope: str = "qk", kv_heads: str = "grouped", scaled: bool = True, masked: bool = True,
                   split: str = "transpose", merge: str = "transpose", o_proj: bool = True,
                   bias: bool = True) -> AttentionFn:
    """An attention forward written out, right by default; each argument is one place to go wrong.

    ``rope``: the tensors rotated ("qk", "", "q", "qkv"); ``kv_heads``: "grouped" (query head h reads
    KV head h // groups) or "tiled" (``repeat``: h % n_kv_heads); ``split``: "transpose" ([batch,
    seq, heads, d] then transpose) or "view" (straight to [batch, heads, seq, d]); ``merge``: the
    same on the way back; ``bias``: whether the projections' biases are used."""

    def attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        n_heads, n_kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim

        def project(linear: torch.nn.Module) -> torch.Tensor:
            return linear(x) if bias else x @ linear.weight.T

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            if split == "view":
                return t.reshape(batch, n, seq, head_dim)
            return t.view(batch, seq, n, head_dim).transpose(1, 2)

        q, k, v = heads(project(attn.q_proj), n_heads), heads(project(attn.k_proj), n_kv_heads), \
            heads(project(attn.v_proj), n_kv_heads)
        q = apply_rope(q, cos, sin) if "q" in rope else q
        k = apply_rope(k, cos, sin) if "k" in rope else k
        v = apply_rope(v, cos, sin) if "v" in rope else v
        groups = n_heads // n_kv_heads
        if kv_heads == "tiled":
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(head_dim) if scaled else 1.0)
        if masked:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [batch, n_heads, seq, head_dim]
        out = out.reshape(batch, seq, -1) if merge == "view" else out.transpose(1, 2).reshape(batch, seq, -1)
        return attn.o_proj(out) if o_proj else out

    return attention


# --- the block ---------------------------------------------------------------------------------------


def pre_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def post_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.input_layernorm(x + layer.self_attn(x, cos, sin, mask))
    return layer.post_attention_layernorm(x + layer.mlp(x))


def normed_stream(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.input_layernorm(x)
    x = x + layer.self_attn(x, cos, sin, mask)
    x = layer.post_attention_layernorm(x)
    return x + layer.mlp(x)


def no_attn_residual(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def no_mlp_residual(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return layer.mlp(layer.post_attention_layernorm(x))


def one_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.input_layernorm(x))


def parallel(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    return x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask) + layer.mlp(layer.post_attention_layernorm(x))


# --- the whole forward -------------------------------------------------------------------------------


def tables(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary tables and the causal mask of a forward over ``ids`` [batch, seq]."""
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    return cos, sin, build_mask(None, seq, seq, ids.device)


def forward_with(block: BlockFn, final_norm: bool = True, tied_head: bool = False, masked: bool = True) -> ForwardFn:
    """A whole forward that runs ``block`` for every layer (the wrong variants differ in one place)."""

    def forward(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
        cos, sin, mask = tables(model, ids)
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = block(layer, x, cos, sin, mask if masked else None)
        if final_norm:
            x = model.norm(x)
        return x @ model.embed_tokens.weight.T if tied_head else model.lm_head(x)

    return forward
