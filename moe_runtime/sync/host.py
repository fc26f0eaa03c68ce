"""Host side of the device synchronization: error words in mapped host memory and the
self-resetting device workspaces (barrier words, counters) the kernels keep between launches.

Error words (`ErrorFlags`): NUM_ERROR_WORDS int32 in pinned, device-mapped host memory
(cudaHostAlloc(cudaHostAllocMapped | cudaHostAllocPortable)). Kernels write them with
system-scope stores when a bounded wait gives up: word 0 counts errors, word `site` is set to 1.
The host reads them with plain CPU loads, so checking costs no CUDA call and no host sync.

When errors are checked (`raise_pending`):
  * at the start of every `moe_runtime.kernels.cute_ops` call (outside CUDA-graph capture):
    this reports a failure of any EARLIER launch whose error store has reached the host;
  * by `check_errors()`, which first synchronizes the device, so it is definitive. Call it
    after a graph replay or at the end of a step when you need the answer now.
A raised error clears the words and zeroes every registered workspace (the barrier word of a
timed-out barrier is inconsistent) so the next launch starts clean.

Workspaces (`workspace`): one zero-initialized int32 tensor per (device, stream, name); kernels
leave them zeroed (or in a parity state they track themselves) at exit, so they are never
memset between launches. One per stream because two concurrent launches must not share a
barrier word. Create them before CUDA-graph capture (run the op once eagerly first).
"""
from __future__ import annotations

import ctypes
import threading

import torch

NUM_ERROR_WORDS = 16

# error word index -> the step it names (the kernels pass these indices as `site`)
SITE_BARRIER_PROBE = 2
SITE_MESSAGES = {
    SITE_BARRIER_PROBE: "grid barrier probe timed out (test hook: one block never arrives)",
}


class DeviceSyncError(RuntimeError):
    """A bounded device-side wait gave up; the message names the step."""


class ErrorFlags:
    """NUM_ERROR_WORDS int32 error words in device-mapped pinned host memory (one per process)."""

    def __init__(self) -> None:
        from cuda.bindings import runtime as cudart

        torch.cuda.init()
        flags = cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
        err, host_ptr = cudart.cudaHostAlloc(NUM_ERROR_WORDS * 4, flags)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostAlloc of the error words failed: {err}")
        err, dev_ptr = cudart.cudaHostGetDevicePointer(host_ptr, 0)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostGetDevicePointer of the error words failed: {err}")
        self.words = (ctypes.c_int32 * NUM_ERROR_WORDS).from_address(int(host_ptr))
        ctypes.memset(ctypes.addressof(self.words), 0, NUM_ERROR_WORDS * 4)
        self.device_addr = int(dev_ptr)  # what kernels get as `err_addr`

    def pending(self) -> list[str]:
        """Messages of the error words set so far (reads host memory only)."""
        if self.words[0] == 0:
            return []
        return [SITE_MESSAGES.get(i, f"device error word {i}") for i in range(1, NUM_ERROR_WORDS)
                if self.words[i]]

    def clear(self) -> None:
        ctypes.memset(ctypes.addressof(self.words), 0, NUM_ERROR_WORDS * 4)
        with _lock:
            for ws in _workspaces.values():
                ws.zero_()


_lock = threading.Lock()
_flags: ErrorFlags | None = None
_workspaces: dict[tuple, torch.Tensor] = {}


def error_flags() -> ErrorFlags:
    """The process-wide error words (allocated on first use; needs CUDA)."""
    global _flags
    with _lock:
        if _flags is None:
            _flags = ErrorFlags()
        return _flags


def raise_pending() -> None:
    """Raise DeviceSyncError if a kernel recorded an error; no device sync (see module doc).

    Skipped while the current stream is capturing a CUDA graph.
    """
    if _flags is None or _flags.words[0] == 0 or torch.cuda.is_current_stream_capturing():
        return
    msgs = _flags.pending()
    _flags.clear()
    raise DeviceSyncError("; ".join(msgs) or "device error")


def check_errors() -> None:
    """Synchronize the device, then raise DeviceSyncError for any recorded device error."""
    torch.cuda.synchronize()
    raise_pending()


class _DeviceBuffer:
    """cudaMalloc'ed device memory (uninitialized) shown to torch through
    __cuda_array_interface__ (never freed: a process-lifetime buffer)."""

    def __init__(self, nbytes: int, typestr: str, shape: tuple[int, ...], device: torch.device):
        from cuda.bindings import runtime as cudart
        with torch.cuda.device(device):
            err, ptr = cudart.cudaMalloc(max(nbytes, 16))
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMalloc of {nbytes} bytes on {device} failed: {err}")
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (int(ptr), False), "version": 2}


_TYPESTR = {torch.int32: "<i4", torch.float32: "<f4"}


def device_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed [n] tensor (int32 or float32) on CUDA `device` for the caches the kernels keep
    across calls (workspaces, constants), allocated outside torch's caching allocator: a CUDA
    graph memory pool that routes the allocations of the moment there (torch.compile's
    mode="reduce-overhead" runs its warm-up calls so, and later restores the pool to an
    earlier checkpoint, which would free the block under a cache that still holds it) never
    holds it. Inside a CUDA-graph capture on `device` (cudaMalloc is not capturable) it is a
    torch tensor of the capture's pool, which that graph keeps, zeroed when the graph replays.
    A normal tensor under inference_mode too.

    Raises:
        RuntimeError: cudaMalloc failed (out of device memory).
    """
    device = torch.device(device)
    with torch.inference_mode(False), torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():  # (on `device`)
            return torch.zeros(n, dtype=dtype, device=device)
        t = torch.as_tensor(_DeviceBuffer(n * dtype.itemsize, _TYPESTR[dtype], (n,), device),
                            device=device)
        return t.zero_()  # (on the current stream, as torch.zeros would: no host sync)


def workspace(device: torch.device, name: str, words: int) -> torch.Tensor:
    """Zero-initialized int32 [words] for (device, current stream, name), created once
    (`device_zeros`: outside CUDA-graph pools, a normal tensor even when first asked for under
    torch.inference_mode(): `ErrorFlags.clear` zeroes it in whatever mode the error is
    raised)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, stream, name, words)
    ws = _workspaces.get(key)
    if ws is None:
        with _lock:
            ws = _workspaces.get(key)
            if ws is None:
                ws = _workspaces[key] = device_zeros(words, torch.int32, device)
    return ws
