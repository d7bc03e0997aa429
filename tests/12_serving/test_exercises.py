"""Notebook 12's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import json

import httpx
import pytest

from minillm.cache import BlockManager
from minillm.engine import prefill_chunk_sizes
from minillm.exercises import nb12
from minillm.exercises.nb12 import package_frames

# --- the right answers, written as a learner would ---------------------------------------------------


def _keys_right(tokens, block_size):
    keys, previous = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        keys.append(previous)
    return keys


def _keys_by_blocks(tokens, block_size):
    # the same, spelled differently: count the full blocks first, then chain
    keys = []
    for i in range(len(tokens) // block_size):
        keys.append(hash((keys[-1] if keys else None, tuple(tokens[i * block_size : (i + 1) * block_size]))))
    return keys


def _step_right(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding}
    left = float("inf") if budget is None else budget
    for name, n in prefilling:
        plan[name] = int(min(n, left))
        left -= plan[name]
    return plan


def _step_with_break(decoding, prefilling, budget):
    # the engine's old loop: stop at the first prompt the budget cannot fully serve, the rest get 0
    plan = {name: 1 for name in decoding} | {name: 0 for name, _ in prefilling}
    left = budget
    for name, n in prefilling:
        if left is not None and left <= 0:
            break
        plan[name] = n if left is None or left >= n else left
        if left is not None:
            left -= plan[name]
    return plan


@pytest.mark.parametrize(
    "check, right",
    [
        (nb12.check_prefix_keys, _keys_right),
        (nb12.check_prefix_keys, _keys_by_blocks),
        (nb12.check_token_budget_step, _step_right),
        (nb12.check_token_budget_step, _step_with_break),
    ],
    ids=["keys", "keys-by-count", "step", "step-break"],
)
def test_right_answers_pass(capsys, check, right):
    assert check(right) is True
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("check", [nb12.check_prefix_keys, nb12.check_token_budget_step])
def test_an_untouched_stub_says_not_attempted(capsys, check):
    def stub(*args):
        raise NotImplementedError

    assert check(stub) is False
    assert "⏳" in capsys.readouterr().out


def _keys_from_the_package(tokens, block_size):
    return BlockManager(1, block_size).prefix_keys(tokens)


def _step_from_the_package(decoding, prefilling, budget):
    sizes = prefill_chunk_sizes([n for _, n in prefilling], budget)
    return {name: 1 for name in decoding} | {name: n for (name, _), n in zip(prefilling, sizes)}


@pytest.mark.parametrize("check, shortcut, name", [
    (nb12.check_prefix_keys, _keys_from_the_package, "prefix_keys"),
    (nb12.check_token_budget_step, _step_from_the_package, "prefill_chunk_sizes"),
])
def test_calling_the_package_instead_of_writing_it_is_refused(capsys, check, shortcut, name):
    assert check(shortcut) is False
    out = capsys.readouterr().out
    assert "❌" in out and f"`{name}`" in out


def test_the_cases_come_from_the_package():
    m = BlockManager(4, 4, prefix_caching=True)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert nb12.package_keys(tokens, 4) == m.prefix_keys(tokens)
    m.add_sequence(0, tokens)
    m.reserve([0], [len(tokens)])
    m.advance([0], [len(tokens)])
    m.cache_full_blocks(0, tokens)
    assert m.keys[0] == nb12.package_keys(tokens, 4)  # what the manager stores is what the check expects
    assert nb12.package_step(["a"], [("p", 5), ("q", 9)], 8) == {"a": 1, "p": 5, "q": 3}
    assert prefill_chunk_sizes([5, 9, 4], 8) == [5, 3, 0] and prefill_chunk_sizes([5, 9], None) == [5, 9]


# --- the mistakes, written as a learner would ---------------------------------------------------------


def _keys_not_chained(tokens, block_size):
    return [hash(tuple(tokens[i : i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def _keys_not_chained_none(tokens, block_size):
    return [hash((None, tuple(tokens[i : i + block_size]))) for i in range(0, len(tokens) - block_size + 1, block_size)]


def _keys_partial_too(tokens, block_size):
    keys, previous = [], None
    for start in range(0, len(tokens), block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        keys.append(previous)
    return keys


def _keys_prefix_rehashed(tokens, block_size):
    return [hash(tuple(tokens[:end])) for end in range(block_size, len(tokens) + 1, block_size)]


def _keys_chain_on_previous_tokens(tokens, block_size):
    keys, previous = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        keys.append(hash((previous, block)))
        previous = block
    return keys


def _keys_from_zero(tokens, block_size):
    keys, previous = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        keys.append(previous)
    return keys


def _keys_block_first(tokens, block_size):
    keys, previous = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((tuple(tokens[start : start + block_size]), previous))
        keys.append(previous)
    return keys


def _keys_list_block(tokens, block_size):
    keys, previous = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tokens[start : start + block_size]))  # a list: unhashable
        keys.append(previous)
    return keys


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_keys_not_chained, "only its own block"),
        (_keys_not_chained_none, "only its own block"),
        (_keys_partial_too, "partial last block"),
        (_keys_prefix_rehashed, "whole prefix from token 0"),
        (_keys_chain_on_previous_tokens, "previous block's tokens"),
        (_keys_from_zero, "starts from 0"),
        (_keys_block_first, "other order"),
        (_keys_list_block, "unhashable"),
    ],
    ids=["unchained", "unchained-none", "partial", "rehash-prefix", "chain-tokens", "zero", "order", "list"],
)
def test_key_mistakes_are_named(capsys, wrong, says):
    assert nb12.check_prefix_keys(wrong) is False
    assert says in capsys.readouterr().out


def _step_ignores_budget(decoding, prefilling, budget):
    return {name: 1 for name in decoding} | dict(prefilling)


def _step_min_each(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding}
    for name, n in prefilling:
        plan[name] = n if budget is None else min(n, budget)
    return plan


def _step_oldest_only(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding} | {name: 0 for name, _ in prefilling}
    if prefilling:
        name, n = prefilling[0]
        plan[name] = n if budget is None else min(n, budget)
    return plan


def _step_lifo(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding}
    left = float("inf") if budget is None else budget
    for name, n in reversed(prefilling):
        plan[name] = int(min(n, left))
        left -= plan[name]
    return plan


def _step_prompts_first(decoding, prefilling, budget):
    plan, left = {}, float("inf") if budget is None else budget
    for name, n in prefilling:
        plan[name] = int(min(n, left))
        left -= plan[name]
    for name in decoding:
        plan[name] = 1 if left >= 1 else 0
        left -= plan[name]
    return plan


def _step_vllm_budget(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding}
    left = float("inf") if budget is None else budget - len(decoding)
    for name, n in prefilling:
        plan[name] = int(max(min(n, left), 0))
        left -= plan[name]
    return plan


def _step_fair_share(decoding, prefilling, budget):
    plan = {name: 1 for name in decoding}
    for name, n in prefilling:
        plan[name] = n if budget is None else min(n, budget // len(prefilling))
    return plan


def _step_forgets_decodes(decoding, prefilling, budget):
    return {name: n for name, n in _step_right([], prefilling, budget).items()}


def _step_skips_waiting(decoding, prefilling, budget):
    return {name: n for name, n in _step_right(decoding, prefilling, budget).items() if n}


def _step_over_by_one(decoding, prefilling, budget):
    # an off-by-one: the budget check lets one token too many through
    plan = {name: 1 for name in decoding}
    left = float("inf") if budget is None else budget + 1
    for name, n in prefilling:
        plan[name] = int(min(n, left))
        left -= plan[name]
    return plan


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_step_ignores_budget, "the budget was ignored"),
        (_step_min_each, "exceeds it"),
        (_step_oldest_only, "only the oldest prompt"),
        (_step_lifo, "newest prompt went first"),
        (_step_prompts_first, "decodes were starved"),
        (_step_vllm_budget, "vLLM's rule"),
        (_step_fair_share, "split evenly"),
        (_step_forgets_decodes, "running requests are missing"),
        (_step_skips_waiting, "with 0"),
        (_step_over_by_one, "expected {'a': 1, 'b': 1, 'c': 1, 'long': 256}"),  # no name: the values are shown
    ],
    ids=["no-budget", "budget-each", "oldest-only", "lifo", "starve", "vllm", "fair", "no-decodes", "no-zeros",
         "off-by-one"],
)
def test_step_mistakes_are_named(capsys, wrong, says):
    assert nb12.check_token_budget_step(wrong) is False
    assert says in capsys.readouterr().out


def test_hints_come_in_tiers(capsys):
    nb12.check_prefix_keys(_keys_not_chained, hint=2)
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 2/3" in out and "Hint 3/3" not in out and "hint=3" in out


# --- exercise 3: the Server-Sent Events of a streamed answer ----------------------------------------------


def _chunk(head, delta, finish=None):
    return {"id": head["id"], "object": "chat.completion.chunk", "created": head["created"], "model": head["model"],
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def _deltas(pieces):
    return [{"role": "assistant", "content": ""}] + [{"content": p} for p in pieces]


def _sse_right(pieces, finish_reason, head):
    chunks = [_chunk(head, d) for d in _deltas(pieces)] + [_chunk(head, {}, finish_reason)]
    return [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _sse_ascii_compact(pieces, finish_reason, head):
    # the same events, written otherwise: \u escapes, no spaces, keys in another order, no space after "data:"
    chunks = [_chunk(head, d) for d in _deltas(pieces)] + [_chunk(head, {}, finish_reason)]
    return ["data:" + json.dumps(dict(reversed(c.items())), separators=(",", ":")) + "\n\n" for c in chunks] \
        + ["data: [DONE]\n\n"]


@pytest.mark.parametrize("right", [nb12.to_sse_chunks_solution, _sse_right, _sse_ascii_compact],
                         ids=["solution", "learner", "ascii-compact"])
def test_sse_right_answers_pass(capsys, right):
    assert nb12.check_to_sse_chunks(right) is True
    assert "✅" in capsys.readouterr().out


def test_sse_stub_says_not_attempted(capsys):
    def to_sse_chunks(pieces, finish_reason, head):
        raise NotImplementedError

    assert nb12.check_to_sse_chunks(to_sse_chunks) is False
    assert "⏳" in capsys.readouterr().out


def _sse_single_newline(pieces, finish_reason, head):
    return [frame[:-1] for frame in _sse_right(pieces, finish_reason, head)]


def _sse_finish_everywhere(pieces, finish_reason, head):
    chunks = [_chunk(head, d, finish_reason) for d in _deltas(pieces)] + [_chunk(head, {}, finish_reason)]
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _sse_no_done(pieces, finish_reason, head):
    return _sse_right(pieces, finish_reason, head)[:-1]


def _sse_fstring(pieces, finish_reason, head):
    def frame(delta, finish):
        return (f'data: {{"id": "{head["id"]}", "object": "chat.completion.chunk", "created": {head["created"]}, '
                f'"model": "{head["model"]}", "choices": [{{"index": 0, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {finish}}}]}}\n\n')

    frames = [frame('{"role": "assistant", "content": ""}', "null")]
    frames += [frame(f'{{"content": "{piece}"}}', "null") for piece in pieces]  # the text pasted in as it is
    return frames + [frame("{}", f'"{finish_reason}"'), "data: [DONE]\n\n"]


def _sse_quotes_escaped_by_hand(pieces, finish_reason, head):
    escaped = [p.replace('"', '\\"') for p in pieces]  # quotes done, newlines forgotten
    return _sse_fstring(escaped, finish_reason, head)


def _sse_backslash_forgotten(pieces, finish_reason, head):
    escaped = [p.replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") for p in pieces]  # not the \ itself
    return _sse_fstring(escaped, finish_reason, head)


def _sse_no_role(pieces, finish_reason, head):
    chunks = [_chunk(head, {"content": p}) for p in pieces] + [_chunk(head, {}, finish_reason)]
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _sse_no_finish(pieces, finish_reason, head):
    chunks = [_chunk(head, d) for d in _deltas(pieces)]
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _sse_finish_on_last_piece(pieces, finish_reason, head):
    deltas = _deltas(pieces)
    chunks = [_chunk(head, d, finish_reason if i == len(deltas) - 1 else None) for i, d in enumerate(deltas)]
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _sse_one_string(pieces, finish_reason, head):
    return "".join(_sse_right(pieces, finish_reason, head))


def _sse_pieces_merged(pieces, finish_reason, head):
    return _sse_right(["".join(pieces)] if pieces else [], finish_reason, head)


def _sse_no_object(pieces, finish_reason, head):
    chunks = [_chunk(head, d) for d in _deltas(pieces)] + [_chunk(head, {}, finish_reason)]
    return [f"data: {json.dumps({k: v for k, v in c.items() if k != 'object'})}\n\n" for c in chunks] \
        + ["data: [DONE]\n\n"]


def _sse_with_the_server(pieces, finish_reason, head):
    return package_frames(pieces, finish_reason, head)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_sse_single_newline, "ends with a single newline"),
        (_sse_finish_everywhere, "every chunk carries a finish_reason"),
        (_sse_no_done, "does not end with `data: [DONE]`"),
        (_sse_fstring, "pasted into the JSON unescaped"),
        (_sse_quotes_escaped_by_hand, "pasted into the JSON unescaped"),
        (_sse_backslash_forgotten, "escape written by hand"),
        (_sse_no_role, "first chunk's delta has no role"),
        (_sse_no_finish, "no chunk says why the answer ended"),
        (_sse_finish_on_last_piece, "came with the last piece of text"),
        (_sse_one_string, "returned one string"),
        (_sse_pieces_merged, "one per piece"),
        (_sse_no_object, "`object` is missing"),
        (_sse_with_the_server, "the server's own chunk builder"),
    ],
    ids=["blank-line", "finish-everywhere", "no-done", "not-escaped", "newline-not-escaped", "backslash",
         "no-role", "no-finish", "finish-with-text", "one-string", "merged", "no-object", "server"],
)
def test_sse_mistakes_are_named(capsys, wrong, says):
    assert nb12.check_to_sse_chunks(wrong) is False
    out = capsys.readouterr().out
    assert "❌" in out and says in out, out


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_tokenizer):
    """The real server on a tiny random model (what it says does not matter: only its framing)."""
    from helpers.checkpoints import tiny_hf_checkpoint
    from helpers.serving import serving

    from minillm import Engine, load_model

    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=1024), "tiny") as served:
        yield served


def test_the_check_expects_the_bytes_the_server_streams(tiny_server):
    """What the check compares with (package_frames) and the solution are what the server writes,
    byte for byte, on the pieces of a real streamed answer."""
    body = {"model": "tiny", "stream": True, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": 'Say "hi"\nplease'}]}
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60) as response:
        raw = "".join(response.iter_text())
    frames = [f + "\n\n" for f in raw.split("\n\n")[:-1]]
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    head = {k: chunks[0][k] for k in ("id", "created", "model")}
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    reason = chunks[-1]["choices"][0]["finish_reason"]
    assert pieces and reason in ("stop", "length")
    assert "".join(package_frames(pieces, reason, head)) == raw
    assert "".join(nb12.to_sse_chunks_solution(pieces, reason, head)) == raw
