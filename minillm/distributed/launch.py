"""Start ``world_size`` ranks on this machine, each a fresh Python process, and collect what they return.

``torchrun`` is the standard launcher (it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, and ``init_group`` reads them). ``run_ranks`` does the same job from inside
Python, for the notebook and the tests: it hosts the rendezvous store itself (so the store
outlives any rank and a failure can still be named), starts the ranks with the ``spawn``
method (a forked copy of a process that already runs torch's threads can deadlock), and
never waits longer than ``deadline`` seconds: a rank still running then is killed, by its pid.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minillm.distributed.group import Group, init_group


@dataclass
class RankResult:
    """What one rank did: its return value, or the error it raised (``"Type: message"``), and
    its exit code (None if it had to be killed at the deadline)."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


def share_cores(world_size: int) -> None:
    """Give this rank its share of the machine's cores (torchrun sets ``OMP_NUM_THREADS=1``
    itself): each rank using every core makes ranks of one machine fight over them, tenfold
    slower on two cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float, grace: float,
           args: tuple, results: mp.Queue) -> None:
    """A rank's process: join the group, run ``fn(group, *args)``, report, leave."""
    share_cores(world_size)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    try:
        group: Group = init_group(rank, world_size, timeout=timeout, grace=grace, store=store)
        value = fn(group, *args)
        # pickled here, by value: the queue would share a tensor's memory through a handle that dies with this process
        results.put((rank, pickle.dumps(value), None))
        group.close()
    except BaseException as err:  # reported to the launcher, then the process ends with an error code
        results.put((rank, None, f"{type(err).__name__}: {err}"))
        if not isinstance(err, Exception):
            raise
        traceback.print_exc()
        raise SystemExit(1) from None


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 30.0,
              grace: float = 3.0, deadline: float = 120.0) -> list[RankResult]:
    """Run ``fn(group, *args)`` in ``world_size`` new processes; return each rank's ``RankResult``.

    ``fn`` must be importable by name (a module-level function), its arguments and return value
    picklable. ``timeout`` and ``grace`` are the group's (``init_group``).
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    processes = [ctx.Process(target=_entry, args=(fn, r, world_size, store.port, timeout, grace, args, results),
                             daemon=True) for r in range(world_size)]
    for p in processes:
        p.start()
    outcomes = [RankResult(r) for r in range(world_size)]
    reported: set[int] = set()
    end = time.monotonic() + deadline
    while len(reported) < world_size and time.monotonic() < end:
        try:
            rank, value, error = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break  # a rank died without a word (killed): nothing more will come
            continue
        outcomes[rank].value, outcomes[rank].error = None if value is None else pickle.loads(value), error
        reported.add(rank)
    for p, outcome in zip(processes, outcomes):
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            outcome.error = outcome.error or f"still running after {deadline:.0f} s: killed"
        else:
            outcome.exitcode = p.exitcode
    del store
    return outcomes
