"""Reading GGUF files (llama.cpp's format), with every declared size checked against the file.

Layout (little-endian)::

    "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count    x  key (string) | value type u32 | value
    tensor_count x name (string) | n_dims u32 | dims u64[n_dims] (innermost first) | ggml type u32 | offset u64
    padding up to general.alignment (default 32)
    tensor data: each tensor at data_offset + its offset

A string is a u64 byte count then that many UTF-8 bytes; an array is an item type u32, a u64
item count, then the items. Every count is *declared by the file*: 51 bytes can declare an
array of 2**60 items, and a reader that believes it loops for ever while its memory grows
(``gguf.GGUFReader`` does exactly that). This reader compares each declared size with the bytes
that actually remain *before* it loops or allocates, so its time and memory are bounded by the
size of the file, whatever the file says.

The tensor data is not read here: each tensor is a read-only view into a memory map of the file,
decoded later by ``gguf.quants.dequantize``. The objects mirror the parts of ``gguf.GGUFReader``
minillm uses (``tensors`` with ``name``, ``tensor_type``, ``shape``, ``n_elements``, ``n_bytes``,
``data``; ``data_offset``), with metadata values already turned into Python values.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from minillm.errors import FileFormatError
from minillm.safe_io import open_regular

HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor_count, kv_count
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most 4 dimensions
MAX_NAME = 63  # GGML_MAX_NAME - 1: llama.cpp refuses longer tensor names too

# Absolute caps, far above any real model, so that even a file whose sizes are all consistent
# cannot make the reader build unbounded Python objects (each value becomes a Python str or
# int, ~10x its size in the file; 2**21 short strings take ~120 MB). Real models: tens of
# metadata keys, a few thousand tensors, and under a million metadata values (a byte-level
# vocabulary, its token types and its merges).
MAX_KEYS = 2**16
MAX_TENSORS = 2**16
MAX_VALUES = 2**21  # in all the metadata together (an array of n items counts n)

# GGUF value types -> (name, numpy dtype); 8 = STRING and 9 = ARRAY have no fixed size.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    0: ("UINT8", np.dtype("<u1")), 1: ("INT8", np.dtype("<i1")), 2: ("UINT16", np.dtype("<u2")),
    3: ("INT16", np.dtype("<i2")), 4: ("UINT32", np.dtype("<u4")), 5: ("INT32", np.dtype("<i4")),
    6: ("FLOAT32", np.dtype("<f4")), 7: ("BOOL", np.dtype("<u1")), 10: ("UINT64", np.dtype("<u8")),
    11: ("INT64", np.dtype("<i8")), 12: ("FLOAT64", np.dtype("<f8")),
}
_BOOL = 7

# The smallest possible records, to bound the declared counts before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims = 1, one dimension, type, offset

# Tensor types whose data the reader exposes as typed arrays; the others (quantized blocks,
# bfloat16) are exposed as uint8 rows of blocks, as gguf.GGUFReader does.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its description, and its bytes as a read-only array view."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF stores it (reverse it for torch)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # typed for float/int tensors; uint8 [..., bytes per row] for quantized ones


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: metadata as Python values, tensors as views into the memory map."""

    path: Path
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the tensor data section starts


def open_gguf(path: Path) -> GGUFFile:
    """Parse the GGUF file at ``path``, or raise a FileFormatError naming it and what is wrong.

    Only a regular file is opened (see ``minillm.safe_io``). Anything malformed — a count or
    length larger than the rest of the file, an unknown type, a tensor past the end — is a
    ``FileFormatError`` beginning ``{path}: not a readable GGUF file``.
    """
    with open_regular(path, "GGUF file") as f:
        size = f.seek(0, 2)
        if size < HEADER.size:
            raise _bad(path, f"{size} bytes, shorter than the {HEADER.size}-byte GGUF header")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    return _Parser(path, buffer).parse()


def gguf_fields(reader: GGUFFile) -> dict[str, Any]:
    """The metadata key/values of an open GGUF file, as Python values (str, int, float, bool, lists)."""
    return reader.fields


def _bad(path: Path, detail: str) -> FileFormatError:
    return FileFormatError(f"{path}: not a readable GGUF file ({detail})")


class _Parser:
    """A cursor over the file's bytes; each read first checks that the bytes are there."""

    def __init__(self, path: Path, buffer: mmap.mmap):
        self.path = path
        self.buffer = buffer
        self.bytes = np.frombuffer(buffer, dtype=np.uint8)
        self.size = len(buffer)
        self.pos = 0
        self.items_left = MAX_VALUES

    def fail(self, detail: str, at: int | None = None) -> FileFormatError:
        return _bad(self.path, f"{detail}, at byte {self.pos if at is None else at:,} of {self.size:,}")

    def take_items(self, count: int, key: str) -> None:
        """Count ``count`` values against the file's allowance (``MAX_VALUES``)."""
        if count > self.items_left:
            raise self.fail(f"{key} has {count:,} values: more than the {MAX_VALUES:,} "
                            "a GGUF file's metadata may hold in all")
        self.items_left -= count

    def need(self, n: int, what: str) -> None:
        """Refuse to read ``n`` bytes that the file does not have."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n:,} bytes but only {self.size - self.pos:,} remain")

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        self.need(fmt.size, what)
        values = fmt.unpack_from(self.buffer, self.pos)
        self.pos += fmt.size
        return values

    def u32(self, what: str) -> int:
        return self.unpack(_U32, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack(_U64, what)[0]

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        self.need(length, what)
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(f"{what} is not UTF-8 ({err.reason} at byte {err.start})") from None

    # ------------------------------------------------------------------ metadata
    def value(self, value_type: int, key: str) -> Any:
        """The value of metadata ``key`` (as the messages show it), of GGUF type ``value_type``."""
        if value_type == _STRING:
            return self.string(f"the value of {key}")
        if value_type == _ARRAY:
            return self.array(key)
        if value_type not in _SCALARS:
            raise self.fail(f"{key} has unknown value type {value_type}")
        return self.items(value_type, 1, key)[0]

    def items(self, item_type: int, count: int, key: str) -> list[Any]:
        """``count`` fixed-size values of one type, read in one go (no loop in Python)."""
        type_name, dtype = _SCALARS[item_type]
        self.need(count * dtype.itemsize, f"{key} ({count:,} x {type_name})")
        self.take_items(count, key)
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return (values != 0 if item_type == _BOOL else values).tolist()

    def array(self, key: str) -> list[Any]:
        item_type = self.u32(f"the item type of {key}")
        count = self.u64(f"the item count of {key}")
        if item_type == _STRING:
            return self.strings(count, key)
        if item_type == _ARRAY:  # llama.cpp refuses nested arrays too
            raise self.fail(f"{key} is an array of arrays, which GGUF readers do not support")
        if item_type not in _SCALARS:
            raise self.fail(f"{key} is an array of unknown value type {item_type}")
        return self.items(item_type, count, key)

    def strings(self, count: int, key: str) -> list[str]:
        """``count`` strings in a row: the vocabulary and the merges, the one hot loop of the header.

        Each string costs at least its 8-byte length, so the count is checked first; each length
        is checked as it is read. The loop is written tight (no per-item method calls or
        messages) because real files hold ~10^5 strings and a crafted one millions.
        """
        self.need(count * 8, f"{key} ({count:,} strings)")
        self.take_items(count, key)
        view, size, unpack = memoryview(self.buffer), self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        pos = self.pos
        for i in range(count):
            if size - pos < 8:
                raise self.fail(f"the length of {key}[{i}] needs 8 bytes but only {size - pos} remain", at=pos)
            end = pos + 8 + unpack(view, pos)[0]
            if end > size:
                raise self.fail(f"{key}[{i}] needs {end - pos - 8:,} bytes but only {size - pos - 8:,} remain", at=pos)
            try:
                append(str(view[pos + 8 : end], "utf-8"))
            except UnicodeDecodeError as err:
                raise self.fail(f"{key}[{i}] is not UTF-8 ({err.reason} at byte {err.start})", at=pos) from None
            pos = end
        self.pos = pos
        return out

    # ------------------------------------------------------------------ tensors
    def tensor_info(self, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string(f"the name of tensor #{index}")
        if len(name.encode()) > MAX_NAME:
            raise self.fail(f"the name of tensor #{index} {name!r:.100} is longer than {MAX_NAME} bytes")
        n_dims = self.u32(f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name} declares {n_dims:,} dimensions (ggml tensors have 1 to {MAX_DIMS})")
        dims = self.unpack(struct.Struct(f"<{n_dims}Q"), f"the dimensions of tensor {name}")
        raw_type = self.u32(f"the type of tensor {name}")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(f"tensor {name} has unknown ggml type {raw_type}") from None
        offset = self.u64(f"the data offset of tensor {name}")
        return name, dims, tensor_type, offset

    def tensor(self, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType, offset: int,
               data_offset: int, alignment: int) -> GGUFTensor:
        """Check that the tensor's bytes lie inside the file, then view them (nothing is copied)."""
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if 0 in dims:  # an empty tensor is no weight; and with one 0, the other dims could be anything
            raise _bad(self.path, f"tensor {name} has a dimension of 0 (shape {list(dims)})")
        n_elements = math.prod(dims)  # a Python int: no overflow, however large the dims
        if dims[0] % block_size:
            raise _bad(self.path, f"tensor {name}: rows of {dims[0]} values are not whole "
                                  f"{tensor_type.name} blocks of {block_size}")
        if offset % alignment:
            raise _bad(self.path, f"tensor {name}: data offset {offset:,} is not a multiple of the alignment "
                                  f"{alignment}")
        n_bytes = n_elements // block_size * type_size
        start = data_offset + offset
        if start + n_bytes > self.size:
            raise _bad(self.path, f"tensor {name} ({tensor_type.name}, shape {list(dims)}) needs bytes "
                                  f"{start:,}..{start + n_bytes:,} but the file has {self.size:,}")
        torch_order = tuple(reversed(dims))
        if tensor_type in _PLAIN_DTYPES:
            data = self.bytes[start : start + n_bytes].view(_PLAIN_DTYPES[tensor_type]).reshape(torch_order)
        else:
            data = self.bytes[start : start + n_bytes].reshape(quant_shape_to_byte_shape(torch_order, tensor_type))
        return GGUFTensor(name, tensor_type, dims, n_elements, n_bytes, start, data)

    # ------------------------------------------------------------------ the whole file
    def parse(self) -> GGUFFile:
        magic, version, tensor_count, kv_count = self.unpack(HEADER, "the header")
        if magic != b"GGUF":
            raise self.fail(f"starts with {magic!r}, not the magic b'GGUF'")
        if version & 0xFFFF == 0 and version:
            raise self.fail("a big-endian GGUF file (only little-endian files are supported)")
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        self.need(kv_count * _MIN_KV_BYTES, f"{kv_count:,} metadata key/values")
        if kv_count > MAX_KEYS:
            raise self.fail(f"{kv_count:,} metadata key/values, more than the {MAX_KEYS:,} a GGUF file may hold")
        fields: dict[str, Any] = {}
        for i in range(kv_count):
            key = self.string(f"metadata key #{i}")
            shown = f"{key!r:.100}"  # quoted, and short: a key can be any UTF-8, of any length
            if key in fields:
                raise self.fail(f"metadata key {shown} appears twice")
            fields[key] = self.value(self.u32(f"the value type of {shown}"), shown)
        self.need(tensor_count * _MIN_TENSOR_INFO_BYTES, f"{tensor_count:,} tensor descriptions")
        if tensor_count > MAX_TENSORS:
            raise self.fail(f"{tensor_count:,} tensors, more than the {MAX_TENSORS:,} a GGUF file may hold")
        infos = [self.tensor_info(i) for i in range(tensor_count)]
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):  # bool is no alignment
            raise self.fail(f"general.alignment is {alignment!r}, not a power of two")
        data_offset = -(-self.pos // alignment) * alignment  # the next multiple of the alignment
        tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, tensor_type, offset in infos:
            if name in names:
                raise self.fail(f"tensor {name} appears twice")
            names.add(name)
            tensors.append(self.tensor(name, dims, tensor_type, offset, data_offset, alignment))
        # Two tensors sharing bytes is no file llama.cpp writes: one of them would be wrong (the
        # safetensors reader refuses the same).
        by_start = sorted(tensors, key=lambda t: t.data_offset)
        for before, after in zip(by_start, by_start[1:]):
            if after.data_offset < before.data_offset + before.n_bytes:
                raise _bad(self.path, f"tensors {before.name} (bytes {before.data_offset:,}..{before.data_offset + before.n_bytes:,}) "
                                      f"and {after.name} (from byte {after.data_offset:,}) overlap")
        return GGUFFile(self.path, version, fields, tensors, alignment, data_offset)


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
