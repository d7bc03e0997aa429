"""Exercises of notebook 02 (real tokenizers): GPT-2's byte map, the bytes a vocabulary lacks,
left padding with positions, and SmolLM2's chat template.

The expected answers come from the package: ``bytes_unicode.token_to_bytes``, SmolLM2's
``Tokenizer`` read from the GGUF file (``missing_bytes``, ``apply_chat_template``) and
``pad_batch``, the function behind ``Tokenizer.encode_batch``. Each classic mistake is written
out as the function a learner would write, so a wrong answer of that kind is named.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from minillm.assets import default_gguf_path
from minillm.exercises import Mistake, check
from minillm.tokenizer import Tokenizer
from minillm.tokenizer.padding import pad_batch
from minillm.tokenizer.bytes_unicode import bytes_to_unicode, token_to_bytes

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@cache
def _smollm2() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read from its GGUF file once (~2 s)."""
    return Tokenizer.from_file(default_gguf_path())


# --- exercise 1: token_to_bytes ------------------------------------------------------------------


def _token_cases() -> list[tuple[tuple[str], bytes]]:
    tokens = ["Ġthe", "ĊĊ", "Ã©", "ðŁ¦Ļ", "ĉĠĸ", "Ń", "Ā", "ġ", "ł", "ÿ"]
    return [((t,), token_to_bytes(t)) for t in tokens]


def _utf8_of_the_string(token: str) -> bytes:
    return token.encode("utf-8")


def _del_kept(token: str) -> bytes:
    """The byte map with DEL (0x7F) wrongly kept as printable: every later shifted byte moves by one."""
    keep = [*range(0x21, 0x80), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}
    return bytes(char_to_byte[c] for c in token)


TOKEN_MISTAKES = [
    Mistake(
        _utf8_of_the_string,
        "you UTF-8-encoded the token string. Each character stands for one byte through the byte map: "
        "'Ġ' (U+0120) is the byte 0x20, not the two bytes c4 a0.",
    ),
    Mistake(
        _del_kept,
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


def _missing_by_substring(tokens: list[str]) -> list[int]:
    text = "".join(tokens)
    return [b for b in range(256) if bytes_to_unicode()[b] not in text]


def _missing_raw_chars(tokens: list[str]) -> list[int]:
    present = set(tokens)
    return [b for b in range(256) if chr(b) not in present]


MISSING_MISTAKES = [
    Mistake(
        _missing_by_substring,
        "a byte counts as present only if it is a token *on its own*: 'Ġa' holds a space but is not the token 'Ġ'.",
    ),
    Mistake(
        _missing_raw_chars,
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


def _as_tuple(rows: list[list[int]], pad_id: int, side: str) -> Batch:
    batch = pad_batch(rows, pad_id, side)
    return batch.input_ids, batch.attention_mask, batch.position_ids


def _right_padded(rows: list[list[int]], pad_id: int) -> Batch:
    return _as_tuple(rows, pad_id, "right")


def _positions_count_pads(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = _as_tuple(rows, pad_id, "left")
    return input_ids, mask, torch.arange(input_ids.shape[1]).expand_as(input_ids).clone()


def _positions_start_after_pads(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = _as_tuple(rows, pad_id, "left")
    return input_ids, mask, torch.arange(input_ids.shape[1]).expand_as(input_ids) * mask


def _mask_from_ids(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, _, positions = _as_tuple(rows, pad_id, "left")
    return input_ids, (input_ids != pad_id).long(), positions


def _mask_and_positions_from_ids(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, _, _ = _as_tuple(rows, pad_id, "left")
    mask = (input_ids != pad_id).long()
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0) * mask


def _pads_at_minus_one(rows: list[list[int]], pad_id: int) -> Batch:
    input_ids, mask, _ = _as_tuple(rows, pad_id, "left")
    return input_ids, mask, mask.cumsum(-1) - 1


PAD_MISTAKES = [
    Mistake(
        _right_padded,
        "you padded on the right. For generation the pads go on the *left*, so that every row's last real "
        "token sits in the last column, where the next token is predicted and appended.",
    ),
    Mistake(
        _positions_count_pads,
        "your positions count the pads: a row with p pads would start at position p. Positions count real tokens "
        "only (0, 1, 2, ... from the row's first real token), the positions the prompt gets alone.",
    ),
    Mistake(
        _positions_start_after_pads,
        "your real tokens' positions start at the number of pads (range(pad, width)); they must start at 0.",
    ),
    Mistake(
        _mask_and_positions_from_ids,
        "your mask is `input_ids != pad_id` (and your positions follow it). A real token equal to the pad id is "
        "hidden too: SmolLM2's pad token is <|im_end|>, which ends every chat turn. Build the mask from the "
        "padding you added, not from the ids.",
    ),
    Mistake(
        _mask_from_ids,
        "your mask is `input_ids != pad_id`: a real token equal to the pad id is hidden too (SmolLM2's pad token "
        "is <|im_end|>, in every chat prompt). Build the mask from the padding you added, not from the ids.",
    ),
    Mistake(
        _pads_at_minus_one,
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

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHAT_CONVERSATIONS: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Capital of Italy?"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], False),
]


def _chat_cases() -> list[tuple[tuple[list[dict[str, str]], bool], str]]:
    tok = _smollm2()
    return [((msgs, gen), str(tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)))
            for msgs, gen in CHAT_CONVERSATIONS]


def _turns(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _chat_no_default_system(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return _turns(messages) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _chat_always_default_system(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    return _turns(messages) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _chat_no_generation_prompt(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    return _turns(messages)


def _chat_no_newline_after_end(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


CHAT_MISTAKES = [
    Mistake(
        _chat_no_default_system,
        "the template inserts a default system message when the first message is not a system message.",
    ),
    Mistake(
        _chat_always_default_system,
        "the default system message is added only when the conversation has no system message of its own.",
    ),
    Mistake(
        _chat_no_generation_prompt,
        "with add_generation_prompt the prompt ends with '<|im_start|>assistant\\n': the model's turn to speak.",
    ),
    Mistake(_chat_no_newline_after_end, "each turn ends with '<|im_end|>' *and a newline*."),
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
