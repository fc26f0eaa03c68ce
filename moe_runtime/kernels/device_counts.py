"""Device helpers for per-expert counting, shared by the routing and dispatch kernels.

Two-level counting: a (t, j) pick gets its rank inside the block from a
shared-memory atomic; then ONE global atomic per (block, expert) adds the block's count and
returns the block's base inside the expert. The offsets are the exclusive scan of the counts,
each rounded up to `align` rows (grouped-GEMM padding).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from ..sync.ordered import ld_relaxed


@cute.jit
def clear_shared(s: cute.Tensor, n: Constexpr[int], threads: Constexpr[int]):
    """s[0:n] = 0 by the whole block, then a block barrier."""
    tidx, _, _ = cute.arch.thread_idx()
    for i in cutlass.range_constexpr((n + threads - 1) // threads):
        e = tidx + i * threads
        if e < n:
            s[e] = 0
    cute.arch.sync_threads()


@cute.jit
def add_block_counts(s_cnt: cute.Tensor, counts: cute.Pointer, s_base, E: Constexpr[int],
                     threads: Constexpr[int]):
    """Block-wide, after a barrier: counts[e] += s_cnt[e] with one global atomic per non-zero
    expert; s_base[e] receives the old value (the block's base) unless s_base is None."""
    tidx, _, _ = cute.arch.thread_idx()
    for i in cutlass.range_constexpr((E + threads - 1) // threads):
        e = tidx + i * threads
        if e < E:
            c = s_cnt[e]
            if c > 0:
                if cutlass.const_expr(s_base is None):
                    cute.arch.red(counts + e, c, op="add", dtype=Int32, sem="relaxed", scope="gpu")
                else:
                    s_base[e] = cute.arch.atomic_add(counts + e, c)


@cute.jit
def block_exclusive_scan(val: Int32, s_warp: cute.Tensor, warps: Constexpr[int]):
    """Exclusive prefix sum of one Int32 per thread over the block (thread order).

    s_warp: shared Int32 [warps] scratch. Returns (exclusive prefix, block total), the same
    total in every thread. Block-wide call (two barriers).
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    incl = val
    for i in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, offset=1 << i)
        if lane >= (1 << i):
            incl = incl + up
    if lane == 31:
        s_warp[warp] = incl
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(warps):
        part = s_warp[w]
        if w < warp:
            before = before + part
        total = total + part
    cute.arch.sync_threads()
    return before + incl - val, total


@cute.jit
def padded_offsets(counts: cute.Pointer, align: Int32, dst: cute.Tensor, s_warp: cute.Tensor,
                   E: Constexpr[int], warps: Constexpr[int]):
    """Block-wide: dst[e] = sum over e' < e of ceil(counts[e'] / align) * align, dst[E] = total.

    counts are read with strong (L1-bypassing) loads: other blocks wrote them.
    """
    threads = warps * 32
    per_t = (E + threads - 1) // threads  # thread t scans experts [t * per_t, (t + 1) * per_t)
    tidx, _, _ = cute.arch.thread_idx()
    part = Int32(0)
    for i in cutlass.range_constexpr(per_t):
        e = tidx * per_t + i
        if e < E:
            part = part + _padded(counts + e, align)
    excl, total = block_exclusive_scan(part, s_warp, warps)
    for i in cutlass.range_constexpr(per_t):
        e = tidx * per_t + i
        if e < E:
            dst[e] = excl
            excl = excl + _padded(counts + e, align)
    if tidx == 0:
        dst[E] = total


@cute.jit
def _padded(count: cute.Pointer, align: Int32) -> Int32:
    c = Int32(ld_relaxed(count))
    return (c + align - 1) // align * align
