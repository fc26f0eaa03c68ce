"""Dispatch, prefill mode, launch 1 of 2: slot ranks and expert offsets.

Specialization (constexpr): E local experts, K top-k, WARPS per block. Dynamic: T tokens.
One thread per flattened (t, j) item, grid = ceil(T * K / threads) (as large as the data
needs; the launcher derives it from the ids' shape):
  * a local expert gets a rank inside its block from a shared-memory atomic (atom.shared.add),
    kept in a register (-1 for experts outside [expert_start, expert_start + E));
  * one global atomic per (block, expert) reserves a contiguous range (base); the item's
    rank inside its expert, base + block rank, is written to `rank` [T, K] once;
  * the block that finishes last (sync/grid_barrier.last_block_arrive) scans the padded counts
    into expert_offsets [E+1] and clears the counters for the next launch.
Workspace int32 [workspace_words(E)]: [0] arrival counter, [4 : 4 + E] counts; zero between
launches. A programmatic dependent launch (PDL) itself: its blocks become resident while the
previous launch (the router) ends and wait for it (griddepcontrol.wait) before any global
access; that wait also orders the workspace after the previous dispatch's last block cleared
it. Launch 2 (dispatch_copy.py) turns ranks into slots and copies the rows; it is a PDL of this
launch: every block lets it start right after its own wait (griddepcontrol.launch_dependents),
so launch 2 loads its x rows and the ids while this launch runs (both were written before
this launch's predecessor completed, which that wait observed) and waits (this grid
complete, its writes visible) only before reading ranks and offsets.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Uint32

from ..sync.grid_barrier import last_block_arrive
from .device_counts import add_block_counts, clear_shared, padded_offsets


def workspace_words(num_experts: int) -> int:
    return 4 + num_experts


@cute.kernel
def dispatch_slots_kernel(mIds: cute.Tensor, mRank: cute.Tensor, mOffsets: cute.Tensor,
                          mWs: cute.Tensor, expert_start: Int32, align: Int32,
                          E: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int]):
    THREADS = WARPS * 32
    PER_T = (E + THREADS - 1) // THREADS
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    item = bidx * THREADS + tidx
    in_range = item < mIds.shape[0] * K
    smem = cutlass.memory.SmemAllocator()
    s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_base = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_warp = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
    counts = cute.make_tensor(mWs.iterator + 4, cute.make_layout(E))
    clear_shared(s_cnt, E, THREADS)  # shared memory only: before the wait
    cute.arch.griddepcontrol_wait()  # PDL: ids written, the previous dispatch's clear done
    cute.arch.griddepcontrol_launch_dependents()  # launch 2 may start loading x rows and ids now

    e = Int32(-1)
    if in_range:
        e = mIds[item // K, item % K] - expert_start
    r = Int32(-1)
    if e >= 0 and e < E:
        r = cute.arch.atomic_add(s_cnt.iterator + e, Int32(1))
    cute.arch.sync_threads()
    add_block_counts(s_cnt, counts.iterator, s_base, E, THREADS)
    cute.arch.sync_threads()
    if in_range:
        rank = Int32(-1)
        if r >= 0:
            rank = r + s_base[e]
        mRank[item // K, item % K] = rank

    if last_block_arrive(cute.recast_ptr(mWs.iterator, dtype=Uint32), s_flag.iterator) != 0:
        padded_offsets(counts.iterator, align, mOffsets, s_warp, E, WARPS)
        for i in cutlass.range_constexpr(PER_T):
            x = tidx + i * THREADS
            if x < E:
                counts[x] = 0
        if tidx == 0:
            mWs[0] = 0


@cute.jit
def dispatch_slots(mIds: cute.Tensor, mRank: cute.Tensor, mOffsets: cute.Tensor, mWs: cute.Tensor,
                   expert_start: Int32, align: Int32, stream,
                   E: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int]):
    """ids int32 [T,K] (T >= 1) -> rank int32 [T,K] (rank inside its expert, -1 = not local),
    offsets [E+1]; grid = ceil(T * K / threads), a programmatic dependent launch (use_pdl)."""
    dispatch_slots_kernel(mIds, mRank, mOffsets, mWs, expert_start, align, E, K, WARPS).launch(
        grid=(cute.ceil_div(mIds.shape[0] * K, WARPS * 32), 1, 1), block=(WARPS * 32, 1, 1),
        stream=stream, use_pdl=True)
