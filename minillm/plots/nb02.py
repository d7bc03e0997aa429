"""Drawing helpers of notebook 02 (real tokenizers): the byte map, padded batches, coloured tokens.

Each function takes what the notebook computed and draws it; none of them computes anything the
lesson depends on. matplotlib is imported inside the functions that draw with it.
"""

from __future__ import annotations

import html
from typing import Any

COLORS = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d7f4f4"]


def byte_map(byte_to_char: dict[int, str]) -> None:
    """GPT-2's 256 bytes as a 16×16 grid of their printable stand-ins, the shifted ones in orange."""
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array([[ord(byte_to_char[16 * r + c]) != 16 * r + c for c in range(16)] for r in range(16)])
    fig, ax = plt.subplots(figsize=(7.5, 7))
    ax.imshow(grid, cmap="Oranges", vmin=-0.6, vmax=2.2)
    for r in range(16):
        for c in range(16):
            ax.text(c, r, byte_to_char[16 * r + c], ha="center", va="center", fontsize=9)
    ax.set_xticks(range(16), [f"{c:X}" for c in range(16)])
    ax.set_yticks(range(16), [f"{r:X}0" for r in range(16)])
    ax.set(xlabel="low nibble", ylabel="high nibble")
    ax.set_title("GPT-2 byte -> printable character (orange = shifted to U+0100 and up)")
    plt.show()


def _draw_batch(ax: Any, batch: Any, tok: Any, title: str, mask: Any = None, vertical: bool = False) -> None:
    """Each cell a token (a space shows as ·), coloured by position; pads gray, and orange where
    ``mask`` hides a real token."""
    import matplotlib.pyplot as plt
    import numpy as np

    real = batch.attention_mask.numpy()
    mask = real if mask is None else mask.numpy()
    pos = batch.position_ids.numpy()
    colors = np.where(mask[..., None] == 1, plt.cm.YlGnBu(np.clip(0.15 + 0.04 * pos, 0, 0.5))[..., :3], 0.92)
    colors[(real == 1) & (mask == 0)] = (0.99, 0.72, 0.39)
    ax.imshow(colors, aspect="auto")
    for (r, c), m in np.ndenumerate(mask):
        label = tok.id_to_token(int(batch.input_ids[r, c])).replace("Ġ", "·").replace("Ċ", "\\n")
        color = "black" if m or real[r, c] else "gray"
        if vertical:  # long rows: the token only, written upwards
            ax.text(c, r, label, ha="center", va="center", rotation=90, fontsize=6, color=color)
            continue
        ax.text(c, r - 0.18, label, ha="center", va="center", fontsize=7, color=color)
        ax.text(c, r + 0.22, f"p{pos[r, c]}" if m else "", ha="center", va="center", fontsize=7)
    ax.set_title(title)
    ax.set(xlabel="column", ylabel="row")
    ax.set_xticks(range(0, mask.shape[1], 5 if vertical else 1))
    ax.set_yticks(range(mask.shape[0]))


def padding_sides(right: Any, left: Any, tok: Any) -> None:
    """The same prompts padded on the right and on the left, one row of cells per prompt."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12.5, 4.6))
    _draw_batch(axes[0], right, tok, "right padding: prompts end in different columns")
    _draw_batch(axes[1], left, tok, "left padding: every prompt ends in the last column (generation appends here)")
    plt.tight_layout()
    plt.show()


def mask_from_ids(batch: Any, wrong_mask: Any, tok: Any) -> None:
    """A chat batch with the mask from the padding, above the mask ``ids != pad_id``."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(13, 5.4))
    _draw_batch(axes[0], batch, tok, "the mask from the padding: pads gray, every real token visible", vertical=True)
    _draw_batch(axes[1], batch, tok, "the mask `ids != pad_id`: every real <|im_end|> is hidden too (orange)",
                mask=wrong_mask, vertical=True)
    plt.tight_layout()
    plt.show()


def token_spans(tok: Any, text: str) -> str:
    """``text`` as HTML, one coloured span per token (hover for its id); half a character shows as \\x.."""
    spans = []
    for k, i in enumerate(tok.encode(text)):
        piece = tok.decode_bytes([i]).decode("utf-8", errors="backslashreplace")
        piece = html.escape(piece).replace(" ", "&nbsp;").replace("\n", "\\n")
        spans.append(f'<span style="background:{COLORS[k % len(COLORS)]};color:#000;padding:1px 0;'
                     f'font-family:monospace" title="id {i}">{piece}</span>')
    return "".join(spans)


def side_by_side(text: str, tokenizers: dict[str, Any]) -> str:
    """An HTML table: one row per tokenizer, its token count and its coloured tokens."""
    rows = "".join(
        f"<tr><td><b>{name}</b> ({len(t.encode(text))} tokens)</td>"
        f"<td style='text-align:left'>{token_spans(t, text)}</td></tr>"
        for name, t in tokenizers.items()
    )
    return f"<table>{rows}</table>"
