"""minillm.plots.nb03: the widget and its stored picture are one output; heatmaps name their axes."""

from __future__ import annotations

import base64

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from minillm.plots import nb03 as plots


def test_sliders_store_the_first_figure_with_the_widget(monkeypatch):
    ipywidgets = pytest.importorskip("ipywidgets")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    drawn = []

    def draw(layer: int):
        drawn.append(layer)
        return plots.heatmap(torch.eye(3) * layer / 5, ["a", "b", "c"], f"layer {layer}")

    plots.sliders(draw, "layer 2", layer=ipywidgets.IntSlider(value=2, min=0, max=5))
    assert drawn == [2]  # drawn once, at the initial value
    [(bundle, raw)] = shown  # one output
    assert raw is True
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "layer 2" in bundle["text/plain"] and "trusted" in bundle["text/plain"]


def test_heatmap_labels_queries_and_keys_with_their_tokens():
    fig = plots.heatmap(torch.rand(3, 3).tril(), ["The", " cat", " sat"], "one head")
    ax = fig.axes[0]
    assert "query" in ax.get_ylabel() and "key" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", " cat", " sat"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["The", " cat", " sat"]
