"""dp_nvlink combine (the `cute` backend): expert outputs go back to their source ranks with
release flags; the weighted sum over k happens at the source.

With the dispatch of epoch e (ep_dispatch.py) and expert outputs expert_y_r [>= xout_rows, H]:
  SEND    (expert owner r) for every staging chunk of source s that r received: rows
          expert_y_r[pos[s, i]] go to ret_s[item] (item = t*k+j, from the row's meta), then
          ret_flag_s[r, chunk] = e (release.sys); chunk = the dispatch's chunk (1 = per token).
  REDUCE  (source s) per token t: threads j < k acquire-poll ret_flag_s[dest(t,j), i(t,j) //
          chunk] >= e, then y[t] = sum_j w[t, j] * ret_s[t*k+j] in fp32, j = 0..k-1, cast once
          (the order of reference.combine).
Launches: "decode" (after a decode dispatch) is ONE cooperative launch, SEND then REDUCE, with
the dispatch's per-token chunks and one or two CTAs per SM in all (peer_sync.
cooperative_ctas_per_sm): a CTA's REDUCE waits only on flags,
so no grid barrier is needed between the phases. "prefill" is two launches (SEND, REDUCE) with
per-chunk flags and a grid >> SMs. Waits are bounded; a timeout raises PeerTimeoutError naming
the rank, the phase and the expert owner waited for.

Buffer reuse without memset: r writes ret_s again only in combine e+1, after its dispatch e+1
saw s's inbox flag e+1, which s raised after finishing this combine.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Constexpr, Float32, Int32, Int64

from ..comm import peer_buffers as pb
from .ep_dispatch import E_BAD_ID, EPDispatchHandle, row_addrs
from .peer_sync import (DEFAULT_TIMEOUT_S, DTYPES, GMEM, THREADS, block_rank, chunk_of,
                        compile_tvm, copy_row, ctas_per_rank, decode_grids, fake_rows,
                        fake_stream, i32_at, in_range, vec_at, vec_elems, wait_bounds, wait_ge)

PH_CSEND, PH_CREDUCE = 1, 2
PH_CALL = PH_CSEND | PH_CREDUCE  # the decode combine: one launch
E_BAD_ITEM = 20  # error code of a refused value (peer_buffers.PHASES)


def _ld(p):
    return cute.arch.load(p, Int32)


@cute.jit
def weighted_rows(srcs: list, rows: list, ws: list, dst: Int64, dst_row: Int32, tidx: Int32,
                  threads: Constexpr[int], nv: Constexpr[int], dtype: Constexpr):
    """dst[dst_row] = sum_j ws[j] * srcs[j][rows[j]] over 16-B vectors, fp32, j in order; the
    CTA's threads split the nv vectors; all loads of a vector group are issued first."""
    K = len(rows)
    for i in cutlass.range_constexpr((nv + threads - 1) // threads):
        c = tidx + i * threads
        if cutlass.const_expr((i + 1) * threads > nv):
            c = c if c < nv else nv - 1
        vals = [vec_at(srcs[j], rows[j], c, nv, dtype).load() for j in range(K)]
        acc = vals[0].to(Float32) * ws[0]
        for j in cutlass.range_constexpr(1, K):
            acc = acc + vals[j].to(Float32) * ws[j]
        if cutlass.const_expr((i + 1) * threads <= nv):
            vec_at(dst, dst_row, c, nv, dtype).store(acc.to(dtype))
        else:
            if tidx + i * threads < nv:
                vec_at(dst, dst_row, c, nv, dtype).store(acc.to(dtype))


@cute.kernel
def combine_kernel(mTab: cute.Tensor, epoch: Int32, S: Int32, rank0: Int32, skip_rank: Int32,
                   max_spins: Int32,
                   phases: Constexpr[int], hidden: Constexpr[int], K: Constexpr[int],
                   W: Constexpr[int], E_l: Constexpr[int], chunk: Constexpr[int],
                   cpr: Constexpr[int], dtype: Constexpr):
    """mTab int64 [NUM_FIELDS, W] is the only tensor. Per rank r (F_ARG_* rows): expert_y
    [>= xout_rows, hidden] (F_ARG_EY), topk_ids int32 [T_r, K] (F_ARG_IDS), topk_weights fp32
    [T_r, K] (F_ARG_W), output y [T_r, hidden] (F_ARG_Y), T_r (F_ARG_T)."""
    threads = THREADS
    nv = hidden // vec_elems(dtype)
    tidx, rl, lb, rank = block_rank(rank0, cpr)
    T = Int32(mTab[pb.F_ARG_T, rank])
    err = mTab[pb.F_ERR, rank]
    if rank != skip_rank:
        if cutlass.const_expr(phases & PH_CSEND):
            counts = [_ld(i32_at(mTab[pb.F_NRECV, rank]) + q) for q in range(W)]
            _p, _c, _n, total = chunk_of(Int32(0), rank, counts, chunk, W)
            ey = mTab[pb.F_ARG_EY, rank]
            meta = i32_at(mTab[pb.F_RECV_META, rank])
            pos = i32_at(mTab[pb.F_POS, rank])
            items = S // min(K, E_l) * K  # rows of F_RET_X: max_tokens_per_rank * K
            for g in cutlass.range(lb, total, cpr):
                s, c, n, _t = chunk_of(g, rank, counts, chunk, W)
                ret = mTab[pb.F_RET_X, s]
                for q in cutlass.range_constexpr(chunk):
                    i = c * chunk + q
                    if i < n:
                        row = s * S + i
                        item = _ld(meta + row * 2 + 1)
                        if in_range(item, items, err, Int32(E_BAD_ITEM), s):
                            copy_row(ey, _ld(pos + row), ret, item, tidx, threads, nv, dtype)
                cute.arch.sync_threads()
                if tidx == 0:
                    cute.arch.store(i32_at(mTab[pb.F_RET_FLAG, s]) + (rank * S + c), epoch,
                                    sem="release", scope="sys")
        if cutlass.const_expr(phases & PH_CREDUCE):
            stage = i32_at(mTab[pb.F_STAGE, rank])
            rflag = i32_at(mTab[pb.F_RET_FLAG, rank])
            ret = mTab[pb.F_RET_X, rank]
            y = mTab[pb.F_ARG_Y, rank]
            ids = i32_at(mTab[pb.F_ARG_IDS, rank])
            wts = cute.make_ptr(Float32, mTab[pb.F_ARG_W, rank], GMEM, assumed_align=4)
            for t in cutlass.range(lb, T, cpr):
                if tidx < K:
                    e = _ld(ids + t * K + tidx)
                    if in_range(e, Int32(W * E_l), err, Int32(E_BAD_ID), Int32(-1)):
                        r = e // E_l
                        wait_ge(rflag + (r * S + _ld(stage + t * K + tidx) // chunk), epoch,
                                err, max_spins, Int32(6), r)
                cute.arch.sync_threads()
                ws = [cute.arch.load(wts + t * K + j, Float32) for j in range(K)]
                weighted_rows([ret] * K, [t * K + j for j in range(K)], ws, y, t, tidx,
                              threads, nv, dtype)


@cute.jit
def combine_entry(mTab: cute.Tensor, epoch: Int32, S: Int32, rank0: Int32, skip_rank: Int32,
                  max_spins: Int32, stream: cuda.CUstream,
                  phases: Constexpr[int], hidden: Constexpr[int], K: Constexpr[int],
                  W: Constexpr[int], E_l: Constexpr[int], chunk: Constexpr[int],
                  cpr: Constexpr[int], n_local: Constexpr[int], dtype: Constexpr):
    combine_kernel(mTab, epoch, S, rank0, skip_rank, max_spins, phases, hidden, K, W, E_l,
                   chunk, cpr, dtype).launch(
        grid=(n_local * cpr, 1, 1), block=(THREADS, 1, 1), stream=stream,
        cooperative=phases == PH_CALL)  # one launch: its REDUCE waits on its own SENDs


@functools.lru_cache(maxsize=None)
def compile_combine(phases: int, hidden: int, top_k: int, world: int, local_experts: int,
                    chunk: int, cpr: int, n_local: int, dtype: str, arch: str | None = None):
    """Compiled TVM-FFI combine of `phases` (PH_CALL: decode, one cooperative launch;
    PH_CSEND or PH_CREDUCE: one prefill launch each). Call:
    f(table, epoch, S, rank0, skip_rank, max_spins) (inputs in F_ARG_* rows)."""
    return compile_tvm(
        combine_entry, fake_rows(Int64, world, pb.NUM_FIELDS), Int32(1), Int32(1), Int32(0),
        Int32(-1), Int32(1), fake_stream(), phases, hidden, top_k, world,
        local_experts, chunk, cpr, n_local, DTYPES[dtype], arch=arch)


def ep_combine(bufs: pb.PeerBuffers, handle: EPDispatchHandle,
               expert_y: Sequence[torch.Tensor] | torch.Tensor, topk_weights: torch.Tensor, *,
               out: torch.Tensor | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               max_spins: int | None = None, check: bool = True,
               skip_rank: int = -1) -> torch.Tensor:
    """dp_nvlink combine of the local rank(s): y [sum T_r, H] in the buffers' dtype.

    Args:
        handle: the NEWEST ep_dispatch handle of these buffers.
        expert_y: per local rank [>= rows, H] expert outputs in the handle's expert_x order
            (a list, or one tensor when n_local == 1); may be the expert_x views themselves.
            rows = handle.rows_used[r] (the dispatch's expert_offsets[-1]; every row the
            combine reads is below it), or xout_rows when the dispatch ran with check=False.
        topk_weights: fp32 [sum T_r, k] (same rows as the dispatch's topk_ids).
        out: optional [sum T_r, H] output. Others: see ep_dispatch.

    Raises:
        ValueError: stale handle (one combined already included), bad shapes (before
            launching). RuntimeError: inside a CUDA graph capture (before launching).
        PeerTimeoutError / PeerDataError: see ep_dispatch.
    """
    s = bufs.spec
    bufs.check_usable()
    if handle.epoch != bufs._last_dispatch:  # (a second combine would find its flags set)
        raise ValueError(f"handle of epoch {handle.epoch} is stale: it was combined already, or "
                         "the buffers were reset or restarted their epochs, or hold a newer "
                         f"dispatch (epoch {bufs._last_dispatch}); combine each dispatch once, "
                         "the newest")
    eys = [expert_y] if isinstance(expert_y, torch.Tensor) else list(expert_y)
    if len(eys) != bufs.n_local:
        raise ValueError(f"expert_y: need {bufs.n_local} tensor(s), got {len(eys)}")
    for r, e in enumerate(eys):
        need = s.xout_rows if handle.rows_used is None else handle.rows_used[r]
        if (e.dim() != 2 or e.shape[0] < need or e.shape[1] != s.hidden
                or e.dtype != s.dtype or not e.is_contiguous() or e.device != bufs.device):
            raise ValueError(f"expert_y[{r}] must be contiguous {s.dtype} [>= {need}, "
                             f"{s.hidden}] on {bufs.device}, got {e.dtype} {tuple(e.shape)}")
    n = sum(handle.tokens)
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (n, s.top_k):
        raise ValueError(f"topk_weights must be float32 [{n}, {s.top_k}], got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    y = torch.empty(n, s.hidden, dtype=s.dtype, device=bufs.device) if out is None else out
    if (tuple(y.shape) != (n, s.hidden) or y.dtype != s.dtype or not y.is_contiguous()
            or y.device != bufs.device or topk_weights.device != bufs.device):
        raise ValueError(f"out must be contiguous {s.dtype} [{n}, {s.hidden}] and topk_weights on "
                         f"{bufs.device}; got out {y.dtype} {tuple(y.shape)} on {y.device}")
    spins = wait_bounds(timeout_s, max_spins)
    w = topk_weights.contiguous()
    bufs.set_args({pb.F_ARG_EY: [e.data_ptr() for e in eys],
                   pb.F_ARG_IDS: row_addrs(handle.topk_ids, handle.tokens),
                   pb.F_ARG_W: row_addrs(w, handle.tokens), pb.F_ARG_Y: row_addrs(y, handle.tokens),
                   pb.F_ARG_T: handle.tokens})
    dname = str(s.dtype).removeprefix("torch.")
    decode = handle.mode == "decode"
    cpr = ctas_per_rank(bufs.n_local, decode, max(handle.tokens) * s.top_k)
    grids = decode_grids(bufs.n_local) if decode else [cpr]  # (as ep_dispatch: all compiled)
    compiled = {c: [compile_combine(ph, s.hidden, s.top_k, s.world_size, s.num_local_experts,
                                    handle.chunk, c, bufs.n_local, dname)
                    for ph in ((PH_CALL,) if decode else (PH_CSEND, PH_CREDUCE))]
                for c in grids}
    launches = compiled[cpr]  # (compiled before anything is launched)
    bufs._last_dispatch = None  # (combined: once)
    for f in launches:
        bufs.launch(f, handle.epoch, s.stage_rows, bufs.rank0, skip_rank, spins)
    if check:
        bufs.check_errors(f"ep_combine ({handle.mode}, epoch {handle.epoch})")
    return y
