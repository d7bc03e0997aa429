"""Automatic prefix caching: full KV blocks keyed by a hash chain, reused by later prompts that
share the prefix, kept after release until the pool needs the room.

The bookkeeping is tested without tensors (random operation streams, invariants that must hold
after every step); the engine is tested on a tiny random model in float64, where a reused block
and a freshly computed one agree to ~1e-12, so a wrong block (another prefix, a stale or
evicted one) would show as a difference of order 1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.cache import BlockManager
from minillm.sampling import SamplingParams

from test_model_units import _tiny_hf_checkpoint, tiny_tokenizer  # noqa: F401  (a fixture)


def _invariants(m: BlockManager, tokens: dict[int, list[int]]) -> None:
    a = m.allocator
    held = {b for b in range(a.num_blocks) if a.ref_counts[b] > 0}
    assert a.num_free + len(held) == a.num_blocks
    assert all(a.ref_counts[b] == 0 and b in a.key_of for b in a.evictable)
    assert all(a.ref_counts[b] == 0 and b not in a.key_of for b in a._free)
    assert {k: b for b, k in a.key_of.items()} == a.block_of
    counts = [0] * a.num_blocks
    for seq, table in m.block_tables.items():
        for b in table:
            counts[b] += 1
        # every key a sequence holds names its own prefix, block for block
        assert m.keys[seq] == m.prefix_keys(tokens[seq])[: len(m.keys[seq])]
        for b, key in zip(table, m.keys[seq]):
            assert a.key_of.get(b, key) == key
    assert counts == a.ref_counts


prompts = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), prompts, st.integers(0, 7)), max_size=40),
       num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
def test_the_prefix_cache_bookkeeping_never_leaks_or_mixes_prefixes(ops, num_blocks, block_size):
    m = BlockManager(num_blocks, block_size, prefix_caching=True)
    tokens: dict[int, list[int]] = {}
    next_id = 0
    for op, prompt, n in ops:
        if op == "add":
            seq = next_id
            next_id += 1
            cached = m.add_sequence(seq, prompt)
            tokens[seq] = list(prompt)
            assert 0 <= cached < len(prompt) and m.lengths[seq] == cached
            assert len(m.block_tables[seq]) * block_size >= cached
            if not m.can_reserve([seq], [len(prompt) - cached]):
                m.free_sequence(seq)
                del tokens[seq]
            else:
                m.reserve([seq], [len(prompt) - cached])
                m.advance([seq], [len(prompt) - cached])
                m.cache_full_blocks(seq, tokens[seq])
        elif op == "grow" and tokens:
            seq = sorted(tokens)[n % len(tokens)]
            if m.can_reserve([seq], [1]):
                m.reserve([seq], [1])
                m.advance([seq], [1])
                tokens[seq].append(prompt[0])
                m.cache_full_blocks(seq, tokens[seq])
        elif op == "free" and tokens:
            seq = sorted(tokens)[n % len(tokens)]
            m.free_sequence(seq)
            del tokens[seq]
        _invariants(m, tokens)
    for seq in list(tokens):
        m.free_sequence(seq)
    assert m.allocator.num_free == num_blocks


def test_a_prompt_reuses_the_blocks_of_its_cached_prefix_and_computes_at_least_one_token():
    m = BlockManager(8, 4, prefix_caching=True)
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert m.add_sequence(0, first) == 0
    m.reserve([0], [9])
    m.advance([0], [9])
    m.cache_full_blocks(0, first)
    assert len(m.keys[0]) == 2  # two full blocks keyed, the partial third is not
    assert m.add_sequence(1, first[:8] + [99]) == 8  # both full blocks reused, shared
    assert m.block_tables[1] == m.block_tables[0][:2] and m.allocator.ref_counts[m.block_tables[0][0]] == 2
    assert m.add_sequence(2, [5, 6, 7, 0]) == 0  # a different first block: nothing in common
    m.free_sequence(0)
    m.free_sequence(1)
    assert m.allocator.num_free == 8 and len(m.allocator.evictable) == 2  # freed, still findable
    assert m.add_sequence(3, first[:8]) == 7  # a full hit: the last token is computed again


def test_cached_blocks_are_evicted_least_recently_freed_first_when_the_pool_needs_them():
    m = BlockManager(3, 2, prefix_caching=True)
    for seq, prompt in enumerate([[1, 1], [2, 2], [3, 3]]):
        m.add_sequence(seq, prompt)
        m.reserve([seq], [2])
        m.advance([seq], [2])
        m.cache_full_blocks(seq, prompt)
    for seq in (1, 0, 2):
        m.free_sequence(seq)
    assert m.allocator.num_free == 3
    m.add_sequence(9, [])
    m.reserve([9], [2])  # takes the block of [2, 2], freed first
    assert m.add_sequence(10, [2, 2, 5]) == 0 and m.add_sequence(11, [1, 1, 5]) == 2


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, tiny_tokenizer):  # noqa: F811
    """A tiny random Llama (its vocabulary the tokenizer's, so every sampled id decodes), in float64."""
    folder = _tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_tokenizer, "llama",
                                 vocab_size=tiny_tokenizer.vocab_size)
    return minillm.load_model(folder, device="cpu", dtype="float64")


def test_the_engine_with_prefix_caching_gives_the_same_answers_and_frees_everything(tiny64):
    model, tok = tiny64
    system = tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer")
    prompts = [system + tok.encode(f" the slings {i}") for i in range(6)] + [system[:32]] * 2  # 32: a full hit
    params = SamplingParams(max_new_tokens=6)
    plain = minillm.Engine(model, tok, block_size=4, compile=False)
    cached = minillm.Engine(model, tok, block_size=4, compile=False, prefix_caching=True, kv_cache_tokens=256)
    free = cached.manager.allocator.num_free
    want = [plain.generate([p], params)[0].token_ids for p in prompts]
    got = [cached.generate([p], params)[0].token_ids for p in prompts]  # one by one: each finds the last's blocks
    assert got == want
    assert cached.cached_prompt_tokens >= 5 * (len(system) // 4 * 4) + 31
    assert cached.manager.allocator.num_free == free
    # the logits themselves agree to float64 rounding, reused blocks or not
    for engine in (plain, cached):
        engine.generate([prompts[2]], params)
    logits = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        request = engine.add_request(prompts[3], SamplingParams(max_new_tokens=1))
        seen = []
        original = engine.runner.prefill

        def prefill(seq_ids, token_lists, original=original, seen=seen):
            out = original(seq_ids, token_lists)
            seen.append((len(token_lists[0]), out.clone()))
            return out

        engine.runner.prefill = prefill
        while engine.has_unfinished_requests():
            engine.step()
        engine.runner.prefill = original
        logits[name] = seen[0]
        assert request.finished
    assert logits["cached"][0] < logits["plain"][0]  # fewer tokens computed
    assert torch.allclose(logits["cached"][1], logits["plain"][1], rtol=0, atol=1e-10)


def test_a_small_pool_evicts_cached_prefixes_and_keeps_serving(tiny64):
    model, tok = tiny64
    params = SamplingParams(max_new_tokens=4)
    plain = minillm.Engine(model, tok, block_size=4, compile=False)
    small = minillm.Engine(model, tok, block_size=4, compile=False, prefix_caching=True, kv_cache_tokens=48)
    prompts = [tok.encode(f"Line {i}: now is the winter of our discontent") for i in range(8)]
    for prompt in prompts + prompts[:2]:
        assert small.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids
    assert small.manager.allocator.num_free == small.manager.allocator.num_blocks


def _counting_prefill(engine: minillm.Engine) -> list[int]:
    """Record how many prompt tokens each prefill forward computes."""
    computed: list[int] = []
    original = engine.runner.prefill

    def prefill(seq_ids, token_lists):
        computed.append(sum(len(tokens) for tokens in token_lists))
        return original(seq_ids, token_lists)

    engine.runner.prefill = prefill
    return computed


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("extra", [0, 3])  # the prompt ends on a block boundary (a full hit), or inside a block
def test_n_completions_compute_their_shared_prompt_once(tiny64, chunk, extra):
    model, tok = tiny64
    prompt = tok.encode("Now is the winter of our discontent made glorious summer by this sun of York")[: 24 + extra]
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=7, n=4)
    plain = minillm.Engine(model, tok, block_size=4, compile=False, prefill_chunk_tokens=chunk)
    cached = minillm.Engine(model, tok, block_size=4, compile=False, prefix_caching=True, prefill_chunk_tokens=chunk)
    free = cached.manager.allocator.num_free
    computed = _counting_prefill(cached)
    want = [c.token_ids for c in plain.generate([prompt], params)]
    assert [c.token_ids for c in cached.generate([prompt], params)] == want
    # the first completion computes the prompt; each sibling waits for its blocks, then computes at
    # most the partial last block (on a full hit: the last token, for its logits)
    assert sum(computed) <= len(prompt) + 3 * max(extra, 1)
    assert cached.cached_prompt_tokens >= 3 * (len(prompt) - max(extra, 1))
    assert cached.manager.allocator.num_free == free


def test_requests_arriving_together_with_one_system_prompt_compute_it_once(tiny64):
    model, tok = tiny64
    system = tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")[:20]
    questions = [tok.encode(f" and {word}?") for word in ("why", "who", "when", "where", "how", "what")]
    params = SamplingParams(max_new_tokens=4)
    plain = minillm.Engine(model, tok, block_size=4, compile=False)
    cached = minillm.Engine(model, tok, block_size=4, compile=False, prefix_caching=True)
    computed = _counting_prefill(cached)
    prompts = [system + q for q in questions]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in cached.generate(prompts, params)] == want  # all six queued at once
    assert sum(computed) <= len(system) + sum(len(q) + 4 for q in questions)
    assert cached.manager.allocator.num_free == cached.manager.allocator.num_blocks


def test_a_beam_search_caches_its_prompt_for_later_requests(tiny64):
    model, tok = tiny64
    prompt = tok.encode("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar")[:16]
    cached = minillm.Engine(model, tok, block_size=4, compile=False, prefix_caching=True)
    plain = minillm.Engine(model, tok, block_size=4, compile=False)
    beams = SamplingParams(max_new_tokens=4, num_beams=3, n=2)
    assert [c.token_ids for c in cached.generate([prompt], beams)] == \
        [c.token_ids for c in plain.generate([prompt], beams)]
    before = cached.cached_prompt_tokens
    follow = prompt + tok.encode(" not to praise him")
    params = SamplingParams(max_new_tokens=4)
    assert cached.generate([follow], params)[0].token_ids == plain.generate([follow], params)[0].token_ids
    assert cached.cached_prompt_tokens - before == len(prompt)  # every block of the beams' prompt
    assert cached.manager.allocator.num_free == cached.manager.allocator.num_blocks
