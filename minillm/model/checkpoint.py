"""Checkpoint files, read safely: safetensors headers and shards, the weights checked against the
config, and the model built from them (no memory spent on a random initialisation).

A checkpoint is untrusted input, so the checks run on the tensor *descriptions* in the file
headers (names, dtypes, shapes) before any tensor data is read. Only safetensors is read here
(GGUF in ``gguf_weights``); nothing is unpickled. ``loading.load_model`` puts the pieces together.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from minillm.errors import FileFormatError
from minillm.model.config import ModelConfig
from minillm.model.llama import Transformer
from minillm.model.rope import RotaryEmbedding
from minillm.safe_io import member_file, read_json, regular_file
from minillm.tokenizer import Tokenizer

# safetensors dtypes that hold real-valued weights; anything else (integers, bool, complex,
# float8 without its scales) would be silently turned into wrong float32 numbers by a cast.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class TensorInfo(NamedTuple):
    """What a file's header says about one tensor, and where: enough to check it against the config."""

    shape: tuple[int, ...]
    file: Path
    stored_as: str  # its name in the file (``blk.0.attn_q.weight``, ``model.norm.weight``)


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names — each a plain file name inside ``folder``."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        if not (folder / "model.safetensors").exists():
            raise FileNotFoundError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")
        return [regular_file(folder / "model.safetensors", "weights file")]
    spec = read_json(index, "shard index")
    weight_map = spec.get("weight_map") if isinstance(spec, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FileFormatError(
            f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file, got {weight_map!r:.100}"
        )
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise FileFormatError(
                f"{index}: weight_map[{tensor!r:.100}] must be a shard file name (a string), got {name!r:.100}"
            )
    files = []
    for name in sorted(set(weight_map.values())):
        try:  # the name is checked as text first: nothing outside the folder is looked at
            shard = member_file(folder, name, "shard")
        except FileFormatError as err:
            raise FileFormatError(f"{index}: weight_map: {err}") from None
        if not name.endswith(".safetensors"):
            raise FileFormatError(f"{index}: weight_map names the shard {name!r}, not a .safetensors file")
        if not shard.exists():
            raise FileFormatError(f"{index}: weight_map names the shard {name!r}, which is not in {folder}")
        files.append(regular_file(shard, "shard"))
    return files


def safetensors_headers(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint as its header describes it (no tensor data is read).

    Refuses dtypes that are not real-valued weights and a tensor stored in two shards.
    """
    headers: dict[str, TensorInfo] = {}
    for file in shard_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    info = f.get_slice(name)
                    if name in headers:
                        raise FileFormatError(f"{file}: tensor {name} is also in {headers[name].file.name}")
                    if info.get_dtype() not in FLOAT_DTYPES:
                        raise FileFormatError(
                            f"{file}: tensor {name} is stored as {info.get_dtype()}, not as floating-point weights "
                            f"({', '.join(sorted(FLOAT_DTYPES))}); a cast would silently change its values"
                        )
                    headers[name] = TensorInfo(tuple(info.get_shape()), file, name)
        except (SafetensorError, OSError) as err:
            raise FileFormatError(f"{file}: not a readable safetensors file ({err})") from None
    return headers


def read_safetensors(headers: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """The tensors ``headers`` describes (memory-mapped reads, file by file)."""
    by_file: dict[Path, list[str]] = {}
    for name, info in headers.items():
        by_file.setdefault(info.file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for name in names:
                    state[name] = f.get_tensor(name)
                    if not torch.isfinite(state[name]).all():  # no trained weight is inf or NaN: the bytes are damaged
                        raise FileFormatError(f"{file}: tensor {name} holds NaN or infinite values")
        except (SafetensorError, OSError) as err:
            raise FileFormatError(f"{file}: not a readable safetensors file ({err})") from None
    return state


# --------------------------------------------------------------------------- checks and assembly
def check_weights(config: ModelConfig, tensors: dict[str, TensorInfo], config_source: Path, weights_source: Path,
                  layers_key: str) -> None:
    """Check the tensors a checkpoint holds (``tensors``: transformers name -> header info) against
    its config, before any tensor data is read or any module is built.

    The layer count comes first: building even a shapes-only model takes time per layer, so a
    config claiming 200,000 layers over weights that hold 2 is refused before that. Messages name
    ``config_source`` and its ``layers_key`` (``num_hidden_layers``) for the config's side, and
    the file and stored name of a tensor for the weights' side.
    """
    infos: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        short = name.removeprefix("model.")
        if short in infos:
            raise FileFormatError(
                f"{info.file}: tensor {short} is stored twice ({infos[short].stored_as}, {info.stored_as})"
            )
        infos[short] = info

    def shown(name: str) -> str:
        stored = infos[name].stored_as
        return stored if stored.removeprefix("model.") == name else f"{stored} ({name})"

    layers = {name.split(".")[1] for name in infos if name.startswith("layers.") and name.count(".") >= 2}
    if config.n_layers != len(layers):
        raise FileFormatError(
            f"{config_source}: {layers_key}={config.n_layers:,} but the weights hold {len(layers):,} layers"
        )
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied lm_head is listed once
    present = {name for name in infos if not (config.tie_word_embeddings and name == "lm_head.weight")}
    missing = sorted(set(expected) - present)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise FileFormatError(f"{weights_source}: missing tensor(s) {', '.join(missing[:3])}{more}")
    unexpected = sorted(name for name in present - set(expected) if not name.endswith("rotary_emb.inv_freq"))
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise FileFormatError(
            f"{weights_source}: unexpected tensor(s) {', '.join(map(shown, unexpected[:3]))}{more} "
            f"for a {config.architecture} model"
        )
    for name, shape in expected.items():
        if infos[name].shape != shape:
            raise FileFormatError(
                f"{infos[name].file}: tensor {shown(name)} has shape {list(infos[name].shape)}, "
                f"expected {list(shape)} from {config_source.name}"
            )


def check_vocab(source: Path, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Every token id must have a row in the embedding table (the table may have spare rows)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise FileFormatError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding "
            f"table has only {config.vocab_size} rows"
        )


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """Assemble the model from weights that ``check_weights`` accepted.

    The modules are created on the meta device (shapes only) and the real tensors are put in
    their place, so no memory is spent on a random initialisation that would be overwritten.
    """
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    with torch.device("meta"):
        model = Transformer(config)
    weights = {name: state[name].to(device=device, dtype=dtype) for name, _ in model.named_parameters()}
    model.load_state_dict(weights, strict=False, assign=True)  # real tensors replace the meta ones
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.device(device):
        model.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
    return model.eval().requires_grad_(False)  # inference only: no autograd bookkeeping
