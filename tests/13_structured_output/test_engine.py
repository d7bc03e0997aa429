"""Constrained decoding, logprobs and logit_bias through the Engine and the CLI.

A tiny random model (float64, so the log-probabilities can be compared exactly with a plain
forward) over a small byte-level tokenizer: whatever it would say unconstrained, a constrained
request's output must match its pattern, in every batch and with every decoding rule.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import minillm
import minillm.__main__ as cli
from minillm import Engine, SamplingParams
from minillm.structured import GrammarTooLarge, SchemaError, compile_regex

from helpers.checkpoints import tiny_hf_checkpoint

# Patterns with the same meaning for Python's ``re`` (checked with fullmatch) and for minillm.
BOUNDED = [r"(yes|no)", r"[0-9]{3}-[0-9]{4}"]  # every match is short: the output must end in eos
PATTERNS = BOUNDED + [r"the (king|queen)( and the (king|queen))*\.", r"[a-z]+( [a-z]+){0,3}"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 5}},
                                                "required": ["kind"]}]},
    },
    "required": ["name", "age", "tags", "pet"],
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    config_file = folder / "tokenizer_config.json"  # name the end-of-sequence token, as real checkpoints do
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    model, tok = minillm.load_model(tiny_folder, device="cpu", dtype=torch.float64)
    return model, tok


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    return Engine(model, tok, max_batch_size=8, backend="eager")


def _constrained(engine, prompts, pattern, **kw) -> list:
    params = SamplingParams(max_new_tokens=40, response_format={"type": "regex", "regex": pattern}, **kw)
    return engine.generate(prompts, params)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_finished_constrained_output_matches_its_pattern(engine, pattern, temperature):
    completions = _constrained(engine, ["the king", "to be", "a"], pattern, temperature=temperature, seed=3)
    if pattern in BOUNDED:  # once the output is a whole match, only eos is allowed
        assert [c.finish_reason for c in completions] == ["eos"] * 3
    for c in completions:
        if c.finish_reason == "eos":
            assert re.fullmatch(pattern, c.text), (pattern, c.text)
        else:  # cut by max_new_tokens: still a prefix of some match
            assert c.finish_reason == "length"
            assert compile_regex(pattern).is_prefix(c.text.encode()), (pattern, c.text)


def test_a_json_schema_output_is_valid_json_with_the_required_fields(engine):
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=0, n=4,
                            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    completions = engine.generate(["the king"], params)
    ends = [c for c in completions if c.finish_reason == "eos"]
    assert ends
    for c in ends:
        value = json.loads(c.text)
        assert list(value) == ["name", "age", "tags", "pet"]  # the declared order
        assert isinstance(value["age"], int)
        assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 3
        assert value["pet"] is None or set(value["pet"]) == {"kind"}


def test_json_object_mode_gives_an_object(engine):
    params = SamplingParams(max_new_tokens=80, temperature=0.7, seed=1, n=2, response_format={"type": "json_object"})
    for c in engine.generate(["the"], params):
        if c.finish_reason == "eos":
            assert isinstance(json.loads(c.text), dict)


def test_constrained_and_free_rows_share_a_batch_without_touching_each_other(engine):
    free = SamplingParams(max_new_tokens=12, temperature=0.9, seed=5)
    alone = engine.generate(["to be or not"], free)[0]
    constrained = SamplingParams(max_new_tokens=12, response_format={"type": "regex", "regex": "[0-9]+"})
    mixed = engine.generate(["the king", "to be or not", "a"], [constrained, free, constrained])
    assert mixed[1].token_ids == alone.token_ids
    assert all(re.fullmatch("[0-9]*", c.text) for c in (mixed[0], mixed[2]))


def test_logprobs_are_the_raw_log_softmax_of_the_model(engine, tiny):
    model, tok = tiny
    prompt = tok.encode("the king and")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, logprobs=3,
                            response_format={"type": "regex", "regex": "[a-z ]+"}, logit_bias={"5": 10})
    c = engine.generate([prompt], params)[0]
    assert len(c.logprobs) == len(c.token_ids)
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), dim=-1)  # [seq, vocab], float64
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = logp[len(prompt) - 1 + i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-9)  # before bias, grammar, temperature
        best = row.topk(3)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-9)


def test_greedy_logprobs_put_the_chosen_token_first(engine):
    c = engine.generate(["to be"], SamplingParams(max_new_tokens=5, logprobs=1))[0]
    assert [lp.top[0][0] for lp in c.logprobs] == c.token_ids
    assert all(lp.logprob <= 0 for lp in c.logprobs)
    assert engine.generate(["to be"], SamplingParams(max_new_tokens=5))[0].logprobs is None


def test_logit_bias_bans_and_forces_tokens(engine):
    plain = engine.generate(["the king"], SamplingParams(max_new_tokens=4))[0].token_ids
    banned = engine.generate(["the king"], SamplingParams(max_new_tokens=4, logit_bias={plain[0]: -100}))[0]
    assert banned.token_ids[0] != plain[0]
    forced = engine.generate(["the king"], SamplingParams(max_new_tokens=3, logit_bias={"42": 100}, temperature=1.0,
                                                          seed=0))[0]
    assert forced.token_ids == [42, 42, 42]


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match="logit_bias token id 300 is outside the vocabulary"):
        engine.generate(["a"], SamplingParams(logit_bias={300: 1}))


@pytest.mark.parametrize("params, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "patternProperties": {}}}}),
     "patternProperties"),
    (dict(response_format={"type": "regex", "regex": "(a"}), r"missing '\)'"),
    (dict(response_format={"type": "xml"}), "response_format type"),
    (dict(response_format={"type": "json_object"}, ignore_eos=True), "ignore_eos"),
    (dict(response_format={"type": "json_object"}, num_beams=2), "beam search"),
    (dict(logprobs=21), "logprobs must be in"),
    (dict(logit_bias={1: 101}), r"logit_bias\[1\]"),
    (dict(logit_bias={"x": 1}), "logit_bias token id"),
])
def test_bad_constraints_are_refused_by_name(params, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**params)
    assert issubclass(SchemaError, ValueError)


def test_a_grammar_too_large_fails_its_request_and_the_engine_goes_on(engine):
    with pytest.raises(GrammarTooLarge):
        _constrained(engine, ["a"], "(a|b|c|d|e|f)" * 8 + "[a-z]{1,400}" * 40)
    assert engine.manager.allocator.num_free == engine.manager.allocator.num_blocks
    assert re.fullmatch("(yes|no)", _constrained(engine, ["a"], "(yes|no)")[0].text)


def test_the_cli_constrains_with_a_regex_and_a_schema_file(tiny_folder, tmp_path, capsys):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(SCHEMA))
    base = ["generate", "--model", str(tiny_folder), "--backend", "eager", "--json", "--prompt", "the king"]
    assert cli.main(base + ["--regex", "[0-9]{3}", "--max-new-tokens", "10", "--logprobs", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert re.fullmatch("[0-9]{3}", record["text"]) and record["finish_reason"] == "eos"
    assert len(record["logprobs"]) == len(record["token_ids"]) and len(record["logprobs"][0]["top"]) == 2
    assert cli.main(base + ["--json-schema", str(schema_file), "--max-new-tokens", "200", "--temperature", "0.5",
                            "--seed", "0"]) == 0
    record = json.loads(capsys.readouterr().out)
    if record["finish_reason"] == "eos":
        assert list(json.loads(record["text"])) == ["name", "age", "tags", "pet"]
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(base + ["--json-schema", str(tmp_path / "bad.json")]) != 0
    assert "not a JSON file" in capsys.readouterr().err
