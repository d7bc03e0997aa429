"""minillm.plots.nb03: heatmaps name their axes (its widget: tests/package/test_plots_widgets.py)."""

from __future__ import annotations

import matplotlib
import torch

matplotlib.use("Agg")

from minillm.plots import nb03 as plots


def test_heatmap_labels_queries_and_keys_with_their_tokens():
    fig = plots.heatmap(torch.rand(3, 3).tril(), ["The", " cat", " sat"], "one head")
    ax = fig.axes[0]
    assert "query" in ax.get_ylabel() and "key" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["The", " cat", " sat"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["The", " cat", " sat"]
