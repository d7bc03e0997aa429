"""Hostile inputs fail fast and clearly (issue 12, tokenizer part).

Each section is one class of attack: text built to make encoding slow or memory-hungry, text
that forges chat turns, tokenizer files that are small but ask for huge allocations, files that
are inconsistent, inputs that used to raise raw library exceptions, model-supplied code (regex,
Jinja) that never finishes, and paths that block when opened. The laws are checked against HF
``tokenizers`` where HF accepts the input, and by counting work, never by wall time (the one
timing test is a ratio against HF measured in the same run).
"""

from __future__ import annotations

import random
import string
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_cases import hf_ids

from minillm.tokenizer import bpe


def random_letters(n: int, seed: int = 0, alphabet: str = string.ascii_lowercase) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.fixture(params=["smollm2", "gpt2"])
def pair(request, smol, smol_hf_raw, gpt2, gpt2_hf):
    """(minillm tokenizer, HF reference) for each real vocabulary."""
    return {"smollm2": (smol, smol_hf_raw), "gpt2": (gpt2, gpt2_hf)}[request.param]


# --------------------------------------------------------------------------- 1. super-linear encode
class CountingTable(dict):
    """A merge table that counts lookups: the unit of work of BPE merging."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


@pytest.mark.parametrize("n", [1_000, 8_000, 64_000])
def test_merging_one_long_chunk_costs_a_constant_number_of_lookups_per_byte(gpt2, monkeypatch, n):
    """A chunk of n bytes costs O(n) merge-table lookups (plus O(n log n) heap work): one per
    initial pair, one per popped heap entry, two per merge. Rescanning after every merge, as the
    first version did, costs about n per merge: 60 000 per byte at 64 KB."""
    table = CountingTable(gpt2._merge_table)
    monkeypatch.setattr(gpt2, "_merge_table", table)
    ids = gpt2._bpe(random_letters(n, seed=n).encode())
    assert len(ids) < n
    assert table.lookups <= 6 * n


def test_200_kb_without_a_space_encodes_like_hf_and_within_20x_its_time(pair):
    """One 200 KB chunk (random letters, no spaces): identical ids, and the time stays a small
    multiple of HF's measured in the same test (the quadratic merge loop took ~1000x)."""
    ours, hf = pair
    text = random_letters(200_000, seed=1)

    def best_of_two(encode):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            ids = encode(text)
            times.append(time.perf_counter() - start)
        return ids, min(times)

    our_ids, our_time = best_of_two(ours.encode)
    hf_ids_, hf_time = best_of_two(lambda t: hf_ids(hf, t))
    assert our_ids == hf_ids_
    assert our_time <= 20 * hf_time + 0.05, f"minillm {our_time:.3f} s vs HF {hf_time:.3f} s"


# Long chunks over few letters: many equal pairs overlap, so the order of merges (lowest rank
# first, then leftmost) decides the ids.
long_runs = st.text(alphabet="ab", min_size=200, max_size=3000) | st.text(alphabet="aeio ", min_size=200, max_size=3000)


@settings(max_examples=60, deadline=None)
@given(long_runs)
def test_long_repetitive_chunks_give_hf_ids(gpt2, gpt2_hf, text):
    assert gpt2.encode(text) == hf_ids(gpt2_hf, text)


@settings(max_examples=60, deadline=None)
@given(long_runs)
def test_long_repetitive_chunks_give_hf_ids_smollm2(smol, smol_hf_raw, text):
    assert smol.encode(text) == hf_ids(smol_hf_raw, text)


def test_long_chunks_are_not_cached(trained):
    """Distinct 50 KB chunks leave nothing behind: a long chunk never repeats, so caching it
    would only hold its text and ids (200 such chunks once held 51 MB)."""
    trained.encode("warm up the cache: to be or not to be")
    chunks = [random_letters(50_000, seed=s) for s in range(8)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for chunk in chunks:
            trained.encode(chunk)
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 100_000
    assert max(map(len, trained._cache)) <= bpe._CACHE_MAX_CHUNK


def test_cache_stays_within_its_byte_budget_and_the_estimate_is_honest(trained, monkeypatch):
    """Many distinct short chunks: the cache empties itself at the budget, and the memory it
    really holds is within a small factor of its own estimate."""
    monkeypatch.setattr(bpe, "_CACHE_BUDGET_BYTES", 400_000)
    tok = bpe.Tokenizer(trained.vocab, trained.merges, trained.special_tokens)
    words = [random_letters(n % 40 + 1, seed=n, alphabet="abcdéf🙂") for n in range(6000)]
    tracemalloc.start()
    try:
        for word in words:
            tok.encode(" " + word)
            assert tok._cache_bytes <= bpe._CACHE_BUDGET_BYTES
        del word
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0 < len(tok._cache) < len(words)  # it was emptied at least once
    assert held < 2 * bpe._CACHE_BUDGET_BYTES


# --------------------------------------------------------------------------- 5. raw exceptions
@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30), st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
def test_lone_surrogate_is_a_value_error_naming_its_position(gpt2, gpt2_hf, before, after, surrogate):
    """A lone surrogate has no UTF-8 bytes. HF refuses the str (TypeError from its binding); we
    raise a ValueError that says where it is, wherever it sits (next to specials or not)."""
    text = before + surrogate + after
    position = text.index(surrogate)  # ``before`` is valid text, so this is the first one
    with pytest.raises(ValueError, match=rf"text\[{position}\] is a lone surrogate U\+{ord(surrogate):04X}"):
        gpt2.encode(text)
    with pytest.raises(ValueError, match=r"lone surrogate"):
        gpt2.encode(text, parse_special=False)
    with pytest.raises(TypeError):
        gpt2_hf.encode(text)


def test_surrogate_pairs_spelled_as_one_character_still_encode(gpt2, gpt2_hf):
    text = "crab \U0001f980 ok"
    assert gpt2.encode(text) == hf_ids(gpt2_hf, text)


def _id_containers(ids):
    import numpy as np
    import torch

    return {
        "list": list(ids),
        "tuple": tuple(ids),
        "numpy int64 array": np.array(ids, dtype=np.int64),
        "numpy int32 array": np.array(ids, dtype=np.int32),
        "numpy uint16 array": np.array(ids, dtype=np.uint16),
        "list of numpy ints": [np.int64(i) for i in ids],
        "torch tensor": torch.tensor(ids),
        "torch int32 tensor": torch.tensor(ids, dtype=torch.int32),
        "list of 0-d tensors": [torch.tensor(i) for i in ids],
    }


@pytest.mark.parametrize("kind", list(_id_containers([1])))
def test_decode_accepts_numpy_and_torch_integers(smol, kind):
    ids = smol.encode("Hello world, <|im_end|> done")
    ids_in_kind = _id_containers(ids)[kind]
    assert smol.decode(ids_in_kind) == smol.decode(ids)
    assert smol.decode(ids_in_kind, skip_special_tokens=True) == smol.decode(ids, skip_special_tokens=True)
    detok = smol.streaming_decoder()
    assert "".join(detok.push(i) for i in ids_in_kind) + detok.flush() == smol.decode(ids)


def test_decode_refuses_non_integer_arrays_with_a_type_error(smol):
    import numpy as np
    import torch

    for bad in (np.array([1.0, 2.0]), torch.tensor([1.0]), [np.float32(3)], [torch.tensor(1.5)], [np.bool_(True)]):
        with pytest.raises(TypeError, match=r"int ids"):
            smol.decode(bad)
