"""The real SmolLM2-135M-Instruct against transformers reading the same GGUF file."""

from __future__ import annotations

import pytest
import torch

import minillm
from minillm.generate import greedy_recompute
from minillm.model.validate import check_core
from minillm.reference import hf_gguf_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "苹果手机很好用 — and emoji 👋🏽 too.",
]


@pytest.fixture(scope="module")
def reference():
    return hf_gguf_model()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(smollm, reference, prompt):
    model, tok = smollm
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        ours = model(ids)
        theirs = reference(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("prompt", PROMPTS[:3] + ["chat"])
def test_greedy_64_tokens_match_transformers_generate(smollm, reference, prompt):
    model, tok = smollm
    if prompt == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    else:
        ids = tok.encode(prompt)
    ours = greedy_recompute(model, ids, max_new_tokens=64, eos_token_id=tok.eos_id)
    out = reference.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=64,
        do_sample=False,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    theirs = out[0, len(ids) :].tolist()
    assert ours == theirs, f"first difference at token {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"
    if prompt == "chat":
        assert tok.decode(ours).startswith("The capital of France is Paris")


def _padding_drift(model, tok) -> list[float]:
    """Per prompt: max |logits(left-padded batch) - logits(alone)| over the real positions."""
    batch = tok.encode_batch(PROMPTS, padding_side="left")
    drifts = []
    with torch.no_grad():
        padded = model(batch.input_ids, attention_mask=batch.attention_mask)
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([tok.encode(prompt)]))
            alone = alone.logits if hasattr(alone, "logits") else alone
            padded_row = padded.logits[row] if hasattr(padded, "logits") else padded[row]
            real = batch.attention_mask[row].bool()
            drifts.append((padded_row[real] - alone[0]).abs().max().item())
    return drifts


def test_left_padded_batch_equals_each_sequence_alone_exactly_in_float64():
    """In float64 the masking is exact: padding changes nothing but rounding noise (~1e-12)."""
    model, tok = minillm.load_model(device="cpu", dtype=torch.float64)
    assert max(_padding_drift(model, tok)) <= 1e-9


def test_left_padded_batch_in_float32_drifts_within_float32_noise_like_transformers(smollm, reference):
    """In float32 a padded batch changes matmul shapes, so the rounding changes: the drift is
    fp32 noise (~1e-4 on logits of magnitude ~30), for transformers as for us. Which of the two
    rounds a little more depends on the machine's kernels, so only the bound is asserted; the
    float64 test above shows the masking itself is exact."""
    model, tok = smollm
    assert max(_padding_drift(model, tok)) <= 5e-4
    assert max(_padding_drift(reference, tok)) <= 5e-4


def test_sdpa_and_explicit_attention_give_the_same_logits(smollm):
    model, tok = smollm
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    with torch.no_grad():
        sdpa = model(ids)
        model.set_attention_backend("explicit")
        try:
            explicit = model(ids)
        finally:
            model.set_attention_backend("sdpa")
    assert (sdpa - explicit).abs().max().item() <= 1e-3


def test_validate_passes_on_the_real_model(smollm):
    model, tok = smollm
    report = minillm.validate(model, tok)
    assert report.ok, str(report)
    assert [c.name for c in report.checks] == ["tokenizer", "core", "closed loop"]
    assert "' Paris'" in report.checks[-1].message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_validates_tolerance_follows_the_dtype_and_still_catches_a_padding_bug(dtype, monkeypatch):
    """bfloat16 rounding moves a padded row's logits by ~0.5% (far over a float32 tolerance); a
    padding bug — here the pad tokens left unmasked — moves them by a large fraction."""
    model, tok = minillm.load_model(device="cpu", dtype=dtype)
    assert minillm.validate(model, tok).ok
    real_encode_batch = tok.encode_batch

    def pads_unmasked(*args, **kwargs):
        batch = real_encode_batch(*args, **kwargs)
        batch.attention_mask = torch.ones_like(batch.attention_mask)
        return batch

    monkeypatch.setattr(tok, "encode_batch", pads_unmasked)
    core, _ = check_core(model, tok, ["Hello", "The capital of France is"])
    assert not core.ok and "padding changes a row's last logits" in core.message


def test_validate_points_at_the_core_when_a_weight_is_nan(smollm):
    model, tok = smollm
    weight = model.layers[3].post_attention_layernorm.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0] = float("nan")
    try:
        report = minillm.validate(model, tok)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not report.ok
    assert report.checks[0].ok and not report.checks[1].ok
    assert "NaN" in report.checks[1].message


def test_prompt_longer_than_the_context_window_is_refused(smollm):
    model, _ = smollm
    too_long = torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context window of 8192"):
        model(too_long)


def test_out_of_range_token_id_is_refused(smollm):
    model, _ = smollm
    with pytest.raises(ValueError, match="49152"):
        model(torch.tensor([[1, 2, 49152]]))
    with pytest.raises(TypeError, match="integer torch.Tensor"):
        model([[1, 2, 3]])
