"""The eager backend: the model's own modules, called one by one — the notebooks' code.

It is the reference every other backend is compared with, and the one that runs anywhere
(any device, any dtype, no compiler). Its prefill is also the prefill of the compiled backend:
a prompt is a matrix-matrix product, which MKL and cuBLAS already run at full speed, and its
length changes every time, which a compiled program would not like.
"""

from __future__ import annotations

import torch

from minillm.cache.paged import PagedStep
from minillm.model.llama import Transformer


class EagerBackend:
    name = "eager"
    compiles = False

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def prefill(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        logits = self.model.run(token_ids[None], step.positions[None], paged=step, logits_index=step.logits_index)
        return logits[0]

    def decode(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        return self.model.run(token_ids[:, None], step.positions[:, None], paged=step)[:, -1]

    def padded_rows(self, rows: int) -> int:
        return rows

    def padded_width(self, width: int) -> int:
        return width
