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


@cute.jit
def round_up(c: Int32, align: Int32) -> Int32:
    """c rounded up to a multiple of align (>= 1): a segment's rows with its padding. The
    division by a runtime align is a long dependent instruction sequence (100-230 cycles of
    the decode dispatch's offsets step on the H200 at align = 1), so align = 1 skips it (a
    uniform branch)."""
    r = c
    if align > 1:
        r = (c + align - 1) // align * align
    return r


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

    s_warp: shared Int32 [warps] scratch, read after this returns: the caller passes a barrier
    before writing it again. Returns (exclusive prefix, block total), the same total in every
    thread. Block-wide call (one barrier).
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
    return before + incl - val, total


@cute.jit
def shared_exclusive_scan(src: cute.Tensor, dst: cute.Tensor, n: Constexpr[int],
                          s_warp: cute.Tensor, threads: Constexpr[int]):
    """dst[i] = src[0] + ... + src[i - 1] for i <= n (dst[n] = the total); src and dst are
    distinct shared Int32 tensors, src written before a barrier the caller passed. Each thread
    sums ceil(n / threads) consecutive values, one block_exclusive_scan joins the threads
    (s_warp: its scratch, [threads / 32]). Block-wide call; ends with a barrier, after which
    dst may be read and s_warp rewritten."""
    tidx, _, _ = cute.arch.thread_idx()
    P = (n + threads - 1) // threads
    vals = []
    mine = Int32(0)
    for i in cutlass.range_constexpr(P):
        e = tidx * P + i
        v = Int32(0)
        if e < n:
            v = src[e]
        vals.append(v)
        mine = mine + v
    before, total = block_exclusive_scan(mine, s_warp, threads // 32)
    for i in cutlass.range_constexpr(P):
        e = tidx * P + i
        if e < n:
            dst[e] = before
        before = before + vals[i]
    if tidx == 0:
        dst[n] = total
    cute.arch.sync_threads()


@cute.jit
def warp_padded_totals(ws: cute.Tensor, at: Constexpr[int], align: Int32, lane: Int32,
                       E: Constexpr[int]) -> list:
    """Warp-wide: [pad_i] for i < P = ceil(E / 32), pad_i = ceil(c / align) * align of expert
    e = P * lane + i (0 for e >= E: each lane holds P consecutive experts), where c is the sum
    of the two sets of E totals in ws[at : at + E] and ws[at + E : at + 2E] (one of them zero:
    dispatch_slots.py), so the loads wait for nothing but the caller's ordering. Plain
    (L1-cached) loads: every warp of a grid may read the same words, and strong loads, which
    all go to the one L2 slice holding them, made the prefill copy launch 20-30% slower on the
    H200; the caller must order the loads after the writers' completion (a kernel boundary or
    griddepcontrol.wait)."""
    P = (E + 31) // 32
    pads = []
    for i in cutlass.range_constexpr(P):
        e = lane * P + i
        idx = e
        if cutlass.const_expr(P * 32 > E):
            idx = cutlass.min(e, E - 1)  # in bounds, no branch around the loads
        c = ws[at + idx] + ws[at + E + idx]
        pad = round_up(c, align)
        if cutlass.const_expr(P * 32 > E):
            pad = pad if e < E else Int32(0)
        pads.append(pad)
    return pads


@cute.jit
def warp_exclusive_offsets(pads: list, lane: Int32, dst: cute.Tensor, E: Constexpr[int],
                           also: cute.Tensor, to_also: cutlass.Boolean):
    """One warp: dst[e] = the offset of expert e (the sum of the padded totals of the experts
    below it) for e < E and dst[E] = the padded total, also written to `also` where to_also
    (the same in every lane); pads from warp_padded_totals (P consecutive experts per lane):
    ONE shuffle scan of the lanes' sums, then each lane's running sum over its own experts.
    Against one scan per 32 experts over coalesced loads (H200, prefill dispatch, same runs):
    Qwen3-30B-A3B (4 scans before) T = 512 / 4096 7.80 / 39.2 -> 7.45 / 38.8 us; DeepSeek-V3
    (8 scans, 8 lines per load instruction now) T = 4096 143.2 -> 144.1 us; regrouping the
    coalesced loads through shared memory instead gained nothing. dst and also may be shared
    or global."""
    P = len(pads)
    mine = Int32(0)
    for i in cutlass.range_constexpr(P):
        mine = mine + pads[i]
    incl = mine
    for b in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, offset=1 << b)
        if lane >= (1 << b):
            incl = incl + up
    base = incl - mine
    for i in cutlass.range_constexpr(P):
        e = lane * P + i
        if e < E:
            dst[e] = base
            if to_also:
                also[e] = base
        base = base + pads[i]
    if lane == 31:
        dst[E] = incl
        if to_also:
            also[E] = incl
