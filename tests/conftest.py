"""Shared fixtures.

Everything expensive is built once per session: SmolLM2's tokenizer read from its GGUF file
(~3 s), the transformers reference reading the same GGUF (~6 s), GPT-2 (minillm and HF
``tokenizers``), the corpus and a small tokenizer trained on a slice of it. The fixtures shared by
several notebooks' folders are here too (a tiny tokenizer and random checkpoint, transformers'
greedy tokens on the real model); plain helpers are in ``tests/helpers/``.

Nothing here imports torch when the file is loaded: the block manager's and the scheduler's tests
run where torch cannot be imported (``tests/package/test_import_graph.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test`), each worker gets its share of the cores, and so do the
# processes it starts (CLI subprocesses, notebook kernels): two workers each running an OpenMP
# team as wide as the machine would make every torch op several times slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

from minillm import Tokenizer, train_bpe  # noqa: E402
from minillm.assets import corpus_path, default_gguf_path, gpt2_vocab_dir  # noqa: E402

# The special tokens of the small trained tokenizer: ChatML's and GPT-2's.
TRAINED_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINED_VOCAB_SIZE = 400
# A slice of the corpus from inside the plays (not the title page).
CORPUS_SLICE = slice(200_000, 260_000)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct and its tokenizer (fp32, CPU), loaded once."""
    from minillm import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def corpus_text() -> str:
    return corpus_path().read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def smol() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read by minillm from the GGUF file."""
    return Tokenizer.from_file(default_gguf_path())


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' tokenizer read from the same GGUF (the reference)."""
    from minillm.reference import hf_gguf_tokenizer

    return hf_gguf_tokenizer()


@pytest.fixture(scope="session")
def smol_hf_raw(smol_hf):
    """The HF ``tokenizers`` object behind the transformers reference: raw ids, no post-processing."""
    return smol_hf.backend_tokenizer


@pytest.fixture(scope="session")
def gpt2() -> Tokenizer:
    """GPT-2, read by minillm from encoder.json + vocab.bpe."""
    return Tokenizer.from_file(gpt2_vocab_dir())


@pytest.fixture(scope="session")
def gpt2_hf():
    """GPT-2 as HF ``tokenizers`` builds it from the same two files."""
    from minillm.reference import hf_gpt2_tokenizer

    return hf_gpt2_tokenizer()


@pytest.fixture(scope="session")
def trained(corpus_text: str) -> Tokenizer:
    """A ~400-token byte-level BPE trained by minillm on a corpus slice, with special tokens."""
    return train_bpe(corpus_text[CORPUS_SLICE], TRAINED_VOCAB_SIZE, TRAINED_SPECIALS, progress=False)


# The hand-written C++ kernels (``minillm/model/kernels``) are built on first use, which takes a
# minute: through these fixtures, only when a test that needs them runs (collecting compiles nothing).
@pytest.fixture(scope="session")
def kernels_built() -> None:
    """The kernel library, built or loaded (its portable loops at least); skips where it cannot be built."""
    from minillm.model import kernels

    if not kernels.available():
        pytest.skip(f"the C++ kernels are not built here: {kernels.why_unavailable()}")


@pytest.fixture(scope="session")
def vector_kernels(kernels_built) -> None:
    """The AVX-512 or AVX2 versions of the kernels (``kernels.vectorized()``): what the packed-cpu
    backend and the float32 few-row product need; skips on a CPU without them."""
    from minillm.model import kernels

    if not kernels.vectorized():
        pytest.skip("the kernels are built without their AVX-512 or AVX2 versions on this CPU")


@pytest.fixture(scope="session")
def cxx_compiler() -> None:
    """``torch.compile`` on the CPU, which writes C++ (the compiled backend); skips where it cannot run."""
    import torch

    from minillm.engine.backends import why_not_compiled

    why = why_not_compiled(torch.device("cpu"))
    if why:
        pytest.skip(f"torch.compile cannot run here: {why}")


# The tiny models: a random transformers checkpoint with a small trained tokenizer, fast enough to
# load in every module that needs a model but not the real one (``helpers.checkpoints``).
@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    """A 300-token byte-level BPE trained on the first 20,000 characters of the corpus."""
    text = corpus_path().read_text(encoding="utf-8")[:20000]
    return train_bpe(text, 300, ["<|endoftext|>"], progress=False)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random Llama checkpoint (2 layers, hidden 64, 4 heads / 2 KV heads), never modified."""
    from helpers.checkpoints import tiny_hf_checkpoint

    return tiny_hf_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt", tiny_tokenizer, "llama")


# The real model's greedy tokens, as transformers computes them (``helpers.greedy``).
@pytest.fixture(scope="module")
def prompt_ids(smollm) -> list[list[int]]:
    """``helpers.greedy.PROMPTS`` encoded: three lengths, none a multiple of ``ODD_BLOCK``."""
    from helpers.greedy import ODD_BLOCK, PROMPTS

    _, tok = smollm
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "the batch must mix prompt lengths"
    assert all(len(i) % ODD_BLOCK for i in ids)
    return ids


@pytest.fixture(scope="module")
def transformers_greedy(smollm, prompt_ids) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (``NEW_TOKENS`` tokens), read from the same GGUF."""
    import torch

    from helpers.greedy import NEW_TOKENS
    from minillm.reference import hf_gguf_model

    _, tok = smollm
    reference = hf_gguf_model()
    outputs = []
    for ids in prompt_ids:
        out = reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        )
        outputs.append(out[0, len(ids):].tolist())
    return outputs
