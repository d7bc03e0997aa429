"""Instruments for an engine under test."""

from __future__ import annotations

import minillm


def counting_prefill(engine: minillm.Engine) -> list[int]:
    """Record how many prompt tokens each prefill forward computes."""
    computed: list[int] = []
    original = engine.runner.prefill

    def prefill(seq_ids, token_lists):
        computed.append(sum(len(tokens) for tokens in token_lists))
        return original(seq_ids, token_lists)

    engine.runner.prefill = prefill
    return computed
