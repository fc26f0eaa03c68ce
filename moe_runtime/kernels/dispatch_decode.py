"""Dispatch, decode mode: ONE cooperative launch, phases separated by a grid barrier.

Specialization (constexpr): dtype (from the tensors), H hidden, E local experts, K top-k,
WARPS per block, V vectors per lane per row segment. Dynamic: T tokens, N output rows.

Grid: G <= number of SMs blocks (co-resident, cooperative launch); block b owns the (t, j)
items [b * ipb, (b + 1) * ipb) of the flattened [T, K] ids, ipb <= WARPS * 32.
  phase 1 (count/assign): each thread takes one item; local experts get a rank inside the
      block from a shared-memory atomic; one global atomic per (block, expert) then reserves
      a contiguous range of the expert's rows (base).
  grid barrier (sync/grid_barrier.py): all counts are final.
  phase 2 (offsets + copy): every block scans the padded global counts itself (E values),
      slot = offset[e] + base[e] + rank; block 0 writes expert_offsets; then the block's warps
      copy its items' rows in 128-bit segments (each warp's first segment is loaded before
      the barrier, so that load's latency overlaps the wait).
Counters are double-buffered by the barrier's parity bit: this launch adds into
counts[phase] and clears counts[1 - phase] for the next launch, so nothing is memset.
Workspace int32 [workspace_words(E)]: [0] barrier word, [4 : 4 + 2E] counts[2][E].
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Int64, Uint32

from ..sync.grid_barrier import barrier_phase, grid_barrier
from .device_counts import add_block_counts, clear_shared, padded_offsets
from .device_rows import load_segment, num_segments, row_vectors, store_segment, vec_width


def workspace_words(num_experts: int) -> int:
    return 4 + 2 * num_experts


@cute.kernel
def dispatch_decode_kernel(mX: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor,
                           mOffsets: cute.Tensor, mSlot: cute.Tensor, mWs: cute.Tensor,
                           expert_start: Int32, align: Int32, ipb: Int32, err_addr: Int64,
                           max_iters: Int32, timeout_ns: Int64,
                           H: Constexpr[int], E: Constexpr[int], K: Constexpr[int],
                           WARPS: Constexpr[int], V: Constexpr[int], site: Constexpr[int]):
    THREADS = WARPS * 32
    VEC = vec_width(mX.element_type)
    NV = H // VEC
    NSEG = num_segments(H, mX.element_type, V)

    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    n_items = mIds.shape[0] * K
    first = bidx * ipb

    smem = cutlass.memory.SmemAllocator()
    s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_base = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_off = smem.allocate_tensor(Int32, cute.make_layout(E + 1), byte_alignment=16)
    s_slot = smem.allocate_tensor(Int32, cute.make_layout(THREADS), byte_alignment=16)
    s_warp = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
    clear_shared(s_cnt, E, THREADS)

    bar = cute.recast_ptr(mWs.iterator, dtype=Uint32)
    phase = barrier_phase(bar)
    counts = mWs.iterator + (4 + phase * E)
    stale = cute.make_tensor(mWs.iterator + (4 + (1 - phase) * E), cute.make_layout(E))

    # ---- phase 1: rank inside the block, then one global reservation per (block, expert)
    item = first + tidx
    mine = tidx < ipb and item < n_items
    el = Int32(-1)
    rank = Int32(0)
    if mine:
        e = mIds[item // K, item % K] - expert_start
        if e >= 0 and e < E:
            el = e
            rank = cute.arch.atomic_add(s_cnt.iterator + e, Int32(1))
    cute.arch.sync_threads()
    add_block_counts(s_cnt, counts, s_base, E, THREADS)

    # prefetch: the warp's first row segment depends only on its item, not on the slots, so its
    # load overlaps the barrier (clamped in range; unused when the warp has no unit)
    n_mine = cutlass.max(cutlass.min(ipb, n_items - first), 0)
    frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), mX.element_type)
    it0 = warp // NSEG
    row0 = cutlass.min(first + cutlass.min(it0, cutlass.max(n_mine - 1, 0)), n_items - 1) // K
    load_segment(row_vectors(mX[row0, None], VEC), frag, lane, warp - it0 * NSEG, V, NV)

    ok = grid_barrier(bar, s_flag.iterator, err_addr, max_iters, timeout_ns, site)

    # ---- phase 2: offsets from the final counts, slots, row copies
    if ok != 0:
        padded_offsets(counts, align, s_off, s_warp, E, WARPS)
        cute.arch.sync_threads()
        if bidx == 0:
            for i in cutlass.range_constexpr((E + 1 + THREADS - 1) // THREADS):
                e = tidx + i * THREADS
                if e <= E:
                    mOffsets[e] = s_off[e]
                if e < E:
                    stale[e] = 0
        slot = Int32(-1)
        if el >= 0:
            slot = s_off[el] + s_base[el] + rank
        if mine:
            mSlot[item // K, item % K] = slot
        s_slot[tidx] = slot
        cute.arch.sync_threads()

        for u in cutlass.range(warp, n_mine * NSEG, WARPS):
            it = u // NSEG
            seg = u - it * NSEG
            if u != warp:
                load_segment(row_vectors(mX[(first + it) // K, None], VEC), frag, lane, seg, V, NV)
            dst = s_slot[it]
            if dst >= 0:
                store_segment(row_vectors(mOut[dst, None], VEC), frag, lane, seg, V, NV)


@cute.jit
def dispatch_decode(mX: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor, mOffsets: cute.Tensor,
                    mSlot: cute.Tensor, mWs: cute.Tensor, expert_start: Int32, align: Int32,
                    ipb: Int32, grid: Int32, err_addr: Int64, max_iters: Int32, timeout_ns: Int64,
                    stream, H: Constexpr[int], E: Constexpr[int], K: Constexpr[int],
                    WARPS: Constexpr[int], V: Constexpr[int], site: Constexpr[int]):
    """x [T,H], ids int32 [T,K] -> out [N,H], offsets int32 [E+1], slot int32 [T,K] (grid <= SMs)."""
    dispatch_decode_kernel(mX, mIds, mOut, mOffsets, mSlot, mWs, expert_start, align, ipb, err_addr,
                           max_iters, timeout_ns, H, E, K, WARPS, V, site).launch(
        grid=(grid, 1, 1), block=(WARPS * 32, 1, 1), cooperative=True, stream=stream)
