"""Opening GGUF files (llama.cpp's format) with the ``gguf`` package, with clear errors.

A GGUF file starts with metadata key/values (architecture, sizes, the whole tokenizer) and
continues with tensor descriptions and data. Both the tokenizer and the model loader read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minillm.errors import FileFormatError


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped), or a FileFormatError naming the file."""
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # gguf raises ValueError, struct.error, IndexError... on bad files
        raise FileFormatError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None


def gguf_fields(reader: Any) -> dict[str, Any]:
    """The metadata key/values of an open GGUF file, as Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}
