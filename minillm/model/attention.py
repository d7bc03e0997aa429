"""Scaled dot-product attention with grouped-query heads.

Each query scores every key it may see, ``q . k / sqrt(head_dim)``, turns the scores into
weights with a softmax, and returns the weighted sum of the values. Dividing by
``sqrt(head_dim)`` keeps the scores' variance at ~1 whatever the head size: without it, large
heads push the softmax into saturation (one weight ~1, the rest ~0) and gradients vanish.

Two implementations compute the same thing: ``attention_explicit`` spells out the math for
teaching; ``attention_sdpa`` calls PyTorch's fused kernel. Tests check they agree.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minillm.cache.base import build_mask
from minillm.model import kernels
from minillm.model.config import ModelConfig
from minillm.model.layers import Linear, linears
from minillm.model.rope import apply_rope

if TYPE_CHECKING:
    from minillm.cache.base import KVCache
    from minillm.cache.paged import PagedStep


def repeat_kv(x: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[batch, n_kv_heads, seq, head_dim] -> [batch, n_kv_heads * n_groups, seq, head_dim]:
    each KV head is shared by ``n_groups`` consecutive query heads."""
    if n_groups == 1:
        return x
    batch, n_kv_heads, seq, head_dim = x.shape
    return x[:, :, None].expand(batch, n_kv_heads, n_groups, seq, head_dim).reshape(batch, -1, seq, head_dim)


def attention_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, written out. q: [b, h, tq, d]; k, v: [b, h, tk, d]."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ v


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same computation through ``torch.nn.functional.scaled_dot_product_attention``.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention): ``enable_gqa``
    lets the kernel share each KV head across its query group without copying it (the same
    numbers as ``repeat_kv``, bit for bit, and no ``n_groups``-times larger copy of the cache).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(torch.nn.Module):
    """Multi-head attention with grouped-query K/V heads and rotary positions."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, use_sdpa: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.use_sdpa = use_sdpa
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, config.n_heads * config.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.o_proj = Linear(config.n_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        paged: PagedStep | None = None,
        layer_idx: int | None = None,
    ) -> torch.Tensor:
        """``x`` [batch, seq, hidden] -> [batch, seq, hidden]. With a ``cache``, the new keys and
        values are stored and attention runs over everything stored so far, under ``mask``; with a
        ``paged`` step, they are written to the step's pools and each row attends through its
        block table. ``layer_idx`` says which of the cache's (or step's) layers they are (default:
        this module's own index)."""
        layer = self.layer_idx if layer_idx is None else layer_idx
        batch, seq, _ = x.shape
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if paged is not None:
            out = paged_attention(q, k, v, paged, layer)
        else:
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if self.use_sdpa:
                out = attention_sdpa(q, k, v, mask)
            else:
                n_groups = self.n_heads // self.n_kv_heads
                out = attention_explicit(q, repeat_kv(k, n_groups), repeat_kv(v, n_groups), mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def write_kv(step: PagedStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new keys and values [batch, n_kv_heads, seq, head_dim] of ``layer`` in
    their slots of the pools (``step.write_blocks``, ``step.write_offsets``)."""
    n_kv_heads, head_dim = k.shape[1], k.shape[3]
    for pool, new in ((step.k_pools[layer], k), (step.v_pools[layer], v)):
        pool[step.write_blocks, :, step.write_offsets] = new.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)


def gather_kv(pool: torch.Tensor, step: PagedStep) -> torch.Tensor:
    """Every row's keys (or values) copied out of ``pool`` into a dense [rows, n_kv_heads, keys,
    head_dim] tensor: the simple way to read a paged cache (notebook 08), not the engine's."""
    blocks = pool[step.block_tables]  # [rows, width, n_kv_heads, block_size, head_dim]
    rows, width, n_kv_heads, block_size, head_dim = blocks.shape
    flat = blocks.transpose(1, 2).reshape(rows, n_kv_heads, width * block_size, head_dim)
    return flat[:, :, : int(step.context_lens.max())]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PagedStep, layer: int) -> torch.Tensor:
    """Store the new ``k``, ``v`` of ``layer`` and return attention [batch, n_heads, seq, head_dim]
    of the queries ``q`` over each row's keys, read from the pools through the block tables."""
    batch, n_heads, seq, head_dim = q.shape
    write_kv(step, layer, k, v)
    k_pool, v_pool = step.k_pools[layer], step.v_pools[layer]
    flat_q = q.transpose(1, 2).reshape(-1, n_heads, head_dim)
    if step.is_decode:
        out = paged_decode_attention(flat_q, k_pool, v_pool, step.block_tables, step.context_lens)
    else:
        assert step.q_lens is not None
        out = paged_prefill_attention(flat_q, k, v, k_pool, v_pool, step.block_tables, step.q_lens,
                                      step.context_lens.tolist())
    return out.view(batch, seq, n_heads, head_dim).transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """One query per row over that row's keys, read from the block pool in place.

    q: [rows, n_heads, head_dim]; k_pool, v_pool: [num_blocks, n_kv_heads, block_size,
    head_dim]; block_tables: [rows, width] block ids; context_lens: [rows] keys per row.
    Returns [rows, n_heads, head_dim].

    On a CPU with float32 pools this runs the hand-written kernel (``kernels/paged_attention.cpp``):
    each block read once where it lies, an online softmax 16 keys at a time, a row's keys split
    over the cores. Measured on the course machine against the PyTorch formulation below,
    compiled: 2-4x faster at 256 keys, 1.1-1.4x at 1024-4096 keys, where both wait on memory.
    Elsewhere (other dtypes, GPUs, head sizes other than 64 and 128, a CPU without AVX-512 or AVX2, or
    no C++ compiler) it runs ``paged_decode_attention_reference``.
    """
    fast = q.device.type == "cpu" and q.dtype == k_pool.dtype == torch.float32 and q.shape[-1] in (64, 128)
    if fast and kernels.vectorized():
        return kernels.paged_decode_attention(q.contiguous(), k_pool, v_pool, block_tables, context_lens)
    return paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens)


def paged_decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """``paged_decode_attention`` in PyTorch operations: any device, any dtype.

    Why it is written as sums of products rather than ``q @ k.T``: a matrix product needs its
    operands as dense tensors, so ``k_pool[block_tables]`` would first be copied out, block by
    block, into a ``[rows, keys, ...]`` tensor in every layer at every step — reading the cache
    twice and writing it once. Written as reductions, ``torch.compile`` fuses the indexing into
    the loops that compute the scores and the weighted sum: each block is read where it lies,
    once, as a paged-attention kernel does. Measured on the course CPU (SmolLM2 shapes,
    compiled, 4096 keys): 10-15 GB/s of K/V read this way vs 6-7 GB/s for gather + matmul.
    Run eagerly (no compiler), the same code materializes the products: correct, not fast.
    """
    rows, n_heads, head_dim = q.shape
    n_kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
    width = block_tables.shape[1]
    k = k_pool[block_tables]  # [rows, width, n_kv_heads, block_size, head_dim] (fused away when compiled)
    v = v_pool[block_tables]
    q = q.view(rows, 1, n_kv_heads, n_heads // n_kv_heads, 1, head_dim)  # query groups share a KV head
    scores = (q * k[:, :, :, None]).sum(-1) / math.sqrt(head_dim)  # [rows, width, n_kv_heads, groups, block_size]
    key_pos = torch.arange(width * block_size, device=q.device).view(width, block_size)
    visible = key_pos[None] < context_lens[:, None, None]  # [rows, width, block_size]
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    # softmax over all of a row's keys (they span two dims: block, offset in the block), in at
    # least float32 whatever the cache's dtype
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    weights = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))
    weights = (weights / weights.sum(dim=(1, 4), keepdim=True)).to(v.dtype)
    out = (weights[..., None] * v[:, :, :, None]).sum(dim=(1, 4))  # [rows, n_kv_heads, groups, head_dim]
    return out.reshape(rows, n_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    context_lens: list[int],
) -> torch.Tensor:
    """Causal attention for rows of several tokens each (prefill, or a prefill chunk).

    q: [tokens, n_heads, head_dim], the rows' tokens one after another; k_new, v_new: the same
    tokens' keys and values as the model computed them ([batch, n_kv_heads, seq, head_dim]).
    A row whose tokens are all there is (a fresh prompt) attends to its own new keys with a
    causal kernel; a row that continues a cached sequence reads its earlier keys from the pool
    and masks by position. Each row is its own attention call: no ``tokens x tokens`` mask
    over the whole packed step is ever built.
    """
    n_kv_heads, block_size, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    k_flat = k_new.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)
    v_flat = v_new.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)
    outputs = []
    start = 0
    for row, (q_len, context) in enumerate(zip(q_lens, context_lens)):
        q_row = q[start : start + q_len].transpose(0, 1)[None]  # [1, n_heads, q_len, head_dim]
        if context == q_len:
            k_row = k_flat[start : start + q_len].transpose(0, 1)[None]
            v_row = v_flat[start : start + q_len].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q_row, k_row, v_row, is_causal=True, enable_gqa=True)
        else:
            table = block_tables[row, : -(-context // block_size)]
            k_row = k_pool[table].transpose(0, 1).reshape(1, n_kv_heads, -1, head_dim)[:, :, :context]
            v_row = v_pool[table].transpose(0, 1).reshape(1, n_kv_heads, -1, head_dim)[:, :, :context]
            mask = build_mask(None, q_len, context, q.device)
            out = F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=mask, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
        start += q_len
    return torch.cat(outputs)
