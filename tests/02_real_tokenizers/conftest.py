"""Fixtures of the tokenizer tests: the small trained tokenizer as a ``tokenizer.json`` dict, to
break one field at a time (``helpers.tokenizer_files``)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def trained_spec(trained, tmp_path_factory) -> dict:
    """The small trained tokenizer as a tokenizer.json dict, to break one field at a time."""
    folder = tmp_path_factory.mktemp("spec")
    trained.save(folder)
    return json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
