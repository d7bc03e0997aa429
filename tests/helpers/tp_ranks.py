"""What each rank runs in the tensor-parallel tests (module-level, so spawned processes can import it),
and the one-process reference they are compared with."""

from __future__ import annotations

import os

import torch

from minillm.cache.paged import PagedKVCache
from minillm.distributed.group import Group
from minillm.distributed.loader import load_tensor_parallel
from minillm.distributed.step import TensorParallelBackend, TensorParallelKVCache, receive_pool_size, serve_steps
from minillm.engine.backends.eager import EagerBackend
from minillm.engine.runner import ModelRunner
from minillm.model.quant import QuantizedLinear

NUM_BLOCKS, BLOCK_SIZE = 32, 4


def greedy(runner: ModelRunner, cache: PagedKVCache, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations on the paged cache, driven like the engine drives it: one packed
    prefill, then a fork of the first sequence (its shared last block is copied on write), then
    batched decode steps over every sequence."""
    seq_ids = list(range(len(prompts)))
    for s in seq_ids:
        cache.add_sequence(s)
    cache.copy_blocks(cache.manager.reserve(seq_ids, [len(p) for p in prompts]))
    first = runner.prefill(seq_ids, prompts).argmax(-1).tolist()
    fork = len(prompts)
    cache.fork(0, fork)
    seq_ids.append(fork)
    out = [[t] for t in first] + [[first[0]]]
    for _ in range(new_tokens - 1):
        cache.copy_blocks(cache.manager.reserve(seq_ids, [1] * len(seq_ids)))
        nxt = runner.decode(seq_ids, [o[-1] for o in out]).argmax(-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
    return out


def logits_and_tokens(group: Group, source: str, dtype: str, prompts: list[list[int]], new_tokens: int,
                      weights: str | None = None) -> dict | None:
    """Every rank: full-sequence logits of each prompt, then the paged greedy run (rank 0 plans
    and samples, the others serve its steps). Rank 0 returns the numbers; the others, their step count."""
    model, _, shard = load_tensor_parallel(source, group, dtype=dtype, weights=weights)
    with torch.inference_mode():
        logits = [model(torch.tensor([p]))[0] for p in prompts]
    local = shard.local_config(model.config)
    if group.rank:
        num_blocks, block_size = receive_pool_size(group)  # rank 0's cache says its size
        cache = PagedKVCache(local, num_blocks, block_size, dtype=model.dtype)
        return {"steps": serve_steps(group, EagerBackend(model), cache)}
    cache = TensorParallelKVCache(group, local, NUM_BLOCKS, BLOCK_SIZE, dtype=model.dtype)
    runner = ModelRunner(model, cache, backend="eager")
    runner.backend = TensorParallelBackend(runner.backend, group)
    tokens = greedy(runner, cache, prompts, new_tokens)
    runner.backend.stop()
    packed = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    return {"logits": logits, "tokens": tokens, "backend": runner.backend.name, "packed": packed}


def dies(group: Group, source: str, victim: int, idle: bool) -> str:
    """Every rank runs a forward; then ``victim`` exits at once, and the others run another
    forward or (``idle``) wait for rank 0's next step, as a worker between requests does."""
    model, _, shard = load_tensor_parallel(source, group, dtype="float64")
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        model(ids)
        if group.rank == victim:
            os._exit(3)
        if idle:
            cache = PagedKVCache(shard.local_config(model.config), NUM_BLOCKS, BLOCK_SIZE, dtype=model.dtype)
            serve_steps(group, EagerBackend(model), cache)
        else:
            model(ids)
    return "went on without the victim"


def engine_requests(tokenizer_eos: int) -> tuple[list, list]:
    """A mixed batch for the tensor-parallel Engine: greedy, a stop string, beam search, seeded
    sampling with n = 2, and prompt-lookup speculation."""
    from minillm import SamplingParams

    prompts = ["the king is dead, long live the king! the king is dead", "long live", "the queen", "a b c a b c a b"]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=10, stop=["king"]),
              SamplingParams(max_new_tokens=6, num_beams=3, n=2),
              SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=3, n=2, speculative=True)]
    return prompts, params


def run_engine(group: Group, source: str, eos: int, die_after: int | None = None) -> dict | None:
    """Every rank: its shard; rank 0 runs ``Engine(tensor_parallel=group)`` on the mixed batch,
    the others ``follow`` it. With ``die_after``, rank 1 exits after that many steps."""
    from minillm import Engine
    from minillm.engine.tensor_parallel import follow

    model, tokenizer, _ = load_tensor_parallel(source, group, dtype="float64")
    if group.rank:
        if die_after is not None and group.rank == 1:
            calls = {"n": 0}
            original = EagerBackend.decode

            def decode(self, token_ids, step):
                calls["n"] += 1
                if calls["n"] > die_after:
                    os._exit(3)
                return original(self, token_ids, step)

            EagerBackend.decode = decode
        with torch.inference_mode():
            return {"steps": follow(group, model)}
    with Engine(model, tokenizer, backend="eager", block_size=4, eos_ids=[eos], tensor_parallel=group) as engine:
        prompts, params = engine_requests(eos)
        completions = engine.generate(prompts, params)
        free = engine.manager.allocator.num_free == engine.manager.allocator.num_blocks
    return {"tokens": [c.token_ids for c in completions], "finish": [c.finish_reason for c in completions],
            "pool_free": free, "backend": engine.backend}
