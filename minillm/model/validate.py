"""``validate()``: the three-step debugging of a freshly loaded model.

When a model produces garbage, the bug is in one of three places, and they are checked in
pipeline order so the first failure points at the culprit:

1. **tokenizer** — do ids round-trip, and are the mask and positions of a padded batch consistent?
2. **core** — are the logits the right shape, finite, and of a sane scale? (min/max/mean/std of
   the key tensors show where numbers blow up), and does padding leave real rows unchanged?
3. **closed loop** — does the most likely next token decode to readable text?
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.model.llama import Transformer
from minillm.tokenizer import Tokenizer


@dataclass
class Check:
    """One step's verdict: ``ok`` plus a message saying what was seen."""

    name: str
    ok: bool
    message: str
    stats: dict[str, dict[str, float]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"[{'ok' if self.ok else 'PROBLEM'}] {self.name}: {self.message}"]
        for tensor, s in self.stats.items():
            lines.append(
                f"      {tensor:<14} min {s['min']:+9.3f}  max {s['max']:+9.3f}  mean {s['mean']:+8.4f}  std {s['std']:8.4f}"
            )
        return "\n".join(lines)


@dataclass
class Report:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def __str__(self) -> str:
        return "\n".join(str(check) for check in self.checks)


def padding_tolerance(dtype: torch.dtype) -> float:
    """How far (relative to the largest logit) a padded row's logits may drift from the same
    prompt run alone, in ``dtype``.

    Padding changes the shapes the kernels see, so the sums are accumulated in another order:
    in exact arithmetic nothing changes, in floating point the last bits do. That noise scales
    with the dtype's machine epsilon: float32 (eps 1.2e-7) drifts by ~1e-6 of the largest logit
    on SmolLM2, bfloat16 (eps 7.8e-3, 8 bits of mantissa) by ~5e-3 — one bfloat16 step of a
    logit near 25 is already 0.125. A fixed float32 tolerance would fail every bfloat16 model.
    The bound is 8 epsilons (and never below 1e-3): a real masking or position bug moves the
    logits by a large fraction of their scale, far above it in every dtype.
    """
    return max(1e-3, 8 * torch.finfo(dtype).eps)


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    x = x.detach().float()
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(), "std": x.std().item()}


def check_tokenizer(tokenizer: Tokenizer, model: Transformer, prompts: list[str]) -> Check:
    ids = [tokenizer.encode(p) for p in prompts]
    bad_round_trip = [p for p, i in zip(prompts, ids) if tokenizer.decode(i) != p]
    if bad_round_trip:
        return Check("tokenizer", False, f"decode(encode(s)) != s for {bad_round_trip[0]!r}")
    if tokenizer.vocab_size > model.config.vocab_size:
        return Check(
            "tokenizer", False, f"{tokenizer.vocab_size} tokens but only {model.config.vocab_size} embedding rows"
        )
    batch = tokenizer.encode_batch(prompts, padding_side="left")
    lengths = batch.attention_mask.sum(-1).tolist()
    if lengths != [len(i) for i in ids]:
        return Check("tokenizer", False, f"attention_mask counts {lengths} real tokens, encode gives {[len(i) for i in ids]}")
    for row, n in enumerate(lengths):
        real = batch.attention_mask[row].bool()
        if batch.position_ids[row][real].tolist() != list(range(n)):
            return Check("tokenizer", False, f"row {row}: position_ids of real tokens are not 0..{n - 1}")
        if batch.input_ids[row][real].tolist() != ids[row]:
            return Check("tokenizer", False, f"row {row}: padded ids differ from encode()")
    return Check("tokenizer", True, f"{len(prompts)} prompts round-trip; left-padded mask and positions consistent")


@torch.no_grad()
def check_core(model: Transformer, tokenizer: Tokenizer, prompts: list[str]) -> tuple[Check, torch.Tensor]:
    batch = tokenizer.encode_batch(prompts, padding_side="left")
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        model.embed_tokens.register_forward_hook(lambda _m, _i, out: captured.__setitem__("embeddings", out)),
        model.norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("final hidden", out)),
    ]
    try:
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    captured["logits"] = logits
    stats = {name: tensor_stats(t) for name, t in captured.items()}
    expected = (len(prompts), batch.input_ids.shape[1], model.config.vocab_size)
    if tuple(logits.shape) != expected:
        return Check("core", False, f"logits shape {list(logits.shape)}, expected {list(expected)}", stats), logits
    if not torch.isfinite(logits).all():
        return Check("core", False, "logits contain NaN or inf", stats), logits
    spread = stats["logits"]["std"]
    if not 0.1 < spread < 100:
        return Check("core", False, f"logits std {spread:.3g} is implausible (expected ~1-20)", stats), logits
    padded_row = int(batch.attention_mask.sum(-1).argmin())  # the most padded row
    alone = model(torch.tensor([tokenizer.encode(prompts[padded_row])]))[0, -1]
    drift = (alone - logits[padded_row, -1]).abs().max().item()
    tolerance = padding_tolerance(model.dtype) * max(1.0, alone.abs().max().item())
    if drift > tolerance:
        return Check("core", False, f"padding changes a row's last logits by {drift:.3g} (tolerance {tolerance:.3g} "
                     f"in {str(model.dtype).removeprefix('torch.')})", stats), logits
    return Check("core", True, f"logits {list(logits.shape)}, finite; padded == alone (max diff {drift:.1e}, "
                 f"tolerance {tolerance:.1e})", stats), logits


def check_closed_loop(tokenizer: Tokenizer, prompt: str, last_logits: torch.Tensor) -> Check:
    top = torch.topk(last_logits.float().softmax(-1), 5)
    candidates = ", ".join(f"{tokenizer.decode([i])!r} {p:.2f}" for p, i in zip(top.values.tolist(), top.indices.tolist()))
    text = tokenizer.decode([int(top.indices[0])])
    readable = text.strip() != "" and "\ufffd" not in text and text.isprintable()
    verdict = "readable" if readable else "not readable text"
    return Check("closed loop", readable, f"{prompt!r} -> {text!r} ({verdict}); top 5: {candidates}")


def validate(model: Transformer, tokenizer: Tokenizer, prompt: str = "The capital of France is") -> Report:
    """Run the three checks on ``prompt`` (plus a shorter prompt to exercise padding)."""
    prompts = ["Hello", prompt]
    checks = [check_tokenizer(tokenizer, model, prompts)]
    if checks[0].ok:
        core, logits = check_core(model, tokenizer, prompts)
        checks.append(core)
        if core.ok:
            checks.append(check_closed_loop(tokenizer, prompt, logits[-1, -1]))
    return Report(checks)
