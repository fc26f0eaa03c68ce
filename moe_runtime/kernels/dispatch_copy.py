"""Dispatch, prefill mode, launch 2 of 2: slots and row copies.

Specialization (constexpr): dtype, H hidden, E local experts, K top-k, WARPS per block, V
vectors per lane per segment. Dynamic: T tokens, N output rows.
One warp per (token, row segment), grid = ceil(T * NSEG / WARPS) (as large as the data needs):
the warp loads the token's segment ONCE (128-bit loads). Launched as a programmatic dependent
launch of launch 1 (dispatch_slots.py), it does so, and lanes j < K load the expert ids of
(t, j), while launch 1 still runs: x and ids were written before launch 1's predecessor
completed, which every block of launch 1 observed in its own wait before it let this launch
start. Then it waits for launch 1 (griddepcontrol.wait); lanes j < K turn rank[t, j] into
slot = offset[e] + rank (both loads in flight together) and broadcast the K slots by
shuffles, and the warp stores the segment to each of its local slots. Segment 0's warp
writes token_slot.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from .device_rows import load_segment, num_segments, row_vectors, store_segment, vec_width, \
    warp_unit


@cute.kernel
def dispatch_copy_kernel(mX: cute.Tensor, mIds: cute.Tensor, mRank: cute.Tensor,
                         mOffsets: cute.Tensor, mOut: cute.Tensor, mSlot: cute.Tensor,
                         expert_start: Int32, H: Constexpr[int], E: Constexpr[int],
                         K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    VEC = vec_width(mX.element_type)
    NV = H // VEC
    lane = cute.arch.lane_idx()
    t, seg = warp_unit(WARPS, num_segments(H, mX.element_type, V))
    frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), mX.element_type)
    e = Int32(-1)
    if t < mX.shape[0]:
        load_segment(row_vectors(mX[t, None], VEC), frag, lane, seg, V, NV)
        if lane < K:
            e = mIds[t, lane] - expert_start
    cute.arch.griddepcontrol_wait()  # launch 1 complete: rank and offsets are final
    if t < mX.shape[0]:
        slot = Int32(-1)
        if lane < K:
            if e >= 0 and e < E:
                slot = mOffsets[e] + mRank[t, lane]
            if seg == 0:
                mSlot[t, lane] = slot
        for j in cutlass.range_constexpr(K):
            dst = cute.arch.shuffle_sync(slot, offset=j)
            if dst >= 0:
                store_segment(row_vectors(mOut[dst, None], VEC), frag, lane, seg, V, NV)


@cute.jit
def dispatch_copy(mX: cute.Tensor, mIds: cute.Tensor, mRank: cute.Tensor, mOffsets: cute.Tensor,
                  mOut: cute.Tensor, mSlot: cute.Tensor, expert_start: Int32, stream,
                  H: Constexpr[int], E: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int],
                  V: Constexpr[int]):
    """x [T,H] + rank/offsets from launch 1 -> out [N,H], slot int32 [T,K]; a programmatic
    dependent launch (use_pdl) of launch 1."""
    nseg = num_segments(H, mX.element_type, V)
    dispatch_copy_kernel(mX, mIds, mRank, mOffsets, mOut, mSlot, expert_start, H, E, K, WARPS,
                         V).launch(grid=(cute.ceil_div(mX.shape[0] * nseg, WARPS), 1, 1),
                                   block=(WARPS * 32, 1, 1), stream=stream, use_pdl=True)
