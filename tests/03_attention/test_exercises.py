"""Notebook 03's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

import functools

import pytest
import torch

from minillm.exercises import nb03


def _mask_right(am, q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, None, :].bool()
    return mask | ~mask.any(-1, keepdim=True)


def _mask_off_by_one(am, q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = (torch.arange(k_len)[None, :] < q_pos)[None, None] & am[:, None, None, :].bool()
    return mask | ~mask.any(-1, keepdim=True)


def _mask_at_start(am, q_len, k_len):
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
    return mask | ~mask.any(-1, keepdim=True)


def _mask_nan_rows_see_themselves(am, q_len, k_len):
    """No NaN either, but not build_mask's rule: an empty row sees its own key only."""
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, None, :].bool()
    return mask | (torch.arange(k_len)[None, :] == q_pos)


def _mask_no_nan_fix(am, q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    return (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, None, :].bool()


def _mask_padding_on_queries(am, q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    return (torch.arange(k_len)[None, :] <= q_pos)[None, None] & am[:, None, -q_len:, None].bool()


def test_nb03_mask_right_answer_passes(capsys):
    assert nb03.check_padding_causal_mask(_mask_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_mask_off_by_one, "hides the diagonal"),
        (_mask_at_start, "the *last* q_len"),
        (lambda am, q_len, k_len: torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
         .expand(am.shape[0], 1, q_len, k_len), "the padding is ignored"),
        (_mask_no_nan_fix, "softmax is 0/0 = NaN"),
        (_mask_padding_on_queries, "you masked the padded *queries*"),
        (_mask_nan_rows_see_themselves, "sees only its own key"),
    ],
    ids=["off-by-one", "queries-at-start", "no-padding", "nan-rows", "padding-on-queries", "empty-row-sees-itself"],
)
def test_nb03_mask_mistakes_are_named(capsys, wrong, says):
    assert nb03.check_padding_causal_mask(wrong) is False
    assert says in capsys.readouterr().out


def _gqa_rows(q, k, v, mask, repeat_mask=False):
    """The group folded into the query rows: a plain batched matmul, no copy of K or V."""
    b, h, t, d = q.shape
    n_kv, k_len = k.shape[1], k.shape[2]
    g = h // n_kv
    scores = q.reshape(b, n_kv, g * t, d) @ k.transpose(-2, -1) / d**0.5
    if repeat_mask:  # the mask copied per group (rows g*t + i): allowed, it is not K or V
        scores = scores.masked_fill(~mask.repeat(1, 1, g, 1), float("-inf"))
    else:
        scores = scores.view(b, n_kv, g, t, k_len).masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(b, n_kv, g * t, k_len)
    return (weights @ v).view(b, h, t, d)


def _gqa_einsum(q, k, v, mask):
    b, h, t, d = q.shape
    qg = q.view(b, k.shape[1], h // k.shape[1], t, d)
    scores = torch.einsum("bngtd,bnkd->bngtk", qg, k) / d**0.5
    weights = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    return torch.einsum("bngtk,bnkd->bngtd", weights, v).reshape(b, h, t, d)


def _gqa_broadcast(q, k, v, mask):
    """k[:, :, None] broadcast over the group in a matmul: matmul expands and copies it."""
    b, h, t, d = q.shape
    qg = q.view(b, k.shape[1], h // k.shape[1], t, d)
    scores = (qg @ k[:, :, None].transpose(-2, -1)) / d**0.5
    weights = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    return (weights @ v[:, :, None]).reshape(b, h, t, d)


def _gqa_rows_with(scale, fill):
    """The copy-free fold with another scale or another fill value for the masked scores."""

    def gqa(q, k, v, mask):
        b, h, t, d = q.shape
        n_kv, k_len = k.shape[1], k.shape[2]
        g = h // n_kv
        scores = q.reshape(b, n_kv, g * t, d) @ k.transpose(-2, -1) * scale(d)
        scores = scores.view(b, n_kv, g, t, k_len).masked_fill(~mask[:, :, None], fill)
        weights = torch.softmax(scores, dim=-1).view(b, n_kv, g * t, k_len)
        return (weights @ v).view(b, h, t, d)

    return gqa


def _gqa_with(expand_kv):
    def gqa(q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv(k, groups), expand_kv(v, groups)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    return gqa


@pytest.mark.parametrize(
    "right",
    [_gqa_rows, functools.partial(_gqa_rows, repeat_mask=True), _gqa_einsum],
    ids=["fold-into-rows", "fold-with-mask-repeat", "einsum"],
)
def test_nb03_gqa_copy_free_answers_pass(capsys, right):
    assert nb03.check_gqa_attention(right) is True, capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_gqa_with(lambda x, n: x.repeat(1, n, 1, 1)), "`repeat` tiles them"),
        (_gqa_with(lambda x, n: x.repeat_interleave(n, dim=1)), "it calls `repeat_interleave` on K"),
        (_gqa_with(lambda x, n: torch.repeat_interleave(x, n, dim=1)), "it calls `repeat_interleave` on K"),
        (_gqa_with(lambda x, n: x[:, :, None].expand(-1, -1, n, -1, -1).reshape(x.shape[0], -1, *x.shape[2:])),
         "`reshape` copied K into a tensor 2× its size"),
        (_gqa_broadcast, "`matmul` copied K into a tensor 2× its size (aten.clone)"),
        (lambda q, k, v, mask: torch.nn.functional.scaled_dot_product_attention(q, k, v, mask,
                                                                               enable_gqa=True),
         "it calls `scaled_dot_product_attention`"),
        (_gqa_rows_with(lambda d: 1.0, float("-inf")), "not divided by sqrt(head_dim)"),
        (_gqa_rows_with(lambda d: 1.0 / d, float("-inf")), "divided by head_dim"),
        (_gqa_rows_with(lambda d: d**-0.5, 0.0), "masked scores set to 0"),
    ],
    ids=["repeat-vs-repeat_interleave", "k.repeat_interleave", "torch.repeat_interleave",
         "copy-by-expand-reshape", "broadcast-matmul", "sdpa", "unscaled", "divided-by-d", "masked-to-zero"],
)
def test_nb03_gqa_mistakes_are_named(capsys, wrong, says):
    assert nb03.check_gqa_attention(wrong) is False
    assert says in capsys.readouterr().out


def _window(seq_len, window):
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return (j <= i) & (j > i - window)


def test_nb03_window_right_answer_passes(capsys):
    assert nb03.check_sliding_window_mask(_window) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda n, w: _window(n, w + 1), "window + 1 keys"),
        (lambda n, w: (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() < w, "reaches into the future"),
        (lambda n, w: _window(n, w + 1) & ~torch.eye(n, dtype=torch.bool), "does not see itself"),
    ],
    ids=["one-too-many", "both-sides", "without-self"],
)
def test_nb03_window_mistakes_are_named(capsys, wrong, says):
    assert nb03.check_sliding_window_mask(wrong) is False
    assert says in capsys.readouterr().out


def test_nb03_entropy_right_answer_passes(capsys):
    assert nb03.check_attention_entropy(lambda w: -torch.special.xlogy(w, w).sum(-1)) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda w: -(w * w.log()).sum(-1), "0 * -inf = NaN"),
        (lambda w: -(w * torch.where(w > 0, w.log2(), 0.0)).sum(-1), "in bits"),
        (lambda w: torch.special.xlogy(w, w).sum(-1), "the sign is flipped"),
        (lambda w: -torch.special.xlogy(w, w).sum(-2), "you summed over the queries"),
        (lambda w: -torch.special.xlogy(w, w).mean(-1), "you averaged over the keys"),
    ],
    ids=["nan", "bits", "sign", "over-queries", "mean"],
)
def test_nb03_entropy_mistakes_are_named(capsys, wrong, says):
    assert nb03.check_attention_entropy(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize(
    "check, solution",
    [
        (nb03.check_padding_causal_mask, nb03.padding_causal_mask_solution),
        (nb03.check_sliding_window_mask, nb03.sliding_window_mask_solution),
        (nb03.check_gqa_attention, nb03.gqa_attention_solution),
        (nb03.check_attention_entropy, nb03.attention_entropy_solution),
    ],
    ids=["mask", "window", "gqa", "entropy"],
)
def test_nb03_reference_solutions_pass(capsys, check, solution):
    assert check(solution) is True, capsys.readouterr().out
