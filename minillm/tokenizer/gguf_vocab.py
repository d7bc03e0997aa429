"""The tokenizer stored in a GGUF file's metadata (keys ``tokenizer.ggml.*``), as llama.cpp writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minillm.errors import FileFormatError
from minillm.gguf_io import gguf_fields, open_gguf
from minillm.tokenizer.checks import short, short_repr
from minillm.tokenizer.pretokenize import GGUF_PRE_PATTERNS, PreTokenizer
from minillm.tokenizer.vocab_file import TokenizerFile, is_int, merges_from_strings, vocab_from_strings

# GGUF token types (llama.cpp's llama_token_type)
GGUF_CONTROL = 3
GGUF_USER_DEFINED = 4


def gguf_tokenizer_file(path: Path, fields: dict[str, Any]) -> TokenizerFile:
    """The tokenizer stored in GGUF metadata (keys ``tokenizer.ggml.*``).

    A token's id is its index in ``tokenizer.ggml.tokens``, so the list must not repeat a token
    (the repeat's id would be lost), and ``tokenizer.ggml.token_type``, which marks the special
    tokens, must have one entry per token.
    """

    def need(key: str) -> Any:
        if key not in fields:
            raise FileFormatError(f"{path}: GGUF metadata has no {key!r}")
        return fields[key]

    kind = need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise FileFormatError(f"{path}: tokenizer model {short_repr(kind)} is not supported (minillm reads byte-level BPE, 'gpt2')")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in GGUF_PRE_PATTERNS:
        raise FileFormatError(
            f"{path}: pre-tokenizer {short_repr(pre)} is not supported (known: {', '.join(sorted(GGUF_PRE_PATTERNS))})"
        )
    tokens = need("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise FileFormatError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    types = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or not all(is_int(t) for t in types):
        raise FileFormatError(f"{path}: tokenizer.ggml.token_type must be an array of ints")
    if len(types) != len(tokens):
        raise FileFormatError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {len(tokens)}"
        )
    token_to_id: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in token_to_id:
            raise FileFormatError(
                f"{path}: tokenizer.ggml.tokens[{i}] {short(token)} repeats tokenizer.ggml.tokens[{token_to_id[token]}]"
            )
        token_to_id[token] = i
    special = {tokens[i]: i for i, t in enumerate(types) if t in (GGUF_CONTROL, GGUF_USER_DEFINED)}
    vocab = vocab_from_strings(path, token_to_id, special, "tokenizer.ggml.tokens")
    merges = merges_from_strings(path, need("tokenizer.ggml.merges"), token_to_id, "tokenizer.ggml.merges")

    def role(key: str) -> str | None:
        field = f"tokenizer.ggml.{key}_token_id"
        i = fields.get(field)
        if i is None:
            return None
        if not is_int(i) or not 0 <= i < len(tokens):
            raise FileFormatError(f"{path}: {field} is {short_repr(i)}, not an id below the {len(tokens)} tokens")
        return tokens[i] if tokens[i] in special else None

    chat_template = fields.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise FileFormatError(f"{path}: tokenizer.chat_template must be a string")
    return TokenizerFile(path, {
        "vocab": vocab,
        "merges": merges,
        "special_tokens": special,
        "pretokenizer": PreTokenizer(GGUF_PRE_PATTERNS[pre]),
        "bos_token": role("bos"),
        "eos_token": role("eos"),
        "pad_token": role("padding"),
        "add_bos": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": chat_template,
    })



def read_gguf_tokenizer(path: Path) -> TokenizerFile:
    """The tokenizer of the GGUF file at ``path``. What the system refuses to do with the file
    (``/proc/self/pagemap`` behind a symlink cannot even be measured) names it."""
    try:
        fields = gguf_fields(open_gguf(path))
    except OSError as err:
        raise FileFormatError(f"{path}: cannot be read as a GGUF file ({err.strerror or err})") from None
    return gguf_tokenizer_file(path, fields)
