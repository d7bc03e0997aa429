"""The engine: many requests, one model, one paged KV cache, continuous batching.

The policy is the scheduler's (``scheduler.py``: admit, prefill in chunks, decode, retire,
preempt, in pure Python); the engine owns the model, the cache and the requests, and runs what
the scheduler plans. Each ``step()`` has two forwards: a packed prefill of the prompts being
computed, then one batched decode step for every running row (``ModelRunner.prefill`` and
``ModelRunner.decode``). After each, every unit that gets a token takes it from its rows of the
logits: the requests' rows in one ``sample_batch`` call, a beam search's in its own search step
(``BeamSearch.advance``); both kinds run in the same forwards.

Requests can arrive while others run: ``add_request`` queues one, ``step()`` runs one iteration
of the scheduler, ``abort`` ends one at once. ``generate``, ``stream`` and a server are loops
over ``step()``; two open streams share the same running batch.

Whatever ends a request early — a stream abandoned with ``break`` or ``close()``, an exception
in the caller's loop, Ctrl-C or an error in the middle of a step — its sequences are freed on
the way out (``abort``; a failed step aborts the requests it was running), so the pool is back
where it started and the engine keeps serving.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from functools import partial

import torch

from minillm.cache import BlockManager, PagedKVCache
from minillm.distributed.group import Group, RankFailure
from minillm.distributed.step import TensorParallelBackend, TensorParallelKVCache
from minillm.engine.beam import BeamSearch
from minillm.engine.draft import DraftModel, make_proposer
from minillm.engine.request import Completion, Request
from minillm.engine.runner import ModelRunner
from minillm.engine.scheduler import ScheduledBatch, Scheduler
from minillm.engine.scoring import prompt_logprobs
from minillm.engine.speculation import (
    MAX_SPECULATIVE_TOKENS,
    Drafts,
    PromptLookup,
    Proposer,
    SpeculationStats,
    Speculator,
)
from minillm.engine.stream import TextStream
from minillm.engine.tokens import take_tokens
from minillm.model.llama import Transformer
from minillm.sampling import SamplingParams, SamplingState, TokenLogprob, make_generator
from minillm.sampling.speculative import Acceptance
from minillm.structured import GrammarState, token_index
from minillm.tokenizer import Tokenizer

# Far beyond any real use (vLLM's default batch is 256 rows, its blocks 16 tokens), and small
# enough that a typo fails here, naming the argument, rather than in an allocator.
MAX_BATCH_SIZE = 4096
MAX_BLOCK_SIZE = 1024

Unit = Request | BeamSearch  # the sequence groups the engine makes (``sequence.SequenceGroup``)
Prompt = str | Sequence[int]  # text, or token ids used as they are


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
        speculative: speculative decoding for every request (``SamplingParams(speculative=False)``
            opts one out): "prompt-lookup" (drafts copied from the prompt and the answer),
            "draft:PATH" (a smaller model with the same tokenizer drafts; "draft:" alone: the
            default model), or a proposer object (``minillm.DraftModel(model)``). None (the
            default): only requests that ask (``speculative=True``) speculate, by prompt lookup.
        tensor_parallel: run ``model`` (this rank's shard, ``minillm.distributed.load_tensor_parallel``)
            as rank 0 of this ``Group``: the engine schedules and samples here and sends every step
            to the other ranks, which run ``engine.tensor_parallel.follow`` (see that module);
            ``close()`` releases them. Eager backend only.
        num_speculative_tokens: the most drafts a request verifies per step.
        adaptive_speculation: verify only as many drafts as pay, by the measured cost of a step
            and each request's acceptance rate (``speculation.py``); False: always up to
            ``num_speculative_tokens`` (to measure a fixed k).
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
        speculative: str | Proposer | None = None,
        num_speculative_tokens: int = 4,
        adaptive_speculation: bool = True,
        tensor_parallel: Group | None = None,
    ) -> None:
        max_batch_size = _positive_int("max_batch_size", max_batch_size, MAX_BATCH_SIZE)
        if prefill_chunk_tokens is not None:
            prefill_chunk_tokens = _positive_int("prefill_chunk_tokens", prefill_chunk_tokens)
        block_size = _positive_int("block_size", block_size, MAX_BLOCK_SIZE)
        if kv_cache_tokens is not None:
            kv_cache_tokens = _positive_int("kv_cache_tokens", kv_cache_tokens)
        self.model = model
        self.tokenizer = tokenizer
        tokens = kv_cache_tokens or max_batch_size * 1024
        num_blocks = math.ceil(tokens / block_size)
        parallel = tensor_parallel is not None and tensor_parallel.world_size > 1
        if parallel and backend not in (None, "eager"):
            raise ValueError(f"a tensor-parallel engine runs the eager backend, not {backend!r}")
        try:
            self.cache = (partial(TensorParallelKVCache, tensor_parallel) if parallel else PagedKVCache)(
                model.config, num_blocks, block_size, device=model.device, dtype=model.dtype,
                prefix_caching=prefix_caching)
        except RankFailure:  # (a tensor-parallel rank went away while the pools were being sized)
            raise
        except (MemoryError, RuntimeError) as err:  # the allocator's own message often names no size
            gib = 2 * model.config.n_layers * (num_blocks + 1) * model.config.n_kv_heads * block_size \
                * model.config.head_dim * model.dtype.itemsize / 2**30
            asked = "kv_cache_tokens" if kv_cache_tokens is not None else \
                f"1024 per row of max_batch_size={max_batch_size}, the default kv_cache_tokens"
            raise ValueError(f"a KV cache of {num_blocks:,} blocks of {block_size} tokens ({asked}) needs "
                             f"{gib:,.1f} GiB on {model.device}, which could not be allocated"
                             f"{f' ({err})' if str(err) else ''}: ask for fewer tokens") from err
        self.runner = ModelRunner(model, self.cache, "eager" if parallel else backend)
        if parallel:  # every step goes to the other ranks first (the scheduler and the sampler stay here)
            self.runner.backend = TensorParallelBackend(self.runner.backend, tensor_parallel)
        default_eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else default_eos)
        self.scheduler = Scheduler(self.cache.manager, max_batch_size, prefill_chunk_tokens)
        self._next_seq_id = 0
        k = _positive_int("num_speculative_tokens", num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        proposer = PromptLookup() if speculative is None else make_proposer(speculative, tokenizer, model.device)
        if isinstance(proposer, DraftModel):
            proposer.bind(model.config.vocab_size, num_blocks * block_size, block_size)
        self.speculator = Speculator(proposer, k, bool(adaptive_speculation))
        self.speculates_by_default = speculative is not None
        self._closed = False

    @property
    def backend(self) -> str:
        """The backend that runs this engine's steps: "eager", "compiled" or "packed-cpu"."""
        return self.runner.backend.name

    def close(self) -> None:
        """Release a tensor-parallel run's other ranks (they return from ``follow``); nothing to do
        otherwise. The engine cannot step afterwards."""
        if isinstance(self.runner.backend, TensorParallelBackend) and not self._closed:
            self.runner.backend.stop()
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Speculative decoding so far: verifications, drafts proposed and accepted."""
        return self.speculator.stats

    @property
    def manager(self) -> BlockManager:
        """The pool's bookkeeping, which the scheduler asks whether work fits."""
        return self.cache.manager

    # the scheduler's settings, queues and counters, read here too (the server's metrics, the notebooks)
    max_batch_size = property(lambda self: self.scheduler.max_batch_size)
    prefill_chunk_tokens = property(lambda self: self.scheduler.prefill_chunk_tokens)
    waiting = property(lambda self: self.scheduler.waiting)  # deque[Unit], in arrival order
    prefilling = property(lambda self: self.scheduler.prefilling)  # list[Prefill]
    running = property(lambda self: self.scheduler.running)  # list[Unit]
    preemptions = property(lambda self: self.scheduler.preemptions)
    prompt_tokens = property(lambda self: self.scheduler.prompt_tokens)
    cached_prompt_tokens = property(lambda self: self.scheduler.cached_prompt_tokens)

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Complete every prompt (``params.n`` completions each, in prompt order). A prompt is a
        string, or a list of token ids (a pre-tokenized prompt, used as it is). A completion that
        failed alone (its logits held NaN) has ``finish_reason == "error"`` and says why in
        ``error``; the others are what they would have been without it."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise TypeError(f"prompts must be a list of prompts (each a str or a list of token ids), "
                            f"got {type(prompts).__name__}")
        per_prompt = self._params_per_prompt(prompts, params)
        groups: list[list[Unit]] = [  # each prompt's units: its beam search, or its n sampled completions
            [self._beam_search(prompt, ps)] if ps.num_beams > 1 else [self._request(prompt, ps, i) for i in range(ps.n)]
            for prompt, ps in zip(prompts, per_prompt)
        ]
        for _ in self._run([unit for group in groups for unit in group]):
            pass
        completions = []
        for prompt, ps, group in zip(prompts, per_prompt, groups):
            if ps.num_beams > 1:
                completions += self._beam_completions(prompt, group[0])
            else:
                completions += [request.completion() for request in group]
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
            self.scheduler.add(request)
        return request

    def score(self, prompt: Prompt, top: int = 0) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it (None for the first),
        with the ``top`` best alternatives at each position: ``echo`` with ``logprobs``."""
        return prompt_logprobs(self.model, self._encode(prompt, SamplingParams(max_new_tokens=0)), top)

    def abort(self, unit: Unit) -> None:
        """End a request now (finish reason ``"abort"``) and return its KV blocks; a finished one
        keeps its result."""
        self.scheduler.abort(unit)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

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
        sampling = SamplingState(params, prompt_ids, self.model.config.vocab_size, generator, self.model.device,
                                 self._grammar(params))
        request = Request(self._new_seq_id(), _as_text(prompt, self.tokenizer), prompt_ids, params, self.tokenizer, self.eos_ids, sampling)
        if params.max_new_tokens == 0:
            request.finish_reason = "length"
        if params.speculative or (params.speculative is None and self.speculates_by_default):
            request.acceptance = Acceptance()
        return request

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for a request with a ``response_format`` (the token index is
        built, lazily, once per pattern and shared by every request that uses it)."""
        if params.response_format is None:
            return None
        if not self.eos_ids:
            raise ValueError("response_format needs an end-of-sequence id to end the output (give eos_ids)")
        return GrammarState(token_index(params.response_format.pattern, self.tokenizer, self.eos_ids))

    def _beam_search(self, prompt: Prompt, params: SamplingParams) -> BeamSearch:
        return BeamSearch(self._encode(prompt, params), params, self.eos_ids, self._new_seq_id)

    def _beam_completions(self, prompt: Prompt, search: BeamSearch) -> list[Completion]:
        if search.error is not None:
            return [Completion(_as_text(prompt, self.tokenizer), "", [], "error", search.error)] * search.params.n
        completions = []
        for token_ids in search.best(search.params.n) or [[]]:
            request = Request(-1, _as_text(prompt, self.tokenizer), search.prompt_ids, search.params, self.tokenizer, self.eos_ids)
            for token in token_ids:
                request.append(token)
                if request.finished:
                    break
            completions.append(request.completion())
        return completions[: search.params.n]

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[tuple[Request, str]]:
        """One iteration of the scheduler: admit and prefill what fits, decode every running row
        once, retire what finished. Returns the (request, new text) pairs it produced.

        If the step fails (an error in the model or the sampler, Ctrl-C), the requests it was
        running are aborted and their blocks freed before the error propagates; waiting
        requests stay queued and the engine keeps serving.
        """
        events: list[tuple[Request, str]] = []
        try:
            for phase in ("prefill", "decode"):
                if phase == "prefill":
                    batch, drafts = self.scheduler.schedule_prefill(), {}
                else:  # (a speculating request's drafts make it a verify step)
                    start = time.perf_counter()
                    drafts = self.speculator.drafts(self.running, self.model.config.max_position_embeddings)
                    batch = self.scheduler.schedule_decode({s: d.tokens for s, d in drafts.items()})
                if batch.seq_ids:
                    events += self._forward(batch, drafts)
                    if not batch.is_prefill:  # what the decode phase cost, by rows: what drafts are weighed by
                        self.speculator.costs.record(sum(map(len, batch.token_ids)), time.perf_counter() - start)
                self.scheduler.postprocess()
        except BaseException:
            for unit in [p.unit for p in self.prefilling] + self.running:
                self.abort(unit)  # (also one that finished in this very step, before it could retire)
            raise
        return events

    def _forward(self, batch: ScheduledBatch, drafts: dict[int, Drafts]) -> list[tuple[Request, str]]:
        """Run one planned forward, then give each unit that takes a step its logits rows: the
        requests' rows go through the sampler, a beam search's through its search."""
        self.cache.copy_blocks(batch.copies)
        if batch.is_prefill:
            logits = self.runner.prefill(batch.seq_ids, batch.token_ids)
        elif batch.verifies:
            logits = self.runner.verify(batch.seq_ids, batch.token_ids)
        else:
            logits = self.runner.decode(batch.seq_ids, [tokens[0] for tokens in batch.token_ids])
        self.scheduler.mark_computed(batch)
        sampled = [(unit, rows) for unit, rows in batch.outputs if unit.params.num_beams == 1]
        events = take_tokens(sampled, logits, drafts if batch.verifies else {}, self.speculator)
        for request, _ in sampled:
            if request.seq_id in drafts and batch.verifies and not request.finished:
                # the cache keeps the accepted tokens; the last one is fed next step
                self.scheduler.rollback(request, request.seq_id, len(request.all_ids) - 1)
        for unit, unit_rows in batch.outputs:
            if unit.params.num_beams > 1:  # a beam search picks its tokens by its own search step
                unit.advance(logits[unit_rows.start : unit_rows.stop], self.manager)
        return events

    def _run(self, units: Sequence[Unit]) -> Iterator[tuple[Request, str]]:
        """Queue ``units`` and step until all of them are done, yielding their (request, text
        delta) pairs; however the loop ends (exhausted, abandoned, an error), they are aborted."""
        mine = [u for u in units if not u.done]
        ids = {id(u) for u in mine}
        for unit in mine:
            self.scheduler.add(unit)
        try:
            while not all(u.done for u in mine):
                for request, delta in self.step():
                    if id(request) in ids:
                        yield request, delta
        finally:
            for unit in mine:
                self.abort(unit)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1


def _positive_int(name: str, value: object, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r:.80} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if limit is not None and value > limit:
        raise ValueError(f"{name} must be at most {limit:,}, got {value:,}")
    return value


def _as_text(prompt: Prompt, tokenizer: Tokenizer) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))
