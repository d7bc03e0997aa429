"""The Engine tensor-parallel: rank 0 schedules and samples, the other ranks follow its steps.

On a tiny float64 model (exact but for the order of the row-parallel sums), a mixed batch —
greedy, a stop string, beam search, seeded sampling, speculation — gives the very tokens of
one process on 2 ranks (an uneven 2 + 1 split of the KV groups) and 3; a rank that dies in the
middle makes rank 0 fail with an error naming it, within the collectives' timeout. The command
line's own launch (``--tensor-parallel 2`` without torchrun) prints what one process prints.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import wait_until_healthy
from helpers.tp_ranks import engine_requests, run_engine

from minillm import Engine, load_model
from minillm.distributed.launch import run_ranks

SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
         "intermediate_size": 96}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer) -> Path:
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tp-engine") / "tiny", tiny_tokenizer, "llama",
                              vocab_size=tiny_tokenizer.vocab_size, **SHAPE)


@pytest.fixture(scope="module")
def eos(tiny_tokenizer) -> int:
    return tiny_tokenizer.special_tokens["<|endoftext|>"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_mixed_batch_gives_one_process_tokens(folder, eos, world_size):
    model, tok = load_model(folder, device="cpu", dtype="float64")
    prompts, params = engine_requests(eos)
    reference = Engine(model, tok, backend="eager", block_size=4, eos_ids=[eos]).generate(prompts, params)
    outcomes = run_ranks(run_engine, world_size, (str(folder), eos), timeout=60, deadline=110)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error or o.exitcode]
    assert not errors, "\n".join(errors)
    result = outcomes[0].value
    assert result["tokens"] == [c.token_ids for c in reference]
    assert result["finish"] == [c.finish_reason for c in reference]
    assert result["pool_free"] and result["backend"] == f"eager x{world_size} ranks"
    assert all(o.value["steps"] > 0 for o in outcomes[1:])


def test_a_rank_that_dies_is_named_by_rank_0_within_the_timeout(folder, eos):
    start = time.monotonic()
    outcomes = run_ranks(run_engine, 2, (str(folder), eos, 3), timeout=10, grace=2, deadline=60)
    assert outcomes[1].exitcode == 3
    assert outcomes[0].error is not None and "rank 1" in outcomes[0].error, outcomes[0].error
    assert time.monotonic() - start < 60


GENERATE = ["-m", "minillm", "generate", "--json", "--max-new-tokens", "16", "--prompt", "the king is dead",
            "--prompt", "long live the queen"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process_output(folder) -> str:
    run = subprocess.run([sys.executable, *GENERATE, "--model", str(folder), "--backend", "eager"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("launch", ["alone", "two nodes"])
def test_the_command_line_prints_one_process_output(folder, one_process_output, launch):
    """``generate --tensor-parallel 2`` run plainly (it starts the second rank itself), and as a
    two-machine run simulated on loopback: two ``torchrun --nnodes 2 --node-rank {0,1}`` commands.
    In float32 two runs may differ where two logits are within rounding of each other: they are
    compared where the float64 model's best logit leads the second by more than 1e-3."""
    base = [*GENERATE, "--model", str(folder)]
    if launch == "alone":
        run = subprocess.run([sys.executable, *base, "--tensor-parallel", "2"], cwd=REPO, capture_output=True,
                             text=True, timeout=240)
        assert run.returncode == 0, run.stderr
        assert "backend eager x2 ranks" in run.stderr
        out = run.stdout
    else:
        port = _free_port()
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                                   "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", *base,
                                   "--tensor-parallel", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in (0, 1)]
        try:
            outputs = [node.communicate(timeout=240) for node in nodes]
        finally:
            for node in nodes:
                node.kill()
        assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
        assert outputs[1][0] == ""  # only rank 0 speaks
        out = outputs[0][0]
    _same_where_clear(folder, one_process_output, out)


def _same_where_clear(folder: Path, one_out: str, two_out: str) -> None:
    one, two = ([json.loads(line) for line in out.splitlines()] for out in (one_out, two_out))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        n = _clear_prefix(folder, a)
        assert n > 0 and b["token_ids"][:n] == a["token_ids"][:n]


def _clear_prefix(folder: Path, record: dict) -> int:
    """How many of a one-process output's tokens were chosen by a clear margin (the float64
    model's best logit ahead of the second by more than 1e-3), from the first."""
    model, tok = load_model(folder, device="cpu", dtype="float64")
    ids = tok.encode(record["prompt"])
    with torch.no_grad():  # the logits that chose each token of the output
        logits = model(torch.tensor([ids + record["token_ids"]]))[0, len(ids) - 1:-1]
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-3).tolist()
    return clear.index(False) if False in clear else len(clear)


def test_serve_tensor_parallel_answers_the_openai_client_as_one_process(folder, one_process_output, tmp_path):
    """``serve --tensor-parallel 2``: the greedy completions the openai client gets are one
    process's (compared as above), and SIGTERM stops both ranks."""
    from openai import OpenAI

    port = _free_port()
    log = (tmp_path / "stderr.txt").open("w+")  # (a file: a pipe nobody reads fills up and blocks the server)
    server = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--port", str(port),
                               "--tensor-parallel", "2"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, 240)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt=r["prompt"], max_tokens=16, temperature=0).choices[0].text
                 for r in map(json.loads, one_process_output.splitlines())]
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        server.kill()
    _, tok = load_model(folder, device="cpu")
    for record, text in zip(map(json.loads, one_process_output.splitlines()), texts):
        n = _clear_prefix(folder, record)
        assert n > 0 and text.startswith(tok.decode(record["token_ids"][:n]))
