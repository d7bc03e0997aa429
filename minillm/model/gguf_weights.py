"""Reading model weights out of a GGUF file (llama.cpp's format).

A GGUF file is a header of metadata key/values (architecture, sizes, the tokenizer) followed by
tensors, many of them *quantized*: Q4_1 stores each block of 32 weights as 4-bit integers plus
a float16 scale and minimum; Q8_0 stores 8-bit integers plus one scale per 32. The ``gguf``
package dequantizes them to float32; this module maps llama.cpp's tensor names to the
transformers names and undoes the one trap of the format, the Q/K permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from minillm.errors import FileFormatError
from minillm.model.config import ModelConfig

# llama.cpp name -> transformers name ("{i}" is the layer index)
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None if minillm does not use it."""
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        target = GGUF_TO_HF.get(f"blk.{{i}}.{rest}")
        return target.format(i=layer) if target else None
    return GGUF_TO_HF.get(gguf_name)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (interleaved RoPE layout -> rotate-half layout).

    llama.cpp's converter reorders each head's rows so that RoPE's coordinate pairs are
    adjacent (2i, 2i+1). transformers pairs i with i + head_dim/2. Skipping this step still
    runs and even produces plausible text; only a logits comparison catches it.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def read_gguf_state_dict(path: Path, reader: Any, config: ModelConfig, progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantize every tensor minillm uses into float32, under transformers' names."""
    import gguf

    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", disable=not progress, unit="tensor"):
        name = hf_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        try:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except Exception as err:  # an unsupported quantization or a truncated data section
            raise FileFormatError(
                f"{path}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}, shape {list(shape)}): {err}"
            ) from None
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = unpermute(weights, config.n_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = unpermute(weights, config.n_kv_heads)
        state[name] = torch.tensor(weights, dtype=torch.float32)  # a copy: the file is memory-mapped read-only
    return state
