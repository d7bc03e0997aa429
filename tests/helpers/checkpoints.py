"""Tiny model files written by the tests: a random transformers checkpoint (safetensors, config,
tokenizer) and the same checkpoint as a GGUF file, as llama.cpp would convert it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from minillm import Tokenizer
from minillm.model.gguf_weights import GGUF_TO_HF


def tiny_hf_checkpoint(folder: Path, tokenizer: Tokenizer, model_type: str, **overrides: Any) -> Path:
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


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script: interleave each head's rows for its RoPE layout."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The metadata of the tiny checkpoint (``tiny_hf_checkpoint``'s defaults) as a GGUF file holds it.
DEFAULT_GGUF_META = {
    "llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": 64,
    "llama.feed_forward_length": 96, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0, "llama.vocab_size": 320,
}


def write_gguf(path: Path, pristine: Path, tokenizer: Tokenizer, meta: dict[str, Any] | None = None,
               tensors: dict[str, np.ndarray | None] | None = None, types: dict[str, Any] | None = None,
               heads: tuple[int, int] = (4, 2)) -> Path:
    """The tiny checkpoint as a float32 GGUF (as llama.cpp would convert it), with metadata
    overrides (a value of None drops the key) and tensor overrides (None drops the tensor);
    ``types`` stores the named tensors quantized (GGUF name -> ``GGMLQuantizationType``, or a
    function of the name), with gguf's own quantizer. ``heads``: the checkpoint's query and KV head
    counts (the Q/K permutation is per head)."""
    import gguf

    hf_to_gguf = {hf.removeprefix("model."): g for g, hf in GGUF_TO_HF.items()}
    state = {}
    for name, w in load_file(pristine / "model.safetensors").items():
        name = name.removeprefix("model.")
        parts = name.split(".")
        key = ".".join(["layers", "{i}", *parts[2:]]) if parts[0] == "layers" else name
        g = hf_to_gguf[key].format(i=parts[1] if parts[0] == "layers" else "")
        w = w.numpy()
        if g.endswith("attn_q.weight"):
            w = permute(w, heads[0])
        elif g.endswith("attn_k.weight"):
            w = permute(w, heads[1])
        state[g] = w
    state.update(tensors or {})
    special = set(tokenizer.special_tokens.values())
    token = tokenizer.id_to_token
    meta = {
        **DEFAULT_GGUF_META,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [token(i) for i in range(tokenizer.vocab_size)],
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(tokenizer.vocab_size)],
        "tokenizer.ggml.merges": [f"{token(a)} {token(b)}" for a, b in tokenizer.merges],
        **(meta or {}),
    }
    writer = gguf.GGUFWriter(str(path), meta.pop("general.architecture", "llama"))
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            add = writer.add_uint32 if 0 <= value < 2**32 else writer.add_int64 if value < 2**63 else writer.add_uint64
            add(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, w in state.items():
        qtype = types(name) if callable(types) else (types or {}).get(name)
        if w is not None and qtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype),
                              raw_dtype=qtype)
        elif w is not None:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
