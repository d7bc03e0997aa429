"""From logits to tokens: each request's next token, or tokens, from its rows of a step's logits.

After every forward the engine hands the requests' rows to ``take_tokens``: one batched sampler
call (``sample_batch``) picks a token per request, ``record`` moves its sampler state (penalty
flags, grammar) and ``append`` applies its stop rules. A request that verified drafts
(speculative decoding) has a row per fed token and may take several tokens in one step.
"""

from __future__ import annotations

import torch

from minillm.engine.request import Request
from minillm.engine.speculation import Drafts, Speculator
from minillm.sampling import NO_TOKEN, sample_batch


def take_tokens(requests: list[tuple[Request, range]], logits: torch.Tensor, drafts: dict[int, Drafts],
                speculator: Speculator) -> list[tuple[Request, str]]:
    """Each request's next token from its first row of ``logits``, all in one sampler call.

    A request that verifies drafts has a row per fed token: row ``i`` is the target's
    distribution after its ``i``-th draft. Its tokens are taken position by position (one
    sampler call per position, over every request still verifying): while the token the
    sampler picks is the draft, the draft is kept and the next row decides; the first token
    that differs (or the row after the last draft) is the target's own, and ends it. Each
    token goes through ``record`` and ``append`` as in plain decoding, so penalties, the
    grammar, logprobs and the stop rules see exactly the same sequence of tokens."""
    events = []
    active = requests
    position = 0
    kept = dict.fromkeys(drafts, 0)
    while active:
        rows = [rows.start + position for _, rows in active]
        rows_logits = logits if rows == list(range(len(logits))) else logits[rows]  # (192 KB a row: only when needed)
        proposals = [_proposal(drafts.get(request.seq_id), position) for request, _ in active]
        tokens = sample_batch(rows_logits, [request.sampling for request, _ in active],
                              proposals if any(proposals) else None).tolist()  # the one host read
        still = []
        for (request, request_rows), token in zip(active, tokens):
            if token == NO_TOKEN:  # this row alone failed (NaN logits, an overflow): it ends, and retires
                request.fail(request.sampling.error or "its logits could not be sampled")  # with the finished
                events.append((request, ""))
                continue
            request.sampling.record(token)
            events.append((request, request.append(token, request.sampling.logprob)))
            drafted = drafts[request.seq_id].tokens if request.seq_id in drafts else []
            if position < len(drafted) and token == drafted[position]:
                kept[request.seq_id] += 1
                if not request.finished:
                    still.append((request, request_rows))
        active = still
        position += 1
    for request, _ in requests:
        if request.seq_id in drafts:
            speculator.settle(request, len(drafts[request.seq_id].tokens), kept[request.seq_id])
    return events


def _proposal(drafts: Drafts | None, position: int) -> tuple[int, torch.Tensor] | None:
    """What the sampler needs to verify a draft model's token at ``position``: the token and the
    distribution it was drawn from (None for a deterministic proposal: the sampler draws as usual)."""
    if drafts is None or drafts.probs is None or position >= len(drafts.tokens):
        return None
    return drafts.tokens[position], drafts.probs[position]
