"""The real model's greedy reference: prompts of mixed lengths, and how many tokens each is
continued by (the ``prompt_ids`` and ``transformers_greedy`` fixtures of ``tests/conftest.py``)."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]
NEW_TOKENS = 32
ODD_BLOCK = 6  # a block size that divides none of the prompt lengths (``prompt_ids`` checks it)
