"""The command line under hostile use: a reader that goes away, Ctrl-C, a conversation longer
than the context. One line on stderr, never a traceback, and the chat keeps going."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import minillm
import minillm.__main__ as cli
from minillm import Engine, Tokenizer

from helpers.checkpoints import tiny_hf_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_tokenizer, "llama", max_position_embeddings=512,
                              vocab_size=300)


def test_a_reader_that_goes_away_ends_the_cli_quietly(tiny_folder):
    """`generate ... | head -c 10`: the pipe closes before the output is written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "minillm", "generate", "--model", str(tiny_folder), "--backend", "eager",
         "--max-new-tokens", "4", "--json"] + ["--prompt", "the king"] * 50,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=600) != 0
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


def test_ctrl_c_outside_a_chat_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate", interrupted)
    assert cli.main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "minillm: interrupted\n"


def test_chat_survives_ctrl_c_and_a_conversation_longer_than_the_context(tiny_folder, monkeypatch, capsys):
    tok = Tokenizer.from_file(tiny_folder)
    engines: list[Engine] = []

    class EagerEngine(Engine):  # the policy under test is the chat loop's, not the compiler's
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "backend": "eager"})
            engines.append(self)

        def stream_chat(self, messages, params=None):
            stream = super().stream_chat(messages, params)
            return Interrupted(stream) if messages[-1]["content"] == "tell me more" else stream

    class Interrupted:  # Ctrl-C arrives after the first piece of the answer
        def __init__(self, stream):
            self.stream = stream

        def __iter__(self):
            yield next(self.stream)
            raise KeyboardInterrupt

        def close(self):
            self.stream.close()

    long_message = " ".join(["the king is dead"] * 300)
    while len(tok.encode(long_message)) > 300:  # about 300 tokens: one fits the 512-token context, two do not
        long_message = long_message.rsplit(" ", 1)[0]
    script = iter(["hello", "tell me more", long_message, long_message, "x " * 2000, "and now?", KeyboardInterrupt()])

    def scripted_input(prompt):
        line = next(script)
        if isinstance(line, BaseException):
            raise line
        return line

    monkeypatch.setattr(minillm.engine, "Engine", EagerEngine)
    monkeypatch.setattr("builtins.input", scripted_input)
    assert cli.main(["chat", "--model", str(tiny_folder), "--device", "cpu", "--max-new-tokens", "8",
                     "--temperature", "1.0", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    # answered: hello, tell me more (stopped), the two long ones, "and now?" (after the refused one)
    assert "[stopped]" in out and out.count("assistant> ") == 5
    assert "the conversation outgrew the context window: dropped its" in err
    assert "that message alone does not fit the context window" in err
    assert "Traceback" not in err
    (engine,) = engines
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks  # the stopped answer's blocks too
