"""Model pieces against hand-written math, transformers on tiny random checkpoints, and bad files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import minillm
from minillm.model.attention import attention_explicit, attention_sdpa, build_mask, repeat_kv
from minillm.model.gguf_weights import unpermute
from minillm.model.rope import RotaryEmbedding, apply_rope, apply_rope_interleaved, interleaved_to_half


# --------------------------------------------------------------------------- attention
@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    n_kv_heads=st.integers(1, 3),
    n_groups=st.integers(1, 4),
    q_len=st.integers(1, 9),
    extra_k=st.integers(0, 70),
    head_dim=st.sampled_from([8, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_path_equals_explicit_path(batch, n_kv_heads, n_groups, q_len, extra_k, head_dim, seed):
    """The fused kernel computes the written-out math; and given the un-repeated K/V heads
    (enable_gqa) it returns the very same numbers, bit for bit, as given repeat_kv's copies."""
    g = torch.Generator().manual_seed(seed)
    k_len = q_len + extra_k
    q = torch.randn(batch, n_kv_heads * n_groups, q_len, head_dim, generator=g)
    k_shared = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
    v_shared = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
    k, v = repeat_kv(k_shared, n_groups), repeat_kv(v_shared, n_groups)
    padding = torch.ones(batch, k_len, dtype=torch.long)
    padding[0, : min(2, k_len - 1)] = 0  # left padding in the first row
    mask = build_mask(padding, q_len, k_len, q.device)
    out = attention_sdpa(q, k, v, mask)
    torch.testing.assert_close(out, attention_explicit(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert torch.equal(attention_sdpa(q, k_shared, v_shared, mask), out)


def test_explicit_attention_matches_the_formula_by_hand():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = build_mask(None, 3, 3, q.device)
    out = attention_explicit(q, k, v, mask)
    for t in range(3):  # query t sees keys 0..t
        scores = torch.tensor([float(q[0, 0, t] @ k[0, 0, s]) / math.sqrt(4) for s in range(t + 1)])
        weights = torch.softmax(scores, dim=0)
        expected = sum(w * v[0, 0, s] for s, w in enumerate(weights))
        torch.testing.assert_close(out[0, 0, t], expected)


def test_mask_is_causal_hides_padding_and_never_leaves_a_row_empty():
    padding = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask = build_mask(padding, 4, 4, torch.device("cpu"))
    assert mask[1, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                    [True, True, True, False], [True, True, True, True]]
    assert mask[0, 0, 2].tolist() == [False, False, True, False]
    assert mask[0, 0, 3].tolist() == [False, False, True, True]
    assert mask[0, 0, 0].all()  # a pad query that could see nothing sees everything (no NaN)


def test_repeat_kv_shares_each_kv_head_with_consecutive_query_heads():
    kv = torch.arange(2).float().view(1, 2, 1, 1)
    assert repeat_kv(kv, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


# --------------------------------------------------------------------------- rope
@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 12), head_dim=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_interleaved_and_rotate_half_rope_agree_under_the_permutation(seq, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, seq, head_dim, generator=g)  # interleaved layout
    positions = torch.randint(0, 8000, (2, seq), generator=g)
    rotary = RotaryEmbedding(head_dim, 8192, 100000.0)
    cos, sin = rotary(positions, torch.float32)
    perm = interleaved_to_half(head_dim)
    half = apply_rope(x[..., perm], cos, sin)
    interleaved = apply_rope_interleaved(x, positions, 100000.0)
    torch.testing.assert_close(interleaved[..., perm], half, atol=1e-4, rtol=1e-4)


def test_attention_outputs_agree_between_the_two_rope_layouts():
    """Scores are invariant to permuting head_dim, so attention outputs agree exactly."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64)
    positions = torch.arange(7)[None]
    perm = interleaved_to_half(64)
    cos, sin = RotaryEmbedding(64, 64, 100000.0)(positions, torch.float32)
    mask = build_mask(None, 7, 7, q.device)
    out_interleaved = attention_explicit(
        apply_rope_interleaved(q, positions, 100000.0), apply_rope_interleaved(k, positions, 100000.0), v, mask
    )
    out_half = attention_explicit(apply_rope(q[..., perm], cos, sin), apply_rope(k[..., perm], cos, sin), v, mask)
    torch.testing.assert_close(out_interleaved, out_half, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
    rotary = RotaryEmbedding(64, 4096, 100000.0)

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rotary(torch.tensor([[m]]), torch.float32)
        cos_n, sin_n = rotary(torch.tensor([[n]]), torch.float32)
        return float((apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum())

    assert score(10, 3) == pytest.approx(score(1007, 1000), abs=1e-3)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert script permutes with reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)."""
    n_heads, head_dim, d_in = 3, 8, 5
    w = torch.randn(n_heads * head_dim, d_in).numpy()
    permuted = w.reshape(n_heads, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute(permuted, n_heads) == w).all()


# --------------------------------------------------------------------------- tiny checkpoints
@pytest.fixture(scope="module")
def tiny_tokenizer():
    text = minillm.assets.corpus_path().read_text(encoding="utf-8")[:20000]
    return minillm.train_bpe(text, 300, ["<|endoftext|>"], progress=False)


def _tiny_hf_checkpoint(folder: Path, tokenizer, model_type: str, **overrides) -> Path:
    """A randomly initialised transformers model saved as safetensors, plus a tokenizer."""
    import transformers

    common = dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    )
    common.update(overrides)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return folder


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": False}),  # q/k/v biases
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ],
    ids=["llama-untied", "llama-tied", "qwen2-bias", "llama3-rope-scaling"],
)
def test_hf_checkpoint_folders_load_and_match_transformers(tmp_path, tiny_tokenizer, model_type, overrides):
    import transformers

    folder = _tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, **overrides)
    model, tok = minillm.load_model(folder, device="cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("To be, or not to be: that is the question.")])
    with torch.no_grad():
        diff = (model(ids) - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.fixture()
def tiny_folder(tmp_path, tiny_tokenizer):
    return _tiny_hf_checkpoint(tmp_path / "ckpt", tiny_tokenizer, "llama")


def _edit_weights(folder: Path, edit) -> None:
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(tiny_folder):
    _edit_weights(tiny_folder, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(minillm.FileFormatError, match=r"missing tensor\(s\) layers\.1\.mlp\.up_proj\.weight"):
        minillm.load_model(tiny_folder)


def test_wrong_shape_names_the_tensor_and_both_shapes(tiny_folder):
    def shrink(state):
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_weights(tiny_folder, shrink)
    with pytest.raises(minillm.FileFormatError, match=r"layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\], expected \[32, 64\]"):
        minillm.load_model(tiny_folder)


def test_tokenizer_larger_than_embedding_names_both_sizes(tiny_folder):
    _edit_config(tiny_folder, vocab_size=200)
    _edit_weights(tiny_folder, lambda s: s.update({k: v[:200] for k, v in s.items() if "embed" in k or "lm_head" in k}))
    with pytest.raises(minillm.FileFormatError, match="tokenizer has 300 tokens but the embedding table has only 200 rows"):
        minillm.load_model(tiny_folder)


def test_unsupported_architecture_is_named(tiny_folder):
    _edit_config(tiny_folder, model_type="gpt2")
    with pytest.raises(minillm.FileFormatError, match="unsupported architecture model_type='gpt2'"):
        minillm.load_model(tiny_folder)


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_corrupt_safetensors_is_named(tiny_folder, damage):
    path = tiny_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(bytes(range(256)) * 10 if damage == "random" else data[: len(data) // 2])
    with pytest.raises(minillm.FileFormatError, match="model.safetensors"):
        minillm.load_model(tiny_folder)


@pytest.mark.parametrize("keep", [1000, 5_000_000])
def test_truncated_gguf_is_named_and_the_default_still_loads(tmp_path, keep):
    data = minillm.assets.default_gguf_path().read_bytes()[:keep]
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data)
    with pytest.raises(minillm.FileFormatError, match="truncated.gguf: not a readable GGUF file"):
        minillm.load_model(bad)
    model, tok = minillm.load_model()  # nothing half-loaded or half-cached was left behind
    assert model.config.n_layers == 30


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        minillm.load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        minillm.load_model(tmp_path)


def test_interrupted_conversion_leaves_no_cache_behind(tmp_path, monkeypatch):
    from minillm.model import loading

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        loading.convert_gguf(minillm.assets.default_gguf_path(), progress=False)
    assert list(tmp_path.iterdir()) == []
