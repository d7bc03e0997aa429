"""Exercises of notebook 12 (serving): the block hash chain of prefix caching, one step of a
token-budget scheduler (chunked prefill), and the Server-Sent Events of a streamed answer.

The expected answers come from the package: ``BlockManager.prefix_keys`` (the keys the engine
stores for every full block), ``minillm.engine.prefill_chunk_sizes`` (the split the engine's
``_prefill`` runs) and ``minillm.serve.protocol`` (the chunks the server streams). The classic
mistakes of the first two are written out in ``nb12_mistakes`` as the functions a learner would
write, so a wrong answer of that kind is named; the stream's are format errors, named by reading
the frames the way a client does.
"""

from __future__ import annotations

import json
import random
import types
from collections.abc import Callable, Sequence

from minillm.cache import BlockManager
from minillm.engine import prefill_chunk_sizes
from minillm.exercises import Mistake, Rule, _print_hints, _short, check
from minillm.exercises.nb12_mistakes import (
    chain,
    keys_chained_on_tokens,
    keys_unchained,
    keys_unchained_plain,
    keys_whole_prefix,
    keys_with_partial,
    step_budget_each,
    step_decodes_in_budget,
    step_equal_split,
    step_first_only,
    step_newest_first,
    step_no_decodes,
    step_prefill_before_decodes,
    step_waiting_left_out,
    step_whole_prompts,
)
from minillm.serve.protocol import Reply, sse

# --- a rule for both: write the mechanism, do not call the package's ---------------------------------


def forbid_names(forbidden: dict[str, str]) -> Rule:
    """A rule: the learner's function (and the functions defined inside it) names none of
    ``forbidden`` (name -> why not): ``BlockManager(...).prefix_keys(...)`` or a call of
    ``prefill_chunk_sizes`` gives the right answer without writing it. These are plain Python
    functions, so the names are read from the function's code rather than recorded as torch calls."""

    def rule(fn: Callable[..., object], args: tuple[object, ...]) -> str | None:
        names: set[str] = set()
        codes = [getattr(fn, "__code__", None)]
        while codes:
            code = codes.pop()
            if code is None:
                continue
            names.update(code.co_names)
            codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
        for name, why in forbidden.items():
            if name in names:
                return f"it uses `{name}`: {why}"
        return None

    return rule


NO_PACKAGE_KEYS = forbid_names({"prefix_keys": "that is the package's answer; chain the hashes yourself."})
NO_PACKAGE_SPLIT = forbid_names({"prefill_chunk_sizes": "that is the package's answer; split the budget yourself."})


# --- exercise 1: the block hash chain ----------------------------------------------------------------


def package_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys the package gives the full blocks of ``tokens`` (a fresh manager: only the block size matters)."""
    return BlockManager(1, block_size, prefix_caching=True).prefix_keys(tokens)


def _key_cases() -> list[tuple[tuple[list[int], int], list[int]]]:
    rng = random.Random(12)
    shared = [rng.randrange(49152) for _ in range(40)]
    inputs = [
        ([5, 6, 7, 8, 9, 10, 11, 12, 13], 4),  # two full blocks and a partial one
        ([1, 2] * 6, 2),  # the same block six times over: only the chain tells them apart
        (list(range(100, 116)), 16),  # exactly one full block
        ([3, 1, 4], 4),  # shorter than a block: no key at all
        ([], 4),
        (shared + [rng.randrange(49152) for _ in range(23)], 16),  # a real-looking prompt, 3 blocks + 15
        (shared[:32] + [7] + shared[33:], 8),  # the same prompt with token 32 changed
        ([rng.randrange(49152) for _ in range(64)], 1),  # block size 1: one key per token
    ]
    return [((tokens, bs), package_keys(tokens, bs)) for tokens, bs in inputs]


UNCHAINED = ("each key hashes only its own block: two prompts that differ in block 0 but hold the same tokens in "
             "block 1 would share block 1's key, and a request would reuse K/V that were computed attending to "
             "another prefix. Chain it: hash((previous_key, block)).")

KEY_MISTAKES = [
    Mistake(keys_unchained, UNCHAINED),
    Mistake(keys_unchained_plain, UNCHAINED),
    Mistake(keys_with_partial, "the partial last block got a key: its next tokens are still to be written, and a "
                                "longer prompt with the same start would find a block that holds only part of its "
                                "tokens. Key full blocks only (len(tokens) // block_size keys)."),
    Mistake(keys_whole_prefix, "each key hashes the whole prefix from token 0: equal keys do mean equal prefixes, "
                                "but the work grows with the square of the prompt length, and these are not the "
                                "package's keys. Hash the previous *key* with this block: hash((previous, block))."),
    Mistake(keys_chained_on_tokens, "each key is chained on the previous block's tokens, not on its key: a key "
                                     "must name the whole prefix, and two prompts that differ in block 0 only would "
                                     "share block 2's key. Chain on the previous key."),
    Mistake(chain(0, lambda prev, block: (prev, block)),
            "the chain starts from 0: the first block has no previous key, which the package writes as None "
            "(hash((None, block)))."),
    Mistake(chain(None, lambda prev, block: (block, prev)),
            "the pair is in the other order: hash((previous, block)), the previous key first (a tuple's hash depends "
            "on its order)."),
]

KEY_HINTS = [
    "Cut the tokens into blocks of block_size and drop the last one if it is not full. Each full block's key "
    "hashes its tokens *together with the key of the block before it*, so the key names the whole prefix.",
    "Walk the full blocks with `previous = None`; for each, `previous = hash((previous, tuple(block)))` and keep "
    "it. A list cannot be hashed: make the block a tuple.",
    "keys, previous = [], None\n"
    "for start in range(0, len(tokens) - block_size + 1, block_size):\n"
    "    previous = hash((previous, tuple(tokens[start : start + block_size])))\n"
    "    keys.append(previous)\n"
    "return keys",
]


def check_prefix_keys(fn: Callable[[list[int], int], list[int]], hint: int = 0) -> bool:
    """``fn(tokens, block_size)`` -> one key per *full* block, ``key_i = hash((key_{i-1}, tuple(block_i)))``
    with ``key_{-1} = None``: the package's ``BlockManager.prefix_keys``."""
    return check("prefix_keys", fn, _key_cases(), hint=hint, hints=KEY_HINTS, mistakes=KEY_MISTAKES,
                 rules=[NO_PACKAGE_KEYS])


# --- exercise 2: one step of a token-budget scheduler -----------------------------------------------------

Prefilling = Sequence[tuple[str, int]]  # (request, prompt tokens still to compute), in arrival order


def package_step(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    """Tokens each request computes this step, by the engine's rule: one per running request, and
    the prompt chunks of ``prefill_chunk_sizes`` (0 for a prompt that waits)."""
    chunks = prefill_chunk_sizes([n for _, n in prefilling], budget)
    return {name: 1 for name in decoding} | {name: n for (name, _), n in zip(prefilling, chunks)}


def _step_cases() -> list[tuple[tuple[list[str], list[tuple[str, int]], int | None], dict[str, int]]]:
    inputs = [
        (["a", "b", "c"], [("long", 900)], 256),  # a long prompt arrives while three requests stream
        (["a", "b"], [("p", 300), ("q", 200)], 128),  # two long prompts: p takes the budget, q waits
        (["a", "b"], [("p", 100), ("q", 50), ("r", 30)], 128),  # the budget runs out inside q; r waits
        ([], [("p", 40), ("q", 30)], 64),  # nothing decoding yet
        (["a"], [("p", 40), ("q", 30)], 100),  # both prompts fit, budget left over
        (["a", "b", "c", "d"], [("p", 3), ("q", 300)], 2),  # a budget smaller than the decodes
        (["a", "b"], [("p", 700), ("q", 20)], None),  # no budget: every prompt whole (no chunking)
        (["a", "b", "c"], [], 64),  # only decodes
        (["a"], [("p", 64), ("q", 64)], 64),  # p takes the budget exactly; q waits
    ]
    return [((list(d), list(p), b), package_step(d, p, b)) for d, p, b in inputs]


STEP_MISTAKES = [
    Mistake(step_no_decodes, "the running requests are missing: each one decodes its next token every step "
                              "(1 each), before any prompt is computed."),
    Mistake(step_whole_prompts, "the budget was ignored: every prompt got all its remaining tokens, so a long "
                                 "prompt stalls the step again. A step computes at most `budget` prompt tokens."),
    Mistake(step_budget_each, "each prompt got up to the whole budget, so the step exceeds it: the budget is the "
                               "step's, shared — what the first prompt takes, the next one cannot."),
    Mistake(step_first_only, "only the oldest prompt got tokens: when it needs less than the budget, what is left "
                              "goes to the next prompt in arrival order."),
    Mistake(step_newest_first, "the newest prompt went first: prompts are served in arrival order (first come, "
                                "first served), so the oldest one finishes first and none waits forever."),
    Mistake(step_prefill_before_decodes, "the decodes were starved: the prompts took the budget first and the "
                                          "running requests got what was left. Every running request decodes one "
                                          "token each step, whatever the budget; the budget is for prompt tokens."),
    Mistake(step_decodes_in_budget, "the decodes were counted against the budget: that is vLLM's rule "
                                     "(max_num_batched_tokens counts every token of the step); this engine's "
                                     "prefill_chunk_tokens caps the prompt tokens only, the decodes come on top."),
    Mistake(step_equal_split, "the budget was split evenly between the prompts: fair, but then every prompt "
                               "finishes late. The engine fills the budget in arrival order, so the oldest prompt "
                               "gets its first token soonest."),
    Mistake(step_waiting_left_out, "a prompt that waits this step is missing: every request appears in the "
                                    "answer, with 0 when it gets no tokens this step."),
]

STEP_HINTS = [
    "Two parts. The running requests: 1 token each, always. The prompts: walk them in arrival order with a "
    "budget that shrinks by what each one takes; a prompt takes min(what it still needs, what is left).",
    "left = budget (float('inf') when budget is None); for each (name, n) in prefilling: take = min(n, left); "
    "left -= take. Prompts after the budget is spent get 0 — keep them in the answer.",
    "plan = {name: 1 for name in decoding}\n"
    "left = float('inf') if budget is None else budget\n"
    "for name, n in prefilling:\n"
    "    plan[name] = int(min(n, left))\n"
    "    left -= plan[name]\n"
    "return plan",
]


def check_token_budget_step(fn: Callable[[list[str], list[tuple[str, int]], int | None], dict[str, int]],
                            hint: int = 0) -> bool:
    """``fn(decoding, prefilling, budget)`` -> ``{request: tokens this step}``: 1 for each running request, and the
    prompts' chunks in arrival order within ``budget`` (None: no limit), 0 for a prompt that waits."""
    return check("token_budget_step", fn, _step_cases(), hint=hint, hints=STEP_HINTS, mistakes=STEP_MISTAKES,
                 rules=[NO_PACKAGE_SPLIT])


# --- exercise 3: a streamed answer as Server-Sent Events ------------------------------------------------

DONE = "data: [DONE]\n\n"
HEAD = {"id": "chatcmpl-5e4c1b9a", "created": 1_700_000_000, "model": "SmolLM2-135M-Instruct"}


def package_frames(pieces: Sequence[str], finish_reason: str, head: dict[str, object]) -> list[str]:
    """The frames ``minillm.serve`` writes for one streamed chat answer (``app._stream``, one choice,
    no usage): the role chunk, a chunk per piece, the finish reason's chunk, then ``[DONE]``."""
    reply = Reply(True, str(head["model"]), str(head["id"]), int(head["created"]))  # type: ignore[call-overload]
    chunks = [reply.chunk(0, role=True)] + [reply.chunk(0, p) for p in pieces]
    return [sse(c) for c in chunks + [reply.chunk(0, finish_reason=finish_reason)]] + [DONE]


def to_sse_chunks_solution(pieces: list[str], finish_reason: str, head: dict[str, object]) -> list[str]:
    """One frame per event: ``data: <one line of JSON>`` and a blank line; the role first, the finish
    reason last (null before), and OpenAI's ``[DONE]`` sentinel to close."""
    def frame(delta: dict[str, str], finish: str | None = None) -> str:
        chunk = {"id": head["id"], "object": "chat.completion.chunk", "created": head["created"],
                 "model": head["model"],
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"  # json.dumps escapes quotes and newlines

    deltas = [{"role": "assistant", "content": ""}] + [{"content": piece} for piece in pieces]
    return [frame(d) for d in deltas] + [frame({}, finish_reason), "data: [DONE]\n\n"]


SSE_INPUTS = [
    (["The", " capital", " of", " France", " is", " Paris", "."], "stop"),
    (['She said "hi"', " and left.\n", "Next line"], "length"),  # quotes and a newline inside the text
    (["café ", "🐉", " 東京", " a\\b", "\ttab"], "stop"),  # non-ASCII, a backslash, a tab
    ([], "stop"),  # an answer that ended at once (end-of-sequence first): no text, still a role and an end
]

NO_BLANK_LINE = ("frame {i} ends with a single newline: an event ends with a *blank line* (\\n\\n). Without it "
                 "the client takes the next frame's `data:` line as more of this event's data and parses neither.")
NOT_ESCAPED = ("frame {i}'s data is not one line of valid JSON ({error}): the text was pasted into the JSON "
               "unescaped, so a quote ends the string early, a newline cuts the `data:` line, a tab is not allowed in a JSON string. Build the chunk as a "
               "dict and let json.dumps write it (it escapes quotes, newlines and backslashes).")
NO_DONE = ("the stream does not end with `data: [DONE]` and a blank line: OpenAI's streams close with that "
           "sentinel, and a client that never sees it cannot tell a finished answer from a dropped connection.")
FINISH_EVERYWHERE = ("every chunk carries a finish_reason: a client takes a non-null finish_reason as the end of "
                     "the answer and stops after the first chunk. It is null (None) until the last chunk.")
NO_FINISH = ("no chunk says why the answer ended: the last chunk before [DONE] has an empty delta ({{}}) and "
             "finish_reason {reason!r}.")
FINISH_WITH_TEXT = ("the finish_reason came with the last piece of text: the server sends it in a chunk of its own, "
                    "with an empty delta ({}), after the text (there may be no text at all).")
NO_ROLE = ("the first chunk's delta has no role: OpenAI's stream opens with {\"role\": \"assistant\", "
           "\"content\": \"\"}, and the pieces follow as {\"content\": piece}, one chunk each.")

SSE_HINTS = [
    "A frame is `data: ` + one line of JSON + a blank line (\"\\n\\n\"). The chunks, in order: one whose delta is "
    "{\"role\": \"assistant\", \"content\": \"\"}, one per piece with delta {\"content\": piece}, one with an "
    "empty delta and the finish_reason; then the frame \"data: [DONE]\\n\\n\".",
    "Every chunk is {\"id\": head[\"id\"], \"object\": \"chat.completion.chunk\", \"created\": head[\"created\"], "
    "\"model\": head[\"model\"], \"choices\": [{\"index\": 0, \"delta\": ..., \"logprobs\": None, "
    "\"finish_reason\": None or the reason}]}. Write it with json.dumps, never by pasting text into a string.",
    "def frame(delta, finish=None):\n"
    "    chunk = {\"id\": head[\"id\"], \"object\": \"chat.completion.chunk\", \"created\": head[\"created\"],\n"
    "             \"model\": head[\"model\"], \"choices\": [{\"index\": 0, \"delta\": delta, \"logprobs\": None,\n"
    "                                             \"finish_reason\": finish}]}\n"
    "    return \"data: \" + json.dumps(chunk) + \"\\n\\n\"\n"
    "deltas = [{\"role\": \"assistant\", \"content\": \"\"}] + [{\"content\": p} for p in pieces]\n"
    "return [frame(d) for d in deltas] + [frame({}, finish_reason), \"data: [DONE]\\n\\n\"]",
]


def read_frame(frame: object, i: int) -> tuple[object, str | None]:
    """What a client reads from one frame: the parsed JSON (or ``"[DONE]"``), or the named problem."""
    if not isinstance(frame, str):
        return None, f"frame {i} is {_short(frame, 60)}, not a str: each frame is the text written to the socket."
    if not frame.startswith("data:"):
        return None, (f"frame {i} does not start with `data:` ({_short(frame, 40)}): an event's lines are "
                      "`field: value`, and a client reads the `data` lines only.")
    if not frame.endswith("\n\n"):
        return None, NO_BLANK_LINE.format(i=i) if frame.endswith("\n") else (
            f"frame {i} has no line end: an event is its `data:` line and a blank line after it (\\n\\n).")
    data = frame[len("data:"):-2]
    data = data.removeprefix(" ")  # one space after the colon is optional
    if data == "[DONE]":
        return data, None
    try:
        if "\n" in data:
            raise ValueError("a raw newline inside the data")
        return json.loads(data), None
    except ValueError as err:
        return None, NOT_ESCAPED.format(i=i, error=str(err).split(":")[0])


def _choice(chunk: object) -> dict[str, object]:
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}


def _delta(choice: dict[str, object]) -> dict[str, object]:
    delta = choice.get("delta")
    return delta if isinstance(delta, dict) else {}


def sse_problem(frames: object, pieces: Sequence[str], finish_reason: str, head: dict[str, object]) -> str | None:
    """The first thing a client would trip on in ``frames``, named; None when they are the server's."""
    if isinstance(frames, str):
        return ("it returned one string: return a list of frames, one string per event, as the server writes "
                "them, each as soon as its piece of text exists.")
    if not isinstance(frames, (list, tuple)):
        return f"it returned {_short(frames, 60)}: return a list of frames (str)."
    read = [read_frame(f, i) for i, f in enumerate(frames)]
    for _, problem in read:
        if problem:
            return problem
    events = [event for event, _ in read]
    if not events or events[-1] != "[DONE]":
        return NO_DONE
    if "[DONE]" in events[:-1]:
        return f"[DONE] comes at frame {events.index('[DONE]')}, before the end: it closes the stream, only last."
    chunks = events[:-1]
    choices = [_choice(c) for c in chunks]
    finishes = [c.get("finish_reason") for c in choices]
    if len(chunks) > 1 and all(f is not None for f in finishes):
        return FINISH_EVERYWHERE
    if not chunks or finishes[-1] is None:
        return NO_FINISH.format(reason=finish_reason)
    if _delta(choices[0]).get("role") != "assistant":
        return NO_ROLE
    if _delta(choices[-1]).get("content"):
        return FINISH_WITH_TEXT
    text = "".join(str(_delta(c).get("content") or "") for c in choices)
    if text != "".join(pieces):
        by_hand = any(c in "".join(pieces) for c in "\\\t\n\"")
        return (f"the content deltas add up to {_short(text, 60)}, not the pieces' text {_short(''.join(pieces), 60)}"
                + (": an escape written by hand? A backslash must be escaped too (\\\\); json.dumps does it all."
                   if by_hand else "."))
    want = [json.loads(f[len("data: "):]) for f in package_frames(pieces, finish_reason, head)[:-1]]
    if len(chunks) != len(want):
        return (f"{len(chunks)} chunks before [DONE] instead of {len(want)}: the role, one per piece (a client "
                "shows each piece as it comes, so none is merged or split), and the finish reason.")
    for i, (got, expected) in enumerate(zip(chunks, want)):
        if got != expected:
            return f"chunk {i}: {_difference(got, expected, '')}"
    return None


def _difference(got: object, want: object, path: str) -> str:
    """Where two parsed chunks first differ: the field's path, and what the server has there."""
    if isinstance(got, dict) and isinstance(want, dict):
        field = (path + ".") if path else ""
        for key in want:
            if key not in got:
                return f"`{field}{key}` is missing (the server sends {_short(want[key], 80)})."
            if got[key] != want[key]:
                return _difference(got[key], want[key], f"{field}{key}")
        extra = next(key for key in got if key not in want)
        return f"`{field}{extra}` is not in the server's chunk."
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        return _difference(got[i], want[i], f"{path}[{i}]")
    return f"`{path}` is {_short(got, 80)}; the server sends {_short(want, 80)}."


def _uses_the_server(fn: Callable[..., object], args: tuple[object, ...]) -> str | None:
    """A rule: the learner's function does not call the server's own chunk builders."""
    code, found = getattr(fn, "__code__", None), set()
    codes = [code]
    while codes:
        code = codes.pop()
        if code is not None:
            found.update(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    scope = getattr(fn, "__globals__", {})
    for name in sorted(found):
        if scope.get(name) in (Reply, sse, package_frames):
            return f"it uses `{name}`, the server's own chunk builder: write the chunks yourself."
    return None


def check_to_sse_chunks(fn: Callable[[list[str], str, dict[str, object]], list[str]], hint: int = 0) -> bool:
    """``fn(pieces, finish_reason, head)`` -> the frames ``minillm.serve`` streams for that answer,
    read as a client reads them: the same JSON in each frame (spacing and key order are free)."""
    for pieces, reason in SSE_INPUTS:
        head = dict(HEAD)
        call = f"{getattr(fn, '__name__', 'to_sse_chunks')}({_short(pieces, 70)}, {reason!r}, head)"
        try:
            frames = fn(list(pieces), reason, head)
        except NotImplementedError:
            print("⏳ to_sse_chunks: not attempted yet — replace the `raise NotImplementedError` with your code.")
            return False
        except Exception as err:  # the learner's code may fail in any way; report it, don't crash
            print(f"❌ to_sse_chunks: {call} raised {type(err).__name__}: {err}")
            _print_hints("to_sse_chunks", hint, SSE_HINTS)
            return False
        problem = sse_problem(frames, pieces, reason, head) or _uses_the_server(fn, ())
        if problem:
            print(f"❌ to_sse_chunks: {call}:\n   🔎 {problem}")
            _print_hints("to_sse_chunks", hint, SSE_HINTS)
            return False
    print(f"✅ to_sse_chunks: all {len(SSE_INPUTS)} checks pass.")
    return True
