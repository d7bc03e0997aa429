"""Wrong answers to notebook 02's exercises, each the code a learner might write.

The byte map, the missing bytes, the padded batch and the chat template have wrong functions.
The streaming detokenizer has wrong classes: ``Lookback`` is the right mechanism (a byte buffer,
released up to the last complete character) and each other class changes one piece of it, or
skips the buffer altogether. ``nb02`` names a mistake when a learner's answer equals one of these
on the failing case, and ``tests/02_real_tokenizers/test_exercises.py`` feeds every one to its check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.tokenizer.bytes_unicode import bytes_to_unicode
from minillm.tokenizer.padding import pad_batch

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def utf8_of_the_string(token: str) -> bytes:
    return token.encode("utf-8")


def del_kept(token: str) -> bytes:
    """The byte map with DEL (0x7F) wrongly kept as printable: every later shifted byte moves by one."""
    keep = [*range(0x21, 0x80), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}
    return bytes(char_to_byte[c] for c in token)


def missing_by_substring(tokens: list[str]) -> list[int]:
    text = "".join(tokens)
    return [b for b in range(256) if bytes_to_unicode()[b] not in text]


def missing_raw_chars(tokens: list[str]) -> list[int]:
    present = set(tokens)
    return [b for b in range(256) if chr(b) not in present]


def as_tuple(rows: list[list[int]], pad_id: int, side: str) -> Batch:
    batch = pad_batch(rows, pad_id, side)
    return batch.input_ids, batch.attention_mask, batch.position_ids


def right_padded(rows: list[list[int]], pad_id: int) -> Batch:
    return as_tuple(rows, pad_id, "right")


def positions_count_pads(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = as_tuple(rows, pad_id, "left")
    return input_ids, mask, torch.arange(input_ids.shape[1]).expand_as(input_ids).clone()


def positions_start_after_pads(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = as_tuple(rows, pad_id, "left")
    return input_ids, mask, torch.arange(input_ids.shape[1]).expand_as(input_ids) * mask


def mask_from_ids(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, _, positions = as_tuple(rows, pad_id, "left")
    return input_ids, (input_ids != pad_id).long(), positions


def mask_and_positions_from_ids(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, _, _ = as_tuple(rows, pad_id, "left")
    mask = (input_ids != pad_id).long()
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0) * mask


def pads_at_minus_one(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = as_tuple(rows, pad_id, "left")
    return input_ids, mask, mask.cumsum(-1) - 1


def turns(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def chat_no_default_system(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return turns(messages) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_always_default_system(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    return turns(messages) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_no_generation_prompt(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    return turns(messages)


def chat_no_newline_after_end(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# --- the streaming detokenizer -------------------------------------------------------------------


def utf8_length(lead: int) -> int:
    """Bytes in the character that starts with ``lead`` (1 for ASCII and for anything invalid)."""
    if 0xC0 <= lead < 0xE0:
        return 2
    if 0xE0 <= lead < 0xF0:
        return 3
    if 0xF0 <= lead < 0xF8:
        return 4
    return 1


class Lookback:
    """The right mechanism: hold back the bytes of a character that is not complete yet."""

    errors = "replace"

    def __init__(self, id_to_bytes: Sequence[bytes]) -> None:
        self.id_to_bytes, self.buffer = id_to_bytes, b""

    def push(self, token_id: int) -> str:
        self.buffer += self.id_to_bytes[token_id]
        return self._release(self._complete())

    def flush(self) -> str:
        return self._release(len(self.buffer))

    def _complete(self) -> int:
        """How many bytes of the buffer end on a whole character."""
        for back in range(1, min(4, len(self.buffer)) + 1):
            byte = self.buffer[-back]
            if byte & 0xC0 != 0x80:  # the last byte that starts a character
                return len(self.buffer) - back if utf8_length(byte) > back else len(self.buffer)
        return len(self.buffer)

    def _release(self, cut: int) -> str:
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out.decode("utf-8", errors=self.errors)


class DecodesEachToken(Lookback):
    """No buffer: each token's bytes decoded on their own."""

    def push(self, token_id: int) -> str:
        return self.id_to_bytes[token_id].decode("utf-8", errors="replace")


class HoldsUntilFlush(Lookback):
    """Buffers everything and emits nothing until the stream ends."""

    def push(self, token_id: int) -> str:
        self.buffer += self.id_to_bytes[token_id]
        return ""


class HoldsWhileNotAscii(Lookback):
    """Holds the buffer while its last byte is not ASCII: a finished 東 waits for the next ASCII byte."""

    def _complete(self) -> int:
        return 0 if self.buffer and self.buffer[-1] >= 0x80 else len(self.buffer)


class LooksAtTheLastByteOnly(Lookback):
    """Holds a trailing lead byte, but releases a buffer that ends in a continuation byte."""

    def _complete(self) -> int:
        return len(self.buffer) - 1 if self.buffer and self.buffer[-1] >= 0xC0 else len(self.buffer)


class DropsTheTailAtFlush(Lookback):
    """Forgets the held bytes at the end of the stream."""

    def flush(self) -> str:
        self.buffer = b""
        return ""


class DecodesStrictly(Lookback):
    """``bytes.decode("utf-8")`` with the default errors="strict"."""

    errors = "strict"


class IgnoresInvalidBytes(Lookback):
    """``errors="ignore"``: invalid bytes vanish instead of showing as U+FFFD."""

    errors = "ignore"
