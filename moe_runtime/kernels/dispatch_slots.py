"""Dispatch, prefill mode, launch 1 of 2: slot ranks and per-expert counts.

Specialization (constexpr): E local experts, K top-k, WARPS per block. Dynamic: T tokens.
One thread per flattened (t, j) item, grid = ceil(T * K / threads) (as large as the data
needs; the launcher derives it from the ids' shape):
  * a local expert gets a rank inside its block from a shared-memory atomic (atom.shared.add),
    kept in a register (-1 for experts outside [expert_start, expert_start + E));
  * one global atomic per (block, expert) adds the block's count to the expert's total and
    returns the block's base inside the expert; the item's rank inside its expert, base +
    block rank, is written to `rank` [T, K] once.
The offsets are NOT made here: launch 2 (dispatch_copy.py) scans the totals in every block,
so no block of this launch waits for the others (no last-block step on the critical path).

Workspace int32 [workspace_words(E)], zero at first use, two sets of E totals:
  ws[0]  the set p this slots launch adds into (flipped by launch 2's block 0)
  ws[COUNTS_AT + p * E : COUNTS_AT + (p + 1) * E]  the totals of set p
Block 0 clears the other set (the previous dispatch's totals: its launch 2 is complete), so
when launch 2 runs one set holds this launch's totals and the other is zero: launch 2 adds
the two and never waits for the parity (a dependent round trip before its offset scan). The
totals stay intact until every block of launch 2 has read them, with no grid-wide sync (the
next slots launch runs after launch 2 is complete). Every slots launch must be followed by
its launch 2 before the next slots launch (cute_ops._dispatch zeroes the workspace if launch
2 fails to start). Graph replays keep this valid: the parity lives on the device.

A programmatic dependent launch (PDL) itself: its blocks become resident while the previous
launch (the router) ends and wait for it (griddepcontrol.wait) before any global access;
that wait also orders the workspace after the previous dispatch's launch 2. Launch 2 is a
PDL of this launch: every block lets it start right after its own wait
(griddepcontrol.launch_dependents), so launch 2 loads its x rows and the ids while this
launch runs (both were written before this launch's predecessor completed, which that wait
observed) and waits (this grid complete, its writes visible) only before reading ranks and
totals.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from .device_counts import add_block_counts, clear_shared

COUNTS_AT = 4  # first word of count set 0


def workspace_words(num_experts: int) -> int:
    """int32 words of the slots/copy workspace for `num_experts` local experts."""
    return COUNTS_AT + 2 * num_experts


@cute.kernel
def dispatch_slots_kernel(mIds: cute.Tensor, mRank: cute.Tensor, mWs: cute.Tensor,
                          expert_start: Int32, E: Constexpr[int], K: Constexpr[int],
                          WARPS: Constexpr[int]):
    THREADS = WARPS * 32
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    item = bidx * THREADS + tidx
    in_range = item < mIds.shape[0] * K
    smem = cutlass.memory.SmemAllocator()
    s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_base = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    clear_shared(s_cnt, E, THREADS)  # shared memory only: before the wait
    cute.arch.griddepcontrol_wait()  # PDL: ids written, the previous dispatch's launch 2 done
    cute.arch.griddepcontrol_launch_dependents()  # launch 2 may start loading x rows and ids now

    p = mWs[0]  # written by the previous launch 2, complete (a plain load: one hot word)
    e = Int32(-1)
    if in_range:
        e = mIds[item // K, item % K] - expert_start
    r = Int32(-1)
    if e >= 0 and e < E:
        r = cute.arch.atomic_add(s_cnt.iterator + e, Int32(1))
    cute.arch.sync_threads()
    add_block_counts(s_cnt, mWs.iterator + (COUNTS_AT + p * E), s_base, E, THREADS)
    cute.arch.sync_threads()
    if in_range:
        rank = Int32(-1)
        if r >= 0:
            rank = r + s_base[e]
        mRank[item // K, item % K] = rank
    if bidx == 0:  # the previous dispatch's totals (its launch 2 is complete)
        for i in cutlass.range_constexpr((E + THREADS - 1) // THREADS):
            c = tidx + i * THREADS
            if c < E:
                mWs[COUNTS_AT + (1 - p) * E + c] = 0


@cute.jit
def dispatch_slots(mIds: cute.Tensor, mRank: cute.Tensor, mWs: cute.Tensor, expert_start: Int32,
                   stream, E: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int]):
    """ids int32 [T,K] (T >= 1) -> rank int32 [T,K] (rank inside its expert, -1 = not local)
    and the expert totals in the workspace; grid = ceil(T * K / threads), a programmatic
    dependent launch (use_pdl)."""
    dispatch_slots_kernel(mIds, mRank, mWs, expert_start, E, K, WARPS).launch(
        grid=(cute.ceil_div(mIds.shape[0] * K, WARPS * 32), 1, 1), block=(WARPS * 32, 1, 1),
        stream=stream, use_pdl=True)
