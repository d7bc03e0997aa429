"""The draft-model proposer: a smaller (or more quantized) model guesses the next few tokens.

Any model minillm loads can draft for a target that shares its tokenizer: the same SmolLM2 in
packed 4-bit for a float32 target, SmolLM2-135M for a user's SmolLM2-360M or 1.7B. The draft
keeps its own paged KV cache (its own ``BlockManager`` and ``ModelRunner``), holding, for each
request it drafts for, the text the target has settled plus the drafts it fed itself. Each
time it is asked, a request's draft sequence is cut back to what it shares with the request's
text now (the target kept some drafts and corrected one), the missing tokens are fed in one
packed prefill (its logits give the first draft), and each further draft is one batched decode
step of the draft model.

A greedy request drafts the draft model's argmax; a sampled one draws from the draft's own
filtered distribution ``q`` (the request's temperature, filters and penalty applied to the
draft's logits, as transformers does), and hands ``q`` to the sampler's acceptance rule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from minillm.cache import PagedKVCache
from minillm.engine.runner import ModelRunner
from minillm.engine.speculation import Drafts, PromptLookup, Proposer
from minillm.model.llama import Transformer
from minillm.sampling import filtered_distribution, make_generator
from minillm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minillm.engine.request import Request


class DraftModel:
    """Drafts from ``model`` (loaded by ``minillm.load_model``, with the target's tokenizer).

    Args:
        model: the draft model.
        kv_cache_tokens: its cache's size in tokens (default: the target engine's).
        backend: how its steps run (None: the fastest that applies, as for an engine).
    """

    name = "draft"
    free = False

    def __init__(self, model: Transformer, *, kv_cache_tokens: int | None = None, backend: str | None = None) -> None:
        self.model = model
        self.kv_cache_tokens = kv_cache_tokens
        self.backend = backend
        self._runner: ModelRunner | None = None
        self._held: dict[int, tuple[Request, list[int]]] = {}  # seq id -> (its request, tokens in the cache)
        self._generators: dict[int, torch.Generator | None] = {}
        self._seconds_per_draft = 0.0

    def bind(self, vocab_size: int, kv_cache_tokens: int, block_size: int) -> None:
        """Build the draft's cache for an engine whose model has ``vocab_size`` tokens."""
        if self.model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {self.model.config.vocab_size:,} tokens and the "
                             f"target's {vocab_size:,}: a draft model must share the target's tokenizer")
        tokens = self.kv_cache_tokens or kv_cache_tokens
        cache = PagedKVCache(self.model.config, -(-tokens // block_size), block_size, self.model.device,
                             self.model.dtype)
        self._runner = ModelRunner(self.model, cache, self.backend)

    def seconds_per_draft(self) -> float:
        return self._seconds_per_draft

    def propose(self, requests: Sequence[Request], counts: Sequence[int]) -> list[Drafts]:
        if self._runner is None:
            raise RuntimeError("DraftModel.bind() was not called: pass the DraftModel to an Engine")
        start = time.perf_counter()
        self._release_finished()
        manager = self._runner.cache.manager
        drafts = [Drafts([]) for _ in requests]
        rows: list[tuple[int, Request, int]] = []  # (index, request, drafts to make)
        feeds: list[list[int]] = []
        for i, (request, count) in enumerate(zip(requests, counts)):
            if count < 1:
                continue
            feed = self._catch_up(request)
            if not manager.can_reserve([request.seq_id], [len(feed) + count - 1]):
                self._release(request.seq_id)  # start over next time, when the pool has room
                continue
            manager.reserve([request.seq_id], [len(feed) + count - 1])
            rows.append((i, request, count))
            feeds.append(feed)
        if not rows:
            return drafts
        logits = self._runner.prefill([r.seq_id for _, r, _ in rows], feeds)
        made = 1
        while True:
            for (i, request, count), row in zip([r for r in rows if r[2] >= made], logits):
                token, q = self._draw(request, row, drafts[i].tokens)
                drafts[i].tokens.append(token)
                if q is not None:
                    drafts[i].probs = q[None] if drafts[i].probs is None else torch.cat([drafts[i].probs, q[None]])
            made += 1
            going = [(i, request) for i, request, count in rows if count >= made]
            if not going:
                break
            logits = self._runner.decode([r.seq_id for _, r in going], [drafts[i].tokens[-1] for i, _ in going])
        for i, request, count in rows:  # the draft's cache now holds the text and every draft but the last
            self._held[request.seq_id] = (request, request.all_ids + drafts[i].tokens[:-1])
        made_total = sum(count for _, _, count in rows)
        self._seconds_per_draft = (time.perf_counter() - start) / made_total
        return drafts

    def _catch_up(self, request: Request) -> list[int]:
        """Cut the request's draft sequence back to what it shares with the request's text, and
        return the tokens to feed (at least the last one, whose logits give the first draft)."""
        manager = self._runner.cache.manager  # type: ignore[union-attr]
        text = request.all_ids
        _, held = self._held.get(request.seq_id, (request, []))
        if request.seq_id not in manager.block_tables:
            manager.add_sequence(request.seq_id)
            held = []
        shared = 0
        for a, b in zip(held, text[:-1]):
            if a != b:
                break
            shared += 1
        manager.truncate(request.seq_id, shared)
        self._held[request.seq_id] = (request, text[:shared])
        return text[shared:]

    def _draw(self, request: Request, logits: torch.Tensor, so_far: list[int]) -> tuple[int, torch.Tensor | None]:
        """The next draft token: the argmax for a greedy request, else a draw from ``q``."""
        params = request.params
        history = torch.tensor([request.all_ids + so_far] if params.repetition_penalty != 1.0 else [[]],
                               dtype=torch.long)
        q = filtered_distribution(logits[None], history, params)[0]
        if params.is_greedy:
            return int(q.argmax()), None
        if request.seq_id not in self._generators:  # its own stream: the request's is the target's
            own = request.sampling.generator if request.sampling is not None else None  # seeded per completion
            seed = None if own is None else (own.initial_seed() * 2654435761 + 1) % 2**64
            self._generators[request.seq_id] = make_generator(seed, q.device)
        return int(torch.multinomial(q, 1, generator=self._generators[request.seq_id])), q

    def _release_finished(self) -> None:
        for seq_id, (request, _) in list(self._held.items()):
            if request.done:
                self._release(seq_id)

    def _release(self, seq_id: int) -> None:
        manager = self._runner.cache.manager  # type: ignore[union-attr]
        if seq_id in manager.block_tables:
            manager.free_sequence(seq_id)
        self._held.pop(seq_id, None)
        self._generators.pop(seq_id, None)


# A text whose encoding two tokenizers must agree on before one model may draft for another's.
TOKENIZER_CHECK = "The quick brown fox, 1234 times: naïve café ☕ <|im_end|>\n\tdef f(x):\n"


def make_proposer(spec: str | Proposer, tokenizer: Tokenizer, device: torch.device) -> Proposer:
    """A proposer from its name: "prompt-lookup", or "draft:PATH" (a model minillm loads: a
    GGUF file or an HF folder; "draft:" alone is the default model, in its default weights),
    whose tokenizer must encode like ``tokenizer``. A proposer object is returned as it is."""
    if not isinstance(spec, str):
        return spec
    if spec == "prompt-lookup":
        return PromptLookup()
    if spec.startswith("draft:"):
        from minillm.model.loading import default_weights, load_model  # (only when a draft model is asked for)

        source = spec.removeprefix("draft:") or None
        model, draft_tokenizer = load_model(source, device=device, weights=default_weights(source, device))
        if draft_tokenizer.encode(TOKENIZER_CHECK) != tokenizer.encode(TOKENIZER_CHECK):
            raise ValueError(f"the draft model {source or '(default)'} does not share the target's tokenizer "
                             "(they encode the same text differently)")
        return DraftModel(model)
    raise ValueError(f"speculative must be 'prompt-lookup', 'draft:PATH' or a proposer, got {spec!r:.100}")
