"""Run a function in W spawned processes joined by a gloo group on 127.0.0.1 (test helper).

    with DistPool(4) as pool:                     # spawn + init once (a few seconds)
        results = pool.run(fn, arg1, arg2)        # fn(rank, world_size, arg1, arg2) on every rank
    results = run_distributed(fn, 2, arg1)        # one-shot: spawn, run, tear down

`fn` must be importable by the children (a module-level function of a test module or package).
Results come back pickled, in rank order. A child exception is raised here as RankError carrying
each failing rank's traceback; a rank that does not answer within `timeout_s` (hang, crash)
kills the pool and raises TimeoutError. Nothing waits forever.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


class RankError(RuntimeError):
    """One or more ranks raised; the message holds their tracebacks."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, group_timeout_s: float, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    from moe_runtime.comm import init_process_group

    torch.set_num_threads(1)
    try:
        init_process_group(rank, world_size, backend="gloo", master_port=port,
                           timeout_s=group_timeout_s)
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    results.put((rank, -1, True, None))
    while (item := tasks.get()) is not None:
        call_id, payload = item
        try:
            fn, args = pickle.loads(payload)
            results.put((rank, call_id, True, pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:
            results.put((rank, call_id, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """W worker processes with an initialized gloo default group, reused across calls.

    Args:
        world_size: W >= 1.
        group_timeout_s: the gloo group's timeout (bounds every collective in the workers).
        start_timeout_s: bound on spawning and joining the group.

    Raises:
        RankError / TimeoutError: a worker failed to start or join in time.
    """

    def __init__(self, world_size: int, *, group_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._calls = 0
        port = _free_port()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, port, group_timeout_s, self._tasks[r],
                                         self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        try:
            self._collect(-1, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _collect(self, call_id: int, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world_size:
            try:
                rank, cid, ok, value = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in got and not p.is_alive()]
                late = time.monotonic() > deadline
                if dead or late:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    why = f"exited (codes {[self._procs[r].exitcode for r in dead]})" if dead \
                        else f"did not answer within {timeout_s}s"
                    errors = "".join(f"\n--- rank {r} ---\n{v}" for r, (ok_, v) in got.items()
                                     if not ok_)
                    self.close(join_timeout_s=0.0)
                    raise TimeoutError(f"ranks {missing} {why}; pool closed{errors}")
                continue
            if cid == call_id:
                got[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            raise RankError("".join(f"\n--- rank {r} ---\n{v}" for r, v in sorted(failed.items())))
        return [pickle.loads(got[r][1]) if got[r][1] is not None else None
                for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """fn(rank, world_size, *args) on every rank; per-rank results in rank order.

        Raises:
            RankError: a rank raised (its traceback is in the message); the pool stays usable.
            TimeoutError: a rank did not answer within timeout_s or died; the pool is closed.
        """
        if not self._procs:
            raise RuntimeError("DistPool is closed")
        self._calls += 1
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((self._calls, payload))
        return self._collect(self._calls, timeout_s)

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Ask workers to exit; kill any still alive after join_timeout_s."""
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + join_timeout_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs = []

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
                    group_timeout_s: float = 30.0) -> list[Any]:
    """Spawn W ranks, run fn(rank, world_size, *args) once, tear down; results in rank order."""
    with DistPool(world_size, group_timeout_s=group_timeout_s) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s)
