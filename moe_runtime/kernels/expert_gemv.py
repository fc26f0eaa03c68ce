"""Expert GEMV for decode: out[r] = W[e(r)] @ x[r] over expert-major rows, optionally SwiGLU.

At decode sizes an expert sees one or a few rows, so the grouped GEMM is a matrix-vector product
bound by reading the expert weights once; torch's grouped GEMM reads them at ~1.5 TB/s there
(H200 profile of the Qwen3-30B-A3B layer at T=1). This kernel streams weight rows with 128-bit
loads, many in flight per lane, and reduces each dot product across the warp.

Specialization (constexpr): dtype, K (input width), M (weight rows per expert), E (experts),
SWIGLU, ROWS (output rows per warp), WARPS per block, CH (16-byte vectors per lane per chunk).
Dynamic: N rows of x.
  * linear:  out [N, M],   out[r, o] = sum_c W[e, o, c] * x[r, c]
  * SwiGLU:  out [N, M/2], out[r, o] = silu(g) * u with g = W[e, o] . x[r], u = W[e, M/2 + o] . x[r]
    (HF's fused gate_up_proj layout: gate rows first, then up rows).
e(r) is the expert whose segment [offsets[e], offsets[e+1]) holds r; rows r >= offsets[E] are
skipped (their output is unspecified, as with torch._grouped_mm). Dot products accumulate in
fp32 (each lane over its vectors, then a butterfly over the warp); the result is stored in the
input dtype. Grid: (ceil(OUT / (ROWS * WARPS)), N): block (b, r) computes rows b*ROWS*WARPS ..
of row r. Expert weights are addressed with 64-bit offsets (E * M * K exceeds 2^31 for
DeepSeek-V3's gate_up_proj).
Launched as a programmatic dependent launch (PDL): the blocks become resident while the
previous launch (the dispatch, or the gate/up GEMV before the down GEMV) finishes and wait for
it (griddepcontrol.wait) before any global access; each block lets the next launch start once
its weight loads are issued. (Prefetching the expert's weight rows into L2 before the wait, from
offsets the previous launch may still be writing, made the GEMVs slower on the H200: whole
rows thrashed L2, DeepSeek-V3 at T=1 took 231 instead of 168 us; the first chunk of each row
still cost 5-14% at T <= 8.)
"""
from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32, Int64

from .device_rows import row_vectors, vec_width


@cute.jit
def _expert_of_row(mOffs: cute.Tensor, r: Int32, lane: Int32, E: Constexpr[int]) -> Int32:
    """#{j in 1..E : offsets[j] <= r}: the lanes split the offsets, then a warp sum."""
    cnt = Int32(0)
    for i in cutlass.range_constexpr((E + 31) // 32):
        j = 1 + lane + 32 * i
        if cutlass.const_expr(32 * (i + 1) > E):
            jj = cutlass.min(j, E)
            cnt = cnt + ((mOffs[jj] <= r) & (j <= E)).to(Int32)
        else:
            cnt = cnt + (mOffs[j] <= r).to(Int32)
    return cute.arch.warp_redux_sync(cnt, kind="add")


@cute.kernel
def expert_gemv_kernel(mX: cute.Tensor, mOffs: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
                       K: Constexpr[int], M: Constexpr[int], E: Constexpr[int],
                       SWIGLU: Constexpr[bool], ROWS: Constexpr[int], WARPS: Constexpr[int],
                       CH: Constexpr[int]):
    dtype = mX.element_type
    VEC = vec_width(dtype)
    NV = K // VEC                                   # 16-byte vectors per row
    PER_LANE = (NV + 31) // 32
    OUT = M // 2 if SWIGLU else M
    NW = 2 * ROWS if SWIGLU else ROWS               # weight rows per warp
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    bx, r, _ = cute.arch.block_idx()
    o0 = (bx * WARPS + warp) * ROWS
    cute.arch.griddepcontrol_wait()  # PDL: the previous launch (x, offsets) is complete
    if r < mOffs[E]:
        e = _expert_of_row(mOffs, r, lane, E)
        w_base = cute.make_ptr(dtype, mW.iterator.toint() + Int64(e) * (M * K * dtype.width // 8),
                               cute.AddressSpace.gmem, assumed_align=16)
        mWe = cute.make_tensor(w_base, cute.make_layout((M, K), stride=(K, 1)))
        xv = row_vectors(mX[r, None], VEC)
        wrows = []                                   # weight row index of each accumulator
        for q in cutlass.range_constexpr(NW):
            o = cutlass.min(o0 + q % ROWS, OUT - 1)  # clamped: loads never branch
            wrows.append(o + (OUT if q >= ROWS else 0))
        acc = [Float32(0.0) for _ in range(NW)]
        for c0 in cutlass.range_constexpr(0, PER_LANE, CH):
            xs, ws = [], []
            for i in cutlass.range_constexpr(c0, min(c0 + CH, PER_LANE)):
                c = lane + 32 * i
                if cutlass.const_expr(32 * (i + 1) > NV):
                    c = cutlass.min(c, NV - 1)
                xs.append(xv[None, c].load().to(Float32))
                for q in cutlass.range_constexpr(NW):
                    ws.append(row_vectors(mWe[wrows[q], None], VEC)[None, c].load())
            for i in cutlass.range_constexpr(len(xs)):
                c = lane + 32 * (c0 + i)
                keep = Float32(1.0)
                if cutlass.const_expr(32 * (c0 + i + 1) > NV):
                    keep = Float32(1.0) if c < NV else Float32(0.0)
                for q in cutlass.range_constexpr(NW):
                    prod = ws[i * NW + q].to(Float32) * xs[i]
                    acc[q] = acc[q] + keep * prod.reduce(cute.ReductionOp.ADD, init_val=0.0,
                                                         reduction_profile=0)
        # every weight load is issued: the next launch may become resident now
        cute.arch.griddepcontrol_launch_dependents()
        for q in cutlass.range_constexpr(NW):
            acc[q] = cute.arch.warp_reduction(acc[q], operator.add)
        if lane == 0:
            for q in cutlass.range_constexpr(ROWS):
                o = o0 + q
                if o < OUT:
                    if cutlass.const_expr(SWIGLU):
                        g, u = acc[q], acc[ROWS + q]
                        silu = g * cute.arch.rcp_approx(1.0 + cute.math.exp(-g, fastmath=True))
                        mOut[r, o] = (silu * u).to(dtype)
                    else:
                        mOut[r, o] = acc[q].to(dtype)


@cute.jit
def expert_gemv(mX: cute.Tensor, mOffs: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream,
                K: Constexpr[int], M: Constexpr[int], E: Constexpr[int], SWIGLU: Constexpr[bool],
                ROWS: Constexpr[int], WARPS: Constexpr[int], CH: Constexpr[int]):
    """x [N,K], offsets int32 [E+1], W [E,M,K] -> out [N, M/2 if SWIGLU else M] (x's dtype)."""
    out_rows = M // 2 if SWIGLU else M
    expert_gemv_kernel(mX, mOffs, mW, mOut, K, M, E, SWIGLU, ROWS, WARPS, CH).launch(
        grid=((out_rows + ROWS * WARPS - 1) // (ROWS * WARPS), mX.shape[0], 1),
        block=(WARPS * 32, 1, 1), stream=stream, use_pdl=True)
