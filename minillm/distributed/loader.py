"""Each rank loads its shard of the weights, and only that: slices read straight from the files.

A safetensors file is a JSON header and raw tensors; ``safe_open(...).get_slice(name)[a:b]``
memory-maps the file and copies out just rows ``a..b`` (or columns, ``[:, a:b]``) — the rest
of the tensor is never read into the process. So a rank's resident weights are its share
(about ``1 / world_size`` of the matrices and of the vocabulary) plus the small norms every
rank holds whole.

Float weights come from a checkpoint folder: an HF one, or the cache folder the default GGUF
is converted into once (``load_model``'s conversion; in a run, rank 0 converts and the others
wait for it). The checks are ``load_model``'s: the config, then every tensor's *header*
against it, before any data is read.

``weights="native"`` keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks packed, as ``load_model``
does; the conversion cache holds floats only, so the blocks are sliced from the GGUF file
itself (memory-mapped too). A packed matrix's row is its blocks of 32 inputs, each with its
scales: a column-parallel slice takes whole rows, a row-parallel one whole blocks of every
row (the shard puts the feed-forward split between blocks; a GQA group's o_proj columns,
3 x 64 on SmolLM2, are whole blocks too). The blocks a rank holds are the very bytes one
process holds, so the products are the same. ``weights="q8_0"`` (or Q4_x) quantizes the
rank's float slices at load instead (``distributed.quantize``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from minillm.assets import default_gguf_path
from minillm.distributed.group import Group
from minillm.distributed.layers import build_rank_model
from minillm.distributed.quantize import quantize_shard
from minillm.distributed.shard import Shard, plan
from minillm.errors import FileFormatError
from minillm.gguf_io import open_gguf
from minillm.model.checkpoint import check_weights, safetensors_headers
from minillm.model.config import HF_NAMES, ModelConfig
from minillm.model.gguf_weights import FLOAT_TYPES, NATIVE_TYPES, gguf_tensors, unpermute
from minillm.model.llama import Transformer
from minillm.model.loading import CALIBRATION_TEXT, DTYPES, convert_gguf
from minillm.model.quant import BLOCK_BYTES, BLOCK_SIZE, FORMATS, from_gguf_blocks
from minillm.safe_io import read_json
from minillm.tokenizer import Tokenizer


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no config.json: not an HF checkpoint folder")
    return ModelConfig.from_hf(read_json(path, "config.json"), source=str(path))


def read_float_shard(folder: Path, config: ModelConfig, shard: Shard,
                     skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The rank's slices of a checkpoint folder's tensors (names without ``model.``), read with
    ``get_slice``, after every header is checked against ``config``. The weights of the modules
    in ``skip`` are left out (they come packed from elsewhere; their biases do not)."""
    headers = safetensors_headers(folder)
    files = {info.file for info in headers.values()}
    check_weights(config, headers, folder / "config.json", files.pop() if len(files) == 1 else folder,
                  HF_NAMES["n_layers"])
    state: dict[str, torch.Tensor] = {}
    for name, info in headers.items():
        short = name.removeprefix("model.")
        if short.endswith("rotary_emb.inv_freq") or short.removesuffix(".weight") in skip:
            continue
        if config.tie_word_embeddings and short == "lm_head.weight":
            continue
        part = shard.part(short)
        try:  # one tensor per opening: the pages of the map that a slice touches are let go right after
            with safe_open(info.file, framework="pt") as f:
                view = f.get_slice(info.stored_as)
                tensor = view[:] if part is None else view[part[1]] if part[0] == 0 else view[:, part[1]]
                # a copy: the slice may be a view of the memory-mapped file, which would keep the map alive
                tensor = tensor.clone(memory_format=torch.contiguous_format)
        except (SafetensorError, OSError) as err:
            raise FileFormatError(f"{info.file}: not a readable safetensors file ({err})") from None
        if not torch.isfinite(tensor).all():
            raise FileFormatError(f"{info.file}: tensor {name} holds NaN or infinite values")
        state[short] = tensor
    return state


def read_block_shard(path: Path, config: ModelConfig, shard: Shard) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """The rank's slices of a GGUF file's packed matrices, kept as blocks (module name ->
    (format, blocks), as ``quant.use_blocks`` takes them). Float tensors are left out."""
    blocks = {}
    for name, tensor in gguf_tensors(path, open_gguf(path)).items():
        type_name = tensor.tensor_type.name
        if type_name in FLOAT_TYPES:
            continue
        if type_name not in NATIVE_TYPES:
            raise FileFormatError(f"{path}: tensor {tensor.name} is {type_name}, which weights='native' cannot keep "
                                  f"packed (supported: {', '.join(NATIVE_TYPES)})")
        fmt, short = NATIVE_TYPES[type_name], name.removeprefix("model.")
        dim, rows = shard.part(short) or (0, slice(None))
        raw = tensor.data  # uint8 [rows, bytes per row], memory-mapped: the slice below is all that is read
        if dim == 0:
            raw = raw[rows]
        else:
            if rows.start % BLOCK_SIZE or rows.stop % BLOCK_SIZE:
                raise ValueError(f"{tensor.name}: the rank's input columns {rows.start}..{rows.stop} are not whole "
                                 f"blocks of {BLOCK_SIZE}, so the {type_name} blocks cannot be split there")
            width = BLOCK_BYTES[fmt]
            raw = raw[:, rows.start // BLOCK_SIZE * width: rows.stop // BLOCK_SIZE * width]
        parts = from_gguf_blocks(np.ascontiguousarray(raw), fmt)
        for value in parts.values():
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise FileFormatError(f"{path}: tensor {tensor.name} ({type_name}) has NaN or infinite block scales")
        if config.architecture == "llama" and short.endswith(("q_proj.weight", "k_proj.weight")):
            heads = len(shard.q_heads) if "q_proj" in short else len(shard.kv_heads)  # within-head: rows stay the rank's
            parts = {key: torch.from_numpy(unpermute(value.numpy(), heads)) for key, value in parts.items()}
        blocks[short.removesuffix(".weight")] = (fmt, parts)
    return blocks


def load_tensor_parallel(source: str | os.PathLike[str] | None, group: Group, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype | str | None = None,
                         weights: str | None = None) -> tuple[Transformer, Tokenizer, Shard]:
    """This rank's model (a ``Transformer`` of its shard, with the collectives), the tokenizer
    and its ``Shard``.

    Args:
        source: None for the default model, or a ``.gguf`` file (converted once into the
            cache: rank 0 converts, the others wait), or an HF checkpoint folder.
        group: the run (``init_group``); every rank calls this with the same arguments.
        dtype: the activations' (and float weights') dtype, or its name (default float32).
        weights: None (float weights); "native": the GGUF's Q8_0 / Q4_x blocks, packed,
            sliced from the file; "q8_0" / "q4_0" / "q4_1": the float slices quantized at load
            (``distributed.quantize``).

    Raises ValueError, naming the head counts, when the model cannot split over the group.
    """
    if weights not in (None, "native", *FORMATS):
        raise ValueError(f"weights={weights!r} is not one of None (floats), 'native', {', '.join(FORMATS)}")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype or torch.float32
    device = torch.device(device)
    path = None if source is None else Path(source)
    if path is None or path.suffix == ".gguf":
        gguf = default_gguf_path() if path is None else path
        if group.rank == 0:  # converts once (the whole model, once); the others wait, then find it done
            convert_gguf(gguf)
        group.barrier(control=True)
        folder = convert_gguf(gguf, progress=False)
    else:
        folder, gguf = path, None
        if weights == "native":
            raise ValueError(f"weights='native' keeps a GGUF file's blocks, and {path} is a checkpoint of floats")
    config = read_config(folder)
    shards = plan(config, group.world_size)  # every rank raises the same ValueError, before any tensor is read
    shard = shards[group.rank]
    blocks = read_block_shard(gguf, config, shard) if weights == "native" else {}
    state = read_float_shard(folder, config, shard, skip=set(blocks))
    model = build_rank_model(config, shard, group, state, blocks, device, dtype, [len(s.vocab) for s in shards])
    tokenizer = Tokenizer.from_file(folder)
    if weights in FORMATS:  # quantized from the float slices, calibrated on the text load_model uses
        ids = tokenizer.encode(CALIBRATION_TEXT)[: config.max_position_embeddings]
        quantize_shard(model, weights, torch.tensor([ids]), group)
    return model, tokenizer, shard
