"""Greedy generation on the real model: the teaching loops of ``minillm.generate`` (recompute,
contiguous and paged caches) all produce transformers' tokens, for single prompts and for a
mixed-length batch; and the CLI's ``generate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.generate import greedy_contiguous, greedy_paged, greedy_recompute

from helpers.greedy import NEW_TOKENS, ODD_BLOCK, PROMPTS

REPO = Path(__file__).resolve().parents[2]


def test_recompute_matches_transformers(smollm, prompt_ids, transformers_greedy):
    model, tok = smollm
    assert [greedy_recompute(model, ids, NEW_TOKENS, tok.eos_id) for ids in prompt_ids] == transformers_greedy


CACHES = [("contiguous", 16), ("paged", 1), ("paged", 16), ("paged", ODD_BLOCK)]


def generate_greedy(model, prompts, max_new_tokens, eos_token_id, cache, block_size, pad_id=0):
    """Greedy completions of ``prompts`` through the contiguous cache or a paged one of ``block_size``."""
    if cache == "contiguous":
        return greedy_contiguous(model, prompts, max_new_tokens, eos_token_id, pad_id)
    return greedy_paged(model, prompts, max_new_tokens, eos_token_id, block_size)


@pytest.mark.parametrize("cache, block_size", CACHES, ids=[f"{c}-{b}" for c, b in CACHES])
def test_mixed_length_batch_matches_transformers(smollm, prompt_ids, transformers_greedy, cache, block_size):
    model, tok = smollm
    outputs = generate_greedy(model, prompt_ids, NEW_TOKENS, tok.eos_id, cache=cache, block_size=block_size,
                              pad_id=tok.pad_id)
    assert outputs == transformers_greedy


@pytest.mark.parametrize("cache, block_size", CACHES, ids=[f"{c}-{b}" for c, b in CACHES])
def test_single_prompts_match_transformers(smollm, prompt_ids, transformers_greedy, cache, block_size):
    model, tok = smollm
    for ids, expected in zip(prompt_ids, transformers_greedy):
        assert generate_greedy(model, [ids], NEW_TOKENS, tok.eos_id, cache=cache, block_size=block_size) == [expected]


def test_generation_stops_at_eos_and_frees_every_block(smollm):
    from minillm.generate import greedy_paged

    model, tok = smollm
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [out] = greedy_paged(model, [chat], 64, tok.eos_id)
    assert out[-1] == tok.eos_id and tok.decode(out).startswith("The capital of France is Paris")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, cwd=REPO, timeout=900)


def test_cli_generate_json_rows_in_prompt_order(prompt_ids, transformers_greedy):
    # float32 weights (the default on a CPU with the kernels is the file's 4-bit blocks), as transformers reads them
    result = _cli("generate", "--prompt", PROMPTS[1], "--prompt", PROMPTS[0], "--max-new-tokens", "8",
                  "--block-size", str(ODD_BLOCK), "--weights", "float32", "--backend", "eager", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPTS[1], PROMPTS[0]]
    assert rows[0]["token_ids"] == transformers_greedy[1][:8]
    assert rows[1]["token_ids"] == transformers_greedy[0][:8]
    assert "tokens/s" in result.stderr  # diagnostics go to stderr, never stdout


def test_cli_plain_output_is_only_the_completion():
    result = _cli("generate", "--prompt", PROMPTS[0], "--max-new-tokens", "3", "--weights", "float32",
                  "--backend", "eager")
    assert result.returncode == 0, result.stderr
    assert result.stdout == " Paris.\n\n"  # the completion " Paris.\n", then print's newline


def test_cli_bad_arguments_exit_non_zero_without_traceback(tmp_path):
    result = _cli("generate", "--prompt", "x", "--model", str(tmp_path / "missing.gguf"))
    assert result.returncode != 0
    assert "no model at" in result.stderr and "Traceback" not in result.stderr
    result = _cli("generate", "--prompt", "x", "--block-size", "0")
    assert result.returncode != 0 and "--block-size" in result.stderr and "Traceback" not in result.stderr
