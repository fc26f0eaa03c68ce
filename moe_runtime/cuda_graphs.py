"""Bucketed CUDA-graph capture and replay for decode-sized calls of a row-wise function.

Decode calls an MoE layer with a handful of tokens; at that size the host cost of launching
~10 kernels (several µs of host time each) is larger than the GPU work. `BucketedGraphs`
captures one CUDA graph per bucket size (1, 2, 4, ..., 256 tokens by default), pads each
call's rows up to the smallest bucket that holds them, replays that bucket's graph and
returns the first T rows.

What the wrapped function must satisfy (MoELayer's forward does, on CUDA with the `cute` backend
on sm_90/sm_100; see `MoELayer.host_sync_free`):
    * row-wise: row t of the output depends only on row t of the input, so rows past T (the
      padding) cannot change the real rows, and their outputs are dropped;
    * no host synchronization, no data-dependent host branching, and reads its parameters from
      fixed addresses while a graph is alive (in-place updates of the weights are seen by the
      replays; replacing a weight tensor changes its address and is detected, see below);
    * no Python work that must happen on every call (e.g. nn.Module forward hooks inside `fn`):
      a replay runs no Python, and the capture runs it once on the static (padding) rows.
      MoELayer therefore runs calls eagerly while such hooks exist (`MoELayer._inner_hooks`).

All buckets share one memory pool (intermediates of one bucket's graph reuse another's; capture
all at once with `capture()` to capture from the largest bucket down, which is what lets them
share). Because of that sharing, a replay may overwrite the static output of ANOTHER bucket's
graph: by default each call copies its rows out (`copy_output=True`); with copy_output=False the
returned view is valid only until the next call. Calls must be ordered on one stream (the input
copy, the replay and the output copy are enqueued on the caller's current stream), as for any
CUDA graph with static buffers. Graphs are dropped and recaptured when the `fingerprint` callable
(by default the data pointers of the module's parameters and buffers) changes, e.g. after a
weight swap, or after `invalidate()`.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, Hashable, Optional, Sequence

import torch
from torch import nn

log = logging.getLogger("moe_runtime")

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# capture(fn, x_static) -> (replay, out): `replay()` recomputes `out` from the current contents of
# `x_static` (same storage as at capture time).
CaptureFn = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor],
                     tuple[Callable[[], None], torch.Tensor]]


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Validate and sort bucket sizes.

    Raises:
        ValueError: empty, non-integer, < 1, or repeated sizes.
    """
    b = tuple(sorted(int(v) for v in buckets))
    if not b or b[0] < 1 or len(set(b)) != len(b) or any(int(v) != v for v in buckets):
        raise ValueError(f"buckets must be distinct integers >= 1, got {tuple(buckets)}")
    return b


def select_bucket(num_tokens: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket >= num_tokens, or None (run eagerly) for 0 tokens or more than the
    largest bucket. `buckets` must be sorted ascending."""
    if num_tokens < 1:
        return None
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def storage_fingerprint(module: nn.Module) -> tuple[int, ...]:
    """Data pointers of every parameter and buffer of `module` (recursively).

    Captured graphs read weights by address: an in-place update keeps the address (and the graph
    sees the new values), while replacing a tensor (`load_expert_weights`, `.to()`, a swapped
    Parameter) changes it. About 1 µs per tensor on the host.
    """
    return tuple(t.data_ptr() for m in module.modules()
                 for d in (m._parameters, m._buffers) for t in d.values() if t is not None)


def cuda_graph_capture(pool, stream: torch.cuda.Stream, *, warmup: int = 2) -> CaptureFn:
    """A `CaptureFn` that records `fn(x_static)` into a `torch.cuda.CUDAGraph` in `pool`.

    `fn` first runs `warmup` times on `stream`, then is captured on that same stream: first-call
    work (kernel compilation, cuBLAS/CUTLASS workspaces, lazy probes, and the per-stream
    workspaces of the CuTeDSL kernels, see sync/host.py) happens there, outside the capture, and
    the captured launches use the workspaces that warm-up created. Replays run on the caller's
    current stream.
    """
    def capture(fn, x_static):
        current = torch.cuda.current_stream(x_static.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(x_static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn(x_static)
        current.wait_stream(stream)
        return graph.replay, out
    return capture


class BucketedGraphs:
    """Capture-once, replay-many CUDA graphs for calls of `fn` on [T, H] inputs, T <= max bucket.

    Args:
        fn: row-wise function [T, hidden_size] -> [T, H_out] (see the module docstring).
        hidden_size, dtype, device: the input rows' width, dtype and device.
        buckets: token counts to capture (default 1, 2, 4, ..., 256); other sizes round up to
            the next bucket, sizes above the largest run `fn` eagerly.
        fingerprint: callable returning a hashable key of the state the graphs depend on; a
            change drops every graph before the next call (None = never checked).
        copy_output: return a fresh tensor (True) or a view of the graph's static output, which
            the next call may overwrite (False; saves one copy kernel).
        capture_fn: how to capture (default `cuda_graph_capture` into one shared pool; tests
            pass a stand-in to check the bookkeeping without a GPU).

    Calling: `graphs(x)` with x [T, hidden_size] (dtype/device as above) returns
    [T, H_out]; raises ValueError on another shape, dtype or device.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], *, hidden_size: int,
                 dtype: torch.dtype, device, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 fingerprint: Optional[Callable[[], Hashable]] = None, copy_output: bool = True,
                 capture_fn: Optional[CaptureFn] = None):
        self.fn = fn
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.device = torch.device(device)
        self.buckets = check_buckets(buckets)
        self.fingerprint = fingerprint
        self.copy_output = copy_output
        self._capture_fn = capture_fn
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._static_in: Optional[torch.Tensor] = None
        self._key: Hashable = None
        self._pool = None
        self._stream: Optional[torch.cuda.Stream] = None  # warm-up and capture stream
        self.num_captures = 0  # graphs captured so far, recaptures included

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy of a layer, pickling) starts with no graph: captured graphs,
        their memory pool and stream cannot be copied, and would replay the original's buffers."""
        state = self.__dict__.copy()
        state.update(_graphs={}, _static_in=None, _key=None, _pool=None, _stream=None)
        return state

    @property
    def custom_capture(self) -> bool:
        """Whether a capture_fn stands in for the CUDA-graph capture (e.g. tests on CPU)."""
        return self._capture_fn is not None

    @property
    def captured(self) -> tuple[int, ...]:
        """Bucket sizes that have a live graph."""
        return tuple(sorted(self._graphs))

    def invalidate(self) -> None:
        """Drop every graph, its static buffers, the memory pool and the capture stream
        (recaptured on demand, on `self.device`, which a layer's .to() may have changed)."""
        self._graphs.clear()
        self._static_in = None
        self._pool = None
        self._stream = None
        self._key = None

    def bucket_for(self, num_tokens: int) -> Optional[int]:
        """The bucket a call with `num_tokens` rows replays, or None when it runs eagerly."""
        return select_bucket(num_tokens, self.buckets)

    def capture(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Capture the given buckets (default: all) now, largest first, skipping live ones."""
        self._check_fingerprint()
        for b in sorted(check_buckets(buckets) if buckets is not None else self.buckets, reverse=True):
            if b not in self.buckets:
                raise ValueError(f"bucket {b} is not one of {self.buckets}")
            if b not in self._graphs:
                self._capture(b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size or x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"expected [T, {self.hidden_size}] {self.dtype} on {self.device}, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        T = x.shape[0]
        b = self.bucket_for(T)
        if b is None:
            return self.fn(x)
        self._check_fingerprint()
        if b not in self._graphs:
            self._capture(b)
        replay, out = self._graphs[b]
        static = self._static_in
        static[:T].copy_(x)
        if T < b:
            static[T:b].zero_()  # defined padding rows (their outputs are dropped)
        replay()
        return out[:T].clone() if self.copy_output else out[:T]

    # -- internals ----------------------------------------------------------------------------
    def _check_fingerprint(self) -> None:
        if self.fingerprint is None:
            return
        key = self.fingerprint()
        if key != self._key:
            if self._graphs:
                log.info("moe_runtime: weights moved; dropping %d CUDA graph(s)", len(self._graphs))
            self.invalidate()
            self._key = key

    def _capture(self, b: int) -> None:
        if self._static_in is None:
            # a normal (non-inference) tensor: copies into it work in and out of inference mode
            with torch.inference_mode(False):
                self._static_in = torch.zeros(self.buckets[-1], self.hidden_size, dtype=self.dtype,
                                              device=self.device)
        capture_fn = self._capture_fn
        if capture_fn is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            capture_fn = cuda_graph_capture(self._pool, self._stream)
        # normal (non-inference) outputs, whatever mode the first call came in
        with torch.inference_mode(False), torch.no_grad():
            self._graphs[b] = capture_fn(self.fn, self._static_in[:b])
        self.num_captures += 1
