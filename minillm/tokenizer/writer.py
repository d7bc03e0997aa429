"""Writing a tokenizer as HF ``tokenizer.json`` + ``tokenizer_config.json``, loadable by HF ``tokenizers``.

The writer reads a tokenizer's attributes (``SavableTokenizer``), not the ``Tokenizer`` class, so
``Tokenizer.save`` can build on it without an import back up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from minillm.tokenizer.bytes_unicode import bytes_to_token
from minillm.tokenizer.pretokenize import PreTokenizer


class SavableTokenizer(Protocol):
    """What writing a tokenizer file reads from a tokenizer (``Tokenizer`` has all of it)."""

    vocab: dict[int, bytes]
    merges: list[tuple[int, int]]
    special_tokens: dict[str, int]
    pretokenizer: PreTokenizer
    nfc: bool
    ignore_merges: bool
    add_bos: bool
    add_eos: bool
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    chat_template: str | None

    def id_to_token(self, token_id: int) -> str: ...


def write_tokenizer_file(tokenizer: SavableTokenizer, path: str | Path) -> None:
    """Write ``tokenizer.json`` (loadable by HF ``tokenizers``) and a ``tokenizer_config.json``
    beside it holding the chat template and the BOS/EOS/PAD roles. ``path`` is a ``.json``
    file or a folder (created if needed)."""
    path = Path(path)
    if path.suffix != ".json":  # a folder, existing or not
        path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    special_ids = set(tokenizer.special_tokens.values())
    vocab = {bytes_to_token(data): i for i, data in sorted(tokenizer.vocab.items()) if i not in special_ids}
    vocab.update({content: i for content, i in tokenizer.special_tokens.items() if i in tokenizer.vocab})
    merges = [f"{tokenizer.id_to_token(a)} {tokenizer.id_to_token(b)}" for a, b in tokenizer.merges]
    added = [
        {
            "id": i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for content, i in sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if tokenizer.nfc else None,
        "pre_tokenizer": tokenizer.pretokenizer.to_hf(),
        "post_processor": _template_processor(tokenizer),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": tokenizer.ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    path.write_text(json.dumps(spec, ensure_ascii=False, indent=1), encoding="utf-8")

    def name(token_id: int | None) -> str | None:
        return tokenizer.id_to_token(token_id) if token_id is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tokenizer.bos_id),
        "eos_token": name(tokenizer.eos_id),
        "pad_token": name(tokenizer.pad_id),
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": tokenizer.add_eos,
        "chat_template": tokenizer.chat_template,
    }
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def _template_processor(tokenizer: SavableTokenizer) -> dict[str, Any] | None:
    prefix = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    suffix = [tokenizer.eos_id] if tokenizer.add_eos and tokenizer.eos_id is not None else []
    if not prefix and not suffix:
        return None

    def special(token_id: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": tokenizer.id_to_token(token_id), "type_id": 0}}

    single = [special(i) for i in prefix] + [{"Sequence": {"id": "A", "type_id": 0}}] + [special(i) for i in suffix]
    return {
        "type": "TemplateProcessing",
        "single": single,
        "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            tokenizer.id_to_token(i): {"id": tokenizer.id_to_token(i), "ids": [i], "tokens": [tokenizer.id_to_token(i)]}
            for i in prefix + suffix
        },
    }
