"""Hostile model files fail fast and clearly: no hang, no unbounded memory, no file read outside
the checkpoint, no silently wrong numbers, no raw exception from deep inside a library.

Each test covers a *class* of defect, mostly with a generator (random declared sizes, random
shard names, random config values), and asserts laws: which error, naming what, raised before
which work. Nothing asserts wall time; a ``time_limit`` turns a hang into a failure instead.

The fuzz tests at the end feed mutated bytes of small valid files (a GGUF written with gguf's
writer, a safetensors checkpoint, its config.json) to the loaders: every input must load or
raise FileFormatError / ValueError / TypeError. A normal run tries a few dozen inputs each;
``MINILLM_FUZZ_EXAMPLES=20000`` (``make fuzz``) tries many more, with a fresh random seed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import struct
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import minillm
from minillm import FileFormatError, Tokenizer
from minillm.gguf_io import open_gguf
from minillm.model import checkpoint, loading

from helpers.checkpoints import DEFAULT_GGUF_META, write_gguf

FUZZ_EXAMPLES = int(os.environ.get("MINILLM_FUZZ_EXAMPLES", "0"))  # 0: the normal, quick run
CLEAR_ERRORS = (FileFormatError, ValueError, TypeError)
HAS_FIFO = hasattr(os, "mkfifo")
BIG = st.one_of(st.integers(0, 64), st.sampled_from([2**31 - 1, 2**32 - 1, 2**32, 2**60, 2**63, 2**64 - 1]),
                st.integers(0, 2**64 - 1))


def fuzz_settings(quick: int) -> settings:
    """``quick`` examples, the same ones every run; or MINILLM_FUZZ_EXAMPLES random ones."""
    if FUZZ_EXAMPLES:
        return settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))
    return settings(max_examples=quick, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class Hang(Exception):
    """Raised by ``time_limit`` when the code under test runs far longer than any failure should."""


@contextmanager
def time_limit(seconds: float = 20.0) -> Iterator[None]:
    """Turn a hang into a failing test (a loop in Python code is interrupted by the signal)."""
    if sys.platform == "win32":
        yield
        return

    def expire(*_: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def peak_memory_below(limit_mb: float) -> Iterator[None]:
    """Fail if Python and numpy allocate more than ``limit_mb`` at once inside the block."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit_mb * 2**20, f"peak allocation {peak / 2**20:.0f} MB"


def expect_clear_error(run: Callable[[], Any], *names: str) -> None:
    """``run`` loads or raises a clear error whose message names one of ``names`` (file names).
    The outcome is a hypothesis event: ``--hypothesis-show-statistics`` shows how deep the inputs got."""
    try:
        with time_limit():
            run()
        event("loaded")
    except CLEAR_ERRORS as err:
        assert any(name in str(err) for name in names), f"{type(err).__name__} names none of {names}: {err}"
        event(f"{type(err).__name__}: {_gist(str(err))}")


def _gist(message: str) -> str:
    """The kind of an error message: what follows the file name, without the numbers."""
    detail = message.split(": ", 1)[-1]
    return re.sub(r"[\d,]+|'[^']*'|\[[^]]*\]", "#", detail)[:60]


# --------------------------------------------------------------------------- tiny files
def _copy(pristine: Path, where: Path, **config_changes: Any) -> Path:
    folder = where / "ckpt"
    shutil.copytree(pristine, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture()
def ckpt(pristine, tmp_path) -> Path:
    return _copy(pristine, tmp_path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, pristine, tiny_tokenizer) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", pristine, tiny_tokenizer)


def test_the_tiny_gguf_loads_and_matches_its_safetensors_twin(tiny_gguf, pristine):
    """The baseline for the GGUF cases: written by gguf's writer, read by minillm's reader."""
    from_gguf, tok = minillm.load_model(tiny_gguf, device="cpu")
    from_folder, _ = minillm.load_model(pristine, device="cpu")
    ids = torch.tensor([tok.encode("To be, or not to be")])
    assert torch.allclose(from_gguf(ids), from_folder(ids), atol=1e-5)


# --------------------------------------------------------------------------- 1. bounded work and memory
HOSTILE_51 = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)
              + struct.pack("<IQ", 0, 2**60) + b"xx")


def test_the_51_byte_gguf_is_refused_at_once_by_every_reader(tmp_path):
    """An array that declares 2**60 items in a 51-byte file: refused before any loop."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE_51)
    assert len(HOSTILE_51) == 51
    for read in (open_gguf, Tokenizer.from_file, lambda p: minillm.load_model(p, device="cpu")):
        with time_limit(), peak_memory_below(20), pytest.raises(FileFormatError) as err:
            read(path)
        assert "hostile.gguf: not a readable GGUF file" in str(err.value)
        assert "1,152,921,504,606,846,976" in str(err.value) and "2 remain" in str(err.value)


def test_the_cli_refuses_the_51_byte_gguf(tmp_path, capsys):
    from minillm.__main__ import main

    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE_51)
    with time_limit():
        assert main(["generate", "--prompt", "x", "--model", str(path), "--device", "cpu"]) == 1
    assert "hostile.gguf: not a readable GGUF file" in capsys.readouterr().err


@st.composite
def gguf_headers(draw) -> bytes:
    """A GGUF header whose every count, length, type, dimension and offset is random."""
    out = b"GGUF" + struct.pack("<IQQ", draw(st.sampled_from([3, 2, 1, 0x03000000])), draw(BIG), draw(BIG))
    for _ in range(draw(st.integers(0, 3))):  # key/values
        key = draw(st.binary(max_size=6))
        out += struct.pack("<Q", draw(st.one_of(st.just(len(key)), BIG))) + key
        value_type = draw(st.integers(0, 13))
        out += struct.pack("<I", value_type)
        if value_type == 9:  # an array: item type and count
            out += struct.pack("<IQ", draw(st.integers(0, 13)), draw(BIG))
        elif value_type == 8:
            out += struct.pack("<Q", draw(BIG))
        out += draw(st.binary(max_size=24))
    for _ in range(draw(st.integers(0, 2))):  # tensor descriptions
        n_dims = draw(st.one_of(st.integers(0, 5), BIG.map(lambda n: n % 2**32)))
        out += struct.pack("<Q", 1) + b"t" + struct.pack("<I", n_dims)
        out += b"".join(struct.pack("<Q", draw(BIG)) for _ in range(draw(st.integers(0, 4))))
        out += struct.pack("<IQ", draw(st.integers(0, 40)), draw(BIG))
    return out + draw(st.binary(max_size=64))


@given(header=gguf_headers())
@fuzz_settings(60)
def test_declared_sizes_never_drive_work_or_memory(tmp_path_factory, header):
    """Whatever a header declares, reading it is bounded by the file's size: it parses or is a
    FileFormatError naming the file, with little memory, and the loaders say the same."""
    path = tmp_path_factory.mktemp("hdr") / "random.gguf"
    path.write_bytes(header)
    with time_limit(), peak_memory_below(20):
        try:
            open_gguf(path)
        except FileFormatError as err:
            assert "random.gguf: not a readable GGUF file" in str(err)
    expect_clear_error(lambda: Tokenizer.from_file(path), "random.gguf")
    expect_clear_error(lambda: minillm.load_model(path, device="cpu"), "random.gguf")


@pytest.mark.parametrize(
    "body, says",
    [
        (struct.pack("<Q", 2**63) + b"key", "metadata key #0 needs 9,223,372,036,854,775,808 bytes"),
        (struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 8, 2**62), "'a' (4,611,686,018,427,387,904 strings)"),
        (struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 9, 1), "an array of arrays"),
        (struct.pack("<Q", 1) + b"a" + struct.pack("<I", 77), "unknown value type 77"),
    ],
    ids=["key-length", "string-array-count", "nested-array", "value-type"],
)
def test_each_declared_length_is_checked_before_it_is_used(tmp_path, body, says):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body + b"\0" * 16)
    with pytest.raises(FileFormatError, match="m.gguf: not a readable GGUF file") as err:
        open_gguf(path)
    assert says in str(err.value)


@pytest.mark.parametrize(
    "tensor_count, info, says",
    [
        (2**60, b"", "1,152,921,504,606,846,976 tensor descriptions"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 2**32 - 1), "declares 4,294,967,295 dimensions"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<I2QIQ", 2, 2**40, 2**40, 0, 0), "needs bytes"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 0, 2**63), "needs bytes"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 0, 3), "not a multiple of the alignment"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 99, 0), "unknown ggml type 99"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 31, 8, 0), "not whole Q8_0 blocks"),
        (1, struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 0, 0, 0), "has a dimension of 0"),
        (1, struct.pack("<Q", 64) + b"t" * 64 + struct.pack("<IQIQ", 1, 4, 0, 0), "is longer than 63 bytes"),
    ],
    ids=["count", "n-dims", "dims", "offset", "alignment", "type", "block", "empty", "long-name"],
)
def test_tensor_descriptions_must_fit_in_the_file(tmp_path, tensor_count, info, says):
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensor_count, 0) + info + b"\0" * 64)
    with pytest.raises(FileFormatError, match="t.gguf: not a readable GGUF file") as err:
        open_gguf(path)
    assert says in str(err.value)


@pytest.mark.parametrize(
    "cap, header, body",
    [
        ("MAX_VALUES", (0, 1), struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 11) + b"\0" * 11),
        ("MAX_KEYS", (0, 11), b"\0" * 200),
        ("MAX_TENSORS", (11, 0), b"\0" * 400),
    ],
)
def test_even_consistent_sizes_have_an_absolute_cap(tmp_path, monkeypatch, cap, header, body):
    """Each value becomes a Python object ~10x its size in the file, so counts are capped too."""
    monkeypatch.setattr(minillm.gguf_io, cap, 10)
    path = tmp_path / "many.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *header) + body)
    with pytest.raises(FileFormatError, match=r"many\.gguf: not a readable GGUF file \(.*more than the 10 "):
        open_gguf(path)


def _never_built(monkeypatch) -> None:
    """Make building a model (even shapes-only) fail the test: the refusal must come first."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built before the config was checked")

    monkeypatch.setattr(checkpoint, "Transformer", built)


@pytest.mark.parametrize("layers", [200_000, 3, 2**31 - 1])
def test_a_layer_count_the_weights_do_not_hold_is_refused_before_building(pristine, tmp_path, monkeypatch, layers):
    folder = _copy(pristine, tmp_path, num_hidden_layers=layers)
    _never_built(monkeypatch)
    says = rf"config\.json: num_hidden_layers={layers:,} but the weights hold 2 layers"
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(folder, device="cpu")


@pytest.mark.parametrize("layers", [200_000, 1])
def test_a_gguf_layer_count_the_weights_do_not_hold_is_refused_before_dequantizing(tmp_path, pristine, tiny_tokenizer,
                                                                                  monkeypatch, layers):
    path = write_gguf(tmp_path / "layers.gguf", pristine, tiny_tokenizer, meta={"llama.block_count": layers})
    monkeypatch.setattr(loading, "read_gguf_state_dict", lambda *a: pytest.fail("dequantized before checking"))
    says = rf"layers\.gguf: llama\.block_count={layers:,} but the weights hold 2 layers"
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(path, device="cpu")


@pytest.mark.parametrize("context", [2**40, 2**24 + 1, 10**30])
def test_an_absurd_context_is_refused_naming_the_field(pristine, tmp_path, monkeypatch, context):
    folder = _copy(pristine, tmp_path, max_position_embeddings=context)
    _never_built(monkeypatch)
    says = r"config\.json: max_position_embeddings=\d+ must be between 1 and 16,777,216"
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(folder, device="cpu")


def test_rope_allocates_nothing_per_position_of_the_context(pristine, tmp_path):
    """The largest context allowed costs no memory: cos/sin are computed for the positions used."""
    folder = _copy(pristine, tmp_path, max_position_embeddings=2**24)
    model, _ = minillm.load_model(folder, device="cpu")
    assert sum(b.numel() for b in model.rotary.buffers()) == model.config.head_dim // 2
    positions = torch.tensor([[0, 1, 2, 1000]])
    cos, sin = model.rotary(positions, torch.float32)
    angles = positions[0, :, None].double() * model.rotary.inv_freq.double()
    assert torch.allclose(cos[0, 0, :, :8].double(), angles.cos(), atol=1e-5)
    assert torch.allclose(sin[0, 0, :, 8:].double(), angles.sin(), atol=1e-5)
    small = minillm.model.rope.RotaryEmbedding(16, 100, 10000.0)
    assert torch.equal(small(torch.arange(100)[None], torch.float32)[0][0, 0], small.cos)  # the table, on demand


SIZE_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "max_position_embeddings"]
JSON_VALUES = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, -1, 2**31, 2**40, 2**63, True, None, 1.5]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                        st.lists(st.integers(0, 9), max_size=2),
                        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@given(field=st.sampled_from(SIZE_FIELDS), value=JSON_VALUES)
@fuzz_settings(80)
def test_any_size_in_config_json_loads_or_is_refused_naming_the_field(pristine, tmp_path_factory, field, value):
    """Sizes are checked (type, range, divisibility) and then against the tensors present."""
    folder = _copy(pristine, tmp_path_factory.mktemp("size"), **{field: value})
    try:
        with time_limit(), peak_memory_below(300):
            minillm.load_model(folder, device="cpu")
    except FileFormatError as err:
        assert "config.json" in str(err), err
        assert field in str(err) or "tensor" in str(err) or "tokenizer has" in str(err), err


# --------------------------------------------------------------------------- 2. nothing outside the checkpoint
def _sharded(folder: Path, weight_map_value: Any = None, **index: Any) -> Path:
    """Turn the checkpoint into a one-shard sharded checkpoint (shard renamed), with an index."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = load_file(folder / "model-00001-of-00001.safetensors").keys()
    shard = "model-00001-of-00001.safetensors" if weight_map_value is None else weight_map_value
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard), **index}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


ESCAPING_NAMES = ["../outside/x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "..", ".", "",
                  "..\\x.safetensors", "C:x.safetensors", "a\0.safetensors", "x" * 300 + ".safetensors",
                  "\ud800.safetensors", "./model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("name", ESCAPING_NAMES)
def test_shard_names_that_leave_the_folder_are_refused_without_looking(ckpt, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"w": torch.zeros(1)}, outside / "x.safetensors")
    with pytest.raises(FileFormatError, match=r"model\.safetensors\.index\.json: weight_map: .*not a plain file name"):
        minillm.load_model(_sharded(ckpt, name), device="cpu")


def test_a_refused_name_says_nothing_about_what_exists_outside(pristine, tmp_path):
    messages = []
    for exists in (True, False):
        where = tmp_path / str(exists)
        where.mkdir()
        if exists:
            (where / "secret.safetensors").write_bytes(b"")
        folder = _sharded(_copy(pristine, where), "../secret.safetensors")
        with pytest.raises(FileFormatError) as err:
            minillm.load_model(folder, device="cpu")
        messages.append(str(err.value).replace(str(where), "<where>"))
    assert messages[0] == messages[1]


SHARD_NAMES = st.one_of(st.text(alphabet=st.sampled_from("./\\:\0ab-_~ \u00e9"), max_size=12),
                        st.sampled_from(ESCAPING_NAMES), st.just("model-00001-of-00001.safetensors"),
                        st.text(max_size=8).map(lambda s: s + ".safetensors"))


@given(name=SHARD_NAMES)
@fuzz_settings(60)
def test_any_shard_name_opens_nothing_outside_the_folder(pristine, tmp_path_factory, name):
    """A random weight_map name: refused, or (if it is the real shard's name) loaded; any file the
    loader opens lies inside the folder."""
    folder = _sharded(_copy(pristine, tmp_path_factory.mktemp("shard")), name)
    opened: list[Path] = []
    real_safe_open = checkpoint.safe_open

    def spy(path, **kwargs):
        opened.append(Path(path))
        return real_safe_open(path, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "safe_open", spy)
        try:
            with time_limit():
                minillm.load_model(folder, device="cpu")
            assert name == "model-00001-of-00001.safetensors"
        except FileFormatError as err:
            assert "model.safetensors.index.json" in str(err)
    assert all(p.parent == folder for p in opened)


def test_hub_snapshots_whose_files_are_symlinks_into_blobs_still_load(pristine, tmp_path):
    """The HF hub cache layout: snapshots/<rev>/<name> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    folder = _sharded(_copy(pristine, tmp_path))
    for i, file in enumerate(sorted(folder.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    model, tok = minillm.load_model(snapshot, device="cpu")
    reference, _ = minillm.load_model(pristine, device="cpu")
    ids = torch.tensor([tok.encode("a symlinked shard")])
    assert torch.equal(model(ids), reference(ids))


SPECIAL_TARGETS = ["config.json", "model.safetensors", "tokenizer.json", "shard", "gguf"]


@pytest.mark.skipif(not HAS_FIFO, reason="needs os.mkfifo")
@pytest.mark.parametrize("target", SPECIAL_TARGETS)
def test_a_fifo_is_refused_without_being_opened(ckpt, tmp_path, target):
    """Opening a FIFO for reading blocks until a writer comes: the time limit would fire."""
    if target == "gguf":
        path = source = tmp_path / "pipe.gguf"
    elif target == "shard":
        source = _sharded(ckpt)
        path = ckpt / "model-00001-of-00001.safetensors"
    else:
        path, source = ckpt / target, ckpt
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    with time_limit(10), pytest.raises(FileFormatError, match=r"is a FIFO \(named pipe\), not a regular file"):
        minillm.load_model(source, device="cpu")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_device_is_refused_without_being_opened(ckpt, target):
    (ckpt / target).unlink()
    (ckpt / target).symlink_to("/dev/zero")  # endless: reading it whole would never finish
    with time_limit(10), pytest.raises(FileFormatError, match="is a character device, not a regular file"):
        minillm.load_model(ckpt, device="cpu")


@pytest.mark.parametrize(
    "index, says",
    [
        ("not json {", "not valid JSON"),
        ("[1, 2]", "'weight_map' must be a non-empty object"),
        ('{"metadata": {}}', "'weight_map' must be a non-empty object"),
        ('{"weight_map": ["a"]}', "'weight_map' must be a non-empty object"),
        ('{"weight_map": {}}', "'weight_map' must be a non-empty object"),
        ('{"weight_map": {"lm_head.weight": 3}}', r"weight_map\['lm_head.weight'\] must be a shard file name"),
        ('{"weight_map": {"lm_head.weight": "config.json"}}', "not a .safetensors file"),
        ('{"weight_map": {"lm_head.weight": "gone.safetensors"}}', "which is not in"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
    ids=["not-json", "list", "no-weight-map", "map-is-list", "empty", "non-string", "not-safetensors", "missing",
         "deep-nesting"],
)
def test_a_malformed_index_names_the_file_and_field(ckpt, index, says):
    (ckpt / "model.safetensors.index.json").write_text(index)
    with pytest.raises(FileFormatError, match=r"model\.safetensors\.index\.json: .*" + says):
        minillm.load_model(ckpt, device="cpu")


def test_pickle_files_are_never_loaded(ckpt, tmp_path):
    """A pytorch_model.bin runs code when unpickled; minillm does not even look at it."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        minillm.load_model(ckpt, device="cpu")
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
         r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\], "
         r"expected \[32, 64\] from config\.json"),
        (lambda s: s.update({"norm.weight": s["model.norm.weight"].clone()}),
         r"model\.safetensors: tensor norm\.weight is stored twice \((model\.)?norm\.weight, (model\.)?norm\.weight\)"),
        (lambda s: s.clear(), r"config\.json: num_hidden_layers=2 but the weights hold 0 layers"),
    ],
    ids=["shape", "twice", "empty"],
)
def test_tensor_problems_name_the_weights_file(ckpt, edit, says):
    state = load_file(ckpt / "model.safetensors")
    edit(state)
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(ckpt, device="cpu")


# --------------------------------------------------------------------------- 3. no silently wrong numbers
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64,
                                   torch.float8_e4m3fn])
def test_tensors_that_are_not_float_weights_are_refused(ckpt, dtype):
    state = load_file(ckpt / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(dtype)
    save_file(state, ckpt / "model.safetensors")
    says = r"model\.safetensors: tensor model\.norm\.weight is stored as \w+, not as floating"
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(ckpt, device="cpu")


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}},
         "rope_theta=0.0 must be a number from 1 to 3.4e38"),
        ({"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, "rope_theta=-1.0 must be"),
        ({"rope_parameters": {"rope_theta": 1e-300, "rope_type": "default"}}, "rope_theta=1e-300 must be"),
        ({"rope_parameters": {"rope_theta": 1e39, "rope_type": "default"}}, r"rope_theta=1e\+39 must be"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be a number >= 0 and < 1"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be a number"),
        ({"rms_norm_eps": 1e39}, r"rms_norm_eps=1e\+39 must be a number"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be between 1"),
        ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 3},
         "hidden_size=64 is not divisible by num_attention_heads=3"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
         "rope_parameters=.* is not supported"),
    ],
    ids=["theta-0", "theta-negative", "theta-tiny", "theta-huge", "eps-negative", "eps-nan", "eps-huge", "context-0",
         "head-dim-fraction", "gqa-groups", "odd-head-dim", "activation", "yarn"],
)
def test_values_that_would_compute_wrong_numbers_are_refused(pristine, tmp_path, changes, says):
    folder = _copy(pristine, tmp_path, **changes)
    with pytest.raises(FileFormatError, match=r"config\.json: " + says):
        minillm.load_model(folder, device="cpu")


@pytest.mark.parametrize(
    "meta, tensors, says",
    [
        ({"llama.rope.scaling.type": "linear"}, {}, "llama.rope.scaling.type='linear' is not supported"),
        ({"llama.rope.dimension_count": 8}, {}, "llama.rope.dimension_count=8 differs from the head size 16"),
        ({}, {"rope_freqs.weight": np.ones(8, np.float32)}, r"unexpected tensor\(s\) rope_freqs.weight"),
        ({}, {"blk.0.attn_q.weight": np.ones((64, 64), np.int32)}, r"cannot read tensor blk\.0\.attn_q\.weight \(I32"),
        ({}, {"output_norm.weight": np.full(64, np.inf, np.float32)}, "output_norm.weight .F32. holds NaN or infinite"),
    ],
    ids=["rope-scaling", "partial-rotary", "rope-freqs-tensor", "integer-weights", "inf-weights"],
)
def test_gguf_features_minillm_would_ignore_are_refused(tmp_path, pristine, tiny_tokenizer, meta, tensors, says):
    path = write_gguf(tmp_path / "feature.gguf", pristine, tiny_tokenizer, meta=meta, tensors=tensors)
    with pytest.raises(FileFormatError, match=r"feature\.gguf: .*" + says):
        minillm.load_model(path, device="cpu")


# --------------------------------------------------------------------------- 4. no raw exceptions
@pytest.mark.parametrize(
    "changes, says",
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be between 1"),
        ({"num_key_value_heads": -2}, "num_key_value_heads=-2 must be between 1"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3"}},
         "rope_parameters=.* lacks factor, low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
         "rope_parameters=.* needs factor >= 1, 0 < low_freq_factor < high_freq_factor"),
        ({"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
        ({"vocab_size": "320"}, "vocab_size='320' must be an integer"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be true or false"),
    ],
    ids=["heads-0", "kv-heads-negative", "llama3-no-keys", "llama3-bad-factors", "rope-list", "string-size",
         "string-bool"],
)
def test_config_json_problems_are_file_format_errors(pristine, tmp_path, changes, says):
    folder = _copy(pristine, tmp_path, **changes)
    with pytest.raises(FileFormatError, match=r"config\.json: " + says):
        minillm.load_model(folder, device="cpu")


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "null", "{", ""])
def test_config_json_that_is_not_an_object(ckpt, text):
    (ckpt / "config.json").write_text(text)
    says = r"config\.json: (must be a JSON object|the config.json is not valid JSON)"
    with pytest.raises(FileFormatError, match=says):
        minillm.load_model(ckpt, device="cpu")


@pytest.mark.parametrize(
    "meta, says",
    [
        ({"llama.attention.head_count": 0}, "llama.attention.head_count=0 must be between 1"),
        ({"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv=0 must be between 1"),
        ({"llama.attention.head_count": [4, 4]}, r"llama.attention.head_count=\[4, 4\] must be an integer"),
        ({"llama.context_length": None}, "GGUF metadata has no 'llama.context_length'"),
        ({"llama.rope.freq_base": "big"}, "llama.rope.freq_base='big' must be a number from 1"),
        ({"general.architecture": "gpt2"}, "unsupported architecture 'gpt2'"),
    ],
    ids=["heads-0", "kv-heads-0", "per-layer-heads", "no-context", "string-theta", "architecture"],
)
def test_gguf_metadata_problems_name_the_key(tmp_path, pristine, tiny_tokenizer, meta, says):
    path = write_gguf(tmp_path / "meta.gguf", pristine, tiny_tokenizer, meta=meta)
    with pytest.raises(FileFormatError, match=r"meta\.gguf: " + says):
        minillm.load_model(path, device="cpu")


@pytest.mark.parametrize(
    "tensors, says",
    [
        ({"blk.0.attn_q.weight": np.ones((60, 64), np.float32)},
         r"tensor blk\.0\.attn_q\.weight \(layers\.0\.self_attn\.q_proj\.weight\) has shape \[60, 64\], "
         r"expected \[64, 64\]"),
        ({"blk.1.attn_k.weight": np.ones((31, 64), np.float32)},
         r"tensor blk\.1\.attn_k\.weight .* has shape \[31, 64\], expected \[32, 64\]"),
        ({"token_embd.weight": np.ones((320, 63), np.float32)},
         r"tensor token_embd\.weight .* has shape \[320, 63\], expected \[320, 64\]"),
        ({"blk.1.ffn_up.weight": None}, r"missing tensor\(s\) layers\.1\.mlp\.up_proj\.weight"),
    ],
    ids=["q-rows-not-heads", "k-rows", "embedding-width", "missing"],
)
def test_gguf_tensor_shapes_are_checked_before_the_un_permute(tmp_path, pristine, tiny_tokenizer, tensors, says):
    path = write_gguf(tmp_path / "shapes.gguf", pristine, tiny_tokenizer, tensors=tensors)
    with pytest.raises(FileFormatError, match=r"shapes\.gguf: " + says):
        minillm.load_model(path, device="cpu")


def test_an_incomplete_conversion_cache_is_rebuilt(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    folder = loading.convert_gguf(tiny_gguf, progress=False)
    stamp = json.loads((folder / loading.STAMP).read_text())
    assert stamp["files"] == {name: (folder / name).stat().st_size for name in loading.CONVERTED_FILES}
    weights = (folder / "model.safetensors").read_bytes()
    tensors = {name: t.clone() for name, t in load_file(folder / "model.safetensors").items()}  # not a view of the file
    for damage in (lambda: (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2]),  # truncated
                   lambda: (folder / loading.STAMP).unlink(),  # interrupted before the stamp (or made by older minillm)
                   lambda: (folder / "tokenizer.json").unlink(),
                   lambda: (folder / loading.STAMP).write_text("{")):
        damage()
        assert loading.convert_gguf(tiny_gguf, progress=False) == folder
        rebuilt = load_file(folder / "model.safetensors")
        assert rebuilt.keys() == tensors.keys() and all(torch.equal(rebuilt[k], tensors[k]) for k in tensors)
        minillm.load_model(folder, device="cpu")
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # nothing left over


def test_a_cache_folder_holding_other_files_is_not_deleted(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    folder = tmp_path / tiny_gguf.stem
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    says = rf"{re.escape(str(folder))} is in the way of converting tiny.gguf.*Delete it"
    with pytest.raises(FileFormatError, match=says):
        loading.convert_gguf(tiny_gguf, progress=False)
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_cache_path_that_is_a_file_fails_before_converting(tmp_path, monkeypatch, tiny_gguf):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(loading, "read_gguf", lambda *a: pytest.fail("converted before checking the cache folder"))
    for cache in (tmp_path / "file", tmp_path / "file" / "sub"):
        monkeypatch.setenv("MINILLM_CACHE", str(cache))
        says = rf"cannot use {re.escape(str(cache))} as the cache folder .*MINILLM_CACHE"
        with pytest.raises(ValueError, match=says):
            loading.convert_gguf(tiny_gguf, progress=False)


def test_dtype_and_device_parameters_are_checked(ckpt):
    for dtype in ("float16", "bfloat16", torch.float64):
        model, _ = minillm.load_model(ckpt, device="cpu", dtype=dtype)
        assert model.dtype == loading.DTYPES.get(dtype, dtype)
    for bad, error, says in [
        (torch.int32, ValueError, r"dtype=torch\.int32 is not a dtype to run a model in \(accepted: float32, bfloat16"),
        ("int8", ValueError, r"dtype='int8' is not one of float32, bfloat16, float16, float64"),
        (3, TypeError, "dtype must be a torch.dtype or one of the names"),
    ]:
        with pytest.raises(error, match=says):
            minillm.load_model(ckpt, device="cpu", dtype=bad)
    with pytest.raises(ValueError, match="device='nonsense' is not a device torch knows"):
        minillm.load_model(ckpt, device="nonsense")
    with pytest.raises(TypeError, match="source .or None. must be a path"):
        minillm.load_model(3)


# --------------------------------------------------------------------------- fuzz
@st.composite
def mutations(draw, data: bytes, spots: list[int], header_end: int) -> bytes:
    """``data`` with a few random edits: a byte, a random or extreme 4- or 8-byte integer written
    over, a cut, an insertion or a deletion. Edits land on ``spots`` (where values live: counts,
    sizes, types, digits), anywhere in the header (its first ``header_end`` bytes), or anywhere."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.one_of(st.sampled_from(spots), st.integers(0, min(header_end, len(out))),
                               st.integers(0, len(out))))
        kind = draw(st.sampled_from(["byte", "u32", "u64", "cut", "insert", "delete"]))
        if kind == "byte":
            out[where:where + 1] = bytes([draw(st.one_of(st.integers(0, 255), st.sampled_from(b'0123456789-.e"[]{}')))])
        elif kind in ("u32", "u64"):
            fmt, bits = ("<I", 32) if kind == "u32" else ("<Q", 64)
            out[where:where + struct.calcsize(fmt)] = struct.pack(fmt, draw(BIG) % 2**bits)
        elif kind == "cut":
            del out[where:]
        elif kind == "insert":
            out[where:where] = draw(st.binary(min_size=1, max_size=16))
        else:
            del out[where:where + draw(st.integers(1, 64))]
    return bytes(out)


def gguf_spots(path: Path) -> tuple[list[int], list[tuple[int, int]]]:
    """Where a GGUF file's values live: byte offsets of each metadata value type and value and of
    each tensor description field; and (offset, width) of each number (a head count, a dimension,
    a tensor type or offset) — rewriting those keeps the file parseable but changes what it says."""
    data, reader = path.read_bytes(), open_gguf(path)
    spots: list[int] = []
    numbers: list[tuple[int, int]] = []
    widths = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
    for key in reader.fields:
        encoded = key.encode()
        end = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
        spots += [end, end + 4, end + 8]  # the value type, then the value (an array's item type, count)
        value_type = struct.unpack_from("<I", data, end)[0]
        if value_type in widths:
            numbers.append((end + 4, widths[value_type]))
    for tensor in reader.tensors:
        encoded = tensor.name.encode()
        end = data.rindex(struct.pack("<Q", len(encoded)) + encoded, 0, reader.data_offset) + 8 + len(encoded)
        fields = [(end, 4), *((end + 4 + 8 * i, 8) for i in range(len(tensor.shape)))]  # n_dims, dims
        fields += [(end + 4 + 8 * len(tensor.shape), 4), (end + 8 + 8 * len(tensor.shape), 8)]  # type, offset
        spots += [offset for offset, _ in fields]
        numbers += fields
    return spots, numbers


@st.composite
def number_edits(draw, data: bytes, numbers: list[tuple[int, int]]) -> bytes:
    """``data`` with one to three of its numbers rewritten in place: small, extreme or random bits."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        offset, width = draw(st.sampled_from(numbers))
        value = draw(st.one_of(st.integers(0, 64), BIG)) % 2 ** (8 * width)
        out[offset:offset + width] = value.to_bytes(width, "little")
    return bytes(out)


GGUF_SPOTS: dict[Path, tuple[list[int], list[tuple[int, int]]]] = {}


@given(data=st.data())
@fuzz_settings(25)
def test_fuzz_gguf(tiny_gguf, tmp_path_factory, data):
    """Mutated GGUF bytes: the reader, the tokenizer and load_model each load or raise clearly."""
    base = tiny_gguf.read_bytes()
    if tiny_gguf not in GGUF_SPOTS:
        GGUF_SPOTS[tiny_gguf] = gguf_spots(tiny_gguf)
    spots, numbers = GGUF_SPOTS[tiny_gguf]
    path = tmp_path_factory.mktemp("fuzz") / "fuzzed.gguf"
    path.write_bytes(data.draw(st.one_of(mutations(base, spots, open_gguf(tiny_gguf).data_offset),
                                         number_edits(base, numbers))))
    expect_clear_error(lambda: open_gguf(path), "fuzzed.gguf")
    expect_clear_error(lambda: Tokenizer.from_file(path), "fuzzed.gguf")
    expect_clear_error(lambda: minillm.load_model(path, device="cpu"), "fuzzed.gguf")


GGUF_VALUES = st.one_of(
    st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, 2, 3, 4, 64, 2**31, 2**32 - 1, -1]),
    st.floats(width=32), st.text(max_size=8), st.sampled_from(["gpt2", "llama", "none", "linear", "default"]),
    st.booleans(), st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=4),
    st.lists(st.text(max_size=4), min_size=1, max_size=4), st.none(),
)
MODEL_KEYS = [*DEFAULT_GGUF_META, "general.architecture", "general.alignment", "llama.rope.dimension_count",
              "llama.attention.key_length", "llama.rope.scaling.type"]
TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]


def _fuzz_gguf_values(keys: list[str], pristine: Path, tokenizer: Tokenizer, where: Path, data: Any) -> None:
    """A well-formed GGUF whose metadata values (and their types) are random: the readers must
    check what they are given, not only the layout."""
    meta = data.draw(st.dictionaries(st.sampled_from(keys), GGUF_VALUES, min_size=1, max_size=3))
    if "general.architecture" in meta:  # gguf's writer itself writes it, and only as a string
        meta["general.architecture"] = str(meta["general.architecture"])
    path = write_gguf(where / "fuzzed.gguf", pristine, tokenizer, meta=meta)
    expect_clear_error(lambda: Tokenizer.from_file(path), "fuzzed.gguf")
    expect_clear_error(lambda: minillm.load_model(path, device="cpu"), "fuzzed.gguf")


@given(data=st.data())
@fuzz_settings(25)
def test_fuzz_gguf_model_metadata(pristine, tiny_tokenizer, tmp_path_factory, data):
    _fuzz_gguf_values(MODEL_KEYS, pristine, tiny_tokenizer, tmp_path_factory.mktemp("fuzz"), data)


@given(data=st.data())
@fuzz_settings(25)
def test_fuzz_gguf_tokenizer_metadata(pristine, tiny_tokenizer, tmp_path_factory, data):
    _fuzz_gguf_values(TOKENIZER_KEYS, pristine, tiny_tokenizer, tmp_path_factory.mktemp("fuzz"), data)


@given(data=st.data())
@fuzz_settings(20)
def test_fuzz_safetensors(pristine, tmp_path_factory, data):
    """Mutated model.safetensors bytes (mostly the numbers and dtypes of its JSON header)."""
    folder = _copy(pristine, tmp_path_factory.mktemp("fuzz"))
    weights = folder / "model.safetensors"
    base = weights.read_bytes()
    header_end = 8 + struct.unpack("<Q", base[:8])[0]
    spots = [i for i in range(8, header_end) if chr(base[i]) in "0123456789FBIU"]  # shapes, offsets, dtypes
    weights.write_bytes(data.draw(mutations(base, spots + [0], header_end)))
    expect_clear_error(lambda: minillm.load_model(folder, device="cpu"), "model.safetensors", "config.json")


CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias", "model_type", "hidden_act"]


@st.composite
def json_edits(draw, text: str, keys: list[str]) -> str:
    """``text`` (a JSON object) with a few keys set to random JSON values, or removed."""
    spec = json.loads(text)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()):
            spec.pop(key, None)
        else:
            spec[key] = draw(st.one_of(JSON_VALUES, st.fixed_dictionaries(
                {"rope_type": st.sampled_from(["default", "llama3", "linear"]), "rope_theta": JSON_VALUES},
                optional={k: JSON_VALUES for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")})))
    return json.dumps(spec)


@given(data=st.data())
@fuzz_settings(25)
def test_fuzz_config_and_index_json(pristine, tmp_path_factory, data):
    """config.json and model.safetensors.index.json with random values or mutated bytes."""
    folder = _sharded(_copy(pristine, tmp_path_factory.mktemp("fuzz")))
    for name in data.draw(st.sampled_from([["config.json"], ["model.safetensors.index.json"],
                                           ["config.json", "model.safetensors.index.json"]])):
        text = (folder / name).read_text()
        if data.draw(st.booleans()):
            keys = CONFIG_KEYS if name == "config.json" else ["weight_map", "metadata"]
            (folder / name).write_text(data.draw(json_edits(text, keys)))
        else:
            spots = [i for i, c in enumerate(text) if c in '0123456789":,[]{}']
            (folder / name).write_bytes(data.draw(mutations(text.encode(), spots, len(text))))
    expect_clear_error(lambda: minillm.load_model(folder, device="cpu"), "config.json", "model.safetensors.index.json",
                       "safetensors")


# --------------------------------------------------------------------------- the same checks on both formats
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"])
def test_safetensors_weights_that_are_not_finite_are_refused_like_gguf_ones(ckpt, value, name):
    """No trained weight is NaN or infinite: the bytes are damaged. The GGUF loader refuses them,
    and so does the safetensors one, naming the file and the tensor."""

    path = ckpt / "model.safetensors"
    state = load_file(path)
    state[name] = state[name].clone()
    state[name].view(-1)[3] = value
    save_file(state, path)
    with pytest.raises(FileFormatError, match=rf"model\.safetensors: tensor {re.escape(name)} holds NaN or infinite"):
        minillm.load_model(ckpt, device="cpu")


@pytest.mark.parametrize("shift", [0, 32, -32])  # the same start, inside the previous tensor, starting before it ends
def test_gguf_tensors_whose_bytes_overlap_are_refused_like_safetensors_ones(tiny_gguf, tmp_path, shift):
    """Two descriptions pointing into the same bytes: one of the two tensors is wrong, whatever
    its values. Refused at open, naming both tensors."""
    data, reader = bytearray(tiny_gguf.read_bytes()), open_gguf(tiny_gguf)
    first, second = sorted(reader.tensors, key=lambda t: t.data_offset)[:2]
    encoded = second.name.encode()
    end = data.rindex(struct.pack("<Q", len(encoded)) + encoded, 0, reader.data_offset) + 8 + len(encoded)
    at = end + 8 + 8 * len(second.shape)  # its offset field, after n_dims, dims and type
    offset = first.data_offset - reader.data_offset + (first.n_bytes + shift if shift < 0 else shift)
    struct.pack_into("<Q", data, at, offset - offset % reader.alignment)
    path = tmp_path / "overlap.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FileFormatError, match=r"overlap\.gguf.*tensors .* and .* overlap"):
        open_gguf(path)
