"""Reading tokenizer files: HF ``tokenizer.json``, GGUF, and GPT-2's original files.

All three store the same three things: the vocabulary (token string -> id, with bytes shown
through GPT-2's byte<->unicode map), the merges in rank order, and the special tokens. Only
JSON and GGUF are read; nothing is ever unpickled. This module reads the JSON formats and sends
a ``.gguf`` to ``gguf_vocab``; ``writer`` writes ``tokenizer.json``.

These modules know the formats, not the ``Tokenizer`` class: reading a file gives a
``TokenizerFile``, the arguments of ``Tokenizer(...)``. So ``Tokenizer.from_file`` and
``Tokenizer.save`` (in ``bpe``) build on them, and ``files`` holds the same as functions.

A tokenizer file is input like any other, and a small one can be hostile: an id of 10**8 asks
for an 800 MB table, a repeated token silently loses an id, a path may be a FIFO that blocks
forever when opened. So everything read is checked for type and consistency before use, and
every refusal is a ``FileFormatError`` naming the file, the field (as a JSON path or GGUF key)
and the sizes involved.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from minillm.errors import FileFormatError
from minillm.safe_io import existing_path
from minillm.tokenizer.checks import short, short_repr
from minillm.tokenizer.gguf_vocab import read_gguf_tokenizer
from minillm.tokenizer.pretokenize import PreTokenizer
from minillm.tokenizer.vocab_file import (
    TokenizerFile,
    check_vocab_ids,
    is_int,
    merges_from_strings,
    vocab_from_strings,
)

# Larger than any real tokenizer file (Llama 3's tokenizer.json is 9 MB). A sparse file can be
# terabytes long while taking no disk space; reading it whole would exhaust memory.
_MAX_FILE_BYTES = 256 << 20


def read_tokenizer_file(path: str | Path) -> TokenizerFile:
    """Read a tokenizer from a ``tokenizer.json``, a ``.gguf`` file, or a folder holding either
    ``tokenizer.json``, GPT-2's ``encoder.json`` + ``vocab.bpe``, or ``vocab.json`` + ``merges.txt``."""
    path = existing_path(path, "a tokenizer path", "tokenizer", "a tokenizer.json, a .gguf file or a folder of tokenizer files")
    if path.is_dir():
        if _is_regular_file(path / "tokenizer.json"):
            return _load_tokenizer_json(path / "tokenizer.json")
        for vocab_name, merges_name in (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")):
            if _is_regular_file(path / vocab_name) and _is_regular_file(path / merges_name):
                return _load_gpt2_files(path / vocab_name, path / merges_name)
        raise FileNotFoundError(
            f"{path} holds no tokenizer: expected tokenizer.json, encoder.json + vocab.bpe, "
            "or vocab.json + merges.txt"
        )
    _is_regular_file(path)
    if path.suffix == ".gguf":
        return read_gguf_tokenizer(path)
    if path.suffix == ".json":
        return _load_tokenizer_json(path)
    raise FileFormatError(f"{path}: unknown tokenizer file type (expected .json, .gguf or a folder)")


# ------------------------------------------------------------------------------ shared helpers
def _is_regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file; False if it does not exist. Anything else (a FIFO, a
    device, a socket, a folder) is refused *before* opening: opening a FIFO blocks until some
    other process writes to it, which may be never."""
    if path.is_file():
        return True
    if path.exists():
        raise FileFormatError(f"{path}: not a regular file (a folder, FIFO, device or socket); tokenizers are files")
    return False



def _read_text(path: Path) -> str:
    """The UTF-8 text of a regular file.

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a path swapped
    for a FIFO after ``_is_regular_file`` looked at it still cannot block, and a (sparse) file
    of terabytes is refused by its size before a byte is read. The read stops one byte past the
    size ``fstat`` gave: files under ``/proc`` and ``/sys`` say they are empty and are not
    (``/proc/self/pagemap`` holds 8 bytes for every page of the address space), and one that
    holds more than it says is refused. Whatever the system refuses to do names the file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileFormatError(f"{path}: not a regular file (a FIFO, device or socket); tokenizers are files")
            if info.st_size > _MAX_FILE_BYTES:
                raise FileFormatError(f"{path}: {info.st_size} bytes is too large (the limit is {_MAX_FILE_BYTES})")
            data = f.read(info.st_size + 1)
    except OSError as err:
        raise FileFormatError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(data) > info.st_size:
        raise FileFormatError(
            f"{path}: says it holds {info.st_size} bytes but holds more (a special file, such as those under "
            "/proc or /sys); tokenizers are ordinary files"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileFormatError(f"{path}: not UTF-8 text ({err})") from None


class _HugeInt:
    """A JSON integer too long to be an id or a count, kept as its digit count: ``int()`` of
    4300+ digits raises a ValueError that cannot say which file or field it came from, and
    anything longer than ``_MAX_INT_DIGITS`` is refused by the field that holds it instead."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


_MAX_INT_DIGITS = 30


def _parse_int(text: str) -> int | _HugeInt:
    return _HugeInt(len(text.lstrip("-"))) if len(text) > _MAX_INT_DIGITS else int(text)


def _read_json(path: Path) -> Any:
    """Parse a JSON file, refusing duplicate keys: ``json`` keeps the last, silently, so a
    vocabulary listing a token twice would lose one of its ids. Integers of more than 30
    digits become ``_HugeInt``, which every field that wants an int refuses by name."""

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise FileFormatError(f"{path}: the key {short(key)} appears twice in one JSON object")
                seen.add(key)
        return obj

    try:
        return json.loads(_read_text(path), object_pairs_hook=unique_keys, parse_int=_parse_int)
    except json.JSONDecodeError as err:
        raise FileFormatError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise FileFormatError(f"{path}: JSON nested too deeply to parse") from None


# ------------------------------------------------------------------------------ GPT-2's files
def _load_gpt2_files(vocab_path: Path, merges_path: Path) -> TokenizerFile:
    token_to_id = _read_json(vocab_path)
    if not isinstance(token_to_id, dict):
        raise FileFormatError(f"{vocab_path}: expected a JSON object mapping tokens to ids")
    lines = _read_text(merges_path).splitlines()
    lines = [line for line in lines if line and not line.startswith("#version")]
    special = {t: i for t, i in token_to_id.items() if t == "<|endoftext|>"}
    vocab = vocab_from_strings(vocab_path, token_to_id, special, "the vocabulary")
    merges = merges_from_strings(merges_path, lines, token_to_id)
    eos = "<|endoftext|>" if special else None
    arguments = {"vocab": vocab, "merges": merges, "special_tokens": special, "bos_token": eos, "eos_token": eos}
    return TokenizerFile(vocab_path, arguments)


# ------------------------------------------------------------------------------ tokenizer.json
def _load_tokenizer_json(path: Path) -> TokenizerFile:
    spec = _read_json(path)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or "vocab" not in model or "merges" not in model:
        raise FileFormatError(f"{path}: no BPE model with 'vocab' and 'merges' in it")
    if model.get("type", "BPE") != "BPE" or model.get("byte_fallback"):
        raise FileFormatError(f"{path}: model {short_repr(model.get('type'))} is not byte-level BPE (the kind minillm reads)")
    if not isinstance(model["vocab"], dict):
        kind = type(model["vocab"]).__name__
        raise FileFormatError(f"{path}: model.vocab must map token strings to ids, got a {kind}")
    check_vocab_ids(path, model["vocab"], "model.vocab")  # before added_tokens, whose ids follow the vocabulary's
    special = _added_tokens(path, spec.get("added_tokens", []), model["vocab"])
    vocab = vocab_from_strings(path, model["vocab"], special, "model.vocab")
    merges = merges_from_strings(path, model["merges"], model["vocab"], "model.merges")
    _check_bpe_options(path, model, vocab)
    try:
        pretokenizer = PreTokenizer.from_hf(spec.get("pre_tokenizer"))
    except ValueError as err:
        raise FileFormatError(f"{path}: {err}") from None
    normalizer = spec.get("normalizer")
    if normalizer not in (None, {"type": "NFC"}):
        raise FileFormatError(f"{path}: normalizer {short_repr(normalizer)} is not supported (only NFC)")

    config_path = path.parent / "tokenizer_config.json"
    config = _read_json(config_path) if _is_regular_file(config_path) else {}
    if not isinstance(config, dict):
        raise FileFormatError(f"{config_path}: expected a JSON object, got a {type(config).__name__}")
    prefix, suffix = _template_specials(spec.get("post_processor"))
    bos = _token_name(config.get("bos_token")) or (prefix[0] if prefix else None)
    eos = _token_name(config.get("eos_token")) or (suffix[0] if suffix else None)
    return TokenizerFile(path, {
        "vocab": vocab,
        "merges": merges,
        "special_tokens": special,
        "pretokenizer": pretokenizer,
        "bos_token": _present(bos, special),
        "eos_token": _present(eos, special),
        "pad_token": _present(_token_name(config.get("pad_token")), special),
        "add_bos": bool(config.get("add_bos_token", bool(prefix))),
        "add_eos": bool(config.get("add_eos_token", bool(suffix))),
        "chat_template": _chat_template(config_path, config.get("chat_template")),
        "nfc": normalizer is not None,
        "ignore_merges": model.get("ignore_merges") is True,
    })


def _added_tokens(path: Path, entries: Any, model_vocab: dict[str, Any]) -> dict[str, int]:
    """``added_tokens`` of a tokenizer.json: content -> id.

    HF tokenizers does not take these ids from the file: an added token already in
    ``model.vocab`` gets its vocabulary id, and each other one the next id after the
    vocabulary, in file order (with a warning when the file says otherwise). A file whose ids
    disagree with that is inconsistent, and honouring either numbering would give ids that
    differ from HF's or from the model's, so it is refused. The rule also bounds every id by
    the number of tokens actually present.
    """
    if not isinstance(entries, list):
        raise FileFormatError(f"{path}: added_tokens must be a list")
    special: dict[str, int] = {}
    where: dict[str, int] = {}
    next_id = len(model_vocab)
    for n, entry in enumerate(entries):
        field = f"added_tokens[{n}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not is_int(entry.get("id")):
            raise FileFormatError(f"{path}: {field} needs a str 'content' and an int 'id', got {short_repr(entry)}")
        content, token_id = entry["content"], entry["id"]
        if not content:
            raise FileFormatError(f"{path}: {field} (id {token_id}) has empty content, which would match everywhere")
        if content in special:
            raise FileFormatError(f"{path}: {field} {short(content)} repeats added_tokens[{where[content]}]")
        for flag in ("lstrip", "rstrip", "single_word"):
            if entry.get(flag):
                raise FileFormatError(f"{path}: {field} {short(content)} has {flag}=true, which minillm does not support")
        if content in model_vocab:
            expected, rule = model_vocab[content], "its id in model.vocab"
        else:
            expected, rule = next_id, f"the next id after the {len(model_vocab)} entries of model.vocab"
            next_id += 1
        if token_id != expected:
            raise FileFormatError(
                f"{path}: {field} {short(content)} has id {token_id}, but HF tokenizers gives it id {expected} ({rule}; "
                f"{len(model_vocab)} vocabulary entries, {len(entries)} added tokens)"
            )
        special[content] = token_id
        where[content] = n
    return special


def _check_bpe_options(path: Path, model: dict[str, Any], vocab: dict[int, bytes]) -> None:
    """Refuse BPE model options that would change HF's ids in ways minillm does not implement."""
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) not in (None, ""):
            raise FileFormatError(f"{path}: model.{key}={short_repr(model[key])} is not supported (byte-level BPE has none)")
    if model.get("dropout") not in (None, 0, 0.0):
        raise FileFormatError(f"{path}: model.dropout={short_repr(model['dropout'])} is not supported (it makes encoding random)")
    if model.get("unk_token") is not None:
        single_bytes = {data for data in vocab.values() if len(data) == 1}
        missing = [b for b in range(256) if bytes([b]) not in single_bytes]
        if missing:  # HF would emit unk_token for these bytes; minillm drops them (as HF does without one)
            raise FileFormatError(
                f"{path}: model.unk_token={short_repr(model['unk_token'])} with {len(missing)} bytes missing from the "
                f"vocabulary (e.g. 0x{missing[0]:02x}) is not supported"
            )



def _chat_template(path: Path, value: Any) -> str | None:
    """``chat_template`` of tokenizer_config.json: a str, or a list of ``{"name", "template"}``
    of which transformers uses the one named ``default``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        named = {t.get("name"): t["template"] for t in value}
        if "default" in named:
            return named["default"]
        names = sorted(map(short_repr, named))
        raise FileFormatError(f"{path}: chat_template lists templates {short_repr(names)} but none named 'default'")
    raise FileFormatError(f"{path}: chat_template must be a str or a list of {{name, template}}, got {short_repr(value)}")


def _token_name(value: Any) -> str | None:
    """tokenizer_config.json writes a role either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _present(token: str | None, special: dict[str, int]) -> str | None:
    return token if token in special else None


def _template_specials(post_processor: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """Special tokens a TemplateProcessing post-processor puts before and after the text."""
    if not isinstance(post_processor, dict):
        return [], []
    processors = post_processor.get("processors", [post_processor])
    for processor in processors if isinstance(processors, list) else []:
        if isinstance(processor, dict) and processor.get("type") == "TemplateProcessing":
            prefix: list[str] = []
            suffix: list[str] = []
            seen_text = False
            single = processor.get("single")
            for piece in single if isinstance(single, list) else []:
                if not isinstance(piece, dict):
                    continue
                if "Sequence" in piece:
                    seen_text = True
                elif isinstance(piece.get("SpecialToken"), dict) and isinstance(piece["SpecialToken"].get("id"), str):
                    (suffix if seen_text else prefix).append(piece["SpecialToken"]["id"])
            return prefix, suffix
    return [], []
