"""Shared fixtures.

Everything expensive is built once per session: SmolLM2's tokenizer read from its GGUF file
(~3 s), the transformers reference reading the same GGUF (~6 s), GPT-2 (minillm and HF
``tokenizers``), the corpus and a small tokenizer trained on a slice of it.
"""

from __future__ import annotations

import os

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
