"""Memory-ordered device primitives (CuTeDSL, nvidia-cutlass-dsl 4.8.1).

Small `@cute.jit` helpers so kernels name the ordering they need instead of spelling the
`cute.arch` keywords each time. All take a `cute.Pointer` in global memory (its address space
picks `.global`); 32-bit words. PTX each one emits (checked in tests/test_kernels_compile.py):

    ld_acquire(p, "gpu")        ld.acquire.gpu.global.b32
    ld_relaxed(p, "sys")        ld.relaxed.sys.global.b32
    st_release(p, v, "gpu")     st.release.gpu.global.b32
    st_relaxed(p, v, "sys")     st.relaxed.sys.global.b32
    atomic_add_release(p, v)    atom.release.gpu.global.add.u32 (returns the old value)
    atomic_add_acq_rel(p, v)    atom.acq_rel.gpu.global.add.u32
    fence_gpu() / fence_sys()   fence.acq_rel.gpu / fence.acq_rel.sys

Memory model: PTX ISA "Memory Consistency Model" (release/acquire patterns, morally strong
operations). Scope "gpu" orders against other blocks of this device; "sys" also against the
host and peer GPUs (mapped host memory, NVLink peers).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Uint32


@cute.jit
def ld_acquire(ptr: cute.Pointer, scope: Constexpr[str] = "gpu") -> Uint32:
    """Acquire load of one 32-bit word (later accesses are ordered after it)."""
    return cute.arch.load(ptr, Uint32, sem="acquire", scope=scope)


@cute.jit
def ld_relaxed(ptr: cute.Pointer, scope: Constexpr[str] = "gpu") -> Uint32:
    """Relaxed (strong, L1-bypassing) load of one 32-bit word."""
    return cute.arch.load(ptr, Uint32, sem="relaxed", scope=scope)


@cute.jit
def st_release(ptr: cute.Pointer, val: Int32, scope: Constexpr[str] = "gpu"):
    """Release store of one 32-bit word (earlier accesses are ordered before it)."""
    cute.arch.store(ptr, val, sem="release", scope=scope)


@cute.jit
def st_relaxed(ptr: cute.Pointer, val: Int32, scope: Constexpr[str] = "gpu"):
    """Relaxed (strong) store of one 32-bit word."""
    cute.arch.store(ptr, val, sem="relaxed", scope=scope)


@cute.jit
def atomic_add_release(ptr: cute.Pointer, val: Uint32, scope: Constexpr[str] = "gpu") -> Uint32:
    """Atomic add with release semantics; returns the value before the add."""
    return cute.arch.atomic_add(ptr, val, sem="release", scope=scope)


@cute.jit
def atomic_add_acq_rel(ptr: cute.Pointer, val: Uint32, scope: Constexpr[str] = "gpu") -> Uint32:
    """Atomic add with acquire+release semantics; returns the value before the add."""
    return cute.arch.atomic_add(ptr, val, sem="acq_rel", scope=scope)


@cute.jit
def fence_gpu():
    """fence.acq_rel.gpu: orders this thread's accesses at device scope."""
    cute.arch.fence_acq_rel_gpu()


@cute.jit
def fence_sys():
    """fence.acq_rel.sys: orders this thread's accesses at system scope (host, peers)."""
    cute.arch.fence_acq_rel_sys()


def mapped_i32(addr: cutlass.Int64) -> cute.Pointer:
    """Int32 pointer (global address space) from a raw device/mapped-host address."""
    return cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
