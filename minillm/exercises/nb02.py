"""Exercises of notebook 02 (real tokenizers): GPT-2's byte map, the bytes a vocabulary lacks,
left padding with positions, SmolLM2's chat template, and the streaming detokenizer's push/flush.

The expected answers come from the package: ``bytes_unicode.token_to_bytes``, SmolLM2's
``Tokenizer`` read from the GGUF file (``missing_bytes``, ``apply_chat_template``),
``pad_batch`` (the function behind ``Tokenizer.encode_batch``) and ``StreamingDetokenizer``.
Each classic mistake is written out as the code a learner would write (the wrong streamers in
``nb02_mistakes``), so a wrong answer of that kind is named. The ``*_solution`` functions at the
end are one way to solve each exercise.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from minillm.assets import default_gguf_path
from minillm.exercises import Mistake, check
from minillm.exercises import nb02_mistakes as wrong
from minillm.tokenizer import Tokenizer
from minillm.tokenizer.bytes_unicode import bytes_to_unicode, token_to_bytes
from minillm.tokenizer.padding import pad_batch
from minillm.tokenizer.stream import StreamingDetokenizer

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@cache
def _smollm2() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read from its GGUF file once (~2 s)."""
    return Tokenizer.from_file(default_gguf_path())


# --- exercise 1: token_to_bytes ------------------------------------------------------------------


def _token_cases() -> list[tuple[tuple[str], bytes]]:
    tokens = ["Ġthe", "ĊĊ", "Ã©", "ðŁ¦Ļ", "ĉĠĸ", "Ń", "Ā", "ġ", "ł", "ÿ"]
    return [((t,), token_to_bytes(t)) for t in tokens]


TOKEN_MISTAKES = [
    Mistake(
        wrong.utf8_of_the_string,
        "you UTF-8-encoded the token string. Each character stands for one byte through the byte map: "
        "'Ġ' (U+0120) is the byte 0x20, not the two bytes c4 a0.",
    ),
    Mistake(
        wrong.del_kept,
        "DEL (0x7F) is not printable: it is shifted too (to 'ġ', U+0121), so the printable ASCII run is "
        "'!'..'~' = range(0x21, 0x7F).",
    ),
]

TOKEN_HINTS = [
    "Build the byte -> character map first (256 entries), then invert it and look up each character.",
    "keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]; every other byte, in increasing "
    "order, gets chr(256), chr(257), ...",
    "char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(b for b in range(256) "
    "if b not in keep)}; return bytes(char_to_byte[c] for c in token)",
]


def check_token_to_bytes(fn: Callable[[str], bytes], hint: int = 0) -> bool:
    """``fn(token)`` -> the bytes a GPT-2-style vocabulary string stands for (``'Ġthe'`` -> ``b' the'``)."""
    return check("token_to_bytes", fn, _token_cases(), hint=hint, hints=TOKEN_HINTS, mistakes=TOKEN_MISTAKES)


# --- exercise 2: missing_single_bytes ------------------------------------------------------------


def _all_bytes() -> list[str]:
    return [bytes_to_unicode()[b] for b in range(256)]


def _missing_cases() -> list[tuple[tuple[list[str]], list[int]]]:
    every = _all_bytes()
    without_space_and_a = [c for c in every if c not in "Ġa"] + ["Ġa"]
    tok = _smollm2()
    smol_tokens = [tok.id_to_token(i) for i in range(len(tok))]
    return [((every + ["Ġthe"],), []), ((without_space_and_a,), [0x20, 0x61]), ((smol_tokens,), tok.missing_bytes)]


MISSING_MISTAKES = [
    Mistake(
        wrong.missing_by_substring,
        "a byte counts as present only if it is a token *on its own*: 'Ġa' holds a space but is not the token 'Ġ'.",
    ),
    Mistake(
        wrong.missing_raw_chars,
        "vocabulary strings go through the byte map: the space byte is the token 'Ġ', not ' ' (use BYTE_TO_CHAR).",
    ),
]

MISSING_HINTS = [
    "Byte b has a single-byte token when the one-character string BYTE_TO_CHAR[b] is itself a token.",
    "Put the tokens in a set once (49,152 of them), then test each of the 256 bytes.",
    "present = set(tokens); return [b for b in range(256) if BYTE_TO_CHAR[b] not in present]",
]


def check_missing_single_bytes(fn: Callable[[list[str]], list[int]], hint: int = 0) -> bool:
    """``fn(tokens)`` -> sorted bytes with no single-byte token (on SmolLM2: ``tok.missing_bytes``)."""
    return check("missing_single_bytes", fn, _missing_cases(), hint=hint, hints=MISSING_HINTS,
                 mistakes=MISSING_MISTAKES)


# --- exercise 3: left_pad, the padded batch ------------------------------------------------------


def _pad_inputs() -> list[tuple[list[list[int]], int]]:
    tok = _smollm2()
    chats = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Capital of Italy?"},
         {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of Spain?"}],
    ]
    chat_rows = [list(tok.apply_chat_template(m, add_generation_prompt=True)) for m in chats]
    assert tok.pad_id is not None
    return [
        ([[5, 6, 7], [9]], 0),
        ([[3, 1, 4, 1, 5]], 0),  # one row: nothing to pad
        ([[1, 2], [3, 4]], 2),  # the pad id is also a real token here
        ([[7, 2, 8], [2], [4, 5]], 2),
        (chat_rows, tok.pad_id),  # real chat prompts: SmolLM2's pad token <|im_end|> ends every turn
    ]


def _pad_cases() -> list[tuple[tuple[list[list[int]], int], Batch]]:
    cases = []
    for rows, pad_id in _pad_inputs():
        batch = pad_batch(rows, pad_id, "left")
        cases.append(((rows, pad_id), (batch.input_ids, batch.attention_mask, batch.position_ids)))
    return cases


PAD_MISTAKES = [
    Mistake(
        wrong.right_padded,
        "you padded on the right. For generation the pads go on the *left*, so that every row's last real "
        "token sits in the last column, where the next token is predicted and appended.",
    ),
    Mistake(
        wrong.positions_count_pads,
        "your positions count the pads: a row with p pads would start at position p. Positions count real tokens "
        "only (0, 1, 2, ... from the row's first real token), the positions the prompt gets alone.",
    ),
    Mistake(
        wrong.positions_start_after_pads,
        "your real tokens' positions start at the number of pads (range(pad, width)); they must start at 0.",
    ),
    Mistake(
        wrong.mask_and_positions_from_ids,
        "your mask is `input_ids != pad_id` (and your positions follow it). A real token equal to the pad id is "
        "hidden too: SmolLM2's pad token is <|im_end|>, which ends every chat turn. Build the mask from the "
        "padding you added, not from the ids.",
    ),
    Mistake(
        wrong.mask_from_ids,
        "your mask is `input_ids != pad_id`: a real token equal to the pad id is hidden too (SmolLM2's pad token "
        "is <|im_end|>, in every chat prompt). Build the mask from the padding you added, not from the ids.",
    ),
    Mistake(
        wrong.pads_at_minus_one,
        "the pad slots hold position -1 (mask.cumsum(-1) - 1): give them 0, as encode_batch does; their value is "
        "masked anyway, and the model refuses negative positions.",
    ),
]

PAD_HINTS = [
    "width = the longest row. A row of n ids gets width - n pads in front of it.",
    "Build each row of the three lists, then torch.tensor(..., dtype=torch.long): ids = [pad_id] * p + row, "
    "mask = [0] * p + [1] * n, positions = [0] * p + list(range(n)).",
    "for row in rows: p = width - len(row); ids.append([pad_id] * p + row); mask.append([0] * p + [1] * len(row)); "
    "pos.append([0] * p + list(range(len(row)))); return three torch.tensor(...) of dtype torch.long",
]


def check_left_pad(fn: Callable[[list[list[int]], int], Batch], hint: int = 0) -> bool:
    """``fn(rows, pad_id)`` -> ``(input_ids, attention_mask, position_ids)``, long tensors, left-padded,
    compared with ``minillm.tokenizer.padding.pad_batch`` (what ``Tokenizer.encode_batch`` returns)."""
    return check("left_pad", fn, _pad_cases(), hint=hint, hints=PAD_HINTS, mistakes=PAD_MISTAKES)


# --- exercise 4: render_chatml -------------------------------------------------------------------

DEFAULT_SYSTEM = wrong.DEFAULT_SYSTEM  # what SmolLM2's template inserts when there is no system message

CHAT_CONVERSATIONS: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Capital of Italy?"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], False),
]


def _chat_cases() -> list[tuple[tuple[list[dict[str, str]], bool], str]]:
    tok = _smollm2()
    return [((msgs, gen), str(tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)))
            for msgs, gen in CHAT_CONVERSATIONS]


CHAT_MISTAKES = [
    Mistake(
        wrong.chat_no_default_system,
        "the template inserts a default system message when the first message is not a system message.",
    ),
    Mistake(
        wrong.chat_always_default_system,
        "the default system message is added only when the conversation has no system message of its own.",
    ),
    Mistake(
        wrong.chat_no_generation_prompt,
        "with add_generation_prompt the prompt ends with '<|im_start|>assistant\\n': the model's turn to speak.",
    ),
    Mistake(wrong.chat_no_newline_after_end, "each turn ends with '<|im_end|>' *and a newline*."),
]

CHAT_HINTS = [
    "Read tok.chat_template: one `if` before the loop, one string per message, one `if` at the end.",
    "A turn is f\"<|im_start|>{role}\\n{content}<|im_end|>\\n\"; if messages[0]['role'] != 'system', a system turn "
    "with the default message comes first.",
    "default = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'; prepend "
    "{'role': 'system', 'content': default} when needed; join the turns; add '<|im_start|>assistant\\n' if asked.",
]


def check_render_chatml(fn: Callable[[list[dict[str, str]], bool], str], hint: int = 0) -> bool:
    """``fn(messages, add_generation_prompt)`` -> the prompt string ``tok.apply_chat_template`` renders."""
    return check("render_chatml", fn, _chat_cases(), hint=hint, hints=CHAT_HINTS, mistakes=CHAT_MISTAKES)


# --- exercise 5: the streaming detokenizer's push and flush -------------------------------------


@dataclass(frozen=True)
class Stream:
    """Token byte strings pushed as ids 0, 1, 2, ... (``id_to_bytes`` is ``list(tokens)``), then a flush."""

    name: str
    tokens: tuple[bytes, ...]

    def __repr__(self) -> str:
        return f"the {self.name!r} stream {list(self.tokens)}"


class _Table:
    """What the package's detokenizer asks of a tokenizer (``decode_bytes``), for a plain list of bytes."""

    def __init__(self, tokens: Sequence[bytes]) -> None:
        self.tokens = tokens

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        return b"".join(self.tokens[i] for i in ids)


def _streams() -> list[Stream]:
    tok = _smollm2()
    smol = tuple(tok.decode_bytes([i]) for i in tok.encode("Tokyo 東京 🦙🤗 café!"))
    return [
        Stream("ASCII", (b"Hel", b"lo", b" world")),
        Stream("characters completed inside a token", (b" \xe6", b"\x9d\xb1\xe4", b"\xba\xac", b"!")),
        Stream("an emoji over 3 tokens", (b"a", b"\xf0\x9f", b"\xa6", b"\x80", b"b")),
        Stream("invalid bytes", (b"a\xff", b"b\x80", b"\xe6A", b"\xf0\x9f", b"\xe6\x9d\xb1")),
        Stream("a character cut off at the end", (b"ok ", b"\xe6\x9d")),
        Stream("SmolLM2's tokens of 'Tokyo 東京 🦙🤗 café!'", smol),
    ]


def _trace(streamer: object, stream: Stream) -> tuple[str, ...]:
    """Each push and the flush as ``push(b'..') -> '..'``; an exception ends the trace, named."""
    trace = []
    for i, token in enumerate(stream.tokens):
        try:
            trace.append(f"push({token!r}) -> {streamer.push(i)!r}")  # type: ignore[attr-defined]
        except NotImplementedError:
            raise
        except Exception as err:  # the learner's code may fail in any way: the trace says how
            return (*trace, f"push({token!r}) raised {type(err).__name__}")
    try:
        trace.append(f"flush() -> {streamer.flush()!r}")  # type: ignore[attr-defined]
    except NotImplementedError:
        raise
    except Exception as err:
        trace.append(f"flush() raised {type(err).__name__}")
    return tuple(trace)


def _package_trace(stream: Stream) -> tuple[str, ...]:
    return _trace(StreamingDetokenizer(_Table(stream.tokens)), stream)


def _as_mistake(cls: type, message: str) -> Mistake:
    return Mistake(lambda stream: _trace(cls(list(stream.tokens)), stream), message)


STREAM_MISTAKES = [
    # before DecodesEachToken: on the emoji stream both emit U+FFFD, and this one passed the stream before it
    _as_mistake(wrong.LooksAtTheLastByteOnly, "you emitted U+FFFD for a character that was merely incomplete "
                "(its lead byte had arrived, the rest had not): look back past the continuation bytes to the "
                "lead byte and compare utf8_length(lead) with the bytes you have."),
    _as_mistake(wrong.HoldsUntilFlush, "push() never emits anything, everything comes out at flush(): a chat UI "
                "would show nothing until the answer ends. Release every complete character as soon as it is."),
    _as_mistake(wrong.HoldsWhileNotAscii, "a character that is already complete is held back until an ASCII byte "
                "follows: hold back only the bytes of a character whose lead byte says more bytes are to come."),
    _as_mistake(wrong.DecodesEachToken, "you decode each token on its own: a character split over tokens comes "
                "out as U+FFFD pieces mid-stream (mojibake). Keep the bytes of an unfinished character in a buffer."),
    _as_mistake(wrong.DropsTheTailAtFlush, "flush() dropped the held bytes: at the end of the stream a truncated "
                "character must come out as U+FFFD, as decode() shows it, so the pieces join to decode(ids)."),
    _as_mistake(wrong.DecodesStrictly, "decoding raised UnicodeDecodeError: a stream may hold invalid bytes (or "
                "end mid-character); decode with errors='replace' so each shows as U+FFFD, as decode() does."),
    _as_mistake(wrong.IgnoresInvalidBytes, "invalid bytes vanished (errors='ignore'): decode() shows each as "
                "U+FFFD, and the streamed text must equal decode(ids); use errors='replace'."),
]

STREAM_HINTS = [
    "Keep a byte buffer. push() adds the token's bytes, then releases (decodes and removes) the longest "
    "start of the buffer that ends on a whole character; flush() releases the rest.",
    "Look back from the end, at most 4 bytes, for the last byte that is not a continuation byte "
    "(byte & 0xC0 != 0x80). If utf8_length(that byte) is more than the bytes from it to the end, its "
    "character is incomplete: cut the buffer just before it. Decode with errors='replace'.",
    "cut = len(buf); for back in range(1, min(4, len(buf)) + 1): b = buf[-back]; if b & 0xC0 != 0x80: "
    "(if utf8_length(b) > back: cut = len(buf) - back); break — then out, self.buffer = buf[:cut], buf[cut:]; "
    "return out.decode('utf-8', errors='replace'). flush(): decode the whole buffer, empty it.",
]


def _no_incremental_decoder(cls: type) -> Callable[[Callable[..., object], tuple[object, ...]], str | None]:
    """A rule: the learner's streamer holds no ``codecs`` incremental decoder (the package's shortcut)."""

    def rule(_run: Callable[..., object], args: tuple[object, ...]) -> str | None:
        try:
            streamer = cls(list(args[0].tokens))  # type: ignore[attr-defined]
            streamer.push(0)
        except Exception:  # the values already passed; a rule only reports what it saw
            return None
        if any(isinstance(v, codecs.IncrementalDecoder) for v in vars(streamer).values()):
            return ("it keeps a codecs incremental decoder, the package's shortcut. Here write the mechanism: "
                    "a byte buffer and the look back to the last lead byte.")
        return None

    return rule


def check_streamer(cls: type, hint: int = 0) -> bool:
    """``cls(id_to_bytes)`` with ``push(id) -> str`` and ``flush() -> str``: every piece must equal what
    minillm's ``StreamingDetokenizer`` emits on six streams (ASCII, an emoji over 3 tokens, characters
    completed inside a token, invalid bytes, a character cut off at the end, SmolLM2's real tokens)."""

    def run(stream: Stream) -> tuple[str, ...]:
        return _trace(cls(list(stream.tokens)), stream)

    run.__name__ = getattr(cls, "__name__", "streamer")
    cases = [((stream,), _package_trace(stream)) for stream in _streams()]
    return check("streamer", run, cases, hint=hint, hints=STREAM_HINTS, mistakes=STREAM_MISTAKES,
                 rules=[_no_incremental_decoder(cls)])


# --- solutions -----------------------------------------------------------------------------------


def token_to_bytes_solution(token: str) -> bytes:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}
    return bytes(char_to_byte[c] for c in token)


def missing_single_bytes_solution(tokens: list[str]) -> list[int]:
    present, byte_to_char = set(tokens), bytes_to_unicode()
    return [b for b in range(256) if byte_to_char[b] not in present]


def left_pad_solution(rows: list[list[int]], pad_id: int) -> Batch:
    width = max(len(row) for row in rows)
    input_ids, attention_mask, position_ids = [], [], []
    for row in rows:
        pad = width - len(row)
        input_ids.append([pad_id] * pad + list(row))
        attention_mask.append([0] * pad + [1] * len(row))  # from where we padded, never from the ids
        position_ids.append([0] * pad + list(range(len(row))))
    ids, mask, positions = (torch.tensor(x, dtype=torch.long) for x in (input_ids, attention_mask, position_ids))
    return ids, mask, positions


def render_chatml_solution(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class StreamerSolution:
    """Push ids, get back only whole characters: the bytes of an unfinished one wait in ``buffer``."""

    def __init__(self, id_to_bytes: Sequence[bytes]) -> None:
        self.id_to_bytes, self.buffer = id_to_bytes, b""

    def push(self, token_id: int) -> str:
        self.buffer += self.id_to_bytes[token_id]
        cut = len(self.buffer)
        for back in range(1, min(4, len(self.buffer)) + 1):  # find the last lead byte
            byte = self.buffer[-back]
            if byte & 0xC0 != 0x80:  # not a continuation byte
                if wrong.utf8_length(byte) > back:
                    cut = len(self.buffer) - back  # its character is incomplete: hold it back
                break
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out.decode("utf-8", errors="replace")

    def flush(self) -> str:
        out, self.buffer = self.buffer, b""  # a truncated character becomes U+FFFD, as in decode()
        return out.decode("utf-8", errors="replace")
