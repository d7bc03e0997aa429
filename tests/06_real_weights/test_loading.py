"""Loading real weights (``minillm.load_model``): tiny random transformers checkpoints load and
match transformers, GGUF's permuted Q/K rows are un-permuted, and bad files fail with an error
naming the tensor, the file or the size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minillm
from minillm.model.gguf_weights import unpermute

from helpers.checkpoints import tiny_hf_checkpoint


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert script permutes with reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)."""
    n_heads, head_dim, d_in = 3, 8, 5
    w = torch.randn(n_heads * head_dim, d_in).numpy()
    permuted = w.reshape(n_heads, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute(permuted, n_heads) == w).all()


# --------------------------------------------------------------------------- tiny checkpoints
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

    folder = tiny_hf_checkpoint(tmp_path, tiny_tokenizer, model_type, **overrides)
    model, tok = minillm.load_model(folder, device="cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("To be, or not to be: that is the question.")])
    with torch.no_grad():
        diff = (model(ids) - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.fixture()
def tiny_folder(tmp_path, tiny_tokenizer):
    return tiny_hf_checkpoint(tmp_path / "ckpt", tiny_tokenizer, "llama")


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
