"""Chunked prefill: a step computes at most ``prefill_chunk_tokens`` prompt tokens, so a long
prompt is spread over several steps while the running requests keep getting a token each step.

On a tiny random model in float64 (chunks change only the order of float operations, so their
answers agree with whole prefills to ~1e-12 and greedy tokens are the same); no timing is asserted:
the stall is bounded by construction (tokens computed per step), which is what is checked.
"""

from __future__ import annotations

import pytest

import minillm
from minillm.sampling import SamplingParams

from helpers.engines import counting_prefill


def _prompts(tok) -> list[list[int]]:
    text = "Now is the winter of our discontent made glorious summer by this sun of York"
    return [tok.encode(text)[: n] for n in (3, 17, 40, 9)]


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunked_prefill_gives_the_same_answers_and_frees_everything(tiny64, chunk, prefix_caching):
    model, tok = tiny64
    params = SamplingParams(max_new_tokens=5)
    whole = minillm.Engine(model, tok, block_size=4, backend="eager")
    chunked = minillm.Engine(model, tok, block_size=4, backend="eager", prefill_chunk_tokens=chunk,
                             prefix_caching=prefix_caching)
    free = chunked.manager.allocator.num_free
    prompts = _prompts(tok)
    want = [c.token_ids for c in whole.generate(prompts, params)]
    assert [c.token_ids for c in chunked.generate(prompts, params)] == want
    assert [c.token_ids for c in chunked.generate(prompts[::-1], params)] == want[::-1]  # cached prefixes now
    assert chunked.manager.allocator.num_free == free


def test_a_long_prompt_never_takes_a_step_from_the_running_requests(tiny64):
    model, tok = tiny64
    engine = minillm.Engine(model, tok, block_size=4, backend="eager", prefill_chunk_tokens=6)
    computed = counting_prefill(engine)
    short = [engine.add_request(p, SamplingParams(max_new_tokens=40)) for p in _prompts(tok)[:1] * 3]
    while any(not r.output_ids for r in short):
        engine.step()
    long = engine.add_request(_prompts(tok)[2] * 2, SamplingParams(max_new_tokens=2))  # 80 tokens: 14 chunks
    steps = 0
    while not long.output_ids:
        computed.clear()
        before = [len(r.output_ids) for r in short]
        engine.step()
        steps += 1
        assert sum(computed) <= 6  # the prompt tokens computed in this step
        assert [len(r.output_ids) for r in short] == [n + 1 for n in before]  # everyone else advanced
    assert steps == -(-len(long.prompt_ids) // 6)
    for request in short:
        engine.abort(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks


def test_aborting_a_request_while_its_prompt_is_being_prefilled_frees_its_blocks(tiny64):
    model, tok = tiny64
    engine = minillm.Engine(model, tok, block_size=4, backend="eager", prefill_chunk_tokens=4)
    request = engine.add_request(_prompts(tok)[2], SamplingParams(max_new_tokens=3))
    engine.step()
    assert engine.prefilling and not request.output_ids
    engine.abort(request)
    assert not engine.has_unfinished_requests()
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks


def test_the_chunk_size_is_checked(tiny64):
    model, tok = tiny64
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        minillm.Engine(model, tok, backend="eager", prefill_chunk_tokens=0)


def test_requests_being_prefilled_count_against_max_batch_size(tiny64):
    # Prompts prefilled over several steps hold batch rows: a waiting request may not be admitted
    # past max_batch_size just because none of them is decoding yet.
    model, tok = tiny64
    engine = minillm.Engine(model, tok, block_size=4, backend="eager", max_batch_size=2, prefill_chunk_tokens=4)
    requests = [engine.add_request(_prompts(tok)[1], SamplingParams(max_new_tokens=2)) for _ in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.running) + len(engine.prefilling) <= 2
    assert all(r.finished for r in requests)
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks


def test_a_running_request_that_outgrows_the_pool_preempts_a_prompt_being_prefilled(tiny64):
    # A prompt prefilled chunk by chunk holds the blocks of its whole prompt for many steps, while
    # the running request next to it keeps growing. When the pool runs out, the prompt (the newest
    # admission) must go back to the queue: failing the step would abort both requests. Found by a
    # random request stream: 7 blocks of 1 token, a 1-token chunk budget; both are admitted in the
    # first step (1 + 4 prompt blocks and a spare block per row), the first prefilled at once.
    model, tok = tiny64
    engine = minillm.Engine(model, tok, block_size=1, kv_cache_tokens=7, max_batch_size=2, backend="eager",
                            prefill_chunk_tokens=1)
    alone = minillm.Engine(model, tok, block_size=1, backend="eager")
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True), SamplingParams(max_new_tokens=1)]
    prompts = [[7], [1, 1, 1, 1]]  # 6 blocks and 5 blocks at most: each fits the pool alone
    running, prefilling = (engine.add_request(p, ps) for p, ps in zip(prompts, params))
    while engine.has_unfinished_requests():
        engine.step()
    for request, prompt, ps in zip((running, prefilling), prompts, params):
        assert request.output_ids == alone.generate([prompt], ps)[0].token_ids
    assert engine.preemptions >= 1
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks


def test_a_beam_search_being_prefilled_counts_all_its_beams_against_max_batch_size(tiny64):
    # While its prompt is prefilled a beam search holds one sequence, but it decodes num_beams rows
    # from its first step on: a request admitted meanwhile must not push the batch past the limit.
    model, tok = tiny64
    engine = minillm.Engine(model, tok, block_size=4, backend="eager", max_batch_size=2, prefill_chunk_tokens=4)
    # (A beam search is queued for step() only inside generate(), which runs it to the end: the
    # engine's own constructor of one is the way to step it beside a request and watch the batch.)
    search = engine._beam_search(_prompts(tok)[1], SamplingParams(max_new_tokens=4, num_beams=2))
    engine.waiting.append(search)
    request = engine.add_request(_prompts(tok)[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        assert sum(len(u.beams) if u is search else 1 for u in engine.running) <= 2
    assert search.done and len(request.output_ids) == 6
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks
