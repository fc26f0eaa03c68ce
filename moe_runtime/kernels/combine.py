"""Combine: y[t] = sum_j w[t, j] * expert_y[slot[t, j]] (slot -1: no contribution).

Specialization (constexpr): dtype, H hidden, K top-k, WARPS per block, V vectors per lane per
segment (the mode: decode uses small segments so a few tokens still spread over many SMs,
prefill larger ones). Dynamic: T tokens, N expert rows.
One warp per (token, row segment), grid = ceil(T * NSEG / WARPS). Lanes j < K load slot and
weight of pick j and the warp broadcasts them by shuffles; the K gathered segments are all
loaded (128-bit) before any arithmetic, accumulated in fp32 registers in order j = 0..K-1
(as the reference), converted to the input dtype and stored with 128-bit stores.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32

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
    if t < mOut.shape[0]:
        my_slot = Int32(-1)
        my_w = Float32(0.0)
        if lane < K:
            my_slot = mSlot[t, lane]
            my_w = mW[t, lane]
        frags = []
        weights = []
        for j in cutlass.range_constexpr(K):
            src = cute.arch.shuffle_sync(my_slot, offset=j)
            w = cute.arch.shuffle_sync(my_w, offset=j)
            frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), dtype)
            frag.fill(0.0)
            if src >= 0:
                load_segment(row_vectors(mY[src, None], VEC), frag, lane, seg, V, NV)
            else:
                w = Float32(0.0)
            frags.append(frag)
            weights.append(w)
        acc = cute.make_rmem_tensor(cute.make_layout((VEC, V)), Float32)
        acc.fill(0.0)
        for j in cutlass.range_constexpr(K):
            acc.store(acc.load() + frags[j].load().to(Float32) * weights[j])
        res = cute.make_rmem_tensor(cute.make_layout((VEC, V)), dtype)
        res.store(acc.load().to(dtype))
        store_segment(row_vectors(mOut[t, None], VEC), res, lane, seg, V, NV)


@cute.jit
def combine(mY: cute.Tensor, mSlot: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream,
            H: Constexpr[int], K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    """expert_y [N,H], slot int32 [T,K], w fp32 [T,K] -> out [T,H] (expert_y's dtype)."""
    nseg = num_segments(H, mY.element_type, V)
    combine_kernel(mY, mSlot, mW, mOut, H, K, WARPS, V).launch(
        grid=(cute.ceil_div(mOut.shape[0] * nseg, WARPS), 1, 1), block=(WARPS * 32, 1, 1),
        stream=stream)
