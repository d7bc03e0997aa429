"""Reading model weights out of a GGUF file (llama.cpp's format).

A GGUF file is a header of metadata key/values (architecture, sizes, the tokenizer) followed by
tensors, many of them *quantized*: Q4_1 stores each block of 32 weights as 4-bit integers plus
a float16 scale and minimum; Q8_0 stores 8-bit integers plus one scale per 32. The ``gguf``
package dequantizes them to float32; this module maps llama.cpp's tensor names to the
transformers names and undoes the one trap of the format, the Q/K permutation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from minillm.errors import FileFormatError
from minillm.gguf_io import GGUFFile, GGUFTensor
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
    """The transformers name of a GGUF tensor, or None if minillm does not know it."""
    if gguf_name.startswith("blk."):
        parts = gguf_name.split(".", 2)
        if len(parts) != 3 or not (parts[1].isascii() and parts[1].isdigit()):
            return None
        target = GGUF_TO_HF.get(f"blk.{{i}}.{parts[2]}")
        return target.format(i=parts[1]) if target else None
    return GGUF_TO_HF.get(gguf_name)


def gguf_tensors(path: Path, reader: GGUFFile) -> dict[str, GGUFTensor]:
    """The file's tensors under transformers names. A tensor minillm does not know is refused,
    not skipped: ignoring one can change the results (``rope_freqs.weight`` holds Llama 3.1's
    RoPE scaling), so a file holding one is a model minillm cannot run faithfully."""
    tensors = {name: t for t in reader.tensors if (name := hf_name(t.name)) is not None}
    unknown = [t.name for t in reader.tensors if hf_name(t.name) is None]
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise FileFormatError(
            f"{path}: unexpected tensor(s) {', '.join(unknown[:3])}{more}: not part of a model minillm runs"
        )
    return tensors


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


# GGUF tensor types kept as blocks by ``load_model(weights="native")``, and the float types it leaves as they are
NATIVE_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def read_gguf_blocks(path: Path, tensors: dict[str, GGUFTensor],
                     config: ModelConfig) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """The quantized matrices of a GGUF file as blocks, not expanded: module name -> (format,
    ``{"qs", "d"[, "m"]}``). Float tensors (norms, F32/F16 matrices) are left to the float loader;
    a quantized type minillm cannot run packed is refused, named with its tensor.

    Q and K rows are un-permuted like the float weights: a block runs along a row, so moving
    whole rows (with their scales) is exact.
    """
    from minillm.model.quant import from_gguf_blocks

    blocks = {}
    for name, tensor in tensors.items():
        type_name = tensor.tensor_type.name
        if type_name in FLOAT_TYPES:
            continue
        if type_name not in NATIVE_TYPES:
            raise FileFormatError(
                f"{path}: tensor {tensor.name} is {type_name}, which weights='native' cannot keep packed "
                f"(supported: {', '.join(NATIVE_TYPES)}); load with weights='float32', 'q8_0' or 'q4_0'"
            )
        fmt = NATIVE_TYPES[type_name]
        parts = from_gguf_blocks(tensor.data, fmt)
        for key, value in parts.items():
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise FileFormatError(f"{path}: tensor {tensor.name} ({type_name}) has NaN or infinite block "
                                      f"{'scales' if key == 'd' else 'minimums'}")
        if config.architecture == "llama" and name.endswith("q_proj.weight"):
            parts = {key: torch.from_numpy(unpermute(value.numpy(), config.n_heads)) for key, value in parts.items()}
        elif config.architecture == "llama" and name.endswith("k_proj.weight"):
            parts = {key: torch.from_numpy(unpermute(value.numpy(), config.n_kv_heads)) for key, value in parts.items()}
        blocks[name.removeprefix("model.").removesuffix(".weight")] = (fmt, parts)
    return blocks


def read_gguf_state_dict(path: Path, tensors: dict[str, GGUFTensor], config: ModelConfig,
                         progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantize ``tensors`` (transformers name -> GGUF tensor) into float32.

    The shapes were checked against ``config`` first (``loading.check_weights``), so every
    reshape and un-permute below fits.
    """
    import gguf

    state: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(tensors.items(), desc=f"dequantizing {path.name}", disable=not progress, unit="tensor"):
        shape = tuple(reversed(tensor.shape))  # GGUF lists dimensions innermost first
        try:
            with np.errstate(all="ignore"):  # damaged scales overflow: the check below names the tensor
                weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except (NotImplementedError, ValueError) as err:  # a tensor type gguf cannot dequantize (or integers)
            raise FileFormatError(
                f"{path}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}, shape {list(shape)}): {err}"
            ) from None
        if not np.isfinite(weights).all():  # no trained weight is inf or NaN: the bytes are damaged
            raise FileFormatError(
                f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) holds NaN or infinite values"
            )
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = unpermute(weights, config.n_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = unpermute(weights, config.n_kv_heads)
        state[name] = torch.tensor(weights, dtype=torch.float32)  # a copy: the file is memory-mapped read-only
    return state
