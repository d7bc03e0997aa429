"""``bench speculative``: what speculative decoding buys, against plain decoding in the same run.

Greedy, batch 1, on two kinds of prompt: *input-grounded* (correct a given passage, add type
hints to a given function, quote a given passage: the answer copies long runs of its prompt) and
*open-ended* (a story, an explanation: little to copy). For each weight format, the engine plain,
with prompt lookup (adaptive: as many drafts as pay), and with a fixed k = 2, 4, 8 drafts, the
configurations taking turns in rounds. Decode tokens/s: each round's generated tokens (after the
first) over its time less the prompts' prefill, timed in the same round; ratios are taken round
by round. The outputs are checked identical to plain decoding's.

Peers, each against its own plain decoding on the same prompts: transformers'
``generate(prompt_lookup_num_tokens=k)`` (float32) and llama-cpp-python's
``LlamaPromptLookupDecoding`` (the same GGUF; skipped if llama-cpp-python is not installed).
Then 8 concurrent requests (grounded and open-ended mixed), plain against prompt lookup.
"""

from __future__ import annotations

import argparse
from typing import Any

from minillm.bench.timing import interleaved, ratio_range

PASSAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
           "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within fifty "
           "years, presses were running in more than two hundred cities across Europe, and the price of a book fell "
           "by a factor of ten. Pamphlets, newspapers and scientific journals followed, and with them the idea that "
           "knowledge could be shared widely rather than copied by hand in a few monasteries.")
FUNCTION = ('def moving_average(values, window):\n    if window <= 0:\n        raise ValueError("window must be '
            'positive")\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n'
            '        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n'
            '            out.append(total / window)\n    return out\n')
# (kind, text): "chat" wraps the text in the chat template as a user turn; "text" is a raw completion
GROUNDED = [
    ("chat", "Correct the typos in the following text. Reply with the corrected text only.\n\n"
     + PASSAGE.replace("history", "histroy").replace("combined", "combinned").replace("Europe", "Eurpoe")),
    ("chat", "Here is a function:\n\n" + FUNCTION + "\nRewrite it with type hints. Reply with the code only."),
    ("text", "Original text:\n" + PASSAGE + "\n\nThe same text, quoted exactly:\n"),
]
OPEN_ENDED = [
    ("chat", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("chat", "Explain why the sky is blue to a ten-year-old."),
    ("chat", "Give me five ideas for a weekend trip in the mountains, with a sentence on each."),
]
KS = (2, 4, 8)
PEER_KS = (10,)  # the peers' own defaults: llama-cpp-python's num_pred_tokens, transformers' examples


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_speculative()


def bench_speculative(new_tokens: int = 128, rounds: int = 3, weights: tuple[str, ...] = ("native", "float32"),
                      peers: bool = True) -> dict[str, Any]:
    from minillm.model import load_model

    r: dict[str, Any] = {"new_tokens": new_tokens, "rounds": rounds}
    for w in weights:
        model, tok = load_model(weights=w)
        prompts = {kind: [_ids(tok, p) for p in texts] for kind, texts in (("grounded", GROUNDED), ("open", OPEN_ENDED))}
        r[w] = _engine_runs(model, tok, prompts, new_tokens, rounds)
        r[w]["batch8"] = _batch8(model, tok, prompts, new_tokens, rounds)
        if peers and w == "float32":
            r["transformers"] = _transformers(prompts, new_tokens, rounds)
    if peers:
        r["llama.cpp"] = _llama_cpp(prompts, new_tokens, rounds)
    return r


def _ids(tok: Any, prompt: tuple[str, str]) -> list[int]:
    kind, text = prompt
    if kind == "chat":
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def _engine_runs(model: Any, tok: Any, prompts: dict[str, list[list[int]]], new_tokens: int, rounds: int) -> dict[str, Any]:
    from minillm.engine import Engine
    from minillm.engine.speculation import SpeculationStats
    from minillm.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    engines = {"plain": Engine(model, tok, max_batch_size=8),
               "prompt-lookup": Engine(model, tok, max_batch_size=8, speculative="prompt-lookup", num_speculative_tokens=8)}
    for k in KS:
        engines[f"k={k}"] = Engine(model, tok, max_batch_size=8, speculative="prompt-lookup", num_speculative_tokens=k,
                                   adaptive_speculation=False)
    out: dict[str, Any] = {"backend": engines["plain"].backend}
    for kind, ids in prompts.items():
        reference = [c.token_ids for c in engines["plain"].generate(ids, params)]  # warm-up, and the reference
        tokens = sum(map(len, reference))
        same = {}
        for name, engine in engines.items():
            same[name] = [[c.token_ids] for c in [engine.generate([p], params)[0] for p in ids]] == [[t] for t in reference]
            engine.speculator.stats = SpeculationStats()  # count the timed rounds only
        first = SamplingParams(max_new_tokens=1)  # the prompts' prefill (and first token), the same for every engine
        runs = interleaved({"prefill": lambda: [engines["plain"].generate([p], first) for p in ids],
                            **{name: (lambda e=e: [e.generate([p], params) for p in ids]) for name, e in engines.items()}},
                           rounds)
        tok_s = _decode_rates(runs, tokens - len(ids))
        out[kind] = {"tokens": tokens, "identical": same,
                     **{name: {"tok_s": max(tok_s[name]), "ratio": ratio_range(tok_s[name], tok_s["plain"]),
                               "accepted_per_verification": engines[name].speculation_stats.mean_accepted_length,
                               "acceptance_rate": engines[name].speculation_stats.acceptance_rate}
                        for name in engines}}
    return out


def _batch8(model: Any, tok: Any, prompts: dict[str, list[list[int]]], new_tokens: int, rounds: int) -> dict[str, Any]:
    """Eight requests at once (the grounded and open-ended prompts, repeated), plain vs prompt lookup."""
    from minillm.engine import Engine
    from minillm.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    batch = (prompts["grounded"] + prompts["open"]) * 2
    batch = batch[:8]
    engines = {"plain": Engine(model, tok, max_batch_size=8),
               "prompt-lookup": Engine(model, tok, max_batch_size=8, speculative="prompt-lookup", num_speculative_tokens=8)}
    reference = [c.token_ids for c in engines["plain"].generate(batch, params)]
    same = [c.token_ids for c in engines["prompt-lookup"].generate(batch, params)] == reference
    tokens = sum(map(len, reference))
    runs = interleaved({name: (lambda e=e: e.generate(batch, params)) for name, e in engines.items()}, rounds)
    tok_s = {name: [tokens / t for t in m.times] for name, m in runs.items()}
    return {"tokens": tokens, "identical": same, "plain_tok_s": max(tok_s["plain"]),
            "prompt_lookup_tok_s": max(tok_s["prompt-lookup"]), "ratio": ratio_range(tok_s["prompt-lookup"], tok_s["plain"])}


def _transformers(prompts: dict[str, list[list[int]]], new_tokens: int, rounds: int) -> dict[str, Any]:
    """transformers' generate, plain and with prompt_lookup_num_tokens (float32, the same GGUF)."""
    import torch

    from minillm.reference import hf_causal_lm

    model = hf_causal_lm()
    out: dict[str, Any] = {}
    for kind, ids in prompts.items():
        def gen(lookup: int | None, limit: int = new_tokens, ids: list[list[int]] = ids) -> int:
            n = 0
            for p in ids:
                x = torch.tensor([p])
                extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=limit, do_sample=False,
                                   **extra)
                n += y.shape[1] - x.shape[1]
            return n

        tokens = gen(None)  # warm-up
        fns = {"prefill": lambda: gen(None, 1), "plain": lambda: gen(None),
               **{f"k={k}": (lambda k=k: gen(k)) for k in PEER_KS}}
        tok_s = _decode_rates(interleaved(fns, rounds), tokens - len(ids))
        out[kind] = {name: {"tok_s": max(v), "ratio": ratio_range(v, tok_s["plain"])} for name, v in tok_s.items()}
    return out


def _llama_cpp(prompts: dict[str, list[list[int]]], new_tokens: int, rounds: int) -> dict[str, Any] | None:
    """llama-cpp-python on the same GGUF, plain and with LlamaPromptLookupDecoding; None if absent."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    import torch

    from minillm.assets import default_gguf_path

    threads = torch.get_num_threads()
    llms = {"plain": Llama(model_path=str(default_gguf_path()), n_threads=threads, n_ctx=1024, verbose=False)}
    for k in PEER_KS:
        llms[f"k={k}"] = Llama(model_path=str(default_gguf_path()), n_threads=threads, n_ctx=1024, verbose=False,
                               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))
    out: dict[str, Any] = {}
    for kind, ids in prompts.items():
        def gen(llm: Any, limit: int = new_tokens, ids: list[list[int]] = ids) -> int:
            n = 0
            for p in ids:
                llm.reset()
                result = llm.create_completion(p, max_tokens=limit, temperature=0.0, top_k=1)
                n += result["usage"]["completion_tokens"]
            return n

        tokens = gen(llms["plain"])  # warm-up
        fns = {"prefill": lambda: gen(llms["plain"], 1), **{name: (lambda llm=llm: gen(llm)) for name, llm in llms.items()}}
        tok_s = _decode_rates(interleaved(fns, rounds), tokens - len(ids))
        out[kind] = {name: {"tok_s": max(v), "ratio": ratio_range(v, tok_s["plain"])} for name, v in tok_s.items()}
    return out


def _decode_rates(runs: dict[str, Any], decoded: int) -> dict[str, list[float]]:
    """Decode tokens/s of each run, round by round: its time less that round's "prefill" run."""
    prefill = runs.pop("prefill").times
    return {name: [decoded / max(t - p, 1e-9) for t, p in zip(m.times, prefill)] for name, m in runs.items()}


def print_speculative_report(r: dict[str, Any]) -> None:
    print(f"speculative decoding, greedy, {r['new_tokens']} new tokens per prompt, {r['rounds']} interleaved rounds "
          "(ratios round by round, against plain decoding in the same run)")
    for w in ("native", "float32"):
        if w not in r:
            continue
        print(f"  minillm, {w} weights ({r[w]['backend']} backend), batch 1:")
        for kind in ("grounded", "open"):
            runs = r[w][kind]
            print(f"    {kind} ({runs['tokens']} tokens): plain {runs['plain']['tok_s']:.1f} tok/s")
            for name, v in runs.items():
                if name in ("tokens", "identical", "plain"):
                    continue
                low, high = v["ratio"]
                print(f"      {name:14s} {v['tok_s']:7.1f} tok/s  {low:.2f}-{high:.2f}x  "
                      f"{v['accepted_per_verification']:.2f} drafts kept per verification "
                      f"({v['acceptance_rate']:.0%} of drafts), output identical: {runs['identical'][name]}")
        b8 = r[w]["batch8"]
        low, high = b8["ratio"]
        print(f"    8 concurrent requests: plain {b8['plain_tok_s']:.1f} tok/s, prompt lookup "
              f"{b8['prompt_lookup_tok_s']:.1f} tok/s: {low:.2f}-{high:.2f}x, output identical: {b8['identical']}")
    for peer in ("transformers", "llama.cpp"):
        if r.get(peer) is None:
            print(f"  {peer}: not installed")
            continue
        for kind in ("grounded", "open"):
            parts = [f"plain {r[peer][kind]['plain']['tok_s']:.1f} tok/s"]
            parts += [f"prompt lookup {name} {v['tok_s']:.1f} tok/s ({v['ratio'][0]:.2f}-{v['ratio'][1]:.2f}x)"
                      for name, v in r[peer][kind].items() if name != "plain"]
            print(f"  {peer}, {kind}: " + ", ".join(parts))
