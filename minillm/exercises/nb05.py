"""Exercises of notebook 05 (blocks): RMSNorm in half precision, the attention forward, a pre-norm
block, and the core one — the full forward assembled from the blocks' pieces.

The expected answers come from the package (``minillm.model.layers.RMSNorm``, ``Attention``,
``Block`` and ``Transformer`` of ``minillm.model``, on small random models); each classic mistake
is written out as the function a learner would write (``nb05_mistakes``), so a wrong answer of
that kind is named. Rules look at how an answer was computed: running the package's own
``Attention``, ``Block`` or ``Transformer`` forward inside it does not count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from minillm.exercises import Mistake, Rule, check
from minillm.exercises.nb05_mistakes import (
    AttentionFn,
    BlockFn,
    ForwardFn,
    attention_with,
    forward_with,
    no_attn_residual,
    no_mlp_residual,
    normed_stream,
    one_norm,
    parallel,
    post_norm,
    pre_norm,
    rms_centred,
    rms_eps_outside,
    rms_naive,
    rms_no_gain,
    rms_stays_float32,
    rms_wrong_axis,
)
from minillm.model.attention import Attention, build_mask
from minillm.model.config import ModelConfig
from minillm.model.layers import RMSNorm
from minillm.model.llama import Block, Transformer
from minillm.model.rope import RotaryEmbedding

RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

# --- exercise 1: RMSNorm that survives half precision ---------------------------------------------


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = RMSNorm(x.shape[-1], eps).to(x.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x)


def _rms_cases() -> list[tuple[tuple[torch.Tensor, torch.Tensor, float], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = [
        (torch.randn(3, 8, generator=g), torch.randn(8, generator=g), 1e-5),
        # 300² = 90,000 > 65,504, float16's largest number: the naive statistic is inf
        (torch.full((2, 576), 300.0, dtype=torch.float16), torch.ones(576, dtype=torch.float16), 1e-5),
        ((torch.randn(4, 576, generator=g) * 50).to(torch.bfloat16),
         (1 + torch.randn(576, generator=g)).to(torch.bfloat16), 1e-5),
        (torch.zeros(1, 16), torch.ones(16), 1e-6),  # eps keeps 0 / 0 away
        # a small RMS, where eps matters: inside the root, sqrt(1e-6 + 1e-5) ≈ 3.3e-3, not 1e-3 + 1e-5
        (torch.randn(3, 64, generator=g) * 1e-3, 1 + torch.randn(64, generator=g), 1e-5),
        ((torch.randn(2, 64, generator=g) * 1e-2).half(), torch.ones(64, dtype=torch.float16), 1e-4),
    ]
    return [((x, w, eps), _rms_reference(x, w, eps)) for x, w, eps in inputs]


def _same_in_dtype(got: Any, want: torch.Tensor) -> bool:
    """Same dtype and shape, values equal up to the rounding of the dtype (bfloat16 keeps ~3 digits)."""
    return (
        isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        and bool(torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-2))
    )


RMS_MISTAKES = [
    Mistake(rms_naive, "the mean of squares is computed in x's own dtype: in float16, 300² overflows to inf and "
                        "the vector collapses to zeros. Compute the statistic on x.float()."),
    Mistake(rms_stays_float32, "the result stays float32: cast the normalized vector back with .to(x.dtype) "
                                "(then multiply by weight), so the next matrix gets the dtype it expects."),
    Mistake(rms_centred, "you subtracted the mean: that is LayerNorm. RMSNorm only divides by the root mean square."),
    Mistake(rms_wrong_axis, "the statistic is per token vector: take the mean over the last dimension (dim=-1, "
                             "keepdim=True), not over the batch."),
    Mistake(rms_no_gain, "the learned gain is missing: multiply by weight at the end."),
    Mistake(rms_eps_outside, "eps is outside the square root: x / (sqrt(mean(x²)) + eps) is another function, "
                              "far off when the RMS is small (here 1e-3 against eps 1e-5). RMSNorm adds eps to the "
                              "mean of squares, then takes the root: x * rsqrt(mean(x²) + eps)."),
]

RMS_HINTS = [
    "float32 reaches 3e38, float16 only 65504: do the squaring and the mean in float32.",
    "x32 = x.float(); normalized = x32 * torch.rsqrt(mean of x32² over the last dim + eps); then back to x.dtype.",
    "return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)",
]


def check_rms_norm_mixed(fn: RmsNormFn, hint: int = 0) -> bool:
    """``fn(x, weight, eps)`` -> RMSNorm of ``x`` in ``x``'s dtype, the statistic taken in float32."""
    return check("rms_norm_mixed", fn, _rms_cases(), hint=hint, hints=RMS_HINTS, equal=_same_in_dtype,
                 mistakes=RMS_MISTAKES)


# --- section 2's table: the published FFN widths ------------------------------------------------------

# (d_model, multiple_of, ffn_dim_multiplier) -> the published intermediate_size (each model's
# config.json). multiple_of and the multiplier are Meta's params.json for the Llamas; SmolLM2 and
# TinyLlama, trained with other code, store only the width, and it fits the rule with 256.
PUBLISHED_FFN = {
    "SmolLM2-135M": ((576, 256, None), 1536),
    "TinyLlama-1.1B": ((2048, 256, None), 5632),
    "Llama-2-7B": ((4096, 256, None), 11008),
    "Llama-2-13B": ((5120, 256, None), 13824),
    "Llama-2-70B": ((8192, 4096, 1.3), 28672),
    "Llama-3-8B": ((4096, 1024, 1.3), 14336),
    "Llama-3.2-1B": ((2048, 256, 1.5), 8192),
    "Llama-3.1-405B": ((16384, 4096, 1.2), 53248),
}


# --- the small random models the checks run --------------------------------------------------------


class TinyModel(Transformer):
    """A randomly initialized ``Transformer`` small enough to check a forward in milliseconds."""

    def __repr__(self) -> str:
        c = self.config
        return (f"TinyModel({c.n_layers} layers, d {c.hidden_size}, {c.n_heads}/{c.n_kv_heads} heads, "
                f"vocab {c.vocab_size}, {'tied' if c.tie_word_embeddings else 'untied'})")


TINY_CONFIGS = [
    ModelConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                tie_word_embeddings=True),
    ModelConfig(vocab_size=101, hidden_size=48, n_layers=3, n_heads=3, n_kv_heads=3, intermediate_size=96,
                rope_theta=100000.0),
]


def tiny_model(cfg: ModelConfig, seed: int) -> TinyModel:
    """A TinyModel with random weights and random norm gains (a trained model's gains are not all 1)."""
    with torch.random.fork_rng():  # leave the notebook's random state alone
        torch.manual_seed(seed)
        model = TinyModel(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def _forward_cases() -> list[tuple[tuple[TinyModel, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    cases = []
    for seed, (cfg, (batch, seq)) in enumerate(zip(TINY_CONFIGS + TINY_CONFIGS[:1], [(1, 5), (2, 7), (1, 1)])):
        model = tiny_model(cfg, seed)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        with torch.no_grad():
            cases.append(((model, ids), model(ids)))
    return cases


def _no_package_forward(pieces: Callable[[tuple[Any, ...]], list[torch.nn.Module]],
                        whole: Callable[[tuple[Any, ...]], dict[CodeType, str]], advice: str) -> Rule:
    """A rule: the learner's function must not run one of the package's own forwards (``whole``:
    its code -> what to call it), however it is called: ``module(...)``, ``module.forward(...)``,
    ``Class.forward(module, ...)``. Hooks on the module itself would miss ``.forward``, which skips
    them; so a pre-hook on each of its ``pieces`` looks at the Python stack for a running one."""

    def rule(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
        codes, called = whole(args), []

        def look(module: torch.nn.Module, inputs: Any) -> None:
            frame = sys._getframe(1)
            while frame is not None and not called:
                if frame.f_code in codes:
                    called.append(codes[frame.f_code])
                frame = frame.f_back

        hooks = [piece.register_forward_pre_hook(look) for piece in pieces(args)]
        try:
            with torch.no_grad():
                fn(*args)
        except Exception:  # the values already passed; a rule only reports what it saw
            return None
        finally:
            for hook in hooks:
                hook.remove()
        return f"it runs {called[0]}: {advice}" if called else None

    return rule


# --- exercise 2: the attention forward ----------------------------------------------------------------


class TinyAttention(Attention):
    """A randomly initialized ``Attention`` (a ``layer.self_attn``), with a short name in the checks."""

    def __repr__(self) -> str:
        bias = ", biases" if self.q_proj.bias is not None else ""
        return f"TinyAttention({self.n_heads} q / {self.n_kv_heads} kv heads of {self.head_dim}{bias})"


# GQA with 2 groups, plain multi-head, and 3 groups with Qwen2's q/k/v biases
ATTENTION_CONFIGS = [
    (TINY_CONFIGS[0], 1, 6),
    (TINY_CONFIGS[1], 2, 5),
    (ModelConfig(vocab_size=10, hidden_size=48, n_layers=1, n_heads=6, n_kv_heads=2, intermediate_size=64,
                 attention_bias=True), 1, 7),
]


def _rope_and_mask(cfg: ModelConfig, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary tables (cos, sin) of positions 0 .. seq-1 and the causal mask, as the model builds them."""
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    return (*rotary(torch.arange(seq)[None], torch.float32), build_mask(None, seq, seq, torch.device("cpu")))


def _attention_cases() -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    cases = []
    for seed, (cfg, batch, seq) in enumerate(ATTENTION_CONFIGS):
        with torch.random.fork_rng():  # leave the notebook's random state alone
            torch.manual_seed(10 + seed)
            attn = TinyAttention(cfg).eval()
            x = torch.randn(batch, seq, cfg.hidden_size)
        cos, sin, mask = _rope_and_mask(cfg, seq)
        with torch.no_grad():
            cases.append(((attn, x, cos, sin, mask), attn(x, cos, sin, mask)))
    return cases


ATTENTION_MISTAKES = [
    Mistake(attention_with(rope=""), "there is no RoPE: rotate q and k with apply_rope(t, cos, sin) once the heads "
                                     "are split; without it the scores cannot tell positions apart."),
    Mistake(attention_with(rope="qkv"), "RoPE is applied to v too: only q and k are rotated (positions matter in "
                                        "the scores q·k); the values are mixed as they are."),
    Mistake(attention_with(rope="q"), "only q is rotated: rotate k as well, so that q·k depends on the distance "
                                      "between the two positions."),
    Mistake(attention_with(rope="k"), "only k is rotated: rotate q as well, so that q·k depends on the distance "
                                      "between the two positions."),
    Mistake(attention_with(kv_heads="tiled"), "the KV heads are repeated in the wrong order: query head h reads KV "
            "head h // groups (heads 0, 1 share KV head 0), so repeat each KV head in place (repeat_kv, or "
            "repeat_interleave(groups, dim=1)); k.repeat(1, groups, 1, 1) tiles them 0, 1, 0, 1."),
    Mistake(attention_with(scaled=False), "the scores are not divided by sqrt(head_dim)."),
    Mistake(attention_with(masked=False), "the mask is not applied: every token sees the future."),
    Mistake(attention_with(split="view"), "the heads are split the wrong way: view the projection as [batch, seq, "
            "heads, head_dim], then transpose(1, 2); reshaping straight to [batch, heads, seq, head_dim] mixes "
            "tokens and heads."),
    Mistake(attention_with(merge="view"), "the heads are merged the wrong way: transpose the output back to "
            "[batch, seq, heads, head_dim] before reshaping to [batch, seq, heads · head_dim]."),
    Mistake(attention_with(o_proj=False), "o_proj is missing: the heads' outputs, side by side, go through "
                                          "attn.o_proj."),
    Mistake(attention_with(bias=False), "the projections' biases are missing (this model has attention_bias, as "
            "Qwen2 does): call the modules, attn.q_proj(x), rather than multiplying by their weight."),
]

ATTENTION_HINTS = [
    "Project x with attn.q_proj, attn.k_proj, attn.v_proj; split each into heads, [batch, heads, seq, head_dim]; "
    "rotate q and k (not v) with apply_rope(t, cos, sin); let each KV head serve its group of query heads; "
    "attend; put the heads side by side again and apply attn.o_proj.",
    "q = attn.q_proj(x).view(batch, seq, attn.n_heads, attn.head_dim).transpose(1, 2), k and v with "
    "attn.n_kv_heads. groups = n_heads // n_kv_heads consecutive query heads share a KV head: repeat_kv(k, groups). "
    "Then softmax(q k^T / sqrt(head_dim), masked) v, or F.scaled_dot_product_attention(q, k, v, attn_mask=mask).",
    "q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin); k, v = repeat_kv(k, g), repeat_kv(v, g); "
    "out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask); "
    "return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))",
]

NOT_THE_PACKAGE_ATTENTION = _no_package_forward(
    lambda args: [args[0].q_proj, args[0].k_proj, args[0].v_proj, args[0].o_proj],
    lambda args: {type(args[0]).forward.__code__: "the package's attention (attn(x, ...) or attn.forward(...))"},
    "write it from the pieces: the projections, RoPE, the attention itself and o_proj.",
)


def check_attention(fn: AttentionFn, hint: int = 0) -> bool:
    """``fn(attn, x [batch, seq, hidden], cos, sin, mask)`` -> ``[batch, seq, hidden]``: the forward of
    ``attn`` (a ``minillm.model.attention.Attention``) written from its projections, checked against
    it on grouped-query, multi-head and biased layers."""
    with torch.no_grad():
        return check("attention_forward", fn, _attention_cases(), hint=hint, hints=ATTENTION_HINTS,
                     mistakes=ATTENTION_MISTAKES, rules=[NOT_THE_PACKAGE_ATTENTION])


# --- exercise 3: the pre-norm block -------------------------------------------------------------------


class TinyBlock(Block):
    """A randomly initialized ``Block`` (one of ``model.layers``), with a short name in the checks."""

    def __repr__(self) -> str:
        a = self.self_attn
        return f"TinyBlock({a.n_heads} q / {a.n_kv_heads} kv heads of {a.head_dim})"


def _block_cases() -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    cases = []
    for seed, (cfg, batch, seq) in enumerate(ATTENTION_CONFIGS[:2]):
        with torch.random.fork_rng():
            torch.manual_seed(20 + seed)
            layer = TinyBlock(cfg, 0).eval()
            with torch.no_grad():
                for name, p in layer.named_parameters():
                    if "norm" in name:
                        p.copy_(1 + 0.5 * torch.randn_like(p))
            x = 3 * torch.randn(batch, seq, cfg.hidden_size)  # a stream with a scale of its own
        cos, sin, mask = _rope_and_mask(cfg, seq)
        with torch.no_grad():
            cases.append(((layer, x, cos, sin, mask), layer(x, cos, sin, mask)))
    return cases


POST_NORM = ("that is post-norm (2017): Llama normalizes each sub-layer's *input*, x = x + attn(norm(x)), and "
             "never the sum.")
NORMED_STREAM = ("the norm is applied to the residual stream itself (x = norm(x)): the sub-layer must read a "
                 "normalized *copy* while x keeps its scale.")
NO_ATTN_RESIDUAL = "the attention residual is missing: add its output to x (x = x + attn(...)) instead of replacing x."
NO_MLP_RESIDUAL = "the FFN residual is missing: x = x + mlp(post_attention_layernorm(x))."
ONE_NORM = "the FFN reads input_layernorm: each sub-layer has its own norm (post_attention_layernorm before the MLP)."
PARALLEL = ("attention and FFN both read the block's input (a 'parallel' block, as in GPT-J): in Llama the FFN "
            "reads the stream *after* the attention update.")

BLOCK_MISTAKES = [Mistake(wrong, message) for wrong, message in [
    (post_norm, POST_NORM), (normed_stream, NORMED_STREAM), (no_attn_residual, NO_ATTN_RESIDUAL),
    (no_mlp_residual, NO_MLP_RESIDUAL), (one_norm, ONE_NORM), (parallel, PARALLEL)]]

BLOCK_HINTS = [
    "Two sub-layers, each reading a normalized copy of the stream x and *adding* its output to x: attention "
    "(after layer.input_layernorm), then the MLP (after layer.post_attention_layernorm).",
    "h = layer.input_layernorm(x); x = x + attention_forward(layer.self_attn, h, cos, sin, mask) (or "
    "layer.self_attn(h, cos, sin, mask)); then the same with post_attention_layernorm and layer.mlp.",
    "x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask); "
    "return x + layer.mlp(layer.post_attention_layernorm(x))",
]

NOT_A_WHOLE_BLOCK = _no_package_forward(
    lambda args: [args[0].input_layernorm, args[0].self_attn, args[0].self_attn.q_proj,
                  args[0].post_attention_layernorm, args[0].mlp],
    lambda args: {type(args[0]).forward.__code__: "the Block's own forward (layer(x, ...) or layer.forward(...))"},
    "assemble the block from its pieces (norms, attention, mlp) and residuals.",
)


def check_block(fn: BlockFn, hint: int = 0) -> bool:
    """``fn(layer, x [batch, seq, hidden], cos, sin, mask)`` -> the stream after ``layer`` (a
    ``minillm.model.llama.Block``), assembled from its pieces, checked against ``Block.forward``."""
    with torch.no_grad():
        return check("pre_norm_block", fn, _block_cases(), hint=hint, hints=BLOCK_HINTS, mistakes=BLOCK_MISTAKES,
                     rules=[NOT_A_WHOLE_BLOCK])


# --- exercise 4 (the core): the full forward assembled from the blocks ----------------------------


FORWARD_MISTAKES = [
    *[Mistake(forward_with(m.wrong), m.message) for m in BLOCK_MISTAKES],
    Mistake(forward_with(pre_norm, final_norm=False), "the final norm is missing: model.norm(x) before the LM head."),
    Mistake(forward_with(pre_norm, tied_head=True),
            "you used the embedding matrix as the LM head; this model is untied: use model.lm_head "
            "(it is the embedding only when tied)."),
    Mistake(forward_with(pre_norm, masked=False), "the attention got mask=None: every token sees the future. "
                                                  "Pass the causal mask."),
]

FORWARD_HINTS = [
    "Embed, then for every layer two pre-norm sub-layers, each *added* to the stream x; then the final norm "
    "and the LM head. The stream itself is never normalized in place.",
    "The pieces: model.embed_tokens(ids); for layer in model.layers: layer.input_layernorm, "
    "layer.self_attn(h, cos, sin, mask), layer.post_attention_layernorm, layer.mlp; then model.norm and model.lm_head.",
    "x = model.embed_tokens(ids); for layer in model.layers: "
    "x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask); "
    "x = x + layer.mlp(layer.post_attention_layernorm(x)); return model.lm_head(model.norm(x))",
]


def _whole_forwards(args: tuple[Any, ...]) -> dict[CodeType, str]:
    model = args[0]
    whole = {type(model).forward.__code__: "the model's own forward (model(ids) or model.forward)",
             type(model).run.__code__: "the model's own forward (model.run)"}
    return whole | {type(layer).forward.__code__: "a whole Block's forward (layer(x, ...) or layer.forward(...))"
                    for layer in model.layers}


ASSEMBLED_FROM_PIECES = _no_package_forward(
    lambda args: [args[0].embed_tokens, args[0].norm, args[0].lm_head]
    + [piece for layer in args[0].layers
       for piece in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)],
    _whole_forwards,
    "assemble the block from its pieces (norms, self_attn, mlp) and residuals.",
)


def check_forward(fn: ForwardFn, hint: int = 0) -> bool:
    """``fn(model, ids [batch, seq])`` -> logits ``[batch, seq, vocab]``, assembled from ``model``'s pieces.

    Checked on small random models (tied and untied, grouped-query and plain multi-head)
    against the package's ``Transformer.forward``.
    """
    with torch.no_grad():
        return check("forward", fn, _forward_cases(), hint=hint, hints=FORWARD_HINTS, mistakes=FORWARD_MISTAKES,
                     rules=[ASSEMBLED_FROM_PIECES], atol=1e-4)
