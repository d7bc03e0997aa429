"""One bad request among good ones, served: a numerical fault in one request's logits ends that
request with an error; the streams running beside it complete exactly as they would have."""

from __future__ import annotations

import math
import threading

import httpx

from minillm import Engine

from helpers.serving import serving

PROMPTS = ["The cat sat", "Once upon a time", "Hello there", "A B C"]


def _streamed_text(served, prompt: str, out: dict[str, tuple[str, str | None]]) -> None:
    text, reason = "", None
    for chunk in served.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    out[prompt] = (text, reason)


def test_a_fault_in_one_request_fails_it_alone_and_the_other_streams_complete(tiny64):
    model, tok = tiny64
    engine = Engine(model, tok, backend="eager")
    with serving(engine, "tiny") as served:
        reference: dict[str, tuple[str, str | None]] = {}
        for prompt in PROMPTS:
            _streamed_text(served, prompt, reference)
        real_decode = engine.runner.decode

        def decode(seq_ids, tokens):  # NaN in the victim's row of every decode step (on the engine thread)
            logits = real_decode(seq_ids, tokens)
            victims = {r.seq_id for r in engine.running if getattr(r, "prompt", None) == "Poisoned"}
            for row, seq_id in enumerate(seq_ids):
                if seq_id in victims:
                    logits = logits.clone()
                    logits[row, 3] = math.nan
            return logits

        engine.runner.decode = decode
        before = served.metrics()
        got: dict[str, tuple[str, str | None]] = {}
        threads = [threading.Thread(target=_streamed_text, args=(served, p, got)) for p in PROMPTS]
        for thread in threads:
            thread.start()
        reply = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
            "prompt": "Poisoned", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        for thread in threads:
            thread.join(120)
        after = served.wait_until_idle()
    assert reply.status_code == 500 and "NaN" in reply.json()["error"]["message"]
    assert got == reference
    errors = 'minillm_requests_finished_total{reason="error"}'
    assert after[errors] - before[errors] == 1
    assert after["minillm_kv_blocks_free"] == after["minillm_kv_blocks_total"]
