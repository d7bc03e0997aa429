"""minillm.plots.widgets: a widget and the picture of its first state are ONE output.

A trusted notebook draws the widget from the output's widget-view type; any other viewer falls
back to the picture in the same bundle, which must match the controls' initial values.
"""

from __future__ import annotations

import base64

import matplotlib
import pytest

matplotlib.use("Agg")

import ipywidgets
import matplotlib.pyplot as plt
from IPython.display import Image

from minillm.plots import widgets

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def shown(monkeypatch):
    """The bundle of every output of the cell; the images the live widget draws into its own output
    area (``IPython.display.Image``, inside the widget) are not outputs of the cell."""
    outputs: list[dict] = []

    def display(obj, **kwargs):
        if not isinstance(obj, Image):
            outputs.append(obj._repr_mimebundle_())

    monkeypatch.setattr("IPython.display.display", display)
    return outputs


def _figure(value: int):
    fig, ax = plt.subplots(figsize=(1 + value, 1))
    ax.set_title(f"value {value}")
    return fig


def _size(png_b64: str) -> tuple[int, int]:
    data = base64.b64decode(png_b64)
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_interact_with_picture_is_one_output_with_the_figure_at_the_initial_value(shown):
    drawn = []

    def draw(value: int):
        drawn.append(value)
        return _figure(value)

    slider = ipywidgets.IntSlider(value=2, min=0, max=5)
    widgets.interact_with_picture(draw, value=slider)
    assert drawn == [2]  # drawn once, at the initial value
    [bundle] = shown  # one output
    assert "application/vnd.jupyter.widget-view+json" in bundle  # a trusted notebook draws the widget
    assert "trusted" in bundle["text/plain"]
    stored = _size(bundle["image/png"])
    assert stored == _size(widgets._png(_figure(2)))  # the picture of the initial value...
    assert stored != _size(widgets._png(_figure(4)))  # ...not of any other
    slider.value = 4
    assert drawn == [2, 4]  # live: a change redraws


def test_interact_with_picture_says_when_the_first_draw_failed(shown):
    def draw(value: int):
        raise ValueError("broken")

    with pytest.raises(RuntimeError, match="initial values"):
        widgets.interact_with_picture(draw, value=ipywidgets.IntSlider(value=1))


def test_with_picture_carries_html_or_a_png_in_the_widget_output(shown):
    widgets.with_picture(ipywidgets.IntSlider(), "<b>the first view</b>")
    widgets.with_picture(ipywidgets.IntSlider(), _figure(1))
    html, png = shown
    for bundle in (html, png):
        assert "application/vnd.jupyter.widget-view+json" in bundle
    assert html["text/html"] == "<b>the first view</b>" and "image/png" not in html
    assert _size(png["image/png"]) == _size(widgets._png(_figure(1))) and "text/html" not in png
