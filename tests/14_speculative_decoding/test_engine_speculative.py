"""Speculative decoding in the Engine keeps the output: greedy exactly, sampling in distribution.

A tiny float64 model is the target (exact arithmetic: the verify step's rows and a plain decode
step's agree to the last bit that matters); a smaller tiny model with the same tokenizer drafts.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers.checkpoints import tiny_hf_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import minillm
from minillm import DraftModel, Engine, SamplingParams
from minillm.engine.speculation import Drafts
from minillm.sampling import filtered_distribution

DRAFT_NOISE = 0.3
TEXT = "the king is dead, long live the king! the king is dead, long live the queen"


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("spec")
    target = tiny_hf_checkpoint(folder / "target", tiny_tokenizer, "llama", vocab_size=tiny_tokenizer.vocab_size)
    model, tok = minillm.load_model(target, device="cpu", dtype="float64")
    draft_model, _ = minillm.load_model(target, device="cpu", dtype="float64")
    with torch.no_grad():  # the draft: the target with a noisy head, so its guesses are often but not always kept
        noise = torch.randn(draft_model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        draft_model.lm_head.weight += DRAFT_NOISE * noise
    return model, tok, draft_model


def _engine(models, speculative=None, **kw):
    model, tok, draft_model = models
    eos = [tok.special_tokens["<|endoftext|>"]]
    if speculative == "draft":
        speculative = DraftModel(draft_model)
    return Engine(model, tok, backend="eager", block_size=4, eos_ids=eos, speculative=speculative,
                  adaptive_speculation=False, **kw)


class Garbage:
    """A proposer that proposes random tokens: the output must not change, only the speed."""

    name, free = "garbage", True

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.random, self.vocab = random.Random(seed), vocab

    def propose(self, requests, counts):
        return [Drafts([self.random.randrange(self.vocab) for _ in range(n)]) for n in counts]

    def seconds_per_draft(self) -> float:
        return 0.0


def _mixed_batch(tok):
    prompts = [TEXT, "long live", TEXT[:40], "the queen is"]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True),
              SamplingParams(max_new_tokens=9, repetition_penalty=1.3, logprobs=2),
              SamplingParams(max_new_tokens=20, stop=["king"]),
              SamplingParams(max_new_tokens=6, num_beams=3)]
    return prompts, params


@pytest.mark.parametrize("speculative", ["prompt-lookup", "draft", "garbage"])
def test_greedy_output_is_identical_on_a_mixed_batch(models, speculative):
    tok = models[1]
    prompts, params = _mixed_batch(tok)
    plain = _engine(models).generate(prompts, params)
    proposer = Garbage(tok.vocab_size) if speculative == "garbage" else speculative
    engine = _engine(models, proposer, num_speculative_tokens=5)
    fast = engine.generate(prompts, params)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert [c.text for c in fast] == [c.text for c in plain]
    assert [c.finish_reason for c in fast] == [c.finish_reason for c in plain]
    assert [[t.token_id for t in c.logprobs or []] for c in fast] == [[t.token_id for t in c.logprobs or []] for c in plain]
    stats = engine.speculation_stats
    assert stats.verifications > 0 and stats.proposed >= stats.accepted
    if speculative == "prompt-lookup":
        assert stats.accepted > 0  # the repeated text is found again
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks  # every block back


def test_a_grammar_constrained_request_speculates_and_stays_valid(models):
    tok = models[1]
    params = SamplingParams(max_new_tokens=30, response_format={"type": "regex", "regex": "(the king ){2,5}is dead"})
    plain = _engine(models).generate([TEXT], params)[0]
    engine = _engine(models, "prompt-lookup")
    fast = engine.generate([TEXT], params)[0]
    assert fast.token_ids == plain.token_ids and fast.finish_reason == plain.finish_reason
    assert engine.speculation_stats.verifications > 0


def test_seeded_sampling_with_prompt_lookup_draws_the_same_tokens(models):
    """Prompt lookup's drafts are deterministic (q one-hot): a sampled row draws its token as it
    would anyway and keeps the draft when they agree, so a seed gives the same text."""
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_k=20, seed=7, n=4, ignore_eos=True)
    plain = _engine(models).generate([TEXT], params)
    engine = _engine(models, "prompt-lookup", num_speculative_tokens=4)
    fast = engine.generate([TEXT], params)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert engine.speculation_stats.verifications > 0


def test_requests_opt_out_and_in(models):
    engine = _engine(models, "prompt-lookup")
    engine.generate([TEXT], SamplingParams(max_new_tokens=12, speculative=False))
    assert engine.speculation_stats.verifications == 0
    plain_engine = _engine(models)  # no proposer: a request that asks gets prompt lookup
    plain_engine.generate([TEXT], SamplingParams(max_new_tokens=12, speculative=True, ignore_eos=True))
    assert plain_engine.speculation_stats.verifications > 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(alphabet="the king is dead long live queen!,", min_size=1, max_size=60), min_size=1, max_size=4),
       st.integers(1, 6), st.integers(0, 2**16), st.booleans())
def test_any_prompts_and_garbage_drafts_leave_output_and_pool_intact(models, texts, k, seed, prefix_caching):
    tok = models[1]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = _engine(models, kv_cache_tokens=256).generate(texts, params)
    engine = _engine(models, Garbage(tok.vocab_size, seed), num_speculative_tokens=k, kv_cache_tokens=256,
                     prefix_caching=prefix_caching)
    assert [c.token_ids for c in engine.generate(texts, params)] == [c.token_ids for c in plain]
    allocator = engine.manager.allocator
    assert allocator.num_free == allocator.num_blocks or prefix_caching  # cached blocks stay, unreferenced
    assert all(count == 0 for count in allocator.ref_counts)


def _exact_triples(models, prompt, params):
    """The target's own distribution of the first three tokens, from full forwards (float64):
    the first comes from the prefill, the next two from verify steps (one draft, then its bonus)."""
    model, tok, _ = models
    ids = tok.encode(prompt)

    def dist(seq):
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1:]
        return filtered_distribution(logits, torch.tensor([seq]), params)[0]

    out = {}
    p1 = dist(ids)
    for a in p1.nonzero()[:, 0].tolist():
        p2 = dist(ids + [a])
        for b in p2.nonzero()[:, 0].tolist():
            p3 = dist(ids + [a, b])
            for c in p3.nonzero()[:, 0].tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


# (top-k in each: the exact distribution of three tokens is enumerated, k**3 outputs at most)
CONFIGS = [dict(temperature=1.0, top_k=6), dict(temperature=0.7, top_k=10, top_p=0.9),
           dict(temperature=1.3, top_k=8, repetition_penalty=1.4)]


@pytest.mark.parametrize("config", CONFIGS, ids=["t1-top_k", "t0.7-top_p", "t1.3-penalty"])
def test_draft_model_sampling_keeps_the_targets_distribution(models, config):
    exact = _exact_triples(models, TEXT[:30], SamplingParams(**config))
    engine = _engine(models, "draft", num_speculative_tokens=2, max_batch_size=128)
    counts = _sampled(engine, config, draws=2048)
    stats = engine.speculation_stats
    print(f"drafts kept: {stats.acceptance_rate:.2f}")
    assert 0 < stats.accepted < stats.proposed
    p_value = _chi_square_p(counts, exact)
    print(f"chi-square p = {p_value:.3g}")
    assert p_value > 0.01


def test_a_residual_that_is_the_target_itself_fails_the_same_test(models, monkeypatch):
    """The classic mistake, after a rejection drawing from p instead of max(0, p - q)."""
    from minillm.sampling import sampler

    def broken(p, token, q, generator=None):
        if torch.rand((), generator=generator) * q[token] < p[token]:
            return token
        return int(torch.multinomial(p, 1, generator=generator))

    monkeypatch.setattr(sampler, "accept_or_resample", broken)
    config = CONFIGS[0]
    exact = _exact_triples(models, TEXT[:30], SamplingParams(**config))
    counts = _sampled(_engine(models, "draft", num_speculative_tokens=2, max_batch_size=128), config, draws=2048)
    p_value = _chi_square_p(counts, exact)
    print(f"broken residual: chi-square p = {p_value:.3g}")
    assert p_value < 1e-6


def _sampled(engine, config, draws):
    counts: dict[tuple[int, ...], int] = {}
    for start in range(0, draws, 128):
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1000 + start, n=128, **config)
        for c in engine.generate([TEXT[:30]], params):
            counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    return counts


def _chi_square_p(counts, exact) -> float:
    """Chi-square over the outputs, the rare ones (expected < 5) pooled into one cell."""
    total = sum(counts.values())
    assert set(counts) <= set(exact), "an output the target cannot produce came out"
    common = [pair for pair, p in exact.items() if p * total >= 5]
    observed = [counts.get(pair, 0) for pair in common] + [total - sum(counts.get(pair, 0) for pair in common)]
    expected = [exact[pair] * total for pair in common]
    expected.append(total - sum(expected))
    return float(chisquare(observed, expected).pvalue)


def test_bad_settings_are_refused_by_name(models):
    model, tok, _ = models
    with pytest.raises(ValueError, match="speculative must be"):
        Engine(model, tok, backend="eager", speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, tok, backend="eager", speculative="prompt-lookup", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(num_beams=2, speculative=True)
    with pytest.raises(TypeError, match="speculative"):
        SamplingParams(speculative="yes")


def test_a_draft_model_with_another_vocabulary_is_refused(models, tmp_path, tiny_tokenizer):
    model, tok, _ = models
    other = tiny_hf_checkpoint(tmp_path / "other", tiny_tokenizer, "llama", vocab_size=tiny_tokenizer.vocab_size + 8)
    draft, _ = minillm.load_model(other, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        Engine(model, tok, backend="eager", speculative=DraftModel(draft))


def test_the_cli_speculates_with_the_same_output(models, tmp_path, tiny_tokenizer, capsys):
    from minillm import __main__ as cli

    folder = tiny_hf_checkpoint(tmp_path / "tiny", tiny_tokenizer, "llama", vocab_size=tiny_tokenizer.vocab_size)
    base = ["generate", "--model", str(folder), "--backend", "eager", "--json", "--prompt", TEXT, "--prompt", "long live",
            "--max-new-tokens", "20"]
    records = {}
    for extra in ([], ["--speculative", "prompt-lookup", "--num-speculative-tokens", "3"], ["--speculative", f"draft:{folder}"]):
        assert cli.main(base + extra) == 0
        out = capsys.readouterr()
        records[tuple(extra)] = [json.loads(line)["token_ids"] for line in out.out.splitlines()]
        if extra:
            assert "drafts kept" in out.err
    assert len(set(map(str, records.values()))) == 1
    assert cli.main(base + ["--speculative", "medusa"]) != 0
    assert "speculative must be" in capsys.readouterr().err


def test_the_server_speculates_with_the_same_answers_and_counts_drafts(models):
    from helpers.serving import serving

    model, tok, _ = models
    reference = _engine(models).generate([TEXT, "the queen is"], SamplingParams(max_new_tokens=16, ignore_eos=True))
    engine = Engine(model, tok, backend="eager", speculative="prompt-lookup", kv_cache_tokens=1024)
    with serving(engine, "tiny") as served:
        for prompt, expected in zip([TEXT, "the queen is"], reference):
            answer = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                      extra_body={"ignore_eos": True})
            assert answer.choices[0].text == expected.text
        metrics = served.metrics()
    assert 0 < metrics["minillm_speculative_drafts_accepted_total"] <= metrics["minillm_speculative_drafts_total"]
