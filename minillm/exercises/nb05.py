"""Exercises of notebook 05 (blocks): RMSNorm in half precision, Llama's FFN width rule, counting
parameters, and the core one — the full forward assembled from the blocks' pieces.

The expected answers come from the package (``minillm.model.layers.RMSNorm``, a ``Transformer``
built on PyTorch's ``meta`` device, ``Transformer.forward``) or, for the FFN widths, from the
published configs; each classic mistake is written out as the function a learner would write,
so a wrong answer of that kind is named.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from minillm.exercises import Mistake, check
from minillm.model.attention import build_mask
from minillm.model.config import ModelConfig
from minillm.model.layers import RMSNorm
from minillm.model.llama import Block, Transformer

RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
ForwardFn = Callable[[Transformer, torch.Tensor], torch.Tensor]

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


def _rms_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rms_stays_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rms_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 - x32.mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_wrong_axis(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + eps)).to(x.dtype)


def _rms_no_gain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_eps_outside(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


RMS_MISTAKES = [
    Mistake(_rms_naive, "the mean of squares is computed in x's own dtype: in float16, 300² overflows to inf and "
                        "the vector collapses to zeros. Compute the statistic on x.float()."),
    Mistake(_rms_stays_float32, "the result stays float32: cast the normalized vector back with .to(x.dtype) "
                                "(then multiply by weight), so the next matrix gets the dtype it expects."),
    Mistake(_rms_centred, "you subtracted the mean: that is LayerNorm. RMSNorm only divides by the root mean square."),
    Mistake(_rms_wrong_axis, "the statistic is per token vector: take the mean over the last dimension (dim=-1, "
                             "keepdim=True), not over the batch."),
    Mistake(_rms_no_gain, "the learned gain is missing: multiply by weight at the end."),
    Mistake(_rms_eps_outside, "eps is outside the square root: x / (sqrt(mean(x²)) + eps) is another function, "
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


# --- exercise 2: Llama's FFN width rule ----------------------------------------------------------

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


def _ffn_no_round(d: int, multiple_of: int, mult: float | None = None) -> int:
    h = int(2 * 4 * d / 3)
    return int(mult * h) if mult is not None else h


def _ffn_round_down(d: int, multiple_of: int, mult: float | None = None) -> int:
    return multiple_of * (_ffn_no_round(d, multiple_of, mult) // multiple_of)


def _ffn_no_multiplier(d: int, multiple_of: int, mult: float | None = None) -> int:
    return multiple_of * math.ceil(int(2 * 4 * d / 3) / multiple_of)


def _ffn_four_d(d: int, multiple_of: int, mult: float | None = None) -> int:
    h = int(mult * 4 * d) if mult is not None else 4 * d
    return multiple_of * math.ceil(h / multiple_of)


FFN_MISTAKES = [  # the multiplier first: on Llama-2-70B, ignoring it and rounding down give the same number
    Mistake(_ffn_no_multiplier,
            "ffn_dim_multiplier is ignored: when given, multiply by it (and truncate) before rounding."),
    Mistake(_ffn_no_round, "that is the width before rounding: round it up to a multiple of multiple_of."),
    Mistake(_ffn_round_down,
            "you rounded down (or to the nearest multiple): Llama rounds *up*, to the next multiple of multiple_of."),
    Mistake(_ffn_four_d, "you started from 4d: SwiGLU's three matrices take two thirds of it, int(2 * 4 * d / 3)."),
]

FFN_HINTS = [
    "Three steps: two thirds of 4d, the optional multiplier, then round up to a multiple of multiple_of.",
    "h = int(2 * 4 * d_model / 3); if ffn_dim_multiplier is not None: h = int(ffn_dim_multiplier * h).",
    "return multiple_of * ((h + multiple_of - 1) // multiple_of)  # ceil(h / multiple_of) in integers",
]


def check_ffn_width(fn: Callable[..., int], hint: int = 0) -> bool:
    """``fn(d_model, multiple_of, ffn_dim_multiplier=None)`` -> the SwiGLU width of Meta's Llama code."""
    return check("ffn_width", fn, list(PUBLISHED_FFN.values()), hint=hint, hints=FFN_HINTS, mistakes=FFN_MISTAKES)


# --- exercise 3: count the parameters of any config ----------------------------------------------

PARAM_CONFIGS = {
    "SmolLM2-135M": ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                intermediate_size=1536, tie_word_embeddings=True),
    "tiny, untied": ModelConfig(vocab_size=1000, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                intermediate_size=172),
    "TinyLlama-1.1B": ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                                  intermediate_size=5632),
    "Qwen2.5-0.5B": ModelConfig(vocab_size=151936, hidden_size=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                intermediate_size=4864, tie_word_embeddings=True, attention_bias=True,
                                architecture="qwen2"),
}


def true_param_count(cfg: ModelConfig) -> int:
    """``sum(p.numel() for p in Transformer(cfg).parameters())``, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def _params(cfg: ModelConfig, *, kv_full: bool = False, tied_twice: bool = False, norms: bool = True,
            final_norm: bool = True, biases: str = "qkv") -> int:
    d, q_out = cfg.hidden_size, cfg.n_heads * cfg.head_dim
    kv_out = q_out if kv_full else cfg.n_kv_heads * cfg.head_dim
    per_block = 2 * d * q_out + 2 * d * kv_out + 3 * d * cfg.intermediate_size + (2 * d if norms else 0)
    if cfg.attention_bias:
        per_block += {"qkv": q_out + 2 * kv_out, "none": 0, "qkvo": q_out + 2 * kv_out + d}[biases]
    heads = 2 if tied_twice or not cfg.tie_word_embeddings else 1
    return heads * cfg.vocab_size * d + cfg.n_layers * per_block + (d if final_norm else 0)


def _params_rule(cfg: ModelConfig) -> int:
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return 12 * cfg.n_layers * cfg.hidden_size**2 + embeddings


PARAM_MISTAKES = [
    Mistake(lambda c: _params(c, kv_full=True),
            "k_proj and v_proj are d × (n_kv_heads · head_dim), not d × d: grouped-query attention shares "
            "each K/V head among n_heads // n_kv_heads queries."),
    Mistake(lambda c: _params(c, tied_twice=True), "a tied LM head is the embedding matrix itself: count it once "
                                                    "(as model.parameters() does; the state dict lists it twice)."),
    Mistake(lambda c: _params(c, norms=False), "the two RMSNorm gains of each block (d each) are missing."),
    Mistake(lambda c: _params(c, final_norm=False), "the final norm's gain (d) before the LM head is missing."),
    Mistake(lambda c: _params(c, biases="none"), "Qwen2's q, k and v projections have biases (cfg.attention_bias)."),
    Mistake(lambda c: _params(c, biases="qkvo"), "o_proj has no bias, even when cfg.attention_bias is set."),
    Mistake(_params_rule, "that is the 12·L·d² rule: count the real shapes (GQA, SwiGLU width, norms)."),
]

PARAM_HINTS = [
    "Sum the shapes of one block, times n_layers, plus the embeddings, the final norm and (if untied) the LM head.",
    "Per block: q and o are d × (n_heads·head_dim); k and v are d × (n_kv_heads·head_dim); "
    "the FFN is 3·d·intermediate; two norms of d. Biases add n_heads·head_dim + 2·n_kv_heads·head_dim.",
    "embeddings = vocab·d · (1 if tied else 2); return embeddings + n_layers · per_block + d",
]


def check_count_params(fn: Callable[[ModelConfig], int], hint: int = 0) -> bool:
    """``fn(cfg)`` -> what ``sum(p.numel() for p in Transformer(cfg).parameters())`` would return."""
    cases = [((c,), true_param_count(c)) for c in PARAM_CONFIGS.values()]
    return check("count_params", fn, cases, hint=hint, hints=PARAM_HINTS, mistakes=PARAM_MISTAKES)


# --- exercise 4 (the core): the full forward assembled from the blocks ----------------------------


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


def _tables(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq = ids.shape[1]
    cos, sin = model.rotary(torch.arange(seq)[None], torch.float32)
    return cos, sin, build_mask(None, seq, seq, ids.device)


BlockFn = Callable[[Block, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def _forward_with(block: BlockFn, final_norm: bool = True, tied_head: bool = False, masked: bool = True) -> ForwardFn:
    """A whole forward that runs ``block`` for every layer (the wrong variants differ in one place)."""

    def forward(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
        cos, sin, mask = _tables(model, ids)
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = block(layer, x, cos, sin, mask if masked else None)
        if final_norm:
            x = model.norm(x)
        return x @ model.embed_tokens.weight.T if tied_head else model.lm_head(x)

    return forward


def _pre_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _post_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.input_layernorm(x + layer.self_attn(x, cos, sin, mask))
    return layer.post_attention_layernorm(x + layer.mlp(x))


def _normed_stream(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.input_layernorm(x)
    x = x + layer.self_attn(x, cos, sin, mask)
    x = layer.post_attention_layernorm(x)
    return x + layer.mlp(x)


def _no_attn_residual(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _no_mlp_residual(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return layer.mlp(layer.post_attention_layernorm(x))


def _one_norm(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
    return x + layer.mlp(layer.input_layernorm(x))


def _parallel(layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
    return x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask) + layer.mlp(layer.post_attention_layernorm(x))


FORWARD_MISTAKES = [
    Mistake(_forward_with(_post_norm), "that is post-norm (2017): Llama normalizes each sub-layer's *input*, "
                                        "x = x + attn(norm(x)), and never the sum."),
    Mistake(_forward_with(_normed_stream), "the norm is applied to the residual stream itself (x = norm(x)): the "
                                            "sub-layer must read a normalized *copy* while x keeps its scale."),
    Mistake(_forward_with(_no_attn_residual), "the attention residual is missing: add its output to x "
                                               "(x = x + attn(...)) instead of replacing x."),
    Mistake(_forward_with(_no_mlp_residual), "the FFN residual is missing: x = x + mlp(post_attention_layernorm(x))."),
    Mistake(_forward_with(_one_norm), "the FFN reads input_layernorm: each sub-layer has its own norm "
                                       "(post_attention_layernorm before the MLP)."),
    Mistake(_forward_with(_parallel), "attention and FFN both read the block's input (a 'parallel' block, as in "
                                       "GPT-J): in Llama the FFN reads the stream *after* the attention update."),
    Mistake(_forward_with(_pre_norm, final_norm=False), "the final norm is missing: model.norm(x) before the LM head."),
    Mistake(_forward_with(_pre_norm, tied_head=True),
            "you used the embedding matrix as the LM head; this model is untied: use model.lm_head "
            "(it is the embedding only when tied)."),
    Mistake(_forward_with(_pre_norm, masked=False), "the attention got mask=None: every token sees the future. "
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


def _assembled_from_pieces(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """A rule: the forward must not run the model's own forward or a whole Block's, however it is
    called (``model(ids)``, ``layer(x, ...)``, ``layer.forward(...)``, ``Block.forward(layer, ...)``).
    Hooks on ``model`` and ``layer`` would miss ``.forward``, which skips them; so each piece's hook
    looks at the Python stack for a running ``Block.forward`` or ``Transformer.forward``/``run``."""
    model = args[0]
    whole = {type(model).forward.__code__: "the model's own forward (model(ids) or model.forward)",
             type(model).run.__code__: "the model's own forward (model.run)"}
    whole |= {type(layer).forward.__code__: "a whole Block's forward (layer(x, ...) or layer.forward(...))"
              for layer in model.layers}
    called: list[str] = []

    def look(module: torch.nn.Module, inputs: Any) -> None:
        frame = sys._getframe(1)
        while frame is not None and not called:
            if frame.f_code in whole:
                called.append(whole[frame.f_code])
            frame = frame.f_back

    pieces = [model.embed_tokens, model.norm, model.lm_head]
    pieces += [piece for layer in model.layers
               for piece in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)]
    hooks = [piece.register_forward_pre_hook(look) for piece in pieces]
    try:
        with torch.no_grad():
            fn(*args)
    except Exception:  # the values already passed; a rule only reports what it saw
        return None
    finally:
        for hook in hooks:
            hook.remove()
    if called:
        return f"it runs {called[0]}: assemble the block from its pieces (norms, self_attn, mlp) and residuals."
    return None


def check_forward(fn: ForwardFn, hint: int = 0) -> bool:
    """``fn(model, ids [batch, seq])`` -> logits ``[batch, seq, vocab]``, assembled from ``model``'s pieces.

    Checked on small random models (tied and untied, grouped-query and plain multi-head)
    against the package's ``Transformer.forward``.
    """
    with torch.no_grad():
        return check("forward", fn, _forward_cases(), hint=hint, hints=FORWARD_HINTS, mistakes=FORWARD_MISTAKES,
                     rules=[_assembled_from_pieces], atol=1e-4)
