"""Router epilogue: logits [T, E] -> top-k ids, weights and per-expert counts, in one kernel.

Specialization (constexpr): logits dtype, E experts, K top-k, SIGMOID scoring, HAS_BIAS,
N_GROUP / TOPK_GROUP, NORM (renormalize), COUNTS (produce the per-expert counts), WARPS per
block. Dynamic: T tokens, grid, routed_scaling_factor.
Semantics are those of moe_runtime.kernels.reference.route (HF transformers' routers):
  softmax: scores = softmax(logits) in fp32; choice = scores.
  sigmoid: scores = sigmoid(logits); choice = scores + correction_bias; with N_GROUP > 1 a group
      is scored by the sum of its two best choices, the best TOPK_GROUP groups are kept and
      the other experts' choice becomes -inf (transformers 5.x DeepseekV3MoE.route_tokens_to_experts).
  ids = the K largest choices in descending order, ties to the smaller expert id;
  weights = scores at ids, / their sum (sigmoid: sum + 1e-20) if NORM, * routed_scaling_factor;
  a NaN choice counts as the lowest finite fp32 (above the -inf of masked groups), and a
  token with a NaN logit gets K NaN weights. The K ids are distinct even where fewer than K
  choices are finite (a -inf correction bias): -inf choices are taken in id order after the
  finite ones, as the reference's stable sort takes them.
One warp per token (grid-stride over tokens): lane l holds experts [l * PER_LANE, +PER_LANE),
each of the K rounds is a lane-local arg-max then a 5-step butterfly arg-max on
(choice, id, score) with ties to the smaller id; the winner's owner knocks it out (NaN: no
longer a candidate, unlike a -inf choice).
Counts (COUNTS only): a shared-memory histogram per block, one global atomic per (block,
expert), and the last block (sync/grid_barrier.last_block_arrive) copies the totals to `counts`
and clears them. Without COUNTS the kernel has no atomics and no cross-block step (MoELayer's
router: dispatch derives its layout from the ids; on the H200 this saves about 1 µs at T = 1).
Workspace int32 [workspace_words(E)]: [0] arrival counter, [4 : 4 + E] counts.
Launched as a programmatic dependent launch (PDL) of the router's logits GEMM: its blocks
wait for that launch (griddepcontrol.wait) before any global access, and let the next launch
start at once (griddepcontrol.launch_dependents): the decode dispatch (dispatch_decode.py) or
the prefill slots launch (dispatch_slots.py) then becomes resident while this kernel runs (it
waits for this grid before any global access).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32, Uint32

from ..sync.grid_barrier import last_block_arrive
from ..sync.ordered import ld_relaxed
from .device_counts import add_block_counts, clear_shared

LOG2E = math.log2(math.e)
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def workspace_words(num_experts: int) -> int:
    return 4 + num_experts


@cute.jit
def _warp_argmax(choice: Float32, idx: Int32, score: Float32):
    """Butterfly arg-max over the warp; ties to the smaller idx; every lane gets the result."""
    for i in cutlass.range_constexpr(5):
        off = 16 >> i
        oc = cute.arch.shuffle_sync_bfly(choice, offset=off)
        oi = cute.arch.shuffle_sync_bfly(idx, offset=off)
        os_ = cute.arch.shuffle_sync_bfly(score, offset=off)
        take = (oc > choice) | ((oc == choice) & (oi < idx))
        choice = oc if take else choice
        idx = oi if take else idx
        score = os_ if take else score
    return choice, idx, score


@cute.jit
def _warp_top2(b1: Float32, b2: Float32):
    """Two largest values over the warp (b1 >= b2 in every lane on entry and exit)."""
    for i in cutlass.range_constexpr(5):
        o1 = cute.arch.shuffle_sync_bfly(b1, offset=16 >> i)
        o2 = cute.arch.shuffle_sync_bfly(b2, offset=16 >> i)
        n2 = cute.arch.fmax(cute.arch.fmin(b1, o1), cute.arch.fmax(b2, o2))
        b1 = cute.arch.fmax(b1, o1)
        b2 = n2
    return b1, b2


@cute.kernel
def route_topk_kernel(mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                      mW: cute.Tensor, mCounts: cute.Tensor, mWs: cute.Tensor, scale: Float32,
                      E: Constexpr[int], K: Constexpr[int], SIGMOID: Constexpr[bool],
                      HAS_BIAS: Constexpr[bool], N_GROUP: Constexpr[int],
                      TOPK_GROUP: Constexpr[int], NORM: Constexpr[bool], COUNTS: Constexpr[bool],
                      WARPS: Constexpr[int]):
    THREADS = WARPS * 32
    PER_LANE = (E + 31) // 32
    GSZ = E // N_GROUP
    PER_T = (E + THREADS - 1) // THREADS
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    neg_inf = -Float32.inf
    lowest = Float32(-FP32_MAX)  # a NaN's place in the choice
    nan = Float32(math.nan)
    # the next launch (decode dispatch or prefill slots, programmatic dependent launches) may
    # start now: it waits for this grid before any global access
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()  # the logits' producer (previous launch) is complete

    if cutlass.const_expr(COUNTS):  # the block histogram and the workspace's totals
        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        counts = cute.make_tensor(mWs.iterator + 4, cute.make_layout(E))
        clear_shared(s_cnt, E, THREADS)

    raw = cute.make_rmem_tensor(cute.make_layout(PER_LANE), Float32)
    choice = cute.make_rmem_tensor(cute.make_layout(PER_LANE), Float32)
    score = cute.make_rmem_tensor(cute.make_layout(PER_LANE), Float32)
    for t in cutlass.range(bidx * WARPS + warp, mLogits.shape[0], nblk * WARPS):
        # ---- load this lane's logits (one vector when E is a multiple of 32)
        if cutlass.const_expr(E % 32 == 0):
            raw.store(cute.zipped_divide(mLogits[t, None], (PER_LANE,))[None, lane].load()
                      .to(Float32))
        else:
            for q in cutlass.range_constexpr(PER_LANE):
                e = lane * PER_LANE + q
                raw[q] = neg_inf
                if e < E:
                    raw[q] = mLogits[t, e].to(Float32)
        # ---- a NaN logit anywhere in the row: NaN weights (a warp-wide flag, 1.0 or 0.0)
        nan_row = Float32(0.0)
        for q in cutlass.range_constexpr(PER_LANE):
            nan_row = cute.arch.fmax(nan_row, Float32(1.0) if raw[q] != raw[q] else Float32(0.0))
        nan_row = cute.arch.warp_reduction_max(nan_row)
        # ---- scores and the values the choice is made on
        if cutlass.const_expr(SIGMOID):
            for q in cutlass.range_constexpr(PER_LANE):
                e = lane * PER_LANE + q
                s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-raw[q]))
                c = s
                if cutlass.const_expr(HAS_BIAS):
                    if e < E:
                        c = s + mBias[e]
                if e >= E:
                    c = neg_inf
                score[q] = s
                choice[q] = c if c == c else lowest  # (NaN)
        else:
            m = raw[0]
            for q in cutlass.range_constexpr(1, PER_LANE):
                m = cute.arch.fmax(m, raw[q])
            m = cute.arch.warp_reduction_max(m)
            tot = Float32(0.0)
            for q in cutlass.range_constexpr(PER_LANE):
                score[q] = cute.math.exp(raw[q] - m)
                tot = tot + score[q]
            tot = cute.arch.warp_reduction_sum(tot)
            for q in cutlass.range_constexpr(PER_LANE):
                e = lane * PER_LANE + q
                score[q] = score[q] / tot
                choice[q] = score[q] if score[q] == score[q] else lowest  # (NaN)
                if e >= E:
                    choice[q] = neg_inf
        # ---- group-limited selection (sigmoid routers)
        if cutlass.const_expr(N_GROUP > 1):
            gscore = []
            for g in cutlass.range_constexpr(N_GROUP):
                b1 = neg_inf
                b2 = neg_inf
                for q in cutlass.range_constexpr(PER_LANE):
                    e = lane * PER_LANE + q
                    v = choice[q] if (e >= g * GSZ) & (e < (g + 1) * GSZ) else neg_inf
                    b2 = cute.arch.fmax(b2, cute.arch.fmin(b1, v))
                    b1 = cute.arch.fmax(b1, v)
                b1, b2 = _warp_top2(b1, b2)
                gscore.append(b1 + b2 if cutlass.const_expr(GSZ >= 2) else b1)
            for q in cutlass.range_constexpr(PER_LANE):
                e = lane * PER_LANE + q
                keep = e < 0  # False, as a dynamic Boolean
                for g in cutlass.range_constexpr(N_GROUP):
                    better = Int32(0)
                    for h in cutlass.range_constexpr(N_GROUP):
                        if cutlass.const_expr(h != g):
                            ahead = gscore[h] > gscore[g]
                            if cutlass.const_expr(h < g):
                                ahead = gscore[h] >= gscore[g]
                            better = better + (Int32(1) if ahead else Int32(0))
                    in_g = (e >= g * GSZ) & (e < (g + 1) * GSZ)
                    keep = keep | (in_g & (better < TOPK_GROUP))
                if e < E:
                    choice[q] = choice[q] if keep else neg_inf
        # ---- K rounds of arg-max over the experts not taken yet (NaN marks a taken expert or
        # a padding slot; -inf ones stay available, as in the reference's sort)
        for q in cutlass.range_constexpr(PER_LANE):
            if lane * PER_LANE + q >= E:
                choice[q] = nan
        my_id = Int32(0)
        my_s = Float32(0.0)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(K):
            bc = neg_inf
            bi = Int32(E)  # (no expert: loses every tie below)
            bs = Float32(0.0)
            for q in cutlass.range_constexpr(PER_LANE):
                c = choice[q]
                better = (c == c) & ((c > bc) | ((c == bc) & (bi == E)))
                bc = c if better else bc
                bi = lane * PER_LANE + q if better else bi
                bs = score[q] if better else bs
            bc, bi, bs = _warp_argmax(bc, bi, bs)
            for q in cutlass.range_constexpr(PER_LANE):
                if bi == lane * PER_LANE + q:
                    choice[q] = nan
            total = total + bs
            if lane == j:
                my_id = bi
                my_s = bs
        if lane < K:
            w = my_s
            if cutlass.const_expr(NORM):
                if cutlass.const_expr(SIGMOID):
                    w = my_s / (total + Float32(1e-20))
                else:
                    w = my_s / total
            mIds[t, lane] = my_id
            mW[t, lane] = w * scale if nan_row == Float32(0.0) else nan
            if cutlass.const_expr(COUNTS):
                cute.arch.atomic_add(s_cnt.iterator + my_id, Int32(1))

    # ---- counts: per-block histogram -> global -> the last block publishes and clears
    if cutlass.const_expr(COUNTS):
        cute.arch.sync_threads()
        add_block_counts(s_cnt, counts.iterator, None, E, THREADS)
        if last_block_arrive(cute.recast_ptr(mWs.iterator, dtype=Uint32), s_flag.iterator) != 0:
            for i in cutlass.range_constexpr(PER_T):
                e = tidx + i * THREADS
                if e < E:
                    mCounts[e] = Int32(ld_relaxed(counts.iterator + e))
                    counts[e] = 0
            if tidx == 0:
                mWs[0] = 0


@cute.jit
def route_topk(mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
               mCounts: cute.Tensor, mWs: cute.Tensor, scale: Float32, grid: Int32, stream,
               E: Constexpr[int], K: Constexpr[int], SIGMOID: Constexpr[bool],
               HAS_BIAS: Constexpr[bool], N_GROUP: Constexpr[int], TOPK_GROUP: Constexpr[int],
               NORM: Constexpr[bool], COUNTS: Constexpr[bool], WARPS: Constexpr[int]):
    """logits [T,E], bias fp32 [E] -> ids int32 [T,K], weights fp32 [T,K], counts int32 [E]
    (written only if COUNTS)."""
    route_topk_kernel(mLogits, mBias, mIds, mW, mCounts, mWs, scale, E, K, SIGMOID, HAS_BIAS,
                      N_GROUP, TOPK_GROUP, NORM, COUNTS, WARPS).launch(
        grid=(grid, 1, 1), block=(WARPS * 32, 1, 1), stream=stream, use_pdl=True)
