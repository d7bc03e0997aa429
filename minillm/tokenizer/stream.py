"""Streaming detokenization: turn ids into text one at a time, never emitting half a character.

A token is a run of *bytes*, not characters: ``"é"`` is two UTF-8 bytes and an emoji four, and
BPE may put them in different tokens. Decoding each token on its own would print U+FFFD
garbage mid-stream. The fix is a byte buffer that only releases complete characters: Python's
incremental UTF-8 decoder does exactly that, and it is guaranteed to produce the same text as
decoding all bytes at once, so the concatenated pieces always equal ``decode(ids)``.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol


class DecodesBytes(Protocol):
    """What streaming needs from a tokenizer: the bytes of some ids (``Tokenizer`` has it)."""

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes: ...


class StreamingDetokenizer:
    """Push ids one at a time, get back only the text that is complete; ``flush()`` at the end."""

    def __init__(self, tokenizer: DecodesBytes, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (often ``""`` mid-character)."""
        data = self.tokenizer.decode_bytes([token_id], self.skip_special_tokens)
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: whatever is left (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they do not yet form a complete character."""
        return self._decoder.getstate()[0]
