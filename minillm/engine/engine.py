"""The engine: many requests, one model, one paged KV cache, continuous batching.

Every step the scheduler does three things:

1. **admit** waiting requests while there is room in the batch and in the block pool (it
   *asks* the ``BlockManager``); the prompts admitted together are prefilled in one packed
   forward, and each samples its first token. With ``prefix_caching`` a prompt first takes
   the cached blocks of its longest known prefix and computes only the rest; with
   ``prefill_chunk_tokens`` at most that many prompt tokens are computed per step, so a long
   prompt is spread over several steps instead of stalling everyone's next token;
2. **decode** one token for every running row in a single batched, compiled step
   (``ModelRunner.decode``): the rows have different lengths, and each reads its own keys
   through its block table;
3. **retire** finished requests at once, handing their blocks back to the pool, so a waiting
   request can join the running batch on the very next step.

That last point is *continuous batching*: the batch is refilled token by token instead of
waiting for its slowest member, which is why throughput scales with the number of requests.
A request that finishes during its prefill (one new token, a stop string, EOS first) simply
leaves room for the next admission.

A request is a ``Request`` (one row) or a ``BeamSearch`` (``num_beams`` rows); both run in
the same step, and all sampled rows of a step go through one ``sample_batch`` call.

If a decode step finds the pool short, the most recently admitted request is *preempted*:
its blocks are freed and it goes back to the front of the queue, to be prefilled again
(prompt + tokens so far) when room returns. Its output is unchanged, only recomputed.

The scheduler's state lives in the engine (``waiting``, ``running``), and ``step()`` runs one
iteration of it, so requests can arrive while others run: ``add_request`` queues one,
``step()`` admits, decodes and retires, ``abort`` ends one at once. ``generate``, ``stream``
and a server are loops over ``step()``; two open streams share the same running batch.

Whatever ends a request early — a stream abandoned with ``break`` or ``close()``, an exception
in the caller's loop, Ctrl-C or an error in the middle of a step — its sequences are freed on
the way out (``abort``; a failed step aborts the requests it was running), so the pool is back
where it started and the engine keeps serving.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from minillm.cache import BlockManager, OutOfBlocksError, PagedKVCache
from minillm.engine.beam import BeamSearch
from minillm.engine.request import Completion, Request
from minillm.engine.runner import ModelRunner
from minillm.model.llama import Transformer
from minillm.sampling import SamplingParams, SamplingState, make_generator, sample_batch
from minillm.tokenizer import Tokenizer

Unit = Union[Request, BeamSearch]  # what the scheduler admits, runs and retires
Prompt = Union[str, Sequence[int]]  # text, or token ids used as they are


@dataclass
class Prefill:
    """An admitted unit whose prompt is being computed: its sequence, and the tokens still to go."""

    unit: Unit
    seq_id: int
    tokens: list[int]
    pending_keys: list[int]  # prefix keys of the full blocks it computes (with prefix caching)


class TextStream:
    """One completion's text deltas, as the engine produces them.

    Each ``next()`` runs engine steps until this request has new text (other requests in the
    running batch advance too). Abandoning it (``break``, ``close()``, ``del``, an exception in
    the loop) aborts the request at once and returns its KV blocks. Once it is exhausted,
    ``completion`` holds the result.
    """

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
        self._request = request
        self._sent = 0  # characters of request.text already handed out
        self.completion: Completion | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        request = self._request
        while len(request.text) == self._sent and not request.finished:
            self._engine.step()
        if len(request.text) > self._sent:
            delta, self._sent = request.text[self._sent :], len(request.text)
            return delta
        self.completion = request.completion()
        raise StopIteration

    def close(self) -> None:
        self._engine.abort(self._request)  # a no-op once it has finished

    def __del__(self) -> None:
        self.close()


class Engine:
    """Serve generation requests on a model with a paged KV cache.

    Args:
        model, tokenizer: from ``minillm.load_model()``.
        max_batch_size: most rows (sequences, beams included) decoded together in one step.
        kv_cache_tokens: size of the block pool, in tokens (default: 1024 per batch row).
        block_size: tokens per KV block.
        eos_ids: ids that end a completion (default: the tokenizer's EOS).
        backend: how steps run — "eager" (the notebooks' PyTorch), "compiled" (``torch.compile``)
            or "packed-cpu" (C++ kernels, for packed weights on a CPU); None (the default) picks
            the fastest that applies. ``engine.backend`` names the one that runs.
        prefix_caching: reuse the KV blocks of earlier prompts that share a prefix with a new
            one (a system prompt, a conversation so far) instead of computing them again. Off by
            default: a reused block was computed in another packing of the step, so its float
            rounding can differ from a fresh prefill's (the server turns it on).
        prefill_chunk_tokens: at most this many prompt tokens are computed per step ("chunked
            prefill"): a long prompt is prefilled over several steps, each also decoding the
            running requests, so it cannot stall their streams for its whole length. None (the
            default) prefills every admitted prompt whole, in one forward.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        max_batch_size: int = 16,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        eos_ids: Sequence[int] | None = None,
        backend: str | None = None,
        prefix_caching: bool = False,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        max_batch_size = _positive_int("max_batch_size", max_batch_size)
        if prefill_chunk_tokens is not None:
            prefill_chunk_tokens = _positive_int("prefill_chunk_tokens", prefill_chunk_tokens)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        block_size = _positive_int("block_size", block_size)
        if kv_cache_tokens is not None:
            kv_cache_tokens = _positive_int("kv_cache_tokens", kv_cache_tokens)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        tokens = kv_cache_tokens or max_batch_size * 1024
        num_blocks = math.ceil(tokens / block_size)
        try:
            self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype,
                                      prefix_caching=prefix_caching)
        except (MemoryError, RuntimeError) as err:  # the allocator's own message often names no size
            gib = 2 * model.config.n_layers * (num_blocks + 1) * model.config.n_kv_heads * block_size \
                * model.config.head_dim * model.dtype.itemsize / 2**30
            raise ValueError(f"a KV cache of {tokens:,} tokens (kv_cache_tokens) needs {gib:,.1f} GiB on "
                             f"{model.device}, which could not be allocated: ask for fewer tokens") from err
        self.runner = ModelRunner(model, self.cache, backend)
        default_eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else default_eos)
        self._next_seq_id = 0
        self.waiting: deque[Unit] = deque()  # queued, in arrival order (preempted ones go back to the front)
        self.running: list[Unit] = []  # holding KV blocks, decoded every step
        self.prefilling: list[Prefill] = []  # admitted, their prompts being computed chunk by chunk
        self.preemptions = 0  # requests sent back to the queue because the pool ran out
        self.prompt_tokens = 0  # prompt tokens admitted (recomputed ones of preempted requests too)
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache instead of computed

    @property
    def backend(self) -> str:
        """The backend that runs this engine's steps: "eager", "compiled" or "packed-cpu"."""
        return self.runner.backend.name

    @property
    def manager(self) -> BlockManager:
        """The pool's bookkeeping, which the scheduler asks whether work fits."""
        return self.cache.manager

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Complete every prompt (``params.n`` completions each, in prompt order). A prompt is a
        string, or a list of token ids (a pre-tokenized prompt, used as it is)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise TypeError(f"prompts must be a list of prompts (each a str or a list of token ids), "
                            f"got {type(prompts).__name__}")
        per_prompt = self._params_per_prompt(prompts, params)
        units: list[Unit] = []
        for prompt, ps in zip(prompts, per_prompt):
            if ps.num_beams > 1:
                units.append(self._beam_search(prompt, ps))
            else:
                units.extend(self._request(prompt, ps, i) for i in range(ps.n))
        for _ in self._run(units):
            pass
        completions = []
        for prompt, unit in zip(self._unit_prompts(prompts, per_prompt), units):
            if isinstance(unit, BeamSearch):
                completions.extend(self._beam_completions(prompt, unit))
            else:
                completions.append(unit.completion())
        return completions

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> TextStream:
        """The completion's text as it is generated (complete characters only): iterate over
        the returned ``TextStream``; its ``completion`` (token ids, finish reason) is set at the end."""
        params = self._params_per_prompt([prompt], params)[0]
        if params.num_beams > 1 or params.n > 1:
            raise ValueError("stream() serves one sampled completion: use num_beams=1 and n=1")
        return TextStream(self, self.add_request(prompt, params))

    def chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None) -> Completion:
        """Answer a conversation: the chat template, then generation."""
        return self.generate([self._chat_prompt(messages)], params)[0]

    def stream_chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None) -> TextStream:
        return self.stream(self._chat_prompt(messages), params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Request:
        """Queue one completion (``n=1``, no beams) for the next ``step()`` to admit; its
        ``output_ids``, ``text`` and ``finish_reason`` fill in as steps run."""
        params = self._params_per_prompt([prompt], params)[0]
        if params.num_beams > 1 or params.n > 1:
            raise ValueError("add_request() queues one sampled completion: use num_beams=1 and n=1 "
                             "(generate() serves beams and n > 1)")
        request = self._request(prompt, params, 0)  # checked now: a bad prompt fails here
        if not request.finished:
            self.waiting.append(request)
        return request

    def abort(self, unit: Unit) -> None:
        """End a request now (finish reason ``"abort"``) and return its KV blocks; a no-op once
        it has finished."""
        if _is_done(unit):
            return
        self._forget(unit)
        if isinstance(unit, BeamSearch):
            unit.done = True
        else:
            unit.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation's token ids. Message text is encoded with special-token parsing off:
        a user who types ``<|im_end|>`` gets those characters, not a forged end of turn (only
        the template's own markers are special). Never re-encode the rendered string instead."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids

    # ------------------------------------------------------------------ requests
    def _params_per_prompt(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params must be a SamplingParams or a list of them (one per prompt), "
                            f"got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

    @staticmethod
    def _unit_prompts(prompts: Sequence[Prompt], per_prompt: list[SamplingParams]) -> list[Prompt]:
        return [p for p, ps in zip(prompts, per_prompt) for _ in range(1 if ps.num_beams > 1 else ps.n)]

    def _encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        context = self.model.config.max_position_embeddings
        if isinstance(prompt, str):
            # Refuse by size before encoding: a token spans at most max_token_bytes bytes, so this
            # many bytes cannot fit in the context whatever the merges (and encoding megabytes
            # only to refuse them would take seconds).
            at_least = len(prompt.encode("utf-8", "surrogatepass")) // self.tokenizer.max_token_bytes
            if at_least > context:
                raise ValueError(f"the prompt ({len(prompt):,} characters) is at least {at_least:,} tokens, "
                                 f"more than the context window of {context}")
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and \
                all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (vocab_size {vocab})")
        else:  # bytes too: text must be decoded by the caller, who knows its encoding
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(prompt_ids) + params.max_new_tokens > context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={params.max_new_tokens} "
                f"it exceeds the context window of {context}"
            )
        rows = params.num_beams
        needed = rows * self.manager.blocks_for_tokens(len(prompt_ids) + params.max_new_tokens)
        if needed > self.manager.allocator.num_blocks:
            raise ValueError(
                f"a {len(prompt_ids)}-token prompt with max_new_tokens={params.max_new_tokens}"
                + (f" and {rows} beams" if rows > 1 else "")
                + f" may need {needed} KV blocks; the pool has {self.manager.allocator.num_blocks} "
                f"of {self.cache.block_size} tokens (raise kv_cache_tokens)"
            )
        return prompt_ids

    def _request(self, prompt: Prompt, params: SamplingParams, index: int) -> Request:
        prompt_ids = self._encode(prompt, params)
        seed = None if params.seed is None else (params.seed + index) % 2**64  # completion i of n: its own stream
        generator = make_generator(seed, self.model.device)
        sampling = SamplingState(params, prompt_ids, self.model.config.vocab_size, generator, self.model.device)
        request = Request(self._new_seq_id(), _as_text(prompt, self.tokenizer), prompt_ids, params, self.tokenizer, self.eos_ids, sampling)
        if params.max_new_tokens == 0:
            request.finish_reason = "length"
        return request

    def _beam_search(self, prompt: Prompt, params: SamplingParams) -> BeamSearch:
        return BeamSearch(self._encode(prompt, params), params, self.eos_ids, self._new_seq_id)

    def _beam_completions(self, prompt: Prompt, search: BeamSearch) -> list[Completion]:
        completions = []
        for token_ids in search.best(search.params.n) or [[]]:
            request = Request(-1, _as_text(prompt, self.tokenizer), search.prompt_ids, search.params, self.tokenizer, self.eos_ids)
            for token in token_ids:
                request.append(token)
                if request.finished:
                    break
            completions.append(request.completion())
        return completions[: search.params.n]

    # ------------------------------------------------------------------ the scheduler loop
    @torch.inference_mode()
    def step(self) -> list[tuple[Request, str]]:
        """One iteration of the scheduler: admit and prefill what fits, decode every running row
        once, retire what finished. Returns the (request, new text) pairs it produced.

        If the step fails (an error in the model or the sampler, Ctrl-C), the requests it was
        running are aborted and their blocks freed before the error propagates; waiting
        requests stay queued and the engine keeps serving.
        """
        events: list[tuple[Request, str]] = []
        admitted: list[Unit] = []
        try:
            admitted = self._admit()
            self._start(admitted)
            admitted = []
            if self.prefilling:
                events += self._prefill()
            elif not self.running and self.waiting:
                head = self.waiting.popleft()
                self.abort(head)
                raise OutOfBlocksError(
                    f"a {_prefill_len(head)}-token request does not fit in the free KV cache "
                    f"({self.manager.allocator.num_free} of {self.manager.allocator.num_blocks} blocks "
                    f"of {self.cache.block_size} tokens free)"
                )
            if self.running:
                self._reserve_or_preempt()
                events += self._decode()
                self.running = [u for u in self.running if not self._retire_if_done(u)]
        except BaseException:
            for unit in admitted + [p.unit for p in self.prefilling] + self.running:
                self.abort(unit)
                self._forget(unit)  # (also one that finished in this very step, before it could retire)
            raise
        return events

    def _run(self, units: Sequence[Unit]) -> Iterator[tuple[Request, str]]:
        """Queue ``units`` and step until all of them are done, yielding their (request, text
        delta) pairs; however the loop ends (exhausted, abandoned, an error), they are aborted."""
        mine = [u for u in units if not _is_done(u)]
        ids = {id(u) for u in mine}
        self.waiting.extend(mine)
        try:
            while not all(_is_done(u) for u in mine):
                for request, delta in self.step():
                    if id(request) in ids:
                        yield request, delta
        finally:
            for unit in mine:
                self.abort(unit)

    def _admit(self) -> list[Unit]:
        """Pop waiting units while the batch has rows and the pool has blocks for their prompts,
        keeping one spare block per row so the next decode step does not force a preemption. An
        empty batch takes the first unit whatever its size: alone it has the whole pool, which
        is enough (``_encode`` refused larger requests), and nobody is there to preempt.

        With prefix caching, a unit whose next uncached block is being computed right now by a
        prompt in flight (admitted earlier, or just before it in this step) waits, keeping its
        place in the queue: once that block is computed and cached it reuses it instead of
        computing the same prefix a second time. This is how ``n > 1`` completions of one
        prompt, and many clients arriving together with one system prompt, share its blocks.
        """
        waiting = self.waiting
        admitted: list[Unit] = []
        held: list[Unit] = []  # waiting for a prefix in flight; back to the front of the queue
        in_flight = {key for prefill in self.prefilling for key in prefill.pending_keys}
        rows = sum(_rows(u) for u in self.running) + sum(_seats(p.unit) for p in self.prefilling)
        blocks = 0
        while waiting:
            unit = waiting[0]
            unit_rows = _seats(unit)
            unit_blocks = self.manager.blocks_for_tokens(_prefill_len(unit))
            if rows + unit_rows > self.max_batch_size and rows:  # an empty batch takes even an oversized unit
                break
            if blocks + unit_blocks + rows + unit_rows > self.manager.allocator.num_free and rows:
                break  # (an empty batch has the whole pool, and _encode let in only units that fit it)
            waiting.popleft()
            if self.manager.prefix_caching:
                uncached = self.manager.uncached_keys(_prefill_tokens(unit))
                if uncached and uncached[0] in in_flight:
                    held.append(unit)
                    continue
                in_flight.update(uncached)
            admitted.append(unit)
            rows += unit_rows
            blocks += unit_blocks
        waiting.extendleft(reversed(held))
        return admitted

    def _start(self, units: list[Unit]) -> None:
        """Give each admitted unit its sequence and the blocks for its whole prompt (reusing
        cached prefix blocks), and queue the prompt tokens still to compute. A preempted request
        recomputes its prompt and the tokens it had generated (all but the last, which the next
        decode step feeds in)."""
        for unit in units:
            seq_id = unit.start() if isinstance(unit, BeamSearch) else unit.seq_id
            tokens = _prefill_tokens(unit)
            cached = self.manager.add_sequence(seq_id, tokens)  # > 0 only with prefix caching
            self.prompt_tokens += len(tokens)
            self.cached_prompt_tokens += cached
            pending = self.manager.uncached_keys(tokens) if self.manager.prefix_caching else []
            self.prefilling.append(Prefill(unit, seq_id, tokens[cached:], pending))
            self.cache.copy_blocks(self.manager.reserve([seq_id], [len(tokens) - cached]))

    def _prefill(self) -> list[tuple[Request, str]]:
        """One packed forward over the next chunk of every prompt being prefilled, within the
        step's token budget (all of them whole without chunking). Each request whose prompt is
        now complete samples its first token (one batched sampler call), each beam search takes
        its first step, and they join the running batch."""
        sizes = prefill_chunk_sizes([len(p.tokens) for p in self.prefilling], self.prefill_chunk_tokens)
        chunks = [(prefill, prefill.tokens[:n]) for prefill, n in zip(self.prefilling, sizes) if n > 0]
        logits = self.runner.prefill([p.seq_id for p, _ in chunks], [chunk for _, chunk in chunks])
        done: list[tuple[int, Unit]] = []
        for row, (prefill, chunk) in enumerate(chunks):
            prefill.tokens = prefill.tokens[len(chunk):]
            if not prefill.tokens:
                done.append((row, prefill.unit))
        for prefill, _ in chunks:
            self._cache_full_blocks(prefill.seq_id, prefill.unit)
        fresh = [(row, u) for row, u in done if isinstance(u, Request) and not u.output_ids]
        events = self._sample([u for _, u in fresh], logits[[row for row, _ in fresh]])  # type: ignore[misc]
        for row, unit in done:
            if isinstance(unit, BeamSearch):
                unit.advance(logits[row : row + 1], self.manager)
        # The finished prompts leave `prefilling` only now, as they join the running batch: had the
        # sampler failed above (an error, Ctrl-C), step() must still find them there to abort them.
        joined = [u for _, u in done if not self._retire_if_done(u)]
        self.prefilling = [p for p in self.prefilling if p.tokens]
        self.running += joined
        return events

    def _decode(self) -> list[tuple[Request, str]]:
        """One compiled step for every running row; then sampling and the beams' bookkeeping."""
        seq_ids, tokens = [], []
        for unit in self.running:
            if isinstance(unit, BeamSearch):
                seq_ids += unit.seq_ids
                tokens += unit.last_tokens()
            else:
                seq_ids.append(unit.seq_id)
                tokens.append(unit.output_ids[-1])
        logits = self.runner.decode(seq_ids, tokens)
        for unit in self.running:
            if isinstance(unit, Request):  # (beams diverge: only their shared prompt is keyed)
                self._cache_full_blocks(unit.seq_id, unit)
        row, sampled, sampled_rows = 0, [], []
        for unit in self.running:
            if isinstance(unit, BeamSearch):
                n_beams = len(unit.beams)
                unit.advance(logits[row : row + n_beams], self.manager)
                row += n_beams
            else:
                sampled.append(unit)
                sampled_rows.append(row)
                row += 1
        if sampled_rows != list(range(len(logits))):  # (beams in the batch: gather the sampled rows,
            logits = logits[sampled_rows]                # a copy of 192 KB a row, so only when needed)
        return self._sample(sampled, logits)

    def _cache_full_blocks(self, seq_id: int, unit: Unit) -> None:
        """Key the blocks of ``seq_id`` the step just filled, so later prompts with the same
        prefix reuse them: a request's prompt and output, a beam search's prompt."""
        if self.manager.has_unkeyed_full_blocks(seq_id):  # (building the ids copies them: only when a block filled)
            self.manager.cache_full_blocks(seq_id, unit.prompt_ids if isinstance(unit, BeamSearch) else unit.all_ids)

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[Request, str]]:
        if not requests:
            return []
        tokens = sample_batch(logits, [r.sampling for r in requests]).tolist()  # the one host read per step
        events = []
        for request, token in zip(requests, tokens):
            request.sampling.record(token)
            events.append((request, request.append(token)))
        return events

    def _reserve_or_preempt(self) -> None:
        """Reserve one token for every running row, preempting the newest until it fits.

        The newest are the prompts still being prefilled (chunked prefill): each holds the blocks
        of its whole prompt from admission on, for as many steps as its chunks take, while the
        running rows keep growing; so they go back to the queue first, newest first. A single
        running unit left alone always fits (``_encode`` refused any request larger than the
        pool), so each step decodes at least one request and the engine always makes progress.
        """
        while True:
            seq_ids = [s for unit in self.running for s in _seq_ids(unit)]
            alone = len(self.running) == 1 and not self.prefilling
            if self.manager.can_reserve(seq_ids, [1] * len(seq_ids)) or alone:
                self.cache.copy_blocks(self.manager.reserve(seq_ids, [1] * len(seq_ids)))
                return
            victim = self.prefilling.pop().unit if self.prefilling else self.running.pop()  # the most recent arrival
            self._free(victim)
            if isinstance(victim, BeamSearch):
                victim.restart()
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def _retire_if_done(self, unit: Unit) -> bool:
        if _is_done(unit):
            self._free(unit)
            return True
        return False

    def _forget(self, unit: Unit) -> None:
        """Take a unit out of the queue and the batch (by identity) and free its blocks."""
        self.waiting = deque(u for u in self.waiting if u is not unit)
        self.prefilling = [p for p in self.prefilling if p.unit is not unit]
        self.running = [u for u in self.running if u is not unit]
        self._free(unit)

    def _free(self, unit: Unit) -> None:
        if isinstance(unit, BeamSearch):
            unit.free(self.manager)
        elif unit.seq_id in self.manager.block_tables:
            self.manager.free_sequence(unit.seq_id)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1


def prefill_chunk_sizes(remaining: Sequence[int], budget: int | None) -> list[int]:
    """How many prompt tokens each request being prefilled computes this step: in arrival order,
    each takes what it still needs while the step's ``budget`` lasts (``prefill_chunk_tokens``),
    so one prompt may get a partial chunk and the ones after it wait (0); with no budget (None)
    every prompt is computed whole. The budget counts prompt tokens only: every running request
    also decodes its one token each step, whatever the budget."""
    left = math.inf if budget is None else budget
    sizes = []
    for n in remaining:
        take = int(min(n, left))
        sizes.append(take)
        left -= take
    return sizes


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _as_text(prompt: Prompt, tokenizer: Tokenizer) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))


def _is_done(unit: Unit) -> bool:
    return unit.done if isinstance(unit, BeamSearch) else unit.finished


def _rows(unit: Unit) -> int:
    return len(unit.beams) if isinstance(unit, BeamSearch) else 1


def _seats(unit: Unit) -> int:
    """The rows a unit not yet decoding will take in the batch: a beam search prefills one
    sequence, its prompt, but decodes ``num_beams`` rows from its first step on."""
    return unit.params.num_beams if isinstance(unit, BeamSearch) else 1


def _seq_ids(unit: Unit) -> list[int]:
    return unit.seq_ids if isinstance(unit, BeamSearch) else [unit.seq_id]


def _prefill_tokens(unit: Unit) -> list[int]:
    """The tokens a unit's prefill puts in the cache: its prompt, or for a preempted request the
    prompt and every token it had generated but the last (the next decode step feeds that one)."""
    if isinstance(unit, BeamSearch):
        return unit.prompt_ids
    return unit.all_ids[:-1] if unit.output_ids else unit.all_ids


def _prefill_len(unit: Unit) -> int:
    return len(_prefill_tokens(unit))
