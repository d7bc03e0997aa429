"""Saving as tokenizer.json: HF ``tokenizers`` and transformers load what minillm writes, and
minillm reloads it, with the same ids, special tokens, roles and chat template."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from tokenizers import Tokenizer as HFTokenizer

from minillm import Tokenizer

from helpers.tokenizer_cases import EDGE_TEXT, any_text, hf_ids

# Text that is not in the Shakespeare corpus: modern words, unicode, specials and broken specials.
UNSEEN = (
    "The GPU streams tokens at 1234.5 tok/s; DON'T panic!\n"
    "Café naïve résumé — «quotes» 苹果手机很好用 "
    "👨‍👩‍👧‍👦 🏳️‍🌈 e\u0301\x00\t\r\n"
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|><|im_start| <|endoftext|"
)


@pytest.fixture(scope="module")
def trained_dir(trained, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    trained.save(folder)
    return folder


@pytest.fixture(scope="module")
def trained_hf(trained_dir):
    return HFTokenizer.from_file(str(trained_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def smol_dir(smol, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    smol.save(folder)
    return folder


# --------------------------------------------------------------------------- a trained tokenizer
def test_save_writes_tokenizer_json_and_config(trained_dir):
    assert sorted(p.name for p in trained_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    spec = json.loads((trained_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE"
    assert [t["content"] for t in spec["added_tokens"]] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_hf_loads_trained_tokenizer_with_same_ids_on_unseen_text(trained, trained_hf):
    assert trained.encode(UNSEEN) == hf_ids(trained_hf, UNSEEN)


def test_hf_gives_same_special_ids(trained, trained_hf):
    for content, i in trained.special_tokens.items():
        assert trained_hf.token_to_id(content) == i
    assert trained_hf.get_vocab_size() == len(trained)


@settings(max_examples=100, deadline=None)
@given(any_text)
def test_hf_loads_trained_tokenizer_same_ids_on_arbitrary_text(trained, trained_hf, text):
    ids = trained.encode(text)
    assert ids == hf_ids(trained_hf, text)
    assert trained_hf.decode(ids, skip_special_tokens=False) == text


def test_minillm_reloads_trained_tokenizer_identically(trained, trained_dir):
    again = Tokenizer.from_file(trained_dir)
    assert again.merges == trained.merges
    assert again.vocab == trained.vocab
    assert again.special_tokens == trained.special_tokens
    assert again.encode(UNSEEN) == trained.encode(UNSEEN)
    assert again.encode(EDGE_TEXT) == trained.encode(EDGE_TEXT)


def test_reload_from_the_json_file_path(trained, trained_dir):
    assert Tokenizer.from_file(trained_dir / "tokenizer.json").encode(UNSEEN) == trained.encode(UNSEEN)


def test_save_to_a_file_path_creates_the_folder(trained, tmp_path):
    target = tmp_path / "nested" / "tok.json"
    trained.save(target)
    assert target.is_file() and (target.parent / "tokenizer_config.json").is_file()
    assert Tokenizer.from_file(target).encode(UNSEEN) == trained.encode(UNSEEN)


def test_bos_eos_roles_and_add_flags_survive_and_hf_applies_them(trained, tmp_path):
    """A tokenizer that adds BOS and EOS: HF's post-processor adds the same ids after the round trip."""
    tok = Tokenizer(
        trained.vocab,
        trained.merges,
        trained.special_tokens,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|im_end|>",
        add_bos=True,
        add_eos=True,
    )
    tok.save(tmp_path)
    text = "hello there"
    expected = [tok.bos_id, *tok.encode(text), tok.eos_id]
    assert tok.encode(text, add_special_tokens=True) == expected
    assert hf_ids(HFTokenizer.from_file(str(tmp_path / "tokenizer.json")), text, add_special_tokens=True) == expected
    again = Tokenizer.from_file(tmp_path)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert again.encode(text, add_special_tokens=True) == expected


# --------------------------------------------------------------------------- SmolLM2
def test_hf_loads_saved_smollm2_with_same_ids(smol, smol_dir, corpus_text):
    hf = HFTokenizer.from_file(str(smol_dir / "tokenizer.json"))
    for text in (UNSEEN, EDGE_TEXT, corpus_text[:50_000]):
        assert hf_ids(hf, text) == smol.encode(text)


def test_minillm_reloads_saved_smollm2_identically(smol, smol_dir):
    again = Tokenizer.from_file(smol_dir)
    assert again.merges == smol.merges
    assert again.special_tokens == smol.special_tokens
    assert again.missing_bytes == smol.missing_bytes
    assert (again.bos_id, again.eos_id, again.pad_id) == (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)
    assert again.chat_template == smol.chat_template is not None
    assert again.encode(EDGE_TEXT) == smol.encode(EDGE_TEXT)


def test_transformers_loads_saved_smollm2_with_roles_and_template(smol, smol_dir, smol_hf):
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(smol_dir))
    assert (saved.bos_token, saved.eos_token, saved.pad_token) == (
        smol_hf.bos_token,
        smol_hf.eos_token,
        smol_hf.pad_token,
    )
    assert saved.chat_template == smol_hf.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == smol.apply_chat_template(
        messages, tokenize=False
    )


def test_overlapping_special_tokens_match_leftmost_longest_like_hf(tmp_path):
    """'<|a|><|b|>' is itself a special token: the longest special starting leftmost wins, as in HF."""
    from minillm import train_bpe

    specials = ["<|a|>", "<|a|><|b|>", "<|b|>", "a|><|b"]
    tok = train_bpe("hello world " * 20, 280, specials, progress=False)
    a, ab, b = (tok.special_tokens[s] for s in specials[:3])
    tok.save(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    cases = {"<|a|><|b|><|b|>": [ab, b], "<|a|><|a|><|b|>": [a, ab], "<|b|><|a|>": [b, a]}
    for text, expected in cases.items():
        assert tok.encode(text) == hf_ids(hf, text) == expected
