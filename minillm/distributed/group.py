"""The ranks of a tensor-parallel run and the three collectives it needs, with failures named.

A tensor-parallel step talks through three collectives of ``torch.distributed``:
``all_reduce`` (sum the row-parallel layers' partial outputs), ``all_gather`` (put the
vocabulary slices of the logits back together) and ``broadcast`` (rank 0 sends each step's
inputs to the others). ``Group`` wraps them so that a failure reads as what it is.

When a rank dies, its peers' sockets close, and the others' next collective fails at once
with a gloo "Connection reset by peer [127.0.0.1]:41235" — an address, not a rank; a rank
that hangs makes the others wait until the group's ``timeout``. Either way ``Group`` turns
the error into a ``RankFailure`` naming the rank(s) that stopped. How it knows: every rank
runs a heartbeat thread that bumps a counter in the rendezvous store a few times a second;
a rank whose collective failed checks in, then watches the others for ``grace`` seconds: a
rank that checked in too, or whose heartbeat moved, is alive; the rest are named. (If the
store itself is gone, it lived in rank 0's process.)

Two process groups: the default one, with the short ``timeout``, for the collectives inside a
step; and a *control* group with a long one, which workers wait on between steps — a server's
rank 0 may sit idle for hours between requests, and that is no failure.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=7)  # how long a worker may wait for the next step
FAILED_KEY = "minillm/tp/failed/{rank}"  # set by a rank whose collective failed
HEARTBEAT_KEY = "minillm/tp/heartbeat/{rank}"  # a counter each rank's heartbeat thread bumps
HEARTBEAT_SECONDS = 0.2


class RankFailure(RuntimeError):
    """A collective failed because a rank died or stopped answering; the message names it."""


class Group:
    """This process's place in a tensor-parallel run: ``rank`` of ``world_size``.

    Build it with ``init_group`` (or ``launch.run_ranks``, which calls it in each process).
    """

    def __init__(self, rank: int, world_size: int, store: dist.Store, control: dist.ProcessGroup,
                 grace: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.store, self.control, self.grace = store, control, grace
        self._stop = threading.Event()
        self.store.set(HEARTBEAT_KEY.format(rank=rank), "0")
        self._heartbeat = threading.Thread(target=self._beat, name=f"minillm-tp-heartbeat-{rank}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        key = HEARTBEAT_KEY.format(rank=self.rank)
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self.store.add(key, 1)
            except RuntimeError:  # the store is gone; the next collective says so
                return

    # ------------------------------------------------------------------ the collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        try:
            dist.all_reduce(x)
        except RuntimeError as err:
            raise self.failure("all_reduce", err) from None
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension; rank ``r`` holds ``sizes[r]``
        columns, and ``x`` is padded to the largest (a collective moves equal shapes)."""
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as err:
            raise self.failure("all_gather", err) from None
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0, control: bool = False) -> torch.Tensor:
        """``x`` from rank ``src`` to every rank, in place; ``control`` waits with no timeout to
        speak of (a worker waiting for the next step)."""
        try:
            dist.broadcast(x, src, group=self.control if control else None)
        except RuntimeError as err:
            raise self.failure("broadcast", err) from None
        return x

    def barrier(self, control: bool = False) -> None:
        try:
            dist.barrier(group=self.control if control else None)
        except RuntimeError as err:
            raise self.failure("barrier", err) from None

    # ------------------------------------------------------------------ naming a failure
    def failure(self, op: str, err: Exception) -> RankFailure:
        """The ``RankFailure`` for ``err`` raised by ``op``: check in, watch the others for
        ``grace`` seconds, name the ranks that neither checked in nor beat."""
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            self.store.set(FAILED_KEY.format(rank=self.rank), "1")
            beats = {r: self.store.get(HEARTBEAT_KEY.format(rank=r)) for r in others}
            deadline = time.monotonic() + self.grace
            silent = others
            while silent and time.monotonic() < deadline:
                time.sleep(HEARTBEAT_SECONDS)
                silent = [r for r in silent if not self.store.check([FAILED_KEY.format(rank=r)])
                          and self.store.get(HEARTBEAT_KEY.format(rank=r)) == beats[r]]
        except RuntimeError:  # the store is gone: it lived in rank 0's process
            silent = [0]
        if not silent:
            return RankFailure(f"rank {self.rank}: {op} failed, though every rank is still running ({detail})")
        names = ", ".join(map(str, silent))
        return RankFailure(f"rank {self.rank}: rank {names} stopped answering during {op}, so the tensor-parallel "
                           f"run cannot go on ({detail})")

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, world_size: int, host: str = "127.0.0.1", port: int | None = None,
               timeout: float = 30.0, grace: float = 3.0, store: dist.Store | None = None,
               backend: str = "gloo", agent_store: bool = False) -> Group:
    """Join the run as ``rank`` of ``world_size`` and return its ``Group``.

    The ranks meet through a ``TCPStore`` at ``host:port`` (rank 0 hosts it unless ``store`` is
    given: ``launch.run_ranks`` hosts it in the launching process, so it outlives any rank;
    under ``torchrun`` the defaults come from ``MASTER_ADDR`` / ``MASTER_PORT``). A collective
    that waits longer than ``timeout`` seconds fails; ``grace`` is how long a failing rank
    waits for the others to check in before it names the silent ones. ``agent_store``: torchrun's
    agent already hosts the store at ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``): every
    rank, rank 0 too, connects to it.
    """
    if store is None:
        host = os.environ.get("MASTER_ADDR", host)
        port = int(os.environ.get("MASTER_PORT", port or 29500))
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_store,
                              timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    control = dist.new_group(backend=backend, timeout=CONTROL_TIMEOUT)
    return Group(rank, world_size, store, control, grace)
