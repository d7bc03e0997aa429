"""Notebook 05's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from minillm.exercises import nb05
from minillm.model.rope import apply_rope


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


# --- section 2's table of published FFN widths (no longer an exercise) ------------------------------


def test_the_published_ffn_widths_fit_metas_rule():
    """int(8d/3), times the optional multiplier, rounded up to a multiple of multiple_of."""
    for (d, multiple_of, mult), width in nb05.PUBLISHED_FFN.values():
        h = int(2 * 4 * d / 3)
        h = int(mult * h) if mult is not None else h
        assert multiple_of * ((h + multiple_of - 1) // multiple_of) == width


# --- the attention forward --------------------------------------------------------------------------


def _attention(attn, x, cos, sin, mask, rope=(True, True, False), order="grouped", o_proj=True):
    """The attention forward as a learner writes it, with F.scaled_dot_product_attention at its core."""
    batch, seq, _ = x.shape
    q = attn.q_proj(x).view(batch, seq, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, seq, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, seq, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k, v = (apply_rope(t, cos, sin) if rotate else t for t, rotate in zip((q, k, v), rope))
    groups = attn.n_heads // attn.n_kv_heads
    if order == "grouped":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    else:
        k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, seq, -1)
    return attn.o_proj(out) if o_proj else out


def _attention_enable_gqa(attn, x, cos, sin, mask):
    """Another right answer: the kernel shares the KV heads itself."""
    batch, seq, _ = x.shape
    q = apply_rope(attn.q_proj(x).view(batch, seq, attn.n_heads, -1).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(batch, seq, attn.n_kv_heads, -1).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(batch, seq, attn.n_kv_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


@pytest.mark.parametrize("right", [_attention, _attention_enable_gqa], ids=["repeat_interleave", "enable_gqa"])
def test_attention_right_answers_pass(capsys, right):
    assert nb05.check_attention(right) is True
    assert "✅ attention_forward" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (functools.partial(_attention, rope=(False, False, False)), "there is no RoPE"),
        (functools.partial(_attention, rope=(True, True, True)), "RoPE is applied to v too"),
        (functools.partial(_attention, rope=(True, False, False)), "only q is rotated"),
        (functools.partial(_attention, order="tiled"), "the KV heads are repeated in the wrong order"),
        (functools.partial(_attention, o_proj=False), "o_proj is missing"),
        (lambda attn, x, cos, sin, mask: attn(x, cos, sin, mask), "it runs the package's attention"),
        (lambda attn, x, cos, sin, mask: attn.forward(x, cos, sin, mask), "it runs the package's attention"),
    ],
    ids=["no-rope", "rope-on-v", "rope-on-q-only", "gqa-tiled", "no-o_proj", "attn(x)", "attn.forward"],
)
def test_attention_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_attention(wrong) is False
    assert says in capsys.readouterr().out


# --- the pre-norm block ------------------------------------------------------------------------------


def _block_right(layer, x, cos, sin, mask):
    """With the learner's own attention: the block's rule allows it (it forbids only Block.forward)."""
    x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _block_post_norm(layer, x, cos, sin, mask):
    x = layer.input_layernorm(x + layer.self_attn(x, cos, sin, mask))
    return layer.post_attention_layernorm(x + layer.mlp(x))


def _block_no_mlp_residual(layer, x, cos, sin, mask):
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return layer.mlp(layer.post_attention_layernorm(x))


def _block_no_attn_residual(layer, x, cos, sin, mask):
    h = layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def test_block_right_answer_passes(capsys):
    assert nb05.check_block(_block_right) is True
    assert "✅ pre_norm_block" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_block_post_norm, "that is post-norm"),
        (_block_no_mlp_residual, "the FFN residual is missing"),
        (_block_no_attn_residual, "the attention residual is missing"),
        (lambda layer, x, cos, sin, mask: layer(x, cos, sin, mask), "it runs the Block's own forward"),
        (lambda layer, x, cos, sin, mask: layer.forward(x, cos, sin, mask), "it runs the Block's own forward"),
    ],
    ids=["post-norm", "no-mlp-residual", "no-attn-residual", "layer(x)", "layer.forward"],
)
def test_block_mistakes_are_named(capsys, wrong, says):
    assert nb05.check_block(wrong) is False
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


@pytest.mark.parametrize(
    "check, answer",
    [(nb05.check_forward, _forward_right), (nb05.check_attention, _attention), (nb05.check_block, _block_right)],
    ids=["forward", "attention", "block"],
)
def test_checks_leave_the_random_state_alone(check, answer):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    check(answer)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb05.check_rms_norm_mixed, nb05.RMS_MISTAKES),
        (nb05.check_attention, nb05.ATTENTION_MISTAKES),
        (nb05.check_block, nb05.BLOCK_MISTAKES),
        (nb05.check_forward, nb05.FORWARD_MISTAKES),
    ],
    ids=["rms_norm_mixed", "attention", "block", "forward"],
)
def test_every_listed_mistake_is_named_by_its_own_message(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out, mistake.message
