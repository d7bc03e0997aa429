"""The engine under abandonment and failure: whatever ends a request early, its KV blocks come
back and the engine keeps serving. A tiny random checkpoint keeps these fast (eager step)."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm
from minillm import Engine, SamplingParams, load_model
from minillm.engine import tokens as tokens_module
from minillm.engine.beam import BeamSearch

from helpers.checkpoints import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_tokenizer, "llama", max_position_embeddings=512,
                              vocab_size=300)  # the tokenizer's size: every id the model emits decodes


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder, device="cpu")


@pytest.fixture(scope="module")
def tiny64(tiny_folder):
    return load_model(tiny_folder, device="cpu", dtype=torch.float64)  # batched == alone exactly, on any machine


def _engine(tiny, **kwargs) -> Engine:
    model, tok = tiny
    return Engine(model, tok, backend="eager", **kwargs)


def _all_free(engine: Engine) -> bool:
    return engine.manager.allocator.num_free == engine.manager.allocator.num_blocks and not engine.manager.block_tables


def test_engine_and_sampling_params_import_from_the_top_level():
    assert minillm.Engine is Engine and minillm.SamplingParams is SamplingParams
    from minillm.engine import Engine as SubpackageEngine
    from minillm.sampling import SamplingParams as SubpackageParams

    assert SubpackageEngine is Engine and SubpackageParams is SamplingParams


def test_requests_that_finish_in_their_prefill_let_the_waiting_ones_in(tiny):
    engine = _engine(tiny)  # max_batch_size 16: 17 requests cannot all be admitted at once
    completions = engine.generate([f"p{i}" for i in range(17)], SamplingParams(max_new_tokens=1))
    assert len(completions) == 17 and all(len(c.token_ids) == 1 for c in completions)
    hundred = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=2, n=100, temperature=1.0, seed=0))
    assert len(hundred) == 100 and all(len(c.token_ids) == 2 for c in hundred)
    assert _all_free(engine)


def test_a_request_larger_than_the_pool_is_refused_up_front_and_the_engine_keeps_serving(tiny):
    engine = _engine(tiny, kv_cache_tokens=32)
    with pytest.raises(ValueError, match=r"may need 4 KV blocks; the pool has 2 of 16 tokens"):
        engine.generate([[1] * 20], SamplingParams(max_new_tokens=40))
    assert _all_free(engine)
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids) == 5
    assert _all_free(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_that_fits_the_pool_alone_is_served_on_an_empty_pool(tiny, prefix_caching):
    # The up-front check lets in any request whose prompt and new tokens fit the whole pool; the
    # scheduler must then serve it once the pool is empty, even with no spare block left over for
    # "the next decode step" (nothing else runs, so nothing could be preempted for it). It used
    # to be admitted never and aborted with OutOfBlocksError. 2 blocks of 4 tokens:
    engine = _engine(tiny, kv_cache_tokens=8, block_size=4, prefix_caching=prefix_caching)
    for prompt, params in [([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3, ignore_eos=True)),
                           ([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True)),
                           ([5, 6, 7], SamplingParams(max_new_tokens=1, num_beams=2))]:
        completions = engine.generate([prompt, prompt], params)  # one after the other: each fills the pool
        assert all(len(c.token_ids) == params.max_new_tokens for c in completions)
        assert _all_free(engine)


class Boom(Exception):
    pass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.integers(1, 299), min_size=1, max_size=40), min_size=1, max_size=6),
    max_new=st.lists(st.integers(0, 30), min_size=6, max_size=6),
    beams=st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=6, max_size=6),
    pool_tokens=st.integers(64, 512),
    block_size=st.sampled_from([1, 4, 16]),
    batch=st.integers(1, 5),
    fail_at=st.integers(0, 40),
    how=st.sampled_from(["decode", "sample", "interrupt", "consumer", "none"]),
)
def test_the_pool_is_back_where_it_started_after_any_failure(tiny, monkeypatch, prompts, max_new, beams,
                                                             pool_tokens, block_size, batch, fail_at, how):
    """Random request mixes on random pools, failing at a random step in a random place (the
    model step, the sampler, Ctrl-C, the caller's loop): afterwards every block is free and the
    same engine still serves a request."""
    engine = _engine(tiny, kv_cache_tokens=pool_tokens, block_size=block_size, max_batch_size=batch)
    params = [SamplingParams(max_new_tokens=n, num_beams=b, temperature=0.0 if b > 1 else 1.0, seed=i)
              for i, (n, b) in enumerate(zip(max_new, beams))][: len(prompts)]
    calls = {"n": 0}

    def failing(real, error):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > fail_at:
                raise error
            return real(*args, **kwargs)
        return wrapped

    with monkeypatch.context() as patch:
        if how == "decode":
            patch.setattr(engine.runner, "decode", failing(engine.runner.decode, Boom()))
        elif how == "sample":
            patch.setattr(tokens_module, "sample_batch", failing(tokens_module.sample_batch, Boom()))
        elif how == "interrupt":
            patch.setattr(engine.runner, "decode", failing(engine.runner.decode, KeyboardInterrupt()))
        try:
            if how == "consumer":  # the caller's loop fails while it reads the streams, which it drops
                streams = [engine.stream(p, SamplingParams(max_new_tokens=30)) for p in prompts]
                try:
                    for i, _ in enumerate(itertools.chain.from_iterable(itertools.zip_longest(*streams))):
                        if i >= fail_at:
                            raise Boom()
                finally:
                    del streams
            else:
                engine.generate(prompts, params)
        except (Boom, KeyboardInterrupt, ValueError):
            pass  # ValueError: a request too large for this pool, refused before anything ran
    assert _all_free(engine)
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3
    assert _all_free(engine)


@pytest.mark.parametrize("abandon", ["break", "close", "del", "exception"])
def test_an_abandoned_stream_frees_its_blocks_at_once(tiny, abandon):
    engine = _engine(tiny)
    stream = engine.stream([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=1.0, seed=1))
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                if abandon == "exception":
                    raise Boom()
                break
    except Boom:
        pass
    if abandon == "close":
        stream.close()
    if abandon == "del" or abandon == "exception":
        del stream
    elif abandon == "break":
        stream = None  # the caller drops its last reference  # noqa: F841
    assert _all_free(engine)
    full = list(engine.stream([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    assert len(full) >= 1 and _all_free(engine)


def test_beam_search_edge_cases(tiny):
    engine = _engine(tiny)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=0, num_beams=2))[0].token_ids == []
    two = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6, num_beams=3, n=2))
    assert len(two) == 2 and two[0].token_ids != two[1].token_ids
    one = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6, num_beams=3))[0]
    assert one.token_ids == two[0].token_ids  # the best of n is the one beam search returns alone
    assert _all_free(engine)


def test_token_id_prompts_are_checked(tiny):
    engine = _engine(tiny)
    with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
        engine.generate([[1, 300]])
    with pytest.raises(TypeError, match="a prompt must be a str or a list of token ids"):
        engine.generate([[1.5]])
    assert _all_free(engine)


def test_requests_added_between_steps_join_the_running_batch_and_match_running_alone(tiny64):
    model, tok = tiny64
    engine = Engine(model, tok, backend="eager", block_size=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9] * 11, [1, 2], [40, 41, 42, 43, 44]]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    engine.runner.trace = []
    requests = [engine.add_request(prompts[0], params)]
    for step in range(200):
        if step in (2, 3, 7):  # arrivals while the first ones are decoding
            requests.append(engine.add_request(prompts[len(requests)], params))
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert [r.output_ids for r in requests] == alone
    assert max(rows for kind, rows in engine.runner.trace if kind == "decode") == 4  # they ran together
    assert all(r.finish_reason == "length" for r in requests) and _all_free(engine)


def test_two_open_streams_share_one_batch(tiny64):
    model, tok = tiny64
    engine = Engine(model, tok, backend="eager")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = [engine.generate([p], params)[0].text for p in ([3, 4, 5], [7, 8])]
    a, b = engine.stream([3, 4, 5], params), engine.stream([7, 8], params)
    engine.runner.trace = []
    text_a, text_b = "", ""
    for piece_a, piece_b in zip(a, b):
        text_a, text_b = text_a + piece_a, text_b + piece_b
    text_a += "".join(a)
    text_b += "".join(b)
    assert [text_a, text_b] == alone
    assert ("decode", 2) in engine.runner.trace and _all_free(engine)


def test_abort_ends_a_waiting_or_running_request_and_frees_its_blocks(tiny):
    engine = _engine(tiny, max_batch_size=1)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first, second = engine.add_request([1, 2, 3], params), engine.add_request([4, 5], params)
    engine.step()
    assert len(first.output_ids) >= 1 and not second.output_ids  # one seat: the second waits
    engine.abort(second)
    engine.abort(first)
    engine.abort(first)  # twice is harmless
    assert (first.finish_reason, second.finish_reason) == ("abort", "abort")
    assert not engine.has_unfinished_requests() and _all_free(engine)
    assert engine.step() == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 299), min_size=1, max_size=30), st.integers(0, 25)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=40), pool_tokens=st.integers(64, 256), batch=st.integers(1, 4))
def test_random_arrivals_and_aborts_leave_the_pool_whole(tiny, ops, pool_tokens, batch):
    """Requests added, stepped and aborted in any order: every request that is not aborted runs
    to its full length, and once all are done every block is free."""
    engine = _engine(tiny, kv_cache_tokens=pool_tokens, block_size=8, max_batch_size=batch)
    requests, aborted = [], set()
    for op in ops:
        if op[0] == "add":
            requests.append(engine.add_request(op[1], SamplingParams(max_new_tokens=op[2], ignore_eos=True)))
        elif op[0] == "step":
            engine.step()
        elif requests:
            victim = requests[op[1] % len(requests)]
            if not victim.finished:
                aborted.add(id(victim))
            engine.abort(victim)
    while engine.has_unfinished_requests():
        engine.step()
    for request in requests:
        if id(request) not in aborted:
            assert len(request.output_ids) == request.params.max_new_tokens
    assert _all_free(engine)


def test_a_failed_step_aborts_the_requests_it_was_running_and_keeps_the_queue(tiny, monkeypatch):
    engine = _engine(tiny, max_batch_size=1)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    running, queued = engine.add_request([1, 2, 3], params), engine.add_request([4, 5], params)
    engine.step()
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "decode", lambda *args: (_ for _ in ()).throw(Boom()))
        with pytest.raises(Boom):
            engine.step()
    assert running.finish_reason == "abort" and not queued.finished
    while engine.has_unfinished_requests():
        engine.step()
    assert len(queued.output_ids) == 6 and _all_free(engine)


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_sampler_failure_right_after_a_prefill_aborts_the_request(tiny, monkeypatch, chunk, error):
    # The prompts whose prefill just completed sample their first token before joining the running
    # batch: if that fails, step() must still find them to abort. Otherwise a request queued with
    # add_request (the server's way) is in no list, never finishes and keeps its blocks; generate()
    # hid this, as its own loop aborts everything it queued on the way out.
    engine = _engine(tiny, prefill_chunk_tokens=chunk)
    request = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3, ignore_eos=True))
    with monkeypatch.context() as patch:
        patch.setattr(tokens_module, "sample_batch", lambda *args: (_ for _ in ()).throw(error()))
        with pytest.raises(error):
            while engine.has_unfinished_requests():
                engine.step()
    assert request.finish_reason == "abort" and not engine.has_unfinished_requests() and _all_free(engine)
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_failure_after_a_request_finished_in_the_same_prefill_still_frees_its_blocks(tiny, monkeypatch):
    # One packed prefill completes two prompts: a request that finishes with its first token, and a
    # beam search whose first step then fails (Ctrl-C). The request has a finish reason already, so
    # aborting it is a no-op, but it had not been retired yet: its blocks must come back all the same.
    engine = _engine(tiny)
    request = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=1))
    # (A beam search is queued for step() only inside generate(), which runs it to the end: the
    # engine's own constructor of one is the way to have it share this step with the request.)
    engine.waiting.append(engine._beam_search([9, 8, 7], SamplingParams(max_new_tokens=3, num_beams=2)))
    with monkeypatch.context() as patch:
        patch.setattr(BeamSearch, "advance", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    assert request.finish_reason == "length"
    assert not engine.has_unfinished_requests() and _all_free(engine)


# ---------------------------------------------------------------------------- one bad row
MIXED = [SamplingParams(max_new_tokens=8, ignore_eos=True, **kw) for kw in  # greedy and sampled rows, all 8 tokens long
         [{}, {"temperature": 0.9, "seed": 1}, {"repetition_penalty": 1.2}, {"temperature": 1.1, "top_k": 8, "seed": 2}]]


def _poisoning(engine: Engine, call: int, row: int, value: float, stage: str = "decode"):
    """Wrap the runner so that forward number ``call`` (of ``stage``) writes ``value`` into one
    logit of row ``row``: a numerical fault in one request's logits, mid-batch."""
    real = getattr(engine.runner, stage)
    calls = itertools.count()

    def poisoned(*args, **kwargs):
        logits = real(*args, **kwargs)
        if next(calls) == call and row < logits.shape[0]:
            logits = logits.clone()
            logits[row, 5] = value
        return logits

    return poisoned


@pytest.mark.parametrize(("stage", "call", "row"), [("decode", 0, 1), ("decode", 3, 0), ("decode", 5, 3), ("prefill", 0, 2)])
@pytest.mark.parametrize(("value", "params"), [(math.nan, MIXED), (math.inf, [p for p in MIXED if p.do_sample] * 2)])
def test_a_numerical_fault_in_one_row_ends_that_request_alone(tiny64, monkeypatch, stage, call, row, value, params):
    """NaN in one row of a batched step (or +inf in a sampled row, which no softmax turns into
    probabilities): that request alone ends, with an error naming the cause; every other
    request's tokens are exactly those of the run without the fault; every block comes back."""
    prompts = ["The cat", "Once upon a time there", "Hello", "A B C D E"]
    reference = _engine(tiny64).generate(prompts, params)
    engine = _engine(tiny64)
    monkeypatch.setattr(engine.runner, stage, _poisoning(engine, call, row, value, stage))
    got = engine.generate(prompts, params)
    [failed] = [i for i, c in enumerate(got) if c.finish_reason == "error"]
    assert "NaN" in got[failed].error or "not finite" in got[failed].error
    assert len(got[failed].token_ids) < len(reference[failed].token_ids)
    for i, (a, b) in enumerate(zip(reference, got)):
        if i != failed:
            assert (b.token_ids, b.text, b.finish_reason, b.error) == (a.token_ids, a.text, a.finish_reason, None)
    assert _all_free(engine)
    assert engine.generate(prompts, params) == reference  # and the engine keeps serving


def test_a_stream_whose_request_failed_raises_a_generation_error(tiny64, monkeypatch):
    engine = _engine(tiny64)
    monkeypatch.setattr(engine.runner, "decode", _poisoning(engine, 1, 0, math.nan))
    stream = engine.stream("Hello", SamplingParams(max_new_tokens=8))
    with pytest.raises(minillm.errors.GenerationError, match="NaN"):
        for _ in stream:
            pass
    assert stream.completion.finish_reason == "error" and _all_free(engine)


def test_a_beam_search_whose_logits_hold_nan_fails_alone(tiny64, monkeypatch):
    prompts = ["The cat", "Hello"]
    params = [SamplingParams(max_new_tokens=6, num_beams=3), SamplingParams(max_new_tokens=6)]
    reference = _engine(tiny64).generate(prompts, params)
    engine = _engine(tiny64)
    monkeypatch.setattr(engine.runner, "decode", _poisoning(engine, 1, 0, math.nan))  # row 0: a beam of the search
    got = engine.generate(prompts, params)
    assert got[0].finish_reason == "error" and "NaN" in got[0].error
    assert got[1] == reference[1] and _all_free(engine)


@pytest.mark.parametrize(("kwargs", "named"), [({"repetition_penalty": 1e-300, "temperature": 1.0}, "repetition_penalty"),
                                                ({"length_penalty": 1e308, "num_beams": 2}, "length_penalty"),
                                                ({"n": 10**6}, "n")])
def test_parameters_whose_arithmetic_overflows_are_refused_up_front(tiny, kwargs, named):
    with pytest.raises(ValueError, match=f"^{named} must be"):
        _engine(tiny).generate(["Hello"], SamplingParams(**kwargs))


@pytest.mark.parametrize(("kwargs", "named"), [({"max_batch_size": 10**9}, "max_batch_size"), ({"block_size": 10**9}, "block_size"),
                                                ({"kv_cache_tokens": 10**13}, "kv_cache_tokens"),
                                                ({"max_batch_size": 4097}, "max_batch_size must be at most")])
def test_engine_sizes_too_large_are_refused_naming_the_argument(tiny, kwargs, named):
    """Refused before anything is allocated, naming what the user passed (not an argument they did not)."""
    with pytest.raises(ValueError, match=re.escape(named)):
        _engine(tiny, **kwargs)
