"""Notebook 05's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.exercises import nb05


# --- RMSNorm in half precision ---------------------------------------------------------------------


def _rms_right(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_right_answer_passes(capsys):
    assert nb05.check_rms_norm_mixed(_rms_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, "300² overflows to inf"),
        (lambda x, w, eps: w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)),
         "cast the normalized vector back"),
        (lambda x, w, eps: _rms_right(x - x.mean(-1, keepdim=True), w, eps), "that is LayerNorm"),
        (lambda x, w, eps: w * (x.float() / (x.float().pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype),
         "eps is outside the square root"),
        (lambda x, w, eps: w * (x.float() * (x.float().square().mean(-1, keepdim=True).sqrt() + eps).reciprocal())
         .to(x.dtype), "eps is outside the square root"),
    ],
    ids=["no-upcast", "stays-float32", "layernorm", "eps-outside-sqrt", "eps-outside-rsqrt-form"],
)
def test_rms_norm_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_rms_norm_mixed(wrong) is False
    assert says in capsys.readouterr().out


# --- the FFN width rule ----------------------------------------------------------------------------


def _ffn_right(d_model, multiple_of, ffn_dim_multiplier=None):
    h = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier is not None:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def test_ffn_width_right_answer_passes(capsys):
    assert nb05.check_ffn_width(_ffn_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda d, m, k=None: int((k or 1) * int(8 * d / 3)), "before rounding"),
        (lambda d, m, k=None: m * (int((k or 1) * int(8 * d / 3)) // m), "you rounded down"),
        (lambda d, m, k=None: m * math.ceil(int(8 * d / 3) / m), "ffn_dim_multiplier is ignored"),
    ],
    ids=["no-rounding", "round-down", "no-multiplier"],
)
def test_ffn_width_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_ffn_width(wrong) is False
    assert says in capsys.readouterr().out


def test_ffn_width_cases_are_the_published_sizes():
    for (d, multiple_of, mult), width in nb05.PUBLISHED_FFN.values():
        assert _ffn_right(d, multiple_of, mult) == width


# --- counting parameters ---------------------------------------------------------------------------


def _count_right(cfg):
    d, q_out, kv_out = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_block = 2 * d * q_out + 2 * d * kv_out + 3 * d * cfg.intermediate_size + 2 * d
    if cfg.attention_bias:
        per_block += q_out + 2 * kv_out
    return cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2) + cfg.n_layers * per_block + d


def test_count_params_right_answer_passes(capsys):
    assert nb05.check_count_params(_count_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda c: _count_right(c) + c.n_layers * 2 * c.hidden_size * (c.hidden_size - c.n_kv_heads * c.head_dim),
         "grouped-query attention"),
        (lambda c: _count_right(c) + (c.vocab_size * c.hidden_size if c.tie_word_embeddings else 0), "count it once"),
        (lambda c: _count_right(c) - c.hidden_size, "final norm"),
    ],
    ids=["no-gqa", "tied-twice", "no-final-norm"],
)
def test_count_params_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_count_params(wrong) is False
    assert says in capsys.readouterr().out


# --- the full forward --------------------------------------------------------------------------------


def _forward_right(model, ids):
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    mask = nb05.build_mask(None, seq, seq, ids.device)
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))


def _forward_with(block, final_norm=True, head="lm_head"):
    def forward(model, ids):
        seq = ids.shape[1]
        cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
        mask = nb05.build_mask(None, seq, seq, ids.device)
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = block(layer, x, lambda h: layer.self_attn(h, cos, sin, mask))
        x = model.norm(x) if final_norm else x
        return model.lm_head(x) if head == "lm_head" else x @ model.embed_tokens.weight.T

    return forward


def _pre(layer, x, attn):
    x = x + attn(layer.input_layernorm(x))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _post(layer, x, attn):
    x = layer.input_layernorm(x + attn(x))
    return layer.post_attention_layernorm(x + layer.mlp(x))


def _normed_stream(layer, x, attn):
    x = layer.input_layernorm(x)
    x = x + attn(x)
    x = layer.post_attention_layernorm(x)
    return x + layer.mlp(x)


def _no_residual(layer, x, attn):
    x = attn(layer.input_layernorm(x))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def test_forward_right_answer_passes(capsys):
    assert nb05.check_forward(_forward_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_forward_with(_post), "that is post-norm"),
        (_forward_with(_normed_stream), "applied to the residual stream itself"),
        (_forward_with(_no_residual), "the attention residual is missing"),
        (_forward_with(_pre, final_norm=False), "the final norm is missing"),
        (_forward_with(_pre, head="embedding"), "this model is untied"),
    ],
    ids=["post-norm", "norm-on-stream", "missing-residual", "no-final-norm", "tied-head-on-untied-model"],
)
def test_forward_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_forward(wrong) is False
    assert says in capsys.readouterr().out


def _whole_blocks(model, ids):
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    mask = nb05.build_mask(None, seq, seq, ids.device)
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = layer(x, cos, sin, mask, None)
    return model.lm_head(model.norm(x))


def _whole_blocks_by_forward(model, ids):
    """Block.forward called directly: the hooks on the Block never run, the ones on its pieces do."""
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    mask = nb05.build_mask(None, seq, seq, ids.device)
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = layer.forward(x, cos, sin, mask)
    return model.lm_head(model.norm(x))


def _whole_blocks_by_class(model, ids):
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    mask = nb05.build_mask(None, seq, seq, ids.device)
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x = type(layer).forward(layer, x, cos, sin, mask)
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize(
    "shortcut, says",
    [
        (lambda model, ids: model(ids), "the model's own forward"),
        (lambda model, ids: model.forward(ids), "the model's own forward"),
        (lambda model, ids: model.run(ids, torch.arange(ids.shape[1])[None], nb05.build_mask(
            None, ids.shape[1], ids.shape[1], ids.device)), "the model's own forward"),
        (_whole_blocks, "a whole Block"),
        (_whole_blocks_by_forward, "a whole Block"),
        (_whole_blocks_by_class, "a whole Block"),
    ],
    ids=["model(ids)", "model.forward", "model.run", "whole-block", "block.forward", "Block.forward(layer)"],
)
def test_forward_must_be_assembled_from_pieces(capsys, shortcut, says):
    assert nb05.check_forward(shortcut) is False
    assert says in capsys.readouterr().out


def test_forward_check_leaves_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    nb05.check_forward(_forward_right)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb05.check_rms_norm_mixed, nb05.RMS_MISTAKES),
        (nb05.check_ffn_width, nb05.FFN_MISTAKES),
        (nb05.check_count_params, nb05.PARAM_MISTAKES),
        (nb05.check_forward, nb05.FORWARD_MISTAKES),
    ],
    ids=["rms_norm_mixed", "ffn_width", "count_params", "forward"],
)
def test_every_listed_mistake_is_named_by_its_own_message(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out, mistake.message
