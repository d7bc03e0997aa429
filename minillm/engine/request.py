"""One generation request: its prompt, its parameters, its tokens so far, and when it stops.

Stop rules, checked after every new token:

* ``eos``: the model emitted an end-of-sequence id (unless ``ignore_eos``). The id is kept in
  ``token_ids`` but never appears in the text.
* ``stop``: the text now contains one of ``params.stop``. The text is cut *before* the stop
  string (it is not included, as in the OpenAI and vLLM APIs); ``token_ids`` end with the
  token that completed it.
* ``length``: ``max_new_tokens`` tokens were generated. Without this rule nothing bounds a
  model that never emits EOS ("runaway generation").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.cache.block_manager import BlockManager
from minillm.engine.sequence import SequenceGroup
from minillm.sampling import SamplingParams, SamplingState, TokenLogprob
from minillm.sampling.speculative import Acceptance
from minillm.tokenizer import StreamingDetokenizer, Tokenizer


@dataclass
class Completion:
    """A finished completion: the text, the new token ids and why it stopped."""

    prompt: str
    text: str
    token_ids: list[int]
    # "eos", "stop", "length", "abort" (ended by the caller or a failed step), or "error" (this
    # request alone could not go on: ``error`` says why; the others in its batch were unaffected)
    finish_reason: str
    error: str | None = None
    # one per token of ``token_ids`` when ``params.logprobs`` asked for them (else None)
    logprobs: list[TokenLogprob] | None = None


class StopStringFilter:
    """Releases streamed text only once it cannot be the beginning of a stop string.

    If the stop string is ``"\\nUser:"`` and the model has produced ``"...\\nUs"``, the
    ``"\\nUs"`` is held back: the next token may complete the stop string, and text past (or
    part of) a stop string must never reach the user.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add new text; return what is safe to emit. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            emit, self.pending = self.pending[: min(hits)], ""
            return emit
        hold = max((_overlap(self.pending, s) for s in self.stop), default=0)
        emit = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(emit) :]
        return emit

    def flush(self) -> str:
        emit, self.pending = ("" if self.stopped else self.pending), ""
        return emit


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


@dataclass(eq=False)  # a request is itself: the scheduler finds it by identity, not by value
class Request(SequenceGroup):
    """A prompt being generated: a unit of scheduling with one KV-cache sequence, one batch row."""

    seq_id: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    sampling: SamplingState | None = None  # set by the engine: params, generator, seen tokens
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # set with finish_reason "error"
    logprobs: list[TokenLogprob] | None = None  # one per output token, when params.logprobs is set
    acceptance: Acceptance | None = None  # set by the engine when this request speculates

    def __post_init__(self) -> None:
        self._detokenizer = StreamingDetokenizer(self.tokenizer, skip_special_tokens=True)
        self._filter = StopStringFilter(self.params.stop)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    # ------------------------------------------------------------------ as a SequenceGroup
    @property
    def done(self) -> bool:
        return self.finished

    @property
    def seats(self) -> int:
        return 1

    @property
    def seq_ids(self) -> list[int]:
        return [self.seq_id]

    def start(self) -> int:
        return self.seq_id  # (its own from the start: a preempted request takes it again)

    def prefill_tokens(self) -> list[int]:
        return self.all_ids[:-1] if self.output_ids else self.prompt_ids

    def last_tokens(self) -> list[int]:
        return self.output_ids[-1:]

    def prefix_tokens(self) -> list[int]:
        return self.all_ids

    def free(self, manager: BlockManager) -> None:
        if self.seq_id in manager.block_tables:
            manager.free_sequence(self.seq_id)

    def preempt(self) -> None:
        """Nothing to undo: its next prefill recomputes its prompt and the tokens it has."""

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    def fail(self, error: str) -> None:
        """End this request alone with an error (its logits could not be sampled)."""
        if not self.finished:
            self.finish_reason, self.error = "error", error

    def append(self, token_id: int, logprob: TokenLogprob | None = None) -> str:
        """Record a new token (and its log-probability, if asked for), apply the stop rules, and
        return the new text to stream."""
        self.output_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if token_id in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "eos"
            delta = self._filter.push(self._detokenizer.flush()) + self._filter.flush()
        else:
            delta = self._filter.push(self._detokenizer.push(token_id))
            if self._filter.stopped:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                delta += self._filter.push(self._detokenizer.flush()) + self._filter.flush()
        self.text += delta
        return delta

    def completion(self) -> Completion:
        return Completion(self.prompt, self.text, list(self.output_ids), self.finish_reason or "length", self.error,
                          None if self.logprobs is None else list(self.logprobs))
