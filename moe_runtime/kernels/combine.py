"""Combine: y[t] = sum_j w[t, j] * expert_y[slot[t, j]] (slot -1: no contribution).

Specialization (constexpr): dtype, H hidden, K top-k, WARPS per block, V vectors per lane per
segment (cute_compile.combine_shape: V = 1 in every mode; decode uses blocks of 4 warps, or of
1 warp for a few tokens, prefill of 8). Dynamic: T tokens, N expert rows.
One warp per (token, row segment), grid = ceil(T * NSEG / WARPS). Lanes j < K load slot and
weight of pick j and the warp broadcasts them by shuffles; the K gathered segments are all
loaded (128-bit, no branch around them) before any arithmetic, accumulated in fp32 registers
in order j = 0..K-1 (as the reference; a -1 pick is selected away, so a NaN in the row it
read cannot leak), converted to the input dtype and stored with 128-bit stores.
Requires expert_y to have at least one row (the host returns zeros without launching when
it has none). Launched as a programmatic dependent launch (PDL): the blocks become resident
while the previous launch finishes and wait for it (griddepcontrol.wait) before any global
access.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Constexpr, Float32, Int32

from .device_rows import load_segment, num_segments, row_vectors, store_segment, vec_width, \
    warp_unit


@cute.kernel
def combine_kernel(mY: cute.Tensor, mSlot: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
                   H: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int],
                   V: Constexpr[int]):
    dtype = mY.element_type
    VEC = vec_width(dtype)
    NV = H // VEC
    lane = cute.arch.lane_idx()
    t, seg = warp_unit(WARPS, num_segments(H, dtype, V))
    cute.arch.griddepcontrol_wait()  # PDL: the previous launch (expert_y's producer) is complete
    cute.arch.griddepcontrol_launch_dependents()
    if t < mOut.shape[0]:
        my_slot = Int32(-1)
        my_w = Float32(0.0)
        if lane < K:
            my_slot = mSlot[t, lane]
            my_w = mW[t, lane]
        # all K gathers first (unconditional: a -1 pick reads row 0 and is discarded below)
        srcs = []
        frags = []
        for j in cutlass.range_constexpr(K):
            srcs.append(cute.arch.shuffle_sync(my_slot, offset=j))
            frags.append(cute.make_rmem_tensor(cute.make_layout((VEC, V)), dtype))
            load_segment(row_vectors(mY[cutlass.max(srcs[j], 0), None], VEC), frags[j], lane, seg,
                         V, NV)
        acc = cute.full((VEC, V), 0.0, Float32)
        for j in cutlass.range_constexpr(K):
            w = cute.arch.shuffle_sync(my_w, offset=j)
            keep = cute.full((VEC, V), srcs[j] >= 0, Boolean)
            acc = acc + cute.where(keep, frags[j].load().to(Float32) * w, Float32(0.0))
        res = cute.make_rmem_tensor(cute.make_layout((VEC, V)), dtype)
        res.store(acc.to(dtype))
        store_segment(row_vectors(mOut[t, None], VEC), res, lane, seg, V, NV)


@cute.jit
def combine(mY: cute.Tensor, mSlot: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream,
            H: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    """expert_y [N,H], slot int32 [T,K], w fp32 [T,K] -> out [T,H] (expert_y's dtype)."""
    nseg = num_segments(H, mY.element_type, V)
    combine_kernel(mY, mSlot, mW, mOut, H, K, WARPS, V).launch(
        grid=(cute.ceil_div(mOut.shape[0] * nseg, WARPS), 1, 1), block=(WARPS * 32, 1, 1),
        stream=stream, use_pdl=True)
