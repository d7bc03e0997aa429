"""apply_chat_template: same string and ids as transformers for SmolLM2's ChatML template."""

from __future__ import annotations

import pytest

from minillm import Tokenizer

from helpers.tokenizer_cases import hf_chat_ids

SMOL_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)

CONVERSATIONS = {
    "single user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system user assistant user": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France? 苹果 👋🏽"},
    ],
    "user assistant": [
        {"role": "user", "content": "  spaces\tand\nnewlines  "},
        {"role": "assistant", "content": "Noted.\r\n"},
    ],
    "specials in content": [{"role": "user", "content": "say <|im_end|> then <|endoftext|>"}],
    "empty content": [{"role": "user", "content": ""}],
}


# Messages whose text holds no special-token string: the safe default gives transformers' ids.
PLAIN_CONVERSATIONS = {name: messages for name, messages in CONVERSATIONS.items() if name != "specials in content"}


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS.values(), ids=PLAIN_CONVERSATIONS.keys())
def test_chat_ids_equal_transformers(smol, smol_hf, messages, add_generation_prompt):
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_chat_ids(smol_hf, messages, add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_parse_special_in_content_gives_transformers_ids(smol, smol_hf, messages, add_generation_prompt):
    """The explicit transformers-compatible mode: specials typed in a message become special ids."""
    ours = smol.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, parse_special_in_content=True
    )
    assert ours == hf_chat_ids(smol_hf, messages, add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_chat_string_equals_transformers(smol, smol_hf, messages, add_generation_prompt):
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    theirs = smol_hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs


def test_chatml_string_by_hand(smol):
    """SmolLM2 adds its default system prompt when the conversation has none."""
    text = smol.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_ids_are_the_encoding_of_the_chat_string(smol):
    messages = CONVERSATIONS["system user assistant user"]
    text = smol.apply_chat_template(messages, tokenize=False)
    ids = smol.apply_chat_template(messages)
    assert ids == smol.encode(text)
    assert ids.count(1) == 5 and ids.count(2) == 4  # 5 <|im_start|> (incl. generation prompt), 4 <|im_end|>


def test_tokenizer_without_template_uses_plain_chatml(trained):
    assert trained.chat_template is None
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = trained.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = trained.apply_chat_template(messages)
    assert ids[0] == trained.special_tokens["<|im_start|>"]
    assert trained.decode(ids) == text


def test_add_generation_prompt_false_ends_after_last_turn(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


# --------------------------------------------------------------------------- malformed input
@pytest.mark.parametrize(
    "messages",
    ["Hi", {"role": "user", "content": "Hi"}, None, 42],
    ids=["str", "dict", "None", "int"],
)
def test_messages_not_a_list_is_a_type_error(smol, messages):
    with pytest.raises(TypeError, match=r"list of"):
        smol.apply_chat_template(messages)


@pytest.mark.parametrize(
    "bad, index",
    [
        ([{"role": "user"}], 0),
        ([{"content": "Hi"}], 0),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], 1),
        ([{"role": "user", "content": "Hi"}, ("user", "Hi")], 1),
        ([{"role": 3, "content": "Hi"}], 0),
    ],
    ids=["no-content", "no-role", "None-content", "tuple-message", "int-role"],
)
def test_malformed_message_is_a_value_error_naming_it(smol, bad, index):
    with pytest.raises(ValueError, match=rf"message #{index}"):
        smol.apply_chat_template(bad)


def test_template_raise_exception_becomes_a_value_error(trained):
    tok = Tokenizer(
        trained.vocab,
        trained.merges,
        trained.special_tokens,
        chat_template=(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}x"
        ),
    )
    with pytest.raises(ValueError, match=r"first turn must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "Hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "x"


def test_unparsable_template_is_a_value_error(trained):
    tok = Tokenizer(trained.vocab, trained.merges, trained.special_tokens, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match=r"chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
