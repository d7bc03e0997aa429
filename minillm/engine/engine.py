"""The engine: many requests, one model, one paged KV cache, continuous batching.

Every step the scheduler does three things:

1. **admit** waiting requests while there is room in the batch and in the block pool; the
   prompts admitted together are prefilled in one forward, packed end to end (a block-diagonal
   causal mask keeps them apart), and each samples its first token;
2. **decode** one token for every running request in a single batched forward: the rows have
   different lengths, and the paged cache lets each read its own keys through its block table;
3. **retire** finished requests at once, handing their blocks back to the pool, so a waiting
   request can join the running batch on the very next step.

That last point is *continuous batching*: the batch is refilled token by token instead of
waiting for its slowest member, which is why throughput scales with the number of requests.

If a decode step finds the pool empty, the most recently admitted request is *preempted*:
its blocks are freed and it goes back to the front of the queue, to be prefilled again
(prompt + tokens so far) when room returns. Its output is unchanged, only recomputed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from minillm.cache import OutOfBlocksError, PagedBatch, PagedKVCache
from minillm.engine.beam import beam_search
from minillm.engine.request import Completion, Request
from minillm.model.llama import Transformer
from minillm.sampling import SamplingParams, make_generator, next_token
from minillm.tokenizer import Tokenizer


class Engine:
    """Serve generation requests on a model with a paged KV cache.

    Args:
        model, tokenizer: from ``minillm.load_model()``.
        max_batch_size: most requests decoded together in one step.
        kv_cache_tokens: size of the block pool, in tokens (default: 16 full batches of 1024).
        block_size: tokens per KV block.
        eos_ids: ids that end a completion (default: the tokenizer's EOS).
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
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        tokens = kv_cache_tokens or max_batch_size * 1024
        self.cache = PagedKVCache(model.config, math.ceil(tokens / block_size), block_size, model.device, model.dtype)
        default_eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else default_eos)
        self._next_seq_id = 0
        self.preemptions = 0  # requests sent back to the queue because the pool ran out

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Complete every prompt (``params.n`` completions each, in prompt order)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        per_prompt = self._params_per_prompt(prompts, params)
        requests = [self._request(p, ps, i) for p, ps in zip(prompts, per_prompt) for i in range(ps.n)]
        sampled = [r for r in requests if r.params.num_beams == 1]
        for _ in self._run(sampled):
            pass
        for request in requests:
            if request.params.num_beams > 1:
                self._beam(request)
        return [r.completion() for r in requests]

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated (complete characters only)."""
        params = params or SamplingParams()
        if params.num_beams > 1 or params.n > 1:
            raise ValueError("stream() serves one sampled completion: use num_beams=1 and n=1")
        request = self._request(prompt, params, 0)
        for _, delta in self._run([request]):
            if delta:
                yield delta

    def chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None) -> Completion:
        """Answer a conversation: the chat template, then generation."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(prompt, str)
        return self.generate([prompt], params)[0]

    def stream_chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None) -> Iterator[str]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(prompt, str)
        return self.stream(prompt, params)

    # ------------------------------------------------------------------ requests
    def _params_per_prompt(
        self, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

    def _request(self, prompt: str, params: SamplingParams, index: int) -> Request:
        if not isinstance(prompt, str):
            raise TypeError(f"prompts must be str, got {type(prompt).__name__}")
        prompt_ids = self.tokenizer.encode(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        context = self.model.config.max_position_embeddings
        if len(prompt_ids) + params.max_new_tokens > context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={params.max_new_tokens} "
                f"it exceeds the context window of {context}"
            )
        seed = None if params.seed is None else (params.seed + index) % 2**64  # completion i of n: its own stream
        request = Request(
            self._new_seq_id(), prompt, prompt_ids, params, self.tokenizer, self.eos_ids,
            make_generator(seed, self.model.device),
        )
        if params.max_new_tokens == 0:
            request.finish_reason = "length"
        return request

    # ------------------------------------------------------------------ the scheduler loop
    @torch.inference_mode()
    def _run(self, requests: list[Request]) -> Iterator[tuple[Request, str]]:
        """Run requests to completion with continuous batching; yield (request, text delta)."""
        waiting = deque(r for r in requests if not r.finished)
        running: list[Request] = []
        while waiting or running:
            admitted: list[Request] = []
            while (
                waiting
                and len(running) + len(admitted) < self.max_batch_size
                and self._fits(waiting[0], admitted, len(running))
            ):
                admitted.append(waiting.popleft())
            if admitted:
                for request, delta in zip(admitted, self._prefill(admitted)):
                    yield request, delta
                    if request.finished:
                        self.cache.free_sequence(request.seq_id)
                    else:
                        running.append(request)
            if not running:
                if waiting:
                    raise OutOfBlocksError(
                        f"a {len(waiting[0].all_ids)}-token request does not fit in the KV cache "
                        f"({self.cache.allocator.num_blocks} blocks of {self.cache.block_size} tokens)"
                    )
                break
            batch = self._prepare_or_preempt(running, waiting)
            step_ids = torch.tensor([[r.output_ids[-1]] for r in running], device=self.model.device)
            logits = self.model(step_ids, cache=batch, last_only=True)[:, -1]
            still_running = []
            for row, request in enumerate(running):
                yield request, request.append(self._sample(request, logits[row : row + 1]))
                if request.finished:
                    self.cache.free_sequence(request.seq_id)
                else:
                    still_running.append(request)
            running = still_running

    def _prepare_or_preempt(self, running: list[Request], waiting: deque[Request]) -> PagedBatch:
        """Reserve one token for every running request, preempting the newest until it fits.

        Each step therefore decodes at least one request, so the engine always makes progress.
        """
        while True:
            try:
                return self.cache.prepare([r.seq_id for r in running], 1)
            except OutOfBlocksError:
                if len(running) == 1:
                    raise
                victim = running.pop()  # the most recent arrival
                self.cache.free_sequence(victim.seq_id)
                waiting.appendleft(victim)
                self.preemptions += 1

    def _fits(self, request: Request, admitted: list[Request], n_running: int) -> bool:
        """Room for the prompts admitted this step plus ``request``'s, keeping one spare block
        per running or admitted request so that the next decode step does not immediately
        force a preemption."""
        prompts = admitted + [request]
        needed = sum(math.ceil(len(r.all_ids) / self.cache.block_size) for r in prompts)
        return needed + n_running + len(prompts) <= self.cache.allocator.num_free

    def _prefill(self, requests: list[Request]) -> list[str]:
        """One forward over all admitted prompts, packed end to end, fills their blocks; each
        request then samples its first token. A preempted request recomputes its prompt and the
        tokens it had generated (all but the last, which the next decode step feeds in)."""
        token_lists = []
        for request in requests:
            self.cache.add_sequence(request.seq_id)
            ids = request.all_ids
            token_lists.append(ids[:-1] if request.output_ids else ids)
        packed = self.cache.prepare_prefill([r.seq_id for r in requests], [len(t) for t in token_lists])
        flat = torch.tensor([[t for tokens in token_lists for t in tokens]], device=self.model.device)
        logits = self.model(flat, cache=packed)[0, packed.last_index]
        deltas = []
        for row, request in enumerate(requests):
            if request.output_ids:  # resumed: the next token is already chosen
                deltas.append("")
            else:
                deltas.append(request.append(self._sample(request, logits[row : row + 1])))
        return deltas

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        history = torch.tensor([request.all_ids], device=logits.device)
        return int(next_token(logits, history, request.params, request.generator)[0])

    def _beam(self, request: Request) -> None:
        token_ids = beam_search(
            self.model, self.cache, request.prompt_ids, request.params, self.eos_ids, self._new_seq_id
        )
        for token in token_ids:
            request.append(token)
            if request.finished:
                break
        if not request.finished:
            request.finish_reason = "length"

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1
