"""The OpenAI fields of constrained decoding over HTTP, driven by the openai client: response_format,
logprobs / top_logprobs (chat) and logprobs (completions), logit_bias; streaming and not; a bad
schema among good requests is a 400 that names it, and the server keeps serving."""

from __future__ import annotations

import json
import re

import openai
import pytest

import minillm
from minillm import Engine

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import serving

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
          "required": ["answer", "n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "the king"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_tokenizer, "llama", max_position_embeddings=2048,
                                vocab_size=tiny_tokenizer.vocab_size)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    return minillm.load_model(folder, device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    with serving(Engine(model, tok, max_batch_size=8, backend="eager"), "tiny") as s:
        yield s


def _valid(text: str) -> bool:
    value = json.loads(text)
    return list(value) == ["answer", "n"] and value["answer"] in ("yes", "no") and isinstance(value["n"], int)


def test_chat_json_schema_with_logprobs(served):
    reply = served.client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=FORMAT,
                                                  max_tokens=60, temperature=0, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert _valid(choice.message.content)
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens  # every generated token, the final eos included
    assert "".join(entry.token for entry in content).startswith(choice.message.content)
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_streamed_chat_json_object_and_its_logprobs(served):
    stream = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, stream=True,
                                                   response_format={"type": "json_object"}, temperature=0.8, seed=4,
                                                   logprobs=True, stream_options={"include_usage": True})
    text, entries, finish, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs else []
            finish = choice.finish_reason or finish
    assert len(entries) == usage.completion_tokens
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_completions_logprobs_in_the_legacy_shape(served):
    reply = served.client.completions.create(model="tiny", prompt="the king", max_tokens=8, logprobs=2,
                                             temperature=0, extra_body={"response_format": {"type": "regex", "regex": "[a-z ]+"}})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert re.fullmatch("[a-z ]*", reply.choices[0].text)


def test_logit_bias_forces_a_token(served, tiny):
    reply = served.client.completions.create(model="tiny", prompt="the king", max_tokens=3, temperature=1.0,
                                             logit_bias={"65": 100}, seed=0)
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].text == tiny[1].decode([65] * 3)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                               "patternProperties": {}}}}},
     "response_format", "patternProperties"),
    ({"response_format": {"type": "regex", "regex": "[a-z]{1,400}" * 40}}, "response_format", "MAX_"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"logit_bias": {"5": 1000}}, None, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, None, "top_logprobs"),
])
def test_bad_constraints_are_a_400_and_the_server_keeps_serving(served, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
    assert words in caught.value.message
    if param is not None:
        assert caught.value.body.get("param") == param
    reply = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                                  response_format={"type": "regex", "regex": "(yes|no)"})
    assert reply.choices[0].message.content in ("yes", "no")


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(served, tiny):
    """lm-evaluation-harness's local-completions: token-id prompts, echo, logprobs=1, max_tokens=1;
    it sums token_logprobs[context:-1] and compares each with max(top_logprobs)."""
    model, tok = tiny
    prompts = [tok.encode("the king is dead"), tok.encode("long live the queen")]
    reply = served.client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                             temperature=0, seed=1234)
    for choice, ids in zip(sorted(reply.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert choice.text.startswith(tok.decode(ids))
        expected = [s.logprob for s in served_engine_score(model, ids)[1:]]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-9)  # float64: one forward's rounding
        for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert max(top.values()) >= value - 1e-12


def served_engine_score(model, ids):
    from minillm.engine.scoring import prompt_logprobs

    return prompt_logprobs(model, ids)


def test_echo_with_max_tokens_0_and_streamed(served, tiny):
    reply = served.client.completions.create(model="tiny", prompt="the king", echo=True, logprobs=0, max_tokens=0)
    assert reply.choices[0].text == "the king" and reply.usage.completion_tokens == 0
    chunks = list(served.client.completions.create(model="tiny", prompt="the king", echo=True, max_tokens=3,
                                                   temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = served.client.completions.create(model="tiny", prompt="the king", echo=True, max_tokens=3, temperature=0)
    assert text == whole.choices[0].text and text.startswith("the king")
    with pytest.raises(openai.BadRequestError, match="only allowed with echo"):
        served.client.completions.create(model="tiny", prompt="the king", max_tokens=0)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_tool_call_is_a_valid_call(served, choice):
    reply = served.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                  tool_choice=choice, max_tokens=120, temperature=0.7, seed=2)
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    if finish == "length":  # the random model ran out of tokens inside the call: text, as OpenAI returns it
        return
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and arguments["zone"] in ("utc", "local")
    elif call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def test_a_streamed_tool_call_arrives_whole_and_the_conversation_goes_on(served):
    choice = {"type": "function", "function": {"name": "get_time"}}
    stream = served.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                   tool_choice=choice, max_tokens=60, temperature=0, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and content == ""
    call = calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    answer = served.client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, CLOCK],
                                                   tool_choice="none", max_tokens=5, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "patternProperties": {}}}}],
      "tool_choice": "required"}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(served, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
    assert caught.value.body.get("param") == param
