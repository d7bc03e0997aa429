"""Notebook 02's drawing helpers: tokens as HTML (its widget: tests/package/test_plots_widgets.py)."""

from __future__ import annotations

from minillm.plots import nb02 as plots02


def test_token_spans_one_span_per_token_escaped(gpt2):
    text = "a<b> 🦀"
    html = plots02.token_spans(gpt2, text)
    assert html.count("<span") == len(gpt2.encode(text))
    assert "&lt;" in html and "<b>" not in html
    assert "\\xf0\\x9f" in html  # half an emoji shows as escapes, not as U+FFFD
