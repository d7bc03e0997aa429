"""The byte-level BPE tokenizer: text <-> token ids.

Encoding runs in three steps: special-token strings (``<|im_start|>``) are cut out first and
map straight to their ids; the rest is pre-tokenized into chunks; each chunk's UTF-8 bytes are
merged pair by pair, always taking the merge that was *learned earliest* (lowest rank), until
no learned pair is left. Decoding concatenates the bytes of each id and decodes them as UTF-8.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import regex

from minillm.tokenizer.bytes_unicode import bytes_to_token
from minillm.tokenizer.pretokenize import PreTokenizer

if TYPE_CHECKING:
    import torch

    from minillm.tokenizer.stream import StreamingDetokenizer

Pair = tuple[int, int]

# Distinct chunks kept in the encode cache before it is emptied (bounds memory on huge inputs).
_CACHE_LIMIT = 500_000


@dataclass
class BatchEncoding:
    """A padded batch: ``input_ids``, ``attention_mask`` (1 = real token) and ``position_ids``.

    Positions count real tokens only, so a left-padded prompt gets the same positions
    (0, 1, 2, ...) as the same prompt alone; pad slots get position 0 and mask 0.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)


class Tokenizer:
    """A byte-level BPE tokenizer (GPT-2, SmolLM2, Llama 3, Qwen2 and the ones you train).

    Args:
        vocab: id -> the bytes that token stands for; normally includes all 256 single bytes.
        merges: learned pairs of ids, in the order they were learned (their *rank*).
        special_tokens: content string -> id, e.g. ``{"<|im_end|>": 2}``. Never produced by
            merges; matched verbatim in the text before pre-tokenization.
        pretokenizer: how text is cut into chunks before merging.
        bos_token, eos_token, pad_token: names of special tokens with those roles, if any.
        add_bos, add_eos: whether ``encode(..., add_special_tokens=True)`` adds them.
        chat_template: a Jinja template for ``apply_chat_template`` (ChatML when absent).
        nfc: normalize text to Unicode NFC before encoding (Qwen2 does).
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[Pair],
        special_tokens: dict[str, int] | None = None,
        pretokenizer: PreTokenizer | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        nfc: bool = False,
    ) -> None:
        for i in [*vocab, *(special_tokens or {}).values()]:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"token ids must be non-negative ints, got {i!r}")
        self.vocab = dict(vocab)
        self.merges = list(merges)
        self.special_tokens = dict(special_tokens or {})
        self.pretokenizer = pretokenizer or PreTokenizer()
        self.chat_template = chat_template
        self.nfc = nfc
        self.add_bos = add_bos
        self.add_eos = add_eos

        bytes_to_id = {data: i for i, data in self.vocab.items()}
        # A vocabulary may lack a few bytes (SmolLM2 has no token for 21 of them, e.g. 0x04):
        # like HF tokenizers without an unk token, encode() then drops those bytes.
        self._byte_ids: list[int | None] = [bytes_to_id.get(bytes([b])) for b in range(256)]
        self.missing_bytes = [b for b, i in enumerate(self._byte_ids) if i is None]

        # rank and result of each merge: (a, b) -> (rank, id of the merged token)
        self._merge_table: dict[Pair, tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            if a not in self.vocab or b not in self.vocab:
                raise ValueError(f"merge #{rank} ({a}, {b}) uses an id that is not in the vocabulary")
            merged = bytes_to_id.get(self.vocab[a] + self.vocab[b])
            if merged is None:
                raise ValueError(
                    f"merge #{rank} {bytes_to_token(self.vocab[a])!r} + {bytes_to_token(self.vocab[b])!r} "
                    "produces a token that is not in the vocabulary"
                )
            self._merge_table.setdefault((a, b), (rank, merged))

        self.vocab_size = 1 + max([*self.vocab, *self.special_tokens.values()])
        self._id_to_bytes: list[bytes | None] = [None] * self.vocab_size
        for i, data in self.vocab.items():
            self._id_to_bytes[i] = data
        for content, i in self.special_tokens.items():
            self._id_to_bytes[i] = content.encode("utf-8")
        self._special_ids = frozenset(self.special_tokens.values())
        self._special_regex = (
            regex.compile("|".join(regex.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)))
            if self.special_tokens
            else None
        )
        self.bos_id = self._role_id("bos_token", bos_token)
        self.eos_id = self._role_id("eos_token", eos_token)
        self.pad_id = self._role_id("pad_token", pad_token)
        self._cache: dict[str, list[int]] = {}

    def _role_id(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        if token not in self.special_tokens:
            raise ValueError(f"{role} {token!r} is not one of the special tokens")
        return self.special_tokens[token]

    # ----------------------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        Special-token strings inside the text (``<|im_end|>``) become their ids, as HF
        ``tokenizers`` does. For untrusted text pass ``parse_special=False``: they are then
        encoded as plain characters, so a user cannot forge a turn of the chat template.
        ``add_special_tokens=True`` adds BOS/EOS where the tokenizer's config asks for them
        (SmolLM2 and GPT-2 add none).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        ids: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        pieces = self._split_special(text) if parse_special else [(text, None)]
        for piece, special_id in pieces:
            if special_id is None:
                self._encode_ordinary(piece, ids)
            else:
                ids.append(special_id)
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _split_special(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yield (piece, None) for ordinary text and (content, id) for each special token."""
        if self._special_regex is None:
            yield text, None
            return
        start = 0
        for match in self._special_regex.finditer(text):
            if match.start() > start:
                yield text[start : match.start()], None
            yield match.group(), self.special_tokens[match.group()]
            start = match.end()
        if start < len(text):
            yield text[start:], None

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        for chunk in self.pretokenizer.split(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._bpe(chunk.encode("utf-8"))
                cache[chunk] = ids
            out.extend(ids)

    def _bpe(self, data: bytes) -> list[int]:
        """Merge the bytes of one chunk: repeatedly apply the lowest-rank learned pair."""
        byte_ids = self._byte_ids
        ids = [byte_ids[b] for b in data if byte_ids[b] is not None]
        table = self._merge_table
        not_learned = (len(table), -1)
        while len(ids) >= 2:
            rank, merged = min(table.get(pair, not_learned) for pair in zip(ids, ids[1:]))
            if merged < 0:
                break
            ids = _merge(ids, self.merges[rank], merged)
        return ids

    # ----------------------------------------------------------------------------- decoding
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8, e.g. half a character, becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of ``ids``: what ``decode`` turns into text."""
        ids = _as_id_list(ids)
        parts = []
        for i in ids:
            data = self._id_to_bytes[i] if 0 <= i < self.vocab_size else None
            if data is None:
                raise ValueError(f"decode(): id {i} is not in the vocabulary (ids go from 0 to {self.vocab_size - 1})")
            if skip_special_tokens and i in self._special_ids:
                continue
            parts.append(data)
        return b"".join(parts)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of an id, as tokenizer files show it (``'Ġthe'``)."""
        data = self._id_to_bytes[token_id] if 0 <= token_id < self.vocab_size else None
        if data is None:
            raise ValueError(f"id {token_id} is not in the vocabulary")
        if token_id in self._special_ids:
            return data.decode("utf-8")
        return bytes_to_token(data)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={len(self.special_tokens)})"
        )

    # ----------------------------------------------------------------------------- batches
    def encode_batch(
        self,
        texts: Sequence[str],
        padding_side: str = "left",
        add_special_tokens: bool = False,
    ) -> BatchEncoding:
        """Encode several texts and pad them to one length.

        Left padding is what generation wants: every prompt then ends at the last column, so
        the next token of every row is predicted from the same position.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"encode_batch() expects a list of str, got {type(texts).__name__}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if not texts:
            raise ValueError("encode_batch() needs at least one text")
        rows = [self.encode(text, add_special_tokens) for text in texts]
        pad_id = self.pad_id if self.pad_id is not None else (self.eos_id or 0)
        return pad_batch(rows, pad_id, padding_side)

    # ----------------------------------------------------------------------------- chat
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        """Format a conversation the way the model was fine-tuned to see it, then encode it."""
        from minillm.tokenizer.chat import render_chat

        text = render_chat(self, messages, add_generation_prompt)
        return self.encode(text) if tokenize else text

    # ----------------------------------------------------------------------------- files
    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json``, a ``.gguf`` file, or a GPT-2 folder (``encoder.json`` + ``vocab.bpe``)."""
        from minillm.tokenizer.files import load_tokenizer

        return load_tokenizer(path)

    def save(self, path: str | Path) -> None:
        """Write an HF-compatible ``tokenizer.json`` (and ``tokenizer_config.json`` beside it)."""
        from minillm.tokenizer.files import save_tokenizer

        save_tokenizer(self, path)

    def streaming_decoder(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        from minillm.tokenizer.stream import StreamingDetokenizer

        return StreamingDetokenizer(self, skip_special_tokens)


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int, padding_side: str = "left") -> BatchEncoding:
    """Pad lists of ids to one length: ``input_ids``, ``attention_mask``, ``position_ids``."""
    import torch

    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = width - len(row) if padding_side == "left" else 0
        span = slice(start, start + len(row))
        input_ids[r, span] = torch.tensor(list(row), dtype=torch.long)
        attention_mask[r, span] = 1
        position_ids[r, span] = torch.arange(len(row))
    return BatchEncoding(input_ids, attention_mask, position_ids)


def _merge(ids: list[int], pair: Pair, merged: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) by ``merged``."""
    a, b = pair
    out: list[int] = []
    i = 0
    n = len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(merged)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _as_id_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # a torch tensor or numpy array
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"decode() expects a sequence of int ids, got {type(ids).__name__}")
    ids = list(ids)
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"decode() expects int ids, got {i!r} ({type(i).__name__})")
    return ids
