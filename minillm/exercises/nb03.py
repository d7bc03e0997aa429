"""Exercises of notebook 03 (attention): the causal + padding mask, GQA without copies, a
sliding-window mask and the entropy of attention weights.

The reference answers are here too, as ``<name>_solution`` (the notebook's solutions section runs
them through the same checks; ``nb03.gqa_attention_solution??`` shows one's code).

The mask and GQA answers come from the package (``minillm.model.attention``); the window and
the entropy, which the package does not have, from their definitions. Each classic mistake is
written out as the function a learner would write, so a wrong answer of that kind is named.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from minillm.exercises import Mistake, check, forbid_calls, forbid_copies
from minillm.model.attention import attention_explicit, build_mask, repeat_kv

MaskFn = Callable[[torch.Tensor, int, int], torch.Tensor]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _mask_cases() -> list[tuple[tuple[torch.Tensor, int, int], torch.Tensor]]:
    no_pad = torch.ones(1, 4, dtype=torch.long)
    left_padded = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    decode = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # 1 new query over 6 keys
    chunk = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])  # 3 new queries over 7 keys
    cases = [(no_pad, 4, 4), (left_padded, 5, 5), (decode, 1, 6), (chunk, 3, 7)]
    return [((am, q_len, k_len), build_mask(am, q_len, k_len, torch.device("cpu"))) for am, q_len, k_len in cases]


def _diagonal_hidden(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = (torch.arange(k_len)[None, :] < q_pos)[None, None] & am[:, None, None, :].bool()
    return mask | ~mask.any(-1, keepdim=True)


def _queries_at_start(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
    return mask | ~mask.any(-1, keepdim=True)


def _no_padding(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    return build_mask(None, q_len, k_len, torch.device("cpu")).expand(am.shape[0], 1, q_len, k_len)


def _nan_rows_left(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    return (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, None, :].bool()


def _padding_on_queries(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    causal = (torch.arange(k_len)[None, :] <= q_pos)[None, None]
    return causal & am[:, None, -q_len:, None].bool()


def _nan_rows_see_themselves(am: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, None, :].bool()
    return mask | (torch.arange(k_len)[None, :] == q_pos)


MASK_MISTAKES = [
    Mistake(_diagonal_hidden, "your mask hides the diagonal (k < q instead of k <= q): a token must see itself."),
    Mistake(
        _queries_at_start,
        "your queries sit at positions 0..q_len-1; in decoding they are the *last* q_len of the k_len "
        "positions (query i is at position k_len - q_len + i).",
    ),
    Mistake(_no_padding, "the padding is ignored: keys whose attention_mask is 0 must be hidden from every query."),
    Mistake(
        _nan_rows_left,
        "a left-pad query row sees no key at all, so its softmax is 0/0 = NaN; let such a row see "
        "everything (its output is ignored) — `mask | ~mask.any(-1, keepdim=True)`.",
    ),
    Mistake(_padding_on_queries, "you masked the padded *queries* (rows); padding hides *keys* (columns)."),
    Mistake(
        _nan_rows_see_themselves,
        "a row that would see nothing now sees only its own key: no NaN, but not `build_mask`'s rule, which lets "
        "such a row see *every* key (section 5) — `mask | ~mask.any(-1, keepdim=True)`.",
    ),
]

MASK_HINTS = [
    "Build the causal part first: query i sits at position k_len - q_len + i and sees keys j <= that position.",
    "torch.arange(k_len - q_len, k_len)[:, None] against torch.arange(k_len)[None, :] gives [q_len, k_len]; "
    "attention_mask[:, None, None, :] broadcasts the padding over heads and queries.",
    "mask = causal[None, None] & attention_mask[:, None, None, :].bool(); then "
    "mask | ~mask.any(dim=-1, keepdim=True) so no row is all False.",
]


def padding_causal_mask_solution(attention_mask: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """The reference answer: causal over the last ``q_len`` of ``k_len`` positions, pad keys hidden."""
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]  # the queries are the last q_len positions
    k_pos = torch.arange(k_len)[None, :]
    mask = (k_pos <= q_pos)[None, None] & attention_mask[:, None, None, :].bool()  # causal, pad keys hidden
    return mask | ~mask.any(dim=-1, keepdim=True)  # a row that sees nothing sees everything: no NaN


def check_padding_causal_mask(fn: MaskFn, hint: int = 0) -> bool:
    """``fn(attention_mask [batch, k_len], q_len, k_len)`` -> bool ``[batch, 1, q_len, k_len]``."""
    return check("padding_causal_mask", fn, _mask_cases(), hint=hint, hints=MASK_HINTS, mistakes=MASK_MISTAKES)


def _gqa_cases() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    cases = []
    # batch, n_heads, n_kv_heads, q_len, k_len, head_dim, left padding per row: GQA 4/2, SmolLM2's 9/3
    # with a left-padded row (a [batch, 1, q, k] mask), plain multi-head, multi-query, a decode step
    for seed, (batch, n_heads, n_kv_heads, q_len, k_len, head_dim, pads) in enumerate(
        [(1, 4, 2, 5, 5, 8, None), (2, 9, 3, 6, 6, 16, [0, 2]), (1, 3, 3, 4, 4, 8, None),
         (1, 4, 1, 3, 3, 8, None), (2, 9, 3, 1, 5, 16, [1, 0])]
    ):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(batch, n_heads, q_len, head_dim, generator=g)
        k = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
        v = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
        attention_mask = None if pads is None else (torch.arange(k_len)[None, :] >= torch.tensor(pads)[:, None]).long()
        mask = build_mask(attention_mask, q_len, k_len, torch.device("cpu"))
        groups = n_heads // n_kv_heads
        want = attention_explicit(q, repeat_kv(k, groups), repeat_kv(v, groups), mask)
        cases.append(((q, k, v, mask), want))
    return cases


def _gqa_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KV heads tiled (0,1,2,0,1,2,...) instead of grouped (0,0,0,1,1,1,...)."""
    groups = q.shape[1] // k.shape[1]
    return attention_explicit(q, k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1), mask)


def _gqa_unscaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    return attention_explicit(q * q.shape[-1] ** 0.5, repeat_kv(k, groups), repeat_kv(v, groups), mask)


def _gqa_unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    return attention_explicit(q, repeat_kv(k, groups), repeat_kv(v, groups), torch.ones_like(mask))


def _gqa_softmax_over_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    scores = q @ repeat_kv(k, groups).transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-2).nan_to_num() @ repeat_kv(v, groups)


def _gqa_masked_to_zero(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    scores = q @ repeat_kv(k, groups).transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, 0.0), dim=-1) @ repeat_kv(v, groups)


def _gqa_divided_by_d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    return attention_explicit(q / q.shape[-1] ** 0.5, repeat_kv(k, groups), repeat_kv(v, groups), mask)


GQA_MISTAKES = [
    Mistake(
        _gqa_tiled,
        "query head h must use KV head h // groups (heads 0, 1, 2 share KV head 0); `repeat` tiles them "
        "0,1,2,0,1,2 — and copies K and V. Group the query heads instead.",
    ),
    Mistake(_gqa_unscaled, "the scores are not divided by sqrt(head_dim)."),
    Mistake(_gqa_divided_by_d, "the scores are divided by head_dim; the scale is 1 / sqrt(head_dim) (section 3)."),
    Mistake(
        _gqa_masked_to_zero,
        "masked scores set to 0 still get weight exp(0) = 1 before normalizing; set them to -inf "
        "(masked_fill(~mask, float('-inf'))) so their weight is exactly 0.",
    ),
    Mistake(_gqa_unmasked, "the mask is not applied: every query sees the future."),
    Mistake(_gqa_softmax_over_queries, "the softmax runs over the queries (dim=-2); each query's weights over the keys (dim=-1) must sum to 1."),
]

GQA_HINTS = [
    "Leave K and V alone and regroup the *queries*: the query heads that share KV head j are consecutive "
    "(heads j*groups ... j*groups + groups - 1), so q.reshape(batch, n_kv_heads, groups * q_len, head_dim) "
    "stacks each group's queries as extra rows over its one KV head.",
    "Then rows @ k.transpose(-2, -1) is a plain batched matmul, batch dims [batch, n_kv_heads] on both sides: "
    "nothing broadcasts, nothing is copied. (Broadcasting k[:, :, None] against a 5-D q is not free: "
    "torch.matmul expands the broadcast operand and copies it, groups times.) For the mask, view the scores "
    "as [batch, n_kv_heads, groups, q_len, k_len] and use mask[:, :, None].",
    "scores = q.reshape(b, n_kv, groups * q_len, d) @ k.transpose(-2, -1) / math.sqrt(d); "
    "scores = scores.view(b, n_kv, groups, q_len, k_len).masked_fill(~mask[:, :, None], float('-inf')); "
    "weights = scores.softmax(-1).view(b, n_kv, groups * q_len, k_len); "
    "return (weights @ v).view(b, n_heads, q_len, d).",
]

KV = {1: "K", 2: "V"}  # the positions of k and v among gqa_attention's arguments

NO_KV_CALLS = forbid_calls(
    {
        "repeat_interleave": "that makes groups copies of it; regroup the queries instead.",
        "repeat": "that copies it (and tiles the heads in the wrong order).",
        "tile": "that copies it; regroup the queries instead.",
    },
    on=KV,
)
NO_SDPA = forbid_calls({"scaled_dot_product_attention": "write the scores, the mask and the softmax yourself."})
NO_KV_COPIES = forbid_copies(
    KV,
    "one copy per query head of the group. A matmul that broadcasts k[:, :, None] over the group copies "
    "too (torch.matmul expands the broadcast operand, then reshapes it into one batch); fold the group "
    "into the query rows instead: q.reshape(batch, n_kv_heads, groups * q_len, head_dim).",
)


def gqa_attention_solution(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference answer: each group's queries folded into the rows over its one KV head."""
    batch, n_heads, q_len, head_dim = q.shape
    n_kv_heads, k_len = k.shape[1], k.shape[2]
    groups = n_heads // n_kv_heads
    rows = q.reshape(batch, n_kv_heads, groups * q_len, head_dim)  # each group's queries as rows over its KV head
    scores = rows @ k.transpose(-2, -1) / math.sqrt(head_dim)  # batch dims [batch, n_kv_heads] on both sides
    scores = scores.view(batch, n_kv_heads, groups, q_len, k_len).masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(batch, n_kv_heads, groups * q_len, k_len)
    return (weights @ v).view(batch, n_heads, q_len, head_dim)


def check_gqa_attention(fn: AttentionFn, hint: int = 0) -> bool:
    """``fn(q [b, n_heads, q_len, d], k, v [b, n_kv_heads, k_len, d], mask [b or 1, 1, q_len, k_len])``
    -> ``[b, n_heads, q_len, d]``, without copying K or V: no aten op may write their numbers into a
    larger tensor (copies of the mask or of q are fine)."""
    return check(
        "gqa_attention", fn, _gqa_cases(), hint=hint, hints=GQA_HINTS, mistakes=GQA_MISTAKES,
        rules=[NO_KV_CALLS, NO_SDPA, NO_KV_COPIES],
    )


# --- a sliding-window mask ------------------------------------------------------------------------

WindowFn = Callable[[int, int], torch.Tensor]


def _window_cases() -> list[tuple[tuple[int, int], torch.Tensor]]:
    y, n = True, False
    return [
        ((4, 2), torch.tensor([[y, n, n, n], [y, y, n, n], [n, y, y, n], [n, n, y, y]])),
        ((5, 5), torch.ones(5, 5, dtype=torch.bool).tril()),  # a window as long as the sequence: causal
        ((3, 1), torch.eye(3, dtype=torch.bool)),  # a window of 1: each token sees only itself
        ((6, 3), torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)),
    ]


def _window_one_too_many(seq_len: int, window: int) -> torch.Tensor:
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return (j <= i) & (j >= i - window)


def _window_both_sides(seq_len: int, window: int) -> torch.Tensor:
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return (i - j).abs() < window


def _window_without_self(seq_len: int, window: int) -> torch.Tensor:
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return (j < i) & (j >= i - window)


WINDOW_MISTAKES = [
    Mistake(_window_one_too_many, "each query sees window + 1 keys (j >= i - window); the window counts the query itself: j > i - window."),
    Mistake(_window_both_sides, "your window reaches into the future (|i - j| < window): it must stay causal, j <= i."),
    Mistake(_window_without_self, "the query does not see itself (j < i); the window includes it: j <= i."),
]

WINDOW_HINTS = [
    "Two conditions at once: causal (j <= i) and recent (j > i - window).",
    "i = torch.arange(seq_len)[:, None] (a column) and j = torch.arange(seq_len)[None, :] (a row) broadcast "
    "to [seq_len, seq_len].",
    "return (j <= i) & (j > i - window)",
]


def sliding_window_mask_solution(seq_len: int, window: int) -> torch.Tensor:
    """The reference answer: causal (j <= i) and recent (j > i - window)."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    return (j <= i) & (j > i - window)


def check_sliding_window_mask(fn: WindowFn, hint: int = 0) -> bool:
    """``fn(seq_len, window)`` -> bool ``[seq_len, seq_len]``: query i sees key j when i - window < j <= i."""
    return check("sliding_window_mask", fn, _window_cases(), hint=hint, hints=WINDOW_HINTS, mistakes=WINDOW_MISTAKES)


# --- how focused is a head: the entropy of its weights ---------------------------------------------

EntropyFn = Callable[[torch.Tensor], torch.Tensor]


def _entropy_cases() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    third = 1 / 3
    causal = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [third, third, third]])  # masked weights are exactly 0
    two_heads = torch.stack([causal, torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0.0, 0, 1]])])  # [2, 3, 3]
    cases = [torch.full((1, 4), 0.25), torch.tensor([[0.0, 1.0, 0.0]]), causal, two_heads]
    return [((w,), torch.special.entr(w).sum(-1)) for w in cases]


def _entropy_nan(weights: torch.Tensor) -> torch.Tensor:
    return -(weights * weights.log()).sum(-1)


def _entropy_bits(weights: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(weights, weights).sum(-1) / math.log(2)


def _entropy_no_minus(weights: torch.Tensor) -> torch.Tensor:
    return torch.special.xlogy(weights, weights).sum(-1)


def _entropy_over_queries(weights: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(weights, weights).sum(-2)


def _entropy_mean(weights: torch.Tensor) -> torch.Tensor:
    return -torch.special.xlogy(weights, weights).mean(-1)


ENTROPY_MISTAKES = [
    Mistake(_entropy_nan, "p * log(p) is 0 * -inf = NaN where a weight is exactly 0 (every masked key); 0 · log 0 counts as 0."),
    Mistake(_entropy_bits, "that is in bits (log base 2); the exercise asks for nats (natural log)."),
    Mistake(_entropy_no_minus, "the sign is flipped: log p <= 0, so the entropy is -Σ p log p >= 0."),
    Mistake(_entropy_over_queries, "you summed over the queries (dim -2); a row's entropy sums over its keys (dim -1)."),
    Mistake(_entropy_mean, "you averaged over the keys (mean); the entropy is a sum, -Σ p log p (log n for n equal weights)."),
]

ENTROPY_HINTS = [
    "For each row: -Σ_j p_j log p_j, over the last dimension (the keys).",
    "Where p == 0, p * log(p) is NaN; pick 0 there (torch.where) or use torch.special.xlogy(p, p), which is 0 at p = 0.",
    "return -torch.special.xlogy(weights, weights).sum(dim=-1)",
]


def attention_entropy_solution(weights: torch.Tensor) -> torch.Tensor:
    """The reference answer: -Σ p log p over the keys, with 0 log 0 = 0."""
    return -torch.special.xlogy(weights, weights).sum(dim=-1)  # xlogy(0, 0) = 0


def check_attention_entropy(fn: EntropyFn, hint: int = 0) -> bool:
    """``fn(weights [..., q_len, k_len])`` -> ``[..., q_len]``: each row's entropy in nats."""
    return check("attention_entropy", fn, _entropy_cases(), hint=hint, hints=ENTROPY_HINTS, mistakes=ENTROPY_MISTAKES)
