"""The model runner: plans each step's input on the host, and hands it to the engine's backend.

Every path that generates text — the engine's continuous batching, beam search, streaming,
the CLI, the demo, the benchmarks, the server — ends up here, in two calls:

* ``prefill(seq_ids, token_lists)``: the admitted prompts (or prompt chunks) packed end to end
  into one forward, each attending causally to itself and to what its sequence already holds;
  logits only at each one's last token;
* ``decode(seq_ids, tokens)``: one new token for every running row, each attending to its own
  keys through its block table. The step that runs hundreds of times per answer.

For both, the runner builds a ``PagedStep`` from the block manager's tables (positions, write
slots, block tables, lengths, which tokens need logits: plain tensors, built once, read back
never), calls the backend chosen when the engine was built (``backends.choose_backend``:
``eager``, ``compiled`` or ``packed-cpu``), then counts the new tokens as stored. The
sequences must already hold room for them: reserving blocks is the scheduler's job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from minillm.cache.paged import PagedKVCache
from minillm.engine.backends import Backend, choose_backend
from minillm.model.llama import Transformer


class ModelRunner:
    """Runs prefill and decode steps of a model on a ``PagedKVCache``.

    Args:
        model: the loaded ``Transformer``.
        cache: the block pool it reads and writes (its ``BlockManager`` holds the tables).
        backend: "eager", "compiled" or "packed-cpu"; None picks the fastest that applies.
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, backend: str | None = None) -> None:
        self.model = model
        self.cache = cache
        self.backend: Backend = choose_backend(model, cache, backend)
        self.compile_seconds: dict[str, float] = {}  # a compiling backend's first call of each kind, in seconds
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record every step: (kind, rows)

    @torch.inference_mode()
    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Write the tokens of each sequence into the cache in one packed forward; return the logits
        at each one's last token, [len(seq_ids), vocab]."""
        lengths = [len(tokens) for tokens in token_lists]
        if self.trace is not None:
            self.trace.append(("prefill", len(seq_ids)))
        step = self.cache.step(seq_ids, lengths)
        token_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=self.model.device)
        logits = self.backend.prefill(token_ids, step)
        self.cache.manager.advance(seq_ids, lengths)
        return logits

    @torch.inference_mode()
    def verify(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """The decode step of a speculative batch: each sequence is fed its last token and the
        tokens drafted after it, a row per token (each row with its own length, as a short
        prompt's tokens are in the packed-cpu step), and every row gets logits, [total tokens,
        vocab]: the target's distribution after each draft. The backend runs it as any decode
        step; ``BlockManager.truncate`` later takes back the rejected drafts' slots."""
        lengths = [len(tokens) for tokens in token_lists]
        if self.trace is not None:
            self.trace.append(("verify", sum(lengths)))
        token_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=self.model.device)
        return self._rows(seq_ids, lengths, token_ids)

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One step for rows whose sequences already hold room for one more token: feed
        ``tokens[i]`` to ``seq_ids[i]``; return logits [len(seq_ids), vocab]."""
        if self.trace is not None:
            self.trace.append(("decode", len(seq_ids)))
        return self._rows(seq_ids, [1] * len(seq_ids), torch.as_tensor(tokens, device=self.model.device).view(-1))

    def _rows(self, seq_ids: Sequence[int], lengths: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        """The backend's decode step over ``lengths[i]`` new tokens of each sequence, a row per
        token (one each: a plain decode step), padded to the backend's shapes."""
        rows = len(token_ids)
        width = max(len(self.cache.block_tables[s]) for s in seq_ids)
        padded = self.backend.padded_rows(rows)
        step = self.cache.step(seq_ids, lengths, pad_rows_to=padded, pad_width_to=self.backend.padded_width(width),
                               row_per_token=True)
        if padded > rows:
            token_ids = torch.cat([token_ids, token_ids.new_zeros(padded - rows)])
        kind = "rows=1" if rows == 1 else "rows>1"
        start = time.perf_counter()
        logits = self.backend.decode(token_ids, step)[:rows]
        if self.backend.compiles and kind not in self.compile_seconds:
            self.compile_seconds[kind] = time.perf_counter() - start
        self.cache.manager.advance(seq_ids, lengths)
        return logits
