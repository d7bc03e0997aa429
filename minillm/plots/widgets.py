"""Widgets that still show a picture where they cannot run: one output, the widget and its picture.

A saved ipywidgets output is only a reference to a widget model. JupyterLab draws it only in a
trusted notebook whose metadata holds the widget state (``make lab`` trusts the course's
notebooks); an untrusted notebook, GitHub or nbviewer finds no widget and falls back to the
output's next best type, the ``Box(children=...)`` text. So each function here puts a picture of
the widget's first state (a PNG, or HTML) into the SAME output bundle as the widget: a trusted
notebook shows the live widget, every other viewer the picture, and both show the controls'
initial values. (Two outputs, a figure above a widget, would show the figure twice when live
and a picture that no longer matches the controls once they move.)
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import ipywidgets

FALLBACK_TEXT = "(a widget: live in a trusted notebook; the picture shows its first setting)"


class _WithPicture(ipywidgets.VBox):
    """A box around one widget whose display bundle also carries a picture of it."""

    def __init__(self, widget: ipywidgets.Widget, picture: dict[str, str]) -> None:
        super().__init__([widget])
        self.picture = picture

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # IPython's display protocol: an object's rich output is what this method returns, so
        # overriding it is the public way to add a type; ipywidgets has no other way to hand
        # over its widget-view type than this method of the base class.
        return {**super()._repr_mimebundle_(**kwargs), **self.picture, "text/plain": FALLBACK_TEXT}


def _png(figure: Any) -> str:
    """A matplotlib figure as base64 PNG (the encoding of image/png in a notebook); closes it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def with_picture(widget: ipywidgets.Widget, picture: Any) -> None:
    """Display a ready-made ``widget`` as ONE output that carries ``picture``, its first state: a
    matplotlib figure (stored as image/png) or an HTML string (stored as text/html)."""
    from IPython.display import display

    bundle = {"text/html": picture} if isinstance(picture, str) else {"image/png": _png(picture)}
    display(_WithPicture(widget, bundle))


def interact_with_picture(draw: Callable[..., Any], **controls: ipywidgets.ValueWidget) -> None:
    """``ipywidgets.interactive`` over ``draw(**values)``, a function returning a matplotlib figure,
    displayed as ONE output that carries the figure at the controls' initial values. ``draw`` runs
    once to start (the live widget's first picture and the stored one are the same PNG), then once
    per change of a control."""
    from IPython.display import Image, display

    first: list[str] = []

    def show(**values: Any) -> None:
        png = _png(draw(**values))
        if not first:
            first.append(png)
        display(Image(base64.b64decode(png)))

    widget = ipywidgets.interactive(show, **controls)  # calls show once, with the initial values
    if not first:
        raise RuntimeError("draw() failed at the controls' initial values (its traceback is above)")
    display(_WithPicture(widget, {"image/png": first[0]}))
