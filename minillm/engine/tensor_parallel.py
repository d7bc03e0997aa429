"""Tensor parallelism in the engine: rank 0 runs the ``Engine``, every other rank follows its steps.

``Engine(model, tok, tensor_parallel=group)`` on rank 0 (``model`` its shard, from
``minillm.distributed.load_tensor_parallel``) schedules, samples and streams exactly as in one
process; its cache (``TensorParallelKVCache``) and backend (``TensorParallelBackend``) send each
step's inputs to the other ranks, which run ``follow(group, model)``: the same step on their
shard, their own KV heads in pools of the same blocks, until rank 0's ``Engine.close()``.

``start(world_size, ...)`` joins or makes the run for the command line: under ``torchrun`` (one
process per rank, on one machine or several) it joins the group torchrun set up; run plainly,
it starts the other ranks itself, as processes of this machine. Every rank then loads only its
own slices of the weights. The eager backend runs each rank's step: the compiled one would have
to trace the collectives, and the packed-cpu C++ step cannot stop in the middle of a layer for them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field

import torch

from minillm.cache import PagedKVCache
from minillm.distributed.group import Group, init_group
from minillm.distributed.launch import share_cores
from minillm.distributed.loader import load_tensor_parallel
from minillm.distributed.step import receive_pool_size, serve_steps
from minillm.engine.backends.eager import EagerBackend
from minillm.model.llama import Transformer
from minillm.tokenizer import Tokenizer

COLLECTIVE_TIMEOUT_S = 30.0  # a rank that does not answer a collective this long is named as failed


def follow(group: Group, model: Transformer) -> int:
    """A worker rank's whole life: build pools of the size rank 0's engine says, then run every
    step it sends until it closes; returns how many steps ran."""
    num_blocks, block_size = receive_pool_size(group)
    cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype)
    return serve_steps(group, EagerBackend(model), cache)


@dataclass
class Run:
    """This process's part in a tensor-parallel run (rank 0 holds ``workers`` it started itself)."""

    group: Group
    model: Transformer
    tokenizer: Tokenizer
    workers: list = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    def finish(self) -> None:
        """Wait for the workers this process started (after ``Engine.close()`` released them)."""
        for process in self.workers:
            process.join(COLLECTIVE_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        self.group.close()


def _weights(weights: str | None) -> str | None:
    """``load_model``'s weight names as ``load_tensor_parallel`` takes them (floats: None)."""
    return None if weights in (None, "float32", "bfloat16", "float16", "float64") else weights


def _dtype(weights: str | None) -> str:
    return weights if weights in ("bfloat16", "float16", "float64") else "float32"


def start(world_size: int, source: str | None, weights: str | None) -> Run:
    """Join the run (under ``torchrun``) or start it (the other ranks as processes of this
    machine), and load this rank's shard of ``source`` (None: the default model)."""
    if "WORLD_SIZE" in os.environ:  # torchrun: it started every rank and set up the rendezvous
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"--tensor-parallel {world_size}, but torchrun started {os.environ['WORLD_SIZE']} "
                             f"processes: give torchrun --nproc-per-node (times --nnodes) {world_size}")
        group = init_group(int(os.environ["RANK"]), world_size, timeout=COLLECTIVE_TIMEOUT_S,
                           agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        workers = []
    else:
        share_cores(world_size)
        store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")  # (a forked copy of a process running torch's threads can hang)
        workers = [ctx.Process(target=_worker, args=(rank, world_size, store.port, source, weights), daemon=True)
                   for rank in range(1, world_size)]
        for process in workers:
            process.start()
        group = init_group(0, world_size, timeout=COLLECTIVE_TIMEOUT_S, store=store)
    model, tokenizer, _ = load_tensor_parallel(source, group, dtype=_dtype(weights), weights=_weights(weights))
    return Run(group, model, tokenizer, workers)


def _worker(rank: int, world_size: int, port: int, source: str | None, weights: str | None) -> None:
    """A rank this process started: join, load the shard, follow rank 0 until it closes."""
    share_cores(world_size)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False)
    try:
        group = init_group(rank, world_size, timeout=COLLECTIVE_TIMEOUT_S, store=store)
        model, _, _ = load_tensor_parallel(source, group, dtype=_dtype(weights), weights=_weights(weights))
        with torch.inference_mode():
            follow(group, model)
        group.close()
    except Exception as err:  # noqa: BLE001 (rank 0 went away, or this rank failed: say so, end with an error code)
        print(f"minillm: error: {err}", file=sys.stderr)  # (a RankFailure names this rank and the silent one)
        raise SystemExit(1) from None
