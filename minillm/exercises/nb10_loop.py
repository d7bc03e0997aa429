"""The judge of notebook 10's scheduler-loop exercise: a fake model, the package's scheduler on it,
and a step-by-step comparison of what the learner's loop did with what the scheduler does.

The fake runner has the real runner's interface (``cache.manager``, ``prefill``, ``decode``) and
a real ``BlockManager``; its "model" picks the next token as a hash of the sequence so far, so
tokens depend on the tokens fed, never on the schedule. It records every forward — prefill or
decode, and for which requests (a sequence is matched to its request by its prompt) — and every
preemption (a sequence freed before its request is finished). The package's ``Scheduler`` runs
the same scenarios on the same fake; the first recorded difference is what the learner hears.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from minillm.cache import BlockManager, OutOfBlocksError
from minillm.engine.scheduler import Scheduler

VOCAB = 61
DEADLINE_S = 20.0  # a loop that spins this long without finishing is stopped


def next_token(history: Sequence[int]) -> int:
    """The fake model: a hash of the whole sequence so far (feed a wrong token, get other tokens)."""
    h = 0
    for t in history:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: list[list[int]]
    max_new: list[int]
    max_batch_size: int
    num_blocks: int
    block_size: int


def _prompts(lengths: Sequence[int]) -> list[list[int]]:
    return [[100 + i] + [(7 * i + j) % VOCAB for j in range(n - 1)] for i, n in enumerate(lengths)]


SCENARIOS = [  # (checked in this order; the package's own run of each is below)
    Scenario("requests join as others finish", _prompts([5, 9, 3, 12, 6, 4]), [6, 3, 8, 4, 5, 2], 3, 64, 4),
    Scenario("a tight pool: admission and preemption", _prompts([8, 7, 10, 11, 4]), [12, 4, 7, 10, 12], 3, 8, 4),
]


@dataclass(frozen=True)
class Event:
    kind: str  # "prefill", "decode" or "preempt"
    requests: frozenset[int]
    live: int = 0  # sequences holding blocks during the forward (a prefill's newcomers included)
    finished_held: frozenset[int] = frozenset()  # finished requests still holding blocks then

    def same(self, other: Event) -> bool:
        return self.kind == other.kind and self.requests == other.requests


class LoopMistake(Exception):
    """A named mistake, found while the learner's loop runs."""


class Runaway(Exception):
    """The loop ran far more forwards than the scheduler needs, or ran too long without one."""


class WatchedManager(BlockManager):
    """A real ``BlockManager`` that tells the fake runner when a sequence is added, reserved or freed."""

    def __init__(self, runner: FakeRunner, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.runner = runner
        self.last_reserve: list[int] = []

    def add_sequence(self, seq_id: int, tokens: Sequence[int] = ()) -> int:
        if seq_id in self.block_tables:
            who = self.runner.request_of.get(seq_id)
            raise LoopMistake(
                f"sequence {seq_id}{'' if who is None else f' (request {who})'} is added again while it still "
                f"holds {len(self.block_tables[seq_id])} block(s): a preempted request was put back in the queue "
                f"without freeing its blocks. Free its sequence (manager.free_sequence) when you preempt it.")
        return super().add_sequence(seq_id, tokens)

    def reserve(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> list[tuple[int, int]]:
        self.last_reserve = list(seq_ids)
        return super().reserve(seq_ids, n_new)

    def free_sequence(self, seq_id: int) -> None:
        self.runner.freed(seq_id)
        super().free_sequence(seq_id)


@dataclass
class FakeRunner:
    """``prefill`` and ``decode`` as ``minillm.engine.runner.ModelRunner`` has them, on a fake model."""

    scenario: Scenario
    limit: int = 10**6
    events: list[Event] = field(default_factory=list)
    history: dict[int, list[int]] = field(default_factory=dict)  # seq -> tokens stored
    request_of: dict[int, int] = field(default_factory=dict)  # seq -> request
    emitted: list[int] = field(default_factory=list)  # tokens generated so far, per request

    def __post_init__(self) -> None:
        s = self.scenario
        self.cache = SimpleNamespace(manager=WatchedManager(self, s.num_blocks, s.block_size))
        self.emitted = [0] * len(s.prompts)

    @property
    def manager(self) -> WatchedManager:
        return self.cache.manager

    def live_requests(self) -> dict[int, int]:
        """request -> its sequence, for every sequence holding blocks now."""
        return {self.request_of[s]: s for s in self.manager.block_tables if s in self.request_of}

    def freed(self, seq_id: int) -> None:
        i = self.request_of.pop(seq_id, None)  # (a sequence id may be used again, for another start)
        self.history.pop(seq_id, None)
        if i is not None and self.emitted[i] < self.scenario.max_new[i]:
            self.events.append(Event("preempt", frozenset({i})))

    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        requests = []
        for seq, tokens in zip(seq_ids, token_lists):
            tokens = [int(t) for t in tokens]
            if seq not in self.request_of:
                self.request_of[seq] = self._identify(seq, tokens)
                self.history[seq] = []
            requests.append(self.request_of[seq])
            self._room(seq, len(tokens), "prefill")
        return self._forward("prefill", seq_ids, [list(map(int, t)) for t in token_lists], requests)

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        tokens = [int(t) for t in torch.as_tensor(tokens).view(-1).tolist()]
        if len(tokens) != len(seq_ids):
            raise LoopMistake(f"decode got {len(seq_ids)} sequences but {len(tokens)} tokens: one token per row.")
        for seq in seq_ids:
            if seq not in self.request_of:
                raise LoopMistake(f"decode of sequence {seq}, which was never prefilled.")
            self._room(seq, 1, "decode")
        return self._forward("decode", seq_ids, [[t] for t in tokens], [self.request_of[s] for s in seq_ids])

    def _identify(self, seq: int, tokens: list[int]) -> int:
        if seq not in self.manager.block_tables:
            raise LoopMistake(f"prefill of sequence {seq}, which is not in the cache: manager.add_sequence first.")
        matches = [i for i, p in enumerate(self.scenario.prompts) if tokens[: len(p)] == p]
        if not matches:
            raise LoopMistake(f"sequence {seq} was prefilled with {tokens[:6]}..., which begins with none of the "
                              f"prompts: prefill a request's prompt (after a preemption: its prompt and tokens so far).")
        i = matches[0]
        other = self.live_requests().get(i)
        if other is not None:
            raise LoopMistake(
                f"request {i} is prefilled again (as sequence {seq}) while its earlier sequence {other} still holds "
                f"{len(self.manager.block_tables[other])} block(s): a request was preempted without freeing its blocks. "
                f"Free its sequence (manager.free_sequence) when you preempt it.")
        return i

    def _room(self, seq: int, n: int, what: str) -> None:
        m = self.manager
        if seq not in m.block_tables:
            raise LoopMistake(f"{what} of sequence {seq} (request {self.request_of.get(seq)}), which holds no "
                              f"blocks (freed, or never added).")
        if m.lengths[seq] + n > len(m.block_tables[seq]) * m.block_size:
            raise LoopMistake(f"the {what} writes {n} token(s) into sequence {seq} (request {self.request_of[seq]}), "
                              f"which has room for {len(m.block_tables[seq]) * m.block_size - m.lengths[seq]}: "
                              f"reserve room first (manager.reserve).")

    def _forward(self, kind: str, seq_ids: Sequence[int], token_lists: list[list[int]], requests: list[int]) -> torch.Tensor:
        if len(self.events) >= self.limit:
            raise Runaway
        live = self.live_requests()
        done = frozenset(i for i in live if self.emitted[i] >= self.scenario.max_new[i])
        self.events.append(Event(kind, frozenset(requests), len(live), done))
        logits = torch.zeros(len(seq_ids), VOCAB)
        for row, (seq, tokens, i) in enumerate(zip(seq_ids, token_lists, requests)):
            self.history[seq] += tokens
            logits[row, next_token(self.history[seq])] = 1.0
            self.emitted[i] = max(self.emitted[i], len(self.history[seq]) - len(self.scenario.prompts[i]) + 1)
        self.manager.advance(seq_ids, [len(t) for t in token_lists])
        return logits


class Unit:
    """What the package's scheduler sees of a request: one sequence, a prompt, the tokens so far."""

    seats = 1

    def __init__(self, ids: Iterator[int], prompt: list[int], max_new: int = 1) -> None:
        self.ids, self.prompt, self.max_new = ids, list(prompt), max_new
        self.output: list[int] = []
        self.seq_id = next(ids)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new

    @property
    def seq_ids(self) -> list[int]:
        return [self.seq_id]

    def start(self) -> int:
        self.seq_id = next(self.ids)
        return self.seq_id

    def prefill_tokens(self) -> list[int]:
        return (self.prompt + self.output)[:-1] if self.output else self.prompt

    def last_tokens(self) -> list[int]:
        return self.output[-1:]

    def prefix_tokens(self) -> list[int]:
        return self.prompt + self.output

    def free(self, manager: BlockManager) -> None:
        if self.seq_id in manager.block_tables:
            manager.free_sequence(self.seq_id)

    def preempt(self) -> None:
        pass

    def abort(self) -> None:
        self.max_new = len(self.output)


def package_run(s: Scenario) -> tuple[list[list[int]], list[Event]]:
    """The package's ``Scheduler`` on the fake model, stepped as ``Engine.step`` steps it."""
    runner = FakeRunner(s)
    scheduler = Scheduler(runner.manager, s.max_batch_size)
    ids = itertools.count()
    units = [Unit(ids, p, n) for p, n in zip(s.prompts, s.max_new)]
    for unit in units:
        scheduler.add(unit)
    while scheduler.has_unfinished():
        for schedule in (scheduler.schedule_prefill, scheduler.schedule_decode):
            batch = schedule()
            if batch.seq_ids:
                if batch.is_prefill:
                    logits = runner.prefill(batch.seq_ids, batch.token_ids)
                else:
                    logits = runner.decode(batch.seq_ids, [t[0] for t in batch.token_ids])
                scheduler.mark_computed(batch)
                for unit, rows in batch.outputs:
                    unit.output.append(int(logits[rows[0]].argmax()))
            scheduler.postprocess()
    return [u.output for u in units], runner.events


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise Runaway in a loop that spins without calling the runner (where the OS offers a timer)."""
    if not hasattr(signal, "setitimer"):
        yield
        return
    try:
        previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Runaway()))
    except ValueError:  # not the main thread: no timer
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_learner(fn: Callable[..., Any], s: Scenario, limit: int) -> tuple[Any, BaseException | None, FakeRunner]:
    runner = FakeRunner(s, limit=limit)
    try:
        with _deadline(DEADLINE_S):
            return fn(runner, [list(p) for p in s.prompts], list(s.max_new), s.max_batch_size), None, runner
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001  (the learner's code may fail in any way: that is what we report)
        return None, err, runner


def _names(requests: frozenset[int]) -> str:
    return "{" + ", ".join(map(str, sorted(requests))) + "}" if requests else "nobody"


def diagnose(s: Scenario, got: Any, error: BaseException | None, runner: FakeRunner,
             want: list[list[int]], want_events: list[Event]) -> str | None:
    """What is wrong with the learner's run of ``s``, or None."""
    events = runner.events
    forwards = [e for e in events if e.kind != "preempt"]
    decodes = [e for e in forwards if e.kind == "decode"]
    widest = max(len(e.requests) for e in want_events if e.kind == "decode")
    if decodes and all(len(e.requests) == 1 for e in decodes) and widest > 1:
        return (f"it does not batch: each of its {len(decodes)} decode steps ran one request, while the engine's "
                f"ran up to {widest} at once. (Equal tokens prove nothing: a request's tokens do not depend on what "
                f"shares its steps.) Decode every running request in one runner.decode call.")
    if isinstance(error, LoopMistake):
        return str(error)
    held = next((e for e in events if e.finished_held), None)
    if held is not None:
        return (f"request(s) {_names(held.finished_held)} had finished but still held their blocks during forward "
                f"#{forwards.index(held) + 1}: it never frees (or frees late) a finished request. Retire right after "
                f"the forward that finished it (manager.free_sequence), so its seat and blocks go to the queue.")
    first_admitted = {}
    for k, e in enumerate(want_events):
        for i in e.requests:
            first_admitted.setdefault(i, k)
    for k, (g, w) in enumerate(zip(events, want_events)):
        if not g.same(w):
            return _divergence(s, g, w, first_admitted, sum(e.kind != "preempt" for e in events[:k]))
    if isinstance(error, Runaway):
        return f"it did not finish: it ran {len(forwards)} forwards (the engine needed " \
               f"{sum(e.kind != 'preempt' for e in want_events)}), or spun without calling the runner."
    if error is not None:
        nxt = want_events[len(events)] if len(events) < len(want_events) else None
        if isinstance(error, OutOfBlocksError) and nxt is not None and nxt.kind == "preempt":
            (b,) = nxt.requests
            seq = runner.live_requests().get(b)
            if seq is not None and seq not in runner.manager.last_reserve:
                return (f"it took request {b} out of the batch without freeing its blocks, and the step still did "
                        f"not fit ({error}). Preempting means freeing the victim's sequence (manager.free_sequence).")
            return f"the pool ran out where the engine preempts request {b} (the newest): {error}"
        return f"it raised {type(error).__name__}: {error}"
    if len(events) != len(want_events):
        return f"it recorded {len(events)} forwards and preemptions, the engine {len(want_events)}."
    if not (isinstance(got, list) and all(isinstance(o, list) for o in got)) or len(got) != len(want):
        return f"it should return one list of new token ids per prompt ({len(want)} lists), got {str(got)[:80]}."
    for i, (o, w) in enumerate(zip(got, want)):
        if o != w:
            j = next((j for j, (a, b) in enumerate(zip(o, w)) if a != b), min(len(o), len(w)))
            return (f"request {i}: new token {j} is {o[j] if j < len(o) else 'missing'}, expected "
                    f"{w[j] if j < len(w) else 'none'} ({len(o)} tokens returned, {len(w)} expected). Feed decode "
                    f"each row's last token; a preempted request re-prefills its prompt and all its tokens but the last.")
    if runner.manager.block_tables:
        return f"sequences {sorted(runner.manager.block_tables)} still hold blocks at the end: free every finished one."
    return None


def _divergence(s: Scenario, g: Event, w: Event, first_admitted: dict[int, int], n_forwards: int) -> str:
    at = f"after {n_forwards} forward(s)"
    if g.kind == "prefill" and (w.kind != "prefill" or len(g.requests) > len(w.requests)):
        ref = _names(w.requests) if w.kind == "prefill" else "nobody"
        if g.live > s.max_batch_size:
            return (f"{at} it admitted {_names(g.requests)} where the engine admitted {ref}: the batch then held "
                    f"{g.live} rows, past max_batch_size = {s.max_batch_size}.")
        return (f"{at} it admitted {_names(g.requests)} where the engine admitted {ref}: that admits beyond the "
                f"block budget. The free blocks must hold each newcomer's prompt plus one spare block per row, the "
                f"running rows included, or the next decode step preempts at once.")
    if w.kind == "prefill" and g.kind != "prefill":
        return (f"{at} it ran a {g.kind} where the engine first admitted {_names(w.requests)}, who fit: admit at the "
                f"start of every step, so a finished request's seat is refilled on the very next step (waiting for "
                f"the whole batch to finish is static batching).")
    if g.kind == "prefill":
        if len(g.requests) < len(w.requests):
            return f"{at} it admitted only {_names(g.requests)} where {_names(w.requests)} fit."
        return (f"{at} it admitted {_names(g.requests)} instead of {_names(w.requests)}: first come, first served, and "
                f"a preempted request goes back to the *front* of the queue.")
    if g.kind == "preempt" and w.kind == "preempt":
        (a,), (b,) = g.requests, w.requests
        if first_admitted.get(a, 0) < first_admitted.get(b, 0):
            return (f"{at} it preempted request {a}, the oldest running, where the engine preempts the newest "
                    f"(request {b}): the oldest has waited longest and has the most to recompute.")
        return f"{at} it preempted request {a} where the engine preempted request {b}, the newest running."
    if g.kind == "preempt":
        return (f"{at} it preempted request {_names(g.requests)} though the step fit: only rows whose last block is "
                f"full need a new block; preempt only while they do not fit.")
    if w.kind == "preempt":
        return f"{at} it decoded {_names(g.requests)} where the engine first preempted request {_names(w.requests)}."
    return (f"{at} it decoded {_names(g.requests)} where the engine decoded {_names(w.requests)}: every running "
            f"request decodes in every step.")
