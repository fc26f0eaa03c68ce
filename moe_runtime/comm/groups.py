"""Process groups and bounded collectives over torch.distributed (gloo on CPU, nccl on CUDA).

Every collective here is bounded: the group is created with a timeout, and each call may pass
its own `timeout_s` (a CPU-blocking wait on the async work; on NCCL it polls the work's
completion itself, `_poll`). A peer that never joins then surfaces as a `CollectiveError`
naming this rank and the step, never as a hang. With
timeout_s None the group's timeout applies: gloo ops carry it (same CollectiveError); on NCCL
the wait only orders the current stream (a blocking NCCL wait polls with 1 ms sleeps) and
NCCL's watchdog aborts a stalled collective at the group timeout. After such an error the
group's state is undefined (gloo closes the pairs): build a new group before using it again.

Inside a CUDA graph capture (NCCL; e.g. the engine's decode step under tp,
engine/decode_graph.py) a collective is only recorded: `_bounded` orders the capturing stream
after it and returns, and whoever replays the graph bounds the replay's completion
(`wait_stream_bounded`).

`group=None` means the default group; when torch.distributed is not initialized it means a
world of one rank (this process): the collectives below are then local copies, so a
multi-rank topology also runs in a plain single process.

gloo implements all_to_all_single (uneven split sizes, zero-row chunks, fp32/bf16/int64) in
torch 2.13 CPU, so the DP topologies use it directly on both gloo and nccl.
"""
from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

#: Group timeout when none is given; override with MOE_RUNTIME_COMM_TIMEOUT_S (seconds).
DEFAULT_TIMEOUT_S = 300.0
#: The shortest bound: c10d counts whole milliseconds and takes 0 ms as "no timeout".
MIN_TIMEOUT_S = 1e-3


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer stalled, died, or passed mismatched sizes)."""


def default_timeout_s() -> float:
    """The group timeout in seconds: $MOE_RUNTIME_COMM_TIMEOUT_S, else DEFAULT_TIMEOUT_S.

    Raises:
        ValueError: the variable is set to something `check_timeout_s` refuses (named).
    """
    v = os.environ.get("MOE_RUNTIME_COMM_TIMEOUT_S")
    if not v:
        return DEFAULT_TIMEOUT_S
    try:
        return check_timeout_s(float(v))
    except ValueError as e:
        raise ValueError(f"MOE_RUNTIME_COMM_TIMEOUT_S={v!r}: a number of seconds >= "
                         f"{MIN_TIMEOUT_S} is needed ({e})") from None


def default_backend(device: Optional[torch.device] = None) -> str:
    """"nccl" for CUDA (or when CUDA is available and no device is given), else "gloo"."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_timeout_s(timeout_s: Optional[float]) -> Optional[float]:
    """`timeout_s` as a float, or None (= the group's timeout).

    c10d counts whole milliseconds and takes 0 ms as "no timeout", so a bound must be a finite
    number of seconds >= 0.001.

    Raises:
        TypeError: not None and not a number (bool included).
        ValueError: NaN, infinite, or below 0.001 s (0 included).
    """
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be None or a number of seconds, got "
                        f"{type(timeout_s).__name__} {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s >= MIN_TIMEOUT_S):
        raise ValueError(f"timeout_s must be None or a finite number of seconds >= 0.001 (c10d "
                         f"counts whole milliseconds; 0 ms means no bound), got {timeout_s!r}")
    return float(timeout_s)


def _timedelta(timeout_s: Optional[float]) -> datetime.timedelta:
    """timeout_s (None: default_timeout_s()) as a timedelta; raises as check_timeout_s."""
    return datetime.timedelta(seconds=check_timeout_s(
        default_timeout_s() if timeout_s is None else timeout_s))


def init_process_group(rank: int, world_size: int, *, backend: Optional[str] = None,
                       init_method: Optional[str] = None, master_addr: str = "127.0.0.1",
                       master_port: Optional[int] = None, timeout_s: Optional[float] = None):
    """Initialize the default group with a timeout and return it.

    Args:
        rank, world_size: this process's rank and the number of processes.
        backend: "gloo", "nccl" or None (= default_backend()).
        init_method: a torch.distributed init URL; default tcp://master_addr:master_port
            (master_port default: $MASTER_PORT, else 29500).
        timeout_s: bound on every collective of the group (default default_timeout_s()).

    Raises:
        ValueError: rank outside [0, world_size); timeout_s (or $MOE_RUNTIME_COMM_TIMEOUT_S)
            refused by check_timeout_s (TypeError for a non-number).
        RuntimeError / DistStoreError: peers did not join within the timeout.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if init_method is None:
        port = master_port if master_port is not None else int(os.environ.get("MASTER_PORT", 29500))
        init_method = f"tcp://{master_addr}:{port}"
    dist.init_process_group(backend or default_backend(), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=_timedelta(timeout_s))
    return dist.group.WORLD


def new_group(ranks: Optional[Sequence[int]] = None, *, backend: Optional[str] = None,
              timeout_s: Optional[float] = None):
    """A subgroup with its own timeout (default default_timeout_s(); refused as by
    check_timeout_s). Every rank of the default group must call this."""
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend,
                          timeout=_timedelta(timeout_s))


def _alone(group) -> bool:
    """group=None without an initialized torch.distributed: a world of this process only."""
    return group is None and not (dist.is_available() and dist.is_initialized())


def group_rank_size(group=None) -> tuple[int, int]:
    """(rank in group, group size) for a ProcessGroup, or the default group when None
    ((0, 1) when torch.distributed is not initialized and group is None).

    Raises:
        RuntimeError: a group is given but torch.distributed is not initialized.
        ValueError: this process is not a member of `group`.
    """
    if _alone(group):
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a process group was given but torch.distributed is not initialized")
    rank = dist.get_rank(group)  # (-1 for new_group's placeholder to the ranks it leaves out)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the "
                         "group: build the topology only on the group's ranks")
    return rank, dist.get_world_size(group)


# Polling of an NCCL collective's completion (`_poll`): back-to-back for POLL_SPIN_S, then
# every POLL_SLEEP_S, and every POLL_SLOW_SLEEP_S once it has waited POLL_SLOW_AFTER_S (a peer
# busy with a long prefill: a core is not held at 20k wake-ups a second). torch's own bounded
# NCCL wait sleeps 1 ms between its polls (ProcessGroupNCCL WorkNCCL::wait,
# kSynchronizeBusyWaitMillis): a decode step of the engine's small bf16 model under tp on
# 2 H200s took 27 ms with it, 17.7 ms with this polling (1.1 ms on one GPU, graph replayed).
POLL_SPIN_S = 2e-3
POLL_SLEEP_S = 5e-5
POLL_SLOW_AFTER_S = 0.1
POLL_SLOW_SLEEP_S = 1e-3


def _poll(done: Callable[[], bool], timeout_s: float) -> float:
    """Wait until done() (e.g. an NCCL work's is_completed(), a CUDA event query) by polling it
    for at most timeout_s; returns the time left (at least 1 ms), for the bounded wait that
    follows: at once when it completed, else the caller's timeout path."""
    start = time.monotonic()
    deadline = start + timeout_s
    now = start
    while not done() and now < deadline:
        if now - start > POLL_SPIN_S:
            time.sleep(POLL_SLEEP_S if now - start < POLL_SLOW_AFTER_S else POLL_SLOW_SLEEP_S)
        now = time.monotonic()
    return max(deadline - now, 1e-3)


def wait_stream_bounded(step: str, group=None, timeout_s: Optional[float] = None,
                        device: Optional[torch.device] = None) -> None:
    """Wait, from the host, until the work queued so far on `device`'s current stream is done,
    for at most timeout_s (None: default_timeout_s(), whatever the group's timeout): the bound
    of a replayed CUDA graph whose collectives were recorded in a capture (module docstring),
    where neither this module's waits nor NCCL's watchdog see them.

    Raises:
        CollectiveError: not done in time (a peer may have stalled, died or not replayed the
            same graph), naming this rank and `step`; the stream's work stays queued (the
            group and this device are then unusable: tear the process down).
    """
    timeout_s = default_timeout_s() if timeout_s is None else check_timeout_s(timeout_s)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    _poll(done.query, timeout_s)
    if not done.query():
        rank, world = group_rank_size(group)
        raise CollectiveError(f"rank {rank}/{world}: '{step}' did not complete within "
                              f"{timeout_s:g}s (a peer may have stalled, died or not replayed "
                              "the same graph)")


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (module docstring); False on a
    build of torch without CUDA."""
    return (torch.backends.cuda.is_built() and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def _bounded(step: str, group, timeout_s: Optional[float], start) -> None:
    """Run `start()` (returns async Work) and wait for it: CPU-blocking with timeout_s (checked
    by the caller), else with the group's timeout (module docstring). Names the step on
    failure: raises CollectiveError."""
    what = "the group timeout" if timeout_s is None else f"{timeout_s}s"
    try:
        work = start()
        if timeout_s is None or stream_capturing():
            work.wait()  # (NCCL: orders the current stream only; in a capture, the recording)
        else:
            if dist.get_backend(group) == "nccl":
                timeout_s = _poll(work.is_completed, timeout_s)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # gloo/nccl raise RuntimeError subclasses with backend text
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        raise CollectiveError(f"rank {rank}/{world}: collective '{step}' failed or timed out "
                              f"(bound: {what}; a peer may have stalled or died): {e}") from e


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group=None,
                      step: str = "all_to_all", timeout_s: Optional[float] = None) -> torch.Tensor:
    """Bounded torch.distributed.all_to_all_single along dim 0 (gloo supports it on CPU).

    Args:
        output: [sum(output_split_sizes), ...] receive buffer (filled in place and returned).
        input: [sum(input_split_sizes), ...] rows, chunk d goes to rank d.
        *_split_sizes: rows per rank (None = equal split).

    Raises:
        TypeError / ValueError: timeout_s refused by check_timeout_s.
        CollectiveError: failure or timeout, naming this rank and `step`.
    """
    timeout_s = check_timeout_s(timeout_s)
    if _alone(group):
        return output.copy_(input)
    _bounded(step, group, timeout_s, lambda: dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=True))
    return output


def all_reduce_sum(t: torch.Tensor, *, group=None, step: str = "all_reduce",
                   timeout_s: Optional[float] = None) -> torch.Tensor:
    """Bounded in-place SUM all-reduce of `t`; returns `t`. Raises CollectiveError, or
    TypeError / ValueError for a timeout_s refused by check_timeout_s."""
    timeout_s = check_timeout_s(timeout_s)
    if _alone(group):
        return t
    _bounded(step, group, timeout_s,
             lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return t


def all_gather_object(obj: Any, *, group=None, step: str = "all_gather_object") -> list[Any]:
    """Every rank's picklable `obj`, in rank order (bounded by the group timeout).

    Raises:
        CollectiveError: failure or timeout, naming this rank and `step`.
    """
    if _alone(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as e:
        raise CollectiveError(f"rank {dist.get_rank(group)}/{len(out)}: collective '{step}' "
                              f"failed or timed out: {e}") from e
    return out
