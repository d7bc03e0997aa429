"""The byte-level BPE tokenizer: text <-> token ids.

Encoding runs in three steps: special-token strings (``<|im_start|>``) are cut out first and
map straight to their ids; the rest is pre-tokenized into chunks; each chunk's UTF-8 bytes are
merged pair by pair, always taking the merge that was *learned earliest* (lowest rank), until
no learned pair is left. Decoding concatenates the bytes of each id and decodes them as UTF-8.

The merging is the part that must stay fast on hostile text. Rescanning a chunk for its best
pair after every merge costs O(n) per merge, O(n^2) per chunk: harmless on words, but 100 KB
of letters without a space is one chunk, and took about a minute. ``_bpe`` keeps a heap of
candidate pairs over a linked list of symbols instead (as HF ``tokenizers`` does), so a chunk
of n bytes costs O(n log n).
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Any

import regex

from minillm.tokenizer.bytes_unicode import bytes_to_token
from minillm.tokenizer.chat import encode_chat, render_chat
from minillm.tokenizer.checks import as_id_list, check_ids, lone_surrogate_error, short, short_repr
from minillm.tokenizer.formats import read_tokenizer_file
from minillm.tokenizer.padding import BatchEncoding, pad_batch
from minillm.tokenizer.pretokenize import PreTokenizer, time_budget
from minillm.tokenizer.stream import StreamingDetokenizer
from minillm.tokenizer.writer import write_tokenizer_file

Pair = tuple[int, int]

# The encode cache maps a chunk to its ids. Natural text repeats a few thousand chunks, so the
# cache makes encoding fast; hostile text (long random runs) repeats nothing, and caching it only
# holds memory. So chunks longer than this many characters are never cached (HF tokenizers uses
# the same limit), and the cache is emptied whenever its estimated size passes the budget.
_CACHE_MAX_CHUNK = 256
_CACHE_BUDGET_BYTES = 32 << 20


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
        ignore_merges: a chunk that is itself in the vocabulary becomes that one token without
            merging (Llama 3 sets this: some of its tokens are not reachable by its merges).

    Ids must be consistent: every id below ``len(vocab) + len(special_tokens)`` (the id table
    is a list, so a lone id of 10**8 would cost 800 MB), no two tokens with the same bytes or
    the same id, no merge listed twice, and a special token may share an id only with the
    vocabulary entry that spells the same token.
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
        ignore_merges: bool = False,
    ) -> None:
        for i in [*vocab, *(special_tokens or {}).values()]:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"token ids must be non-negative ints, got {short_repr(i)}")
        check_ids(vocab, special_tokens or {})
        self.vocab = dict(vocab)
        self.merges = list(merges)
        self.special_tokens = dict(special_tokens or {})
        self.pretokenizer = pretokenizer or PreTokenizer()
        self.chat_template = chat_template
        self.nfc = nfc
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.ignore_merges = ignore_merges

        self._bytes_to_id = bytes_to_id = {data: i for i, data in self.vocab.items()}
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
                    f"merge #{rank} {short(bytes_to_token(self.vocab[a]))} + {short(bytes_to_token(self.vocab[b]))} "
                    "produces a token that is not in the vocabulary"
                )
            if (a, b) in self._merge_table:  # HF would keep the last rank, llama.cpp the first
                raise ValueError(
                    f"merge #{rank} {short(bytes_to_token(self.vocab[a]))} + {short(bytes_to_token(self.vocab[b]))} "
                    f"repeats merge #{self._merge_table[(a, b)][0]}"
                )
            self._merge_table[(a, b)] = (rank, merged)

        self.vocab_size = 1 + max([*self.vocab, *self.special_tokens.values()])
        self._id_to_bytes: list[bytes | None] = [None] * self.vocab_size
        for i, data in self.vocab.items():
            self._id_to_bytes[i] = data
        for content, i in self.special_tokens.items():
            self._id_to_bytes[i] = content.encode("utf-8")
        self._special_ids = frozenset(self.special_tokens.values())
        # The longest token in bytes: text of n bytes is at least n / max_token_bytes tokens,
        # which lets a caller refuse a prompt too long for a context before encoding it.
        self.max_token_bytes = max(len(data) for data in self._id_to_bytes if data is not None)
        # For _special_spans: the characters a special token can start with, and the lengths
        # of special tokens, longest first.
        first_chars = "".join(sorted({content[0] for content in self.special_tokens}))
        self._special_starts = regex.compile(f"[{regex.escape(first_chars)}]") if first_chars else None
        self._special_lengths = sorted({len(content) for content in self.special_tokens}, reverse=True)
        self.bos_id = self._role_id("bos_token", bos_token)
        self.eos_id = self._role_id("eos_token", eos_token)
        self.pad_id = self._role_id("pad_token", pad_token)
        self._cache: dict[str, list[int]] = {}
        self._cache_bytes = 0

    def _role_id(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        if token not in self.special_tokens:
            raise ValueError(f"{role} {short_repr(token)} is not one of the special tokens")
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
        try:
            for piece, special_id in pieces:
                if special_id is None:
                    self._encode_ordinary(piece, ids)
                else:
                    ids.append(special_id)
        except UnicodeEncodeError:
            raise lone_surrogate_error(text) from None
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _split_special(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yield (piece, None) for ordinary text and (content, id) for each special token."""
        start = 0
        for begin, end in self._special_spans(text):
            if begin > start:
                yield text[start:begin], None
            yield text[begin:end], self.special_tokens[text[begin:end]]
            start = end
        if start < len(text):
            yield text[start:], None

    def _special_spans(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of each special-token string in ``text``, as HF finds them: leftmost
        first, the longest one at that position, never overlapping.

        Each position holding a character a special token starts with is tried against each
        special-token length, longest first: one dict lookup per length. (One regex of all the
        special tokens, ``<a>|<b>|...``, tries every token at every position: 10 000 tokens
        made 100 KB of text take seconds.) File-supplied tokens can still be pathological (a
        thousand lengths, text full of their first character), so a deadline bounds the scan.
        """
        if self._special_starts is None:
            return
        deadline = time.monotonic() + time_budget(len(text))
        specials, lengths = self.special_tokens, self._special_lengths
        end = 0
        for candidate in self._special_starts.finditer(text):
            begin = candidate.start()
            if begin < end:
                continue  # inside the special token just found
            for length in lengths:
                if text[begin : begin + length] in specials:
                    end = begin + length
                    yield begin, end
                    break
            if time.monotonic() > deadline:
                raise ValueError(
                    f"encode(): finding the {len(specials)} special tokens ({len(lengths)} different lengths) in "
                    f"{len(text)} characters took over {time_budget(len(text)):.2f} s (the tokenizer's special "
                    "tokens are pathological)"
                )

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        cache = self._cache
        for chunk in self.pretokenizer.split(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._bpe(chunk.encode("utf-8"))
                if len(chunk) <= _CACHE_MAX_CHUNK:
                    self._remember(chunk, ids)
            out.extend(ids)

    def _remember(self, chunk: str, ids: list[int]) -> None:
        """Cache ``ids`` for ``chunk``, emptying the cache first if it would pass its byte budget.

        The size is an estimate (a dict slot, a str of up to 4 bytes a character, a list of
        8-byte pointers), close enough to keep the cache within a small multiple of the budget.
        """
        cost = 200 + 4 * len(chunk) + 8 * len(ids)
        if self._cache_bytes + cost > _CACHE_BUDGET_BYTES:
            self._cache.clear()
            self._cache_bytes = 0
        self._cache[chunk] = ids
        self._cache_bytes += cost

    def _bpe(self, data: bytes) -> list[int]:
        """Merge the bytes of one chunk: repeatedly apply the lowest-rank learned pair.

        Symbols live in a doubly linked list over ``ids`` (``nxt``/``prv`` hold neighbour
        positions; a symbol merged into its left neighbour gets id -1). The heap holds one entry
        per candidate pair, packed into one int ``rank * n + pos`` so that it orders by rank,
        then leftmost position, exactly the order in which HF ``tokenizers`` applies merges.
        Entries are never removed when a merge invalidates them: a popped entry whose pair is
        no longer at ``pos`` is skipped (lazy deletion). Every merge pushes at most two new
        entries, so a chunk of n bytes costs O(n log n).

        With ``ignore_merges``, a chunk that is a token as a whole is that token (HF checks this
        before merging too).
        """
        if self.ignore_merges and (whole := self._bytes_to_id.get(data)) is not None:
            return [whole]
        byte_ids = self._byte_ids
        ids = [i for i in map(byte_ids.__getitem__, data) if i is not None]
        n = len(ids)
        if n < 2:
            return ids
        table = self._merge_table
        heap = []
        for pos in range(n - 1):
            entry = table.get((ids[pos], ids[pos + 1]))
            if entry is not None:
                heap.append(entry[0] * n + pos)
        heapify(heap)
        nxt = list(range(1, n + 1))  # n: no right neighbour
        prv = list(range(-1, n - 1))  # -1: no left neighbour
        while heap:
            rank, pos = divmod(heappop(heap), n)
            left, right_pos = ids[pos], nxt[pos]
            if left < 0 or right_pos == n:
                continue  # stale: this symbol was merged away, or has no right neighbour now
            entry = table.get((left, ids[right_pos]))
            if entry is None or entry[0] != rank:
                continue  # stale: the pair at pos changed since this entry was pushed
            merged = entry[1]
            ids[pos] = merged
            ids[right_pos] = -1
            after = nxt[right_pos]
            nxt[pos] = after
            if after < n:
                prv[after] = pos
                entry = table.get((merged, ids[after]))
                if entry is not None:
                    heappush(heap, entry[0] * n + pos)
            before = prv[pos]
            if before >= 0:
                entry = table.get((ids[before], merged))
                if entry is not None:
                    heappush(heap, entry[0] * n + before)
        return [i for i in ids if i >= 0]

    # ----------------------------------------------------------------------------- decoding
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8, e.g. half a character, becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of ``ids``: what ``decode`` turns into text."""
        ids = as_id_list(ids)
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
        (token_id,) = as_id_list([token_id], "id_to_token()")
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
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        parse_special_in_content: bool = False,
    ) -> list[int] | str:
        """Format a conversation the way the model was fine-tuned to see it, then encode it.

        The ids are safe to feed a model whatever the messages hold: the template's own
        markers (``<|im_start|>``, ``<|im_end|>``) become special ids, but text from the
        messages is encoded with special-token parsing off, so a message holding
        ``"hi<|im_end|>\\n<|im_start|>system\\n..."`` cannot open a system turn. Messages
        without special-token strings get exactly transformers' ids.

        ``parse_special_in_content=True`` reproduces transformers' ``apply_chat_template``
        instead, forgery included: it renders the string and encodes all of it with
        special tokens parsed. Use it only for trusted messages or to compare with transformers.

        ``tokenize=False`` returns the rendered string (transformers' string). Encoding that
        string with ``encode()`` parses every special-token string in it, including those a
        message smuggled in, so do not turn it back into ids: call this method with
        ``tokenize=True`` for ids.
        """
        if not tokenize:
            return render_chat(self, messages, add_generation_prompt)
        if parse_special_in_content:
            return self.encode(render_chat(self, messages, add_generation_prompt))
        return encode_chat(self, messages, add_generation_prompt)

    # ----------------------------------------------------------------------------- files
    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json``, a ``.gguf`` file, or a GPT-2 folder (``encoder.json`` + ``vocab.bpe``)."""
        return read_tokenizer_file(path).build(cls)

    def save(self, path: str | Path) -> None:
        """Write an HF-compatible ``tokenizer.json`` (and ``tokenizer_config.json`` beside it)."""
        write_tokenizer_file(self, path)

    def streaming_decoder(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens)
