"""Notebook 02's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

import codecs

import pytest
import torch

from minillm.exercises import nb02, nb02_mistakes
from minillm.tokenizer.bytes_unicode import bytes_to_unicode


def _token_to_bytes(token):
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}
    return bytes(char_to_byte[c] for c in token)


def _missing_single_bytes(tokens):
    present = set(tokens)
    return [b for b in range(256) if bytes_to_unicode()[b] not in present]


def _left_pad(rows, pad_id):
    width = max(len(row) for row in rows)
    ids, mask, pos = [], [], []
    for row in rows:
        p = width - len(row)
        ids.append([pad_id] * p + list(row))
        mask.append([0] * p + [1] * len(row))
        pos.append([0] * p + list(range(len(row))))
    return tuple(torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos))


def _render_chatml(messages, add_generation_prompt):
    if messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": nb02.DEFAULT_SYSTEM}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize(
    "check, answer",
    [
        (nb02.check_token_to_bytes, _token_to_bytes),
        (nb02.check_missing_single_bytes, _missing_single_bytes),
        (nb02.check_left_pad, _left_pad),
        (nb02.check_render_chatml, _render_chatml),
    ],
    ids=["token_to_bytes", "missing_single_bytes", "left_pad", "render_chatml"],
)
def test_right_answers_pass(capsys, check, answer):
    assert check(answer) is True
    assert "❌" not in capsys.readouterr().out


def _left_pad_mask_from_ids(rows, pad_id):
    ids, _, pos = _left_pad(rows, pad_id)
    return ids, (ids != pad_id).long(), pos


def _left_pad_positions_with_pads(rows, pad_id):
    ids, mask, _ = _left_pad(rows, pad_id)
    return ids, mask, torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)


def _right_pad(rows, pad_id):
    width = max(len(row) for row in rows)
    ids = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
    pos = [list(range(len(row))) + [0] * (width - len(row)) for row in rows]
    return tuple(torch.tensor(x) for x in (ids, mask, pos))


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_left_pad_mask_from_ids, "your mask is `input_ids != pad_id`"),
        (_left_pad_positions_with_pads, "your positions count the pads"),
        (_right_pad, "you padded on the right"),
        *[(m.wrong, m.message[:40]) for m in nb02.PAD_MISTAKES],
    ],
    ids=["mask-from-ids", "positions-count-pads", "right-padding", *[m.wrong.__name__ for m in nb02.PAD_MISTAKES]],
)
def test_left_pad_mistakes_are_named(capsys, wrong, says):
    assert nb02.check_left_pad(wrong) is False
    assert says in capsys.readouterr().out


def test_left_pad_says_tensors_not_lists(capsys):
    assert nb02.check_left_pad(lambda rows, pad_id: tuple(t.tolist() for t in _left_pad(rows, pad_id))) is False
    assert "expected a torch.Tensor, got a list" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb02.check_token_to_bytes, nb02.TOKEN_MISTAKES),
        (nb02.check_missing_single_bytes, nb02.MISSING_MISTAKES),
        (nb02.check_render_chatml, nb02.CHAT_MISTAKES),
    ],
    ids=["token_to_bytes", "missing_single_bytes", "render_chatml"],
)
def test_other_mistakes_are_named(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out


# --- the streaming detokenizer --------------------------------------------------------------------


class _Streamer:
    """A right answer written as a learner writes the notebook's stub: count the continuation bytes
    at the end of the buffer rather than looking for the lead byte first."""

    def __init__(self, id_to_bytes):
        self.id_to_bytes, self.buffer = id_to_bytes, b""

    def _needed(self, lead):
        return 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 1

    def push(self, token_id):
        self.buffer += self.id_to_bytes[token_id]
        tail = 0
        while tail < min(3, len(self.buffer)) and self.buffer[-1 - tail] & 0xC0 == 0x80:
            tail += 1
        cut = len(self.buffer)
        if tail < len(self.buffer) and self._needed(self.buffer[-1 - tail]) > tail + 1:
            cut -= tail + 1
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out.decode("utf-8", errors="replace")

    def flush(self):
        out, self.buffer = self.buffer.decode("utf-8", errors="replace"), b""
        return out


def test_streamer_right_answers_pass(capsys):
    assert nb02.check_streamer(_Streamer) is True
    assert nb02.check_streamer(nb02.StreamerSolution) is True
    assert "❌" not in capsys.readouterr().out


@pytest.mark.parametrize("mistake", nb02.STREAM_MISTAKES, ids=lambda m: m.message[:30])
def test_streamer_mistakes_are_named(capsys, mistake):
    """Each wrong streamer fails, and the message names its own mistake, not another one."""
    cls = next(c for c in vars(nb02_mistakes).values()
               if isinstance(c, type) and c.__module__ == nb02_mistakes.__name__ and c is not nb02_mistakes.Lookback
               and _same_trace(c, mistake))
    assert nb02.check_streamer(cls) is False
    out = capsys.readouterr().out
    assert mistake.message in out
    assert sum(m.message in out for m in nb02.STREAM_MISTAKES) == 1


def _same_trace(cls, mistake):
    streams = nb02._streams()
    return all(mistake.wrong(s) == nb02._trace(cls(list(s.tokens)), s) for s in streams)


@pytest.mark.parametrize(
    "cls, says",
    [
        (nb02_mistakes.DecodesEachToken, "you decode each token on its own"),
        (nb02_mistakes.HoldsUntilFlush, "push() never emits anything"),
        (nb02_mistakes.HoldsWhileNotAscii, "already complete is held back"),
        (nb02_mistakes.LooksAtTheLastByteOnly, "U+FFFD for a character that was merely incomplete"),
        (nb02_mistakes.DropsTheTailAtFlush, "flush() dropped the held bytes"),
        (nb02_mistakes.DecodesStrictly, "raised UnicodeDecodeError"),
        (nb02_mistakes.IgnoresInvalidBytes, "invalid bytes vanished"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_every_wrong_streamer_is_named(capsys, cls, says):
    assert nb02.check_streamer(cls) is False
    assert says in capsys.readouterr().out


def test_the_package_shortcut_is_refused(capsys):
    class IncrementalDecoder:
        def __init__(self, id_to_bytes):
            self.id_to_bytes = id_to_bytes
            self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def push(self, token_id):
            return self.decoder.decode(self.id_to_bytes[token_id])

        def flush(self):
            return self.decoder.decode(b"", final=True)

    assert nb02.check_streamer(IncrementalDecoder) is False
    assert "codecs incremental decoder" in capsys.readouterr().out


def test_unfinished_streamer_waits(capsys):
    class Stub:
        def __init__(self, id_to_bytes):
            self.buffer = b""

        def push(self, token_id):
            raise NotImplementedError

        def flush(self):
            raise NotImplementedError

    assert nb02.check_streamer(Stub) is False
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check, solution",
    [
        (nb02.check_token_to_bytes, nb02.token_to_bytes_solution),
        (nb02.check_missing_single_bytes, nb02.missing_single_bytes_solution),
        (nb02.check_left_pad, nb02.left_pad_solution),
        (nb02.check_render_chatml, nb02.render_chatml_solution),
    ],
    ids=["token_to_bytes", "missing_single_bytes", "left_pad", "render_chatml"],
)
def test_the_module_solutions_pass(capsys, check, solution):
    assert check(solution) is True
    assert "❌" not in capsys.readouterr().out
