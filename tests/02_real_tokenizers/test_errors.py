"""Bad input gives a clear error naming the problem (errors.py: every error a user can trigger
is a FileFormatError / FileNotFoundError / TypeError / ValueError whose message names the file,
id or parameter), never a stack trace from deep inside."""

from __future__ import annotations

import json
import os

import pytest
import torch

from minillm import FileFormatError, Tokenizer
from minillm.assets import default_gguf_path
from minillm.tokenizer.bytes_unicode import bytes_to_unicode

from helpers.tokenizer_files import fails_cheaply

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


# --------------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("bad", [b"bytes", None, 42, ["a", "list"]], ids=["bytes", "None", "int", "list"])
def test_encode_non_str_is_a_type_error_mentioning_str(gpt2, bad):
    with pytest.raises(TypeError, match=r"str") as err:
        gpt2.encode(bad)
    assert type(bad).__name__ in str(err.value)


@pytest.mark.parametrize("bad_id", [49152, 10**9, -1], ids=["one-past-end", "huge", "negative"])
def test_decode_unknown_id_is_a_value_error_naming_it(smol, bad_id):
    with pytest.raises(ValueError, match=rf"(?<!\d){bad_id}(?!\d)"):
        smol.decode([19556, bad_id])


def test_decode_unknown_id_in_a_trained_tokenizer(trained):
    with pytest.raises(ValueError, match=r"\b400\b"):
        trained.decode([400])


@pytest.mark.parametrize(
    "bad",
    [["a"], [1.0], [1, None], "abc", b"\x01", None, 7],
    ids=["str-id", "float-id", "None-id", "str", "bytes", "None", "int"],
)
def test_decode_non_int_is_a_type_error(smol, bad):
    with pytest.raises(TypeError, match=r"int"):
        smol.decode(bad)


def test_decode_accepts_a_tensor(smol):
    ids = smol.encode("Hello world")
    assert smol.decode(torch.tensor(ids)) == smol.decode(ids) == "Hello world"


def test_tokenizer_constructor_rejects_merge_whose_result_is_not_in_vocab():
    """A merge (a, b) whose bytes b'ab' have no token is a ValueError naming the merge."""
    with pytest.raises(ValueError, match=r"merge #0"):
        Tokenizer({0: b"a", 1: b"b"}, [(0, 1)])


def test_tokenizer_constructor_rejects_merge_of_unknown_id():
    with pytest.raises(ValueError, match=r"merge #0"):
        Tokenizer({0: b"a", 1: b"b", 2: b"ab"}, [(0, 5)])


def test_role_that_is_not_a_special_token_is_a_value_error():
    with pytest.raises(ValueError, match=r"eos_token '<eos>'"):
        Tokenizer({0: b"a"}, [], eos_token="<eos>")


# --------------------------------------------------------------------------- missing files
def test_missing_path_is_file_not_found_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=str(missing).replace("\\", "\\\\")):
        Tokenizer.from_file(missing)


def test_folder_without_tokenizer_lists_what_was_looked_for(tmp_path):
    (tmp_path / "README.md").write_text("no tokenizer here")
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_file(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message
    for name in ("tokenizer.json", "encoder.json", "vocab.bpe"):
        assert name in message


def test_unknown_file_type_is_a_file_format_error(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("a b\n")
    with pytest.raises(FileFormatError, match="vocab.txt"):
        Tokenizer.from_file(path)


# --------------------------------------------------------------------------- malformed tokenizer.json
def _model(vocab, merges):
    return {"type": "BPE", "vocab": vocab, "merges": merges}


def _bpe_spec(**changes):
    """A valid three-token tokenizer.json ('a', 'b', 'ab'), with some parts replaced."""
    spec = {
        "added_tokens": [],
        "pre_tokenizer": BYTE_LEVEL,
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
    }
    spec.update(changes)
    return json.dumps(spec)


def test_the_valid_base_spec_loads(tmp_path):
    """The malformed cases below each break one thing in this spec."""
    path = tmp_path / "tokenizer.json"
    path.write_text(_bpe_spec())
    assert Tokenizer.from_file(path).encode("abab") == [2, 2]


MALFORMED_JSON = {
    "invalid JSON": "{not json",
    "not UTF-8": b"\xff\xfe{}",
    "a JSON list": "[1, 2, 3]",
    "no model": json.dumps({"version": "1.0", "added_tokens": []}),
    "model without merges": _bpe_spec(model={"type": "BPE", "vocab": {"a": 0}}),
    "merge of an unknown token": _bpe_spec(model=_model({"a": 0, "b": 1, "ab": 2}, ["a zz"])),
    "merge that is not a pair": _bpe_spec(model=_model({"a": 0, "b": 1, "ab": 2}, ["a b c"])),
    "merge whose result is not in the vocab": _bpe_spec(model=_model({"a": 0, "b": 1}, ["a b"])),
    "id that is not an int": _bpe_spec(model=_model({"a": "0"}, [])),
    "negative id": _bpe_spec(model=_model({"a": -5}, [])),
    "vocab that is a list": _bpe_spec(model=_model(["a", "b"], [])),
    "token outside the byte map": _bpe_spec(model=_model({"a": 0, " b": 1}, [])),
    "added token without id": _bpe_spec(added_tokens=[{"content": "<x>"}]),
    "pre_tokenizer that is a string": _bpe_spec(pre_tokenizer="ByteLevel"),
    "unsupported pre_tokenizer": _bpe_spec(pre_tokenizer={"type": "Whitespace"}),
    "WordPiece model": _bpe_spec(model={"type": "WordPiece", "vocab": {"a": 0}, "merges": []}),
    "unsupported normalizer": _bpe_spec(normalizer={"type": "Lowercase"}),
}


@pytest.mark.parametrize("content", MALFORMED_JSON.values(), ids=MALFORMED_JSON.keys())
def test_malformed_tokenizer_json_is_file_format_error_naming_the_file(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(FileFormatError, match=str(path).replace("\\", "\\\\")):
        Tokenizer.from_file(path)


def test_malformed_tokenizer_config_is_file_format_error_naming_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text(_bpe_spec())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(FileFormatError, match="tokenizer_config.json"):
        Tokenizer.from_file(tmp_path)


# --------------------------------------------------------------------------- GPT-2's files
def _gpt2_folder(tmp_path, encoder, merges):
    (tmp_path / "encoder.json").write_text(encoder, encoding="utf-8")
    if isinstance(merges, bytes):
        (tmp_path / "vocab.bpe").write_bytes(merges)
    else:
        (tmp_path / "vocab.bpe").write_text(merges, encoding="utf-8")
    return tmp_path


def test_encoder_json_that_is_a_list_is_file_format_error(tmp_path):
    folder = _gpt2_folder(tmp_path, json.dumps(["a", "b"]), "#version: 0.2\n")
    with pytest.raises(FileFormatError, match="encoder.json"):
        Tokenizer.from_file(folder)


def test_encoder_json_invalid_json_is_file_format_error(tmp_path):
    folder = _gpt2_folder(tmp_path, "{oops", "#version: 0.2\n")
    with pytest.raises(FileFormatError, match="encoder.json"):
        Tokenizer.from_file(folder)


def test_vocab_bpe_merge_of_unknown_token_is_file_format_error(tmp_path):
    folder = _gpt2_folder(tmp_path, json.dumps({"a": 0, "b": 1, "ab": 2}), "#version: 0.2\na zz\n")
    with pytest.raises(FileFormatError, match="vocab.bpe"):
        Tokenizer.from_file(folder)


def test_vocab_bpe_not_utf8_is_file_format_error(tmp_path):
    folder = _gpt2_folder(tmp_path, json.dumps({"a": 0, "b": 1, "ab": 2}), b"#version: 0.2\n\xff\xfe\n")
    with pytest.raises(FileFormatError, match="vocab.bpe"):
        Tokenizer.from_file(folder)


# --------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_head() -> bytes:
    with open(default_gguf_path(), "rb") as f:
        return f.read(1000)


@pytest.mark.parametrize(
    "make",
    [
        lambda head: head,  # truncated: the header says 49152 tokens follow
        lambda head: head[:10],
        lambda head: b"",
        lambda head: os.urandom(4096),
        lambda head: b"GGUF" + os.urandom(4096),
    ],
    ids=["first-1000-bytes", "first-10-bytes", "empty", "random-bytes", "magic-then-random"],
)
def test_corrupt_gguf_is_file_format_error_naming_the_file(tmp_path, gguf_head, make):
    path = tmp_path / "broken.gguf"
    path.write_bytes(make(gguf_head))
    with pytest.raises(FileFormatError, match="broken.gguf"):
        Tokenizer.from_file(path)


def _write_gguf(path, fill):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BYTE_TOKENS = [bytes_to_unicode()[b] for b in range(256)]


def test_hand_written_gguf_tokenizer_loads(tmp_path):
    """A valid GGUF written with gguf's writer: 256 bytes + 'ab', one merge (the baseline)."""

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list([*BYTE_TOKENS, "ab"])
        w.add_token_merges(["a b"])

    tok = Tokenizer.from_file(_write_gguf(tmp_path / "tiny.gguf", fill))
    assert tok.encode("abab") == [256, 256]


def test_gguf_without_tokenizer_metadata_names_the_missing_key(tmp_path):
    path = _write_gguf(tmp_path / "notok.gguf", lambda w: None)
    with pytest.raises(FileFormatError, match=r"notok\.gguf.*tokenizer\.ggml\.model"):
        Tokenizer.from_file(path)


def test_gguf_with_unsupported_tokenizer_model(tmp_path):
    path = _write_gguf(tmp_path / "spm.gguf", lambda w: w.add_tokenizer_model("llama"))
    with pytest.raises(FileFormatError, match=r"spm\.gguf.*'llama'"):
        Tokenizer.from_file(path)


def test_gguf_merge_of_unknown_token(tmp_path):
    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list([*BYTE_TOKENS, "ab"])
        w.add_token_merges(["a zz"])

    path = _write_gguf(tmp_path / "badmerge.gguf", fill)
    with pytest.raises(FileFormatError, match=r"badmerge\.gguf.*merge #0"):
        Tokenizer.from_file(path)


# --------------------------------------------------------------------------- special files, oversized fields
SPECIAL_FILES = ["/proc/self/pagemap", "/proc/self/status", "/proc/cpuinfo", "/proc/self/mem"]


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc")
@pytest.mark.parametrize("target", SPECIAL_FILES)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "encoder.json", "vocab.bpe", "model.gguf"])
def test_a_special_file_behind_a_tokenizer_name_is_an_error_naming_it(tmp_path, target, name):
    """Files under /proc say they are empty (``stat``: a regular file of 0 bytes) and are not:
    reading /proc/self/pagemap raised a bare ``OSError: [Errno 22]`` without a path."""
    if name == "tokenizer_config.json":
        (tmp_path / "tokenizer.json").write_text(_bpe_spec())
    if name in ("encoder.json", "vocab.bpe"):
        _gpt2_folder(tmp_path, json.dumps({"a": 0, "b": 1, "ab": 2}), "#version: 0.2\na b\n")
        (tmp_path / name).unlink()
    os.symlink(target, tmp_path / name)
    loaded = tmp_path / name if name in ("tokenizer.json", "model.gguf") else tmp_path
    fails_cheaply(lambda: Tokenizer.from_file(loaded), FileFormatError, str(tmp_path / name))


def _with_vocab_entry(entry: str) -> str:
    """The base spec with ``entry`` (raw JSON text) added first in model.vocab."""
    return _bpe_spec().replace('"vocab": {', '"vocab": {' + entry + ", ", 1)


HUGE = "9" * 100_000
BIG_TOKEN = "Ġ" * 5_000_000  # 10 MB of UTF-8
OVERSIZED_FIELDS = {
    "vocab id of 100k digits": (_with_vocab_entry(f'"zz": {HUGE}'),
                                ["model.vocab", "'zz'", "<an integer of 100000 digits>"]),
    "negative vocab id of 100k digits": (_with_vocab_entry(f'"zz": -{HUGE}'), ["model.vocab", "100000 digits"]),
    "added token id of 100k digits": (
        _bpe_spec(added_tokens=[{"content": "<x>", "id": 0}]).replace('"id": 0', f'"id": {HUGE}'),
        ["added_tokens[0]", "100000 digits"]),
    "merges entry of 1 MB that is no pair": (
        _bpe_spec(model=_model({"a": 0, "b": 1, "ab": 2}, ["a b", "a " * 500_000])),
        ["model.merges[1]", "merge #1", "is not a pair"]),
    "merges entry of 1 MB with an unknown token": (
        _bpe_spec(model=_model({"a": 0, "b": 1, "ab": 2}, ["a " + "b" * 1_000_000])),
        ["model.merges[0]", "not in the vocabulary"]),
    "token of 10 MB outside the byte map": (
        _bpe_spec(model=_model({"a": 0, "b": 1, "ab": 2, BIG_TOKEN + " ": 3}, ["a b"])),
        ["model.vocab", "5000001 characters", "' '"]),
    "token of 10 MB repeated": (_with_vocab_entry(f'"{BIG_TOKEN}": 0, "{BIG_TOKEN}": 1'), ["appears twice"]),
    "model type of 10 MB": (_bpe_spec(model={"type": "X" * 10_000_000, "vocab": {}, "merges": []}), ["model 'XXX"]),
    "pre-tokenizer of 10 MB": (_bpe_spec(pre_tokenizer={"type": "Y" * 10_000_000}), ["pre_tokenizer"]),
    "pre-tokenizer nested 500 deep": (_bpe_spec(pre_tokenizer=json.loads("[" * 500 + "]" * 500)), ["pre_tokenizer"]),
    "merges nested 100k deep": (_bpe_spec().replace('"merges": ["a b"]', '"merges": ' + "[" * 100_000 + "]" * 100_000),
                                ["nested too deeply"]),
}


@pytest.mark.parametrize("content, fragments", OVERSIZED_FIELDS.values(), ids=OVERSIZED_FIELDS.keys())
def test_an_oversized_field_is_an_error_naming_the_file_and_the_field_shortly(tmp_path, content, fragments):
    """Each error names the file and the field, and shows the value cut short: a message holding
    a 10 MB token, or int() failing on 100k digits without saying where, is no error message."""
    path = tmp_path / "tokenizer.json"
    path.write_text(content, encoding="utf-8")
    fails_cheaply(lambda: Tokenizer.from_file(path), FileFormatError, str(path), *fragments)


def test_an_oversized_config_field_is_named_shortly(tmp_path):
    (tmp_path / "tokenizer.json").write_text(_bpe_spec())
    names = [{"name": "n" * 1_000_000 + str(k), "template": "T"} for k in range(20)]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": names}))
    fails_cheaply(lambda: Tokenizer.from_file(tmp_path), FileFormatError, "tokenizer_config.json", "chat_template",
                  "none named 'default'")


def test_an_oversized_merge_line_in_vocab_bpe_is_named_shortly(tmp_path):
    folder = _gpt2_folder(tmp_path, json.dumps({"a": 0, "b": 1, "ab": 2}), "#version: 0.2\na b\n" + "a " * 500_000)
    fails_cheaply(lambda: Tokenizer.from_file(folder), FileFormatError, "vocab.bpe", "merge #1", "is not a pair")
