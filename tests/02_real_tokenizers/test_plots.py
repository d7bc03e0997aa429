"""Notebook 02's drawing helpers: the widget and its stored picture are one output; tokens as HTML."""

from __future__ import annotations

import ipywidgets as widgets

from minillm.plots import nb01 as plots01
from minillm.plots import nb02 as plots02


def test_a_live_widget_carries_its_picture_in_the_same_output(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    for plots in (plots01, plots02):
        plots.live(widgets.IntSlider(), "<b>the first view</b>")
    for bundle, raw in shown:
        assert raw
        assert "application/vnd.jupyter.widget-view+json" in bundle  # a trusted notebook draws the widget
        assert bundle["text/html"] == "<b>the first view</b>"  # any other viewer, the picture


def test_token_spans_one_span_per_token_escaped(gpt2):
    text = "a<b> 🦀"
    html = plots02.token_spans(gpt2, text)
    assert html.count("<span") == len(gpt2.encode(text))
    assert "&lt;" in html and "<b>" not in html
    assert "\\xf0\\x9f" in html  # half an emoji shows as escapes, not as U+FFFD
