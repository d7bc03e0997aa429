"""``bench structured``: what constrained decoding costs, measured against the same engine free.

* decode tokens/s of a request under a JSON Schema against the same request unconstrained, at
  batch 1 and 8, the two taking turns in rounds (the ratio is taken round by round); the free
  side ignores eos and the schema's outputs are long, so both generate every token;
* the first request's cost for a new schema (compiling its DFA and walking the first state: the
  index is lazy) and the cost of exploring every state, next to outlines-core's ``Index``, which
  builds the whole index up front (when outlines-core is installed: ``pip install outlines-core``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from minillm.bench.timing import interleaved, ratio_range

# Forty short strings: every step constrained, no early end, a DFA of a few thousand states.
SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40, "maxItems": 40}}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_structured()


def bench_structured(weights: str = "native", new_tokens: int = 64, rounds: int = 3) -> dict[str, Any]:
    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    model, tok = load_model(weights=weights)
    engine = Engine(model, tok, max_batch_size=8)
    prompt = tok.apply_chat_template([{"role": "user", "content": "List forty fruits as JSON."}],
                                     add_generation_prompt=True)
    free = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=new_tokens,
                                 response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    r: dict[str, Any] = {"weights": weights, "backend": engine.backend, "new_tokens": new_tokens, **_index_build(tok, engine)}
    engine.generate([prompt], constrained)  # warm-up: the step compiled, the states of this output explored
    for batch in (1, 8):
        runs = interleaved({name: (lambda ps=ps: engine.generate([prompt] * batch, ps))
                            for name, ps in (("free", free), ("constrained", constrained))}, rounds)
        tok_s = {name: [batch * new_tokens / t for t in m.times] for name, m in runs.items()}
        r[f"b{batch}_free_tok_s"] = max(tok_s["free"])
        r[f"b{batch}_constrained_tok_s"] = max(tok_s["constrained"])
        r[f"b{batch}_ratio_range"] = ratio_range(tok_s["constrained"], tok_s["free"])
    return r


def _index_build(tok: Any, engine: Any) -> dict[str, Any]:
    """Seconds to the first masked step of a new schema, and to every state, beside outlines-core."""
    from minillm.structured import pattern_to_nfa, schema_to_regex, vocab_trie
    from minillm.structured.dfa import nfa_to_dfa
    from minillm.structured.index import TokenIndex

    pattern = schema_to_regex(SCHEMA)
    trie = vocab_trie(tok)  # built once per tokenizer, shared by every schema
    start = time.perf_counter()
    index = TokenIndex(nfa_to_dfa(pattern_to_nfa(pattern)), trie, engine.eos_ids)  # compiled afresh
    index.next_states(index.start)
    first = time.perf_counter() - start
    states = index.explore_all()
    r: dict[str, Any] = {"index_first_state_s": first, "index_all_states_s": time.perf_counter() - start,
                         "index_states": states}
    try:
        import outlines_core
    except ImportError:
        return {**r, "outlines_core_index_s": None}
    # every ordinary token by its bytes (special tokens never match; outlines adds eos itself)
    tokens: dict[bytes, list[int]] = {}
    for i, data in tok.vocab.items():
        if i not in set(tok.special_tokens.values()) and i not in engine.eos_ids and data:
            tokens.setdefault(data, []).append(i)
    vocabulary = outlines_core.Vocabulary(min(engine.eos_ids), tokens)
    start = time.perf_counter()
    outlines_core.Index(pattern, vocabulary)
    return {**r, "outlines_core_index_s": time.perf_counter() - start}


def print_structured_report(r: dict[str, Any]) -> None:
    print(f"constrained decoding ({r['weights']} weights, {r['backend']} backend, {r['new_tokens']} tokens per row)")
    for batch in (1, 8):
        low, high = r[f"b{batch}_ratio_range"]
        print(f"  batch {batch}: {r[f'b{batch}_constrained_tok_s']:.1f} tok/s constrained vs "
              f"{r[f'b{batch}_free_tok_s']:.1f} free: {low:.2f}-{high:.2f}x, round by round")
    print(f"  a new schema ({r['index_states']} states): first masked step after {r['index_first_state_s']:.2f} s, "
          f"every state explored after {r['index_all_states_s']:.2f} s", end="")
    oc = r["outlines_core_index_s"]
    print(f"; outlines-core's Index (all states, up front) {oc:.2f} s" if oc is not None else
          "; outlines-core not installed")
