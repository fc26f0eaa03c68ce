"""tp all-reduce (the `cute` backend) over peer buffers: one-shot, two-shot, and the tp
combine (local weighted gather-sum) followed by one of them.

Inputs live in every rank's peer-visible F_AR_IN ([T_max, H], the buffers' dtype); outputs in a
caller tensor out [n_local, T, H]. Sums are fp32 in rank order 0..W-1, cast once.

  one-shot  barrier(e) -> each rank reads all W inputs, sums, writes its out -> barrier(e+1).
            W-1 remote reads of the whole tensor per rank: best for small tensors (latency).
  two-shot  barrier(e) -> rank r reduces its 1/W slice of all inputs into its F_AR_MID
            (reduce-scatter) -> barrier(e+1) -> every rank copies every slice from its owner's
            F_AR_MID into out (all-gather) -> barrier(e+2). ~2 (W-1)/W of the tensor over the
            links per rank: best for large tensors (bandwidth).
  combine   (tp, tp_combine_all_reduce: algo COMBINE | ONESHOT or COMBINE | TWOSHOT, ONE
            launch) first the local combine y_r[t] = sum_j w[t,j] * expert_y_r[slot_r[t,j]]
            (slot -1 = expert not on this rank) into F_AR_IN, rounded to the buffers' dtype,
            then the one-shot or two-shot (by size, pick_algo). Each CTA combines exactly the
            vectors that CTAs of its index read first in the all-reduce (one-shot: its strided
            vectors; two-shot: its strided part of every rank's slice), so the per-CTA barrier
            below also publishes the combine: no grid barrier, no second launch.
Before the first barrier, CTA 0 of each rank stores its call's site word and T into its own
F_SITE row; after it, each rank reads every peer's (with its first reads of their inputs) and
compares them with its own (E_OUT_OF_STEP, E_OTHER_TOKENS: PeerDataError), so ranks that paired
calls of different layers or token counts raise instead of summing them.
Barriers are per CTA (CTA b of every rank meets CTA b of every rank); a vector is produced and
consumed by CTAs with the same index on every rank, so no grid-wide barrier is needed (a
barrier before reading peers and one before returning). Every wait is bounded and a
timeout raises PeerTimeoutError naming the rank, the phase and the peer.
Every launch is cooperative (all ranks' CTAs co-resident; virtual ranks: grid <= SMs).
NVLS (multimem) lives in nvls_allreduce.py and is never selected unless nvls_allowed().

Topology hook: topologies/tp.py (the `cute` backend) creates the buffers on its first call
(PeerBuffers.from_process_group with PeerSpec(all_to_all=False): only F_AR_IN / F_AR_MID / F_SIG
are sized) and combines with

    y = tp_combine_all_reduce(bufs, [expert_y], token_slot[None], topk_weights)[0]

Status (issue 5): on the H200 with W in {2, 4, 8} virtual ranks, one-shot and two-shot equal
torch's sum and tp_combine_all_reduce equals the sum of reference.combine over ranks
(tests/gpu/test_multirank_virtual_gpu.py); timings in benchmarks/multirank_virtual.py. Real
ranks: the tp topology's GPU test (tests/gpu/test_topologies_cute_gpu.py) runs two processes on
one GPU over CUDA IPC; tests/gpu/test_multi_gpu.py one process per GPU (passed on 2 H200s).
`benchmarks/multirank_virtual.py --real` there (2026-11-30, the ranks' timed calls started
together by an NCCL rendezvous; earlier numbers without it carried the ranks' start skew),
[128, 7168] bf16 per rank (1.8 MB): one-shot 19-21 us, two-shot 22 us, NCCL all_reduce 31 us;
[4096, 7168]: 194 / 228 us, NCCL 225 us; [1, 7168]: 18 / 23 us, NCCL 13 us.
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
from .peer_sync import (DEFAULT_TIMEOUT_S, DTYPES, GMEM, THREADS, block_rank, check_site,
                        compile_tvm, cross_rank_barrier, ctas_per_rank, fake_rows, fake_stream,
                        i32_at, in_range, peer_site, record_error, vec_at, vec_elems,
                        wait_bounds)

ONESHOT, TWOSHOT = 1, 2
COMBINE = 4  # flag: the tp combine first, in the same launch (COMBINE | ONESHOT, COMBINE | TWOSHOT)
ALGOS = {"oneshot": ONESHOT, "twoshot": TWOSHOT}
SIG_EPOCHS = {ONESHOT: 2, TWOSHOT: 3}  # cross-rank barrier epochs per launch (by algo & 3)
ONESHOT_MAX_BYTES = 1 << 20   # auto: one-shot up to 1 MiB per rank, two-shot above
E_BAD_SLOT = 21               # error code of a refused token_slot entry (peer_buffers.PHASES)


@cute.jit
def sum_peers(ins: list, c: Int32, nv: Constexpr[int], dtype: Constexpr):
    """fp32 sum over ranks (in order) of vector c of every input; all loads first."""
    vals = [vec_at(ins[r], 0, c, nv, dtype).load() for r in range(len(ins))]
    acc = vals[0].to(Float32)
    for r in cutlass.range_constexpr(1, len(ins)):
        acc = acc + vals[r].to(Float32)
    return acc


@cute.jit
def slice_len(n: Int32, lo: Int32, per: Int32) -> Int32:
    """Vectors of the two-shot slice starting at lo: min(per, n - lo) (<= 0: none)."""
    cnt = n - lo
    return per if cnt > per else cnt


@cute.jit
def combine_vector(ey: Int64, rows: Int32, slots: cute.Pointer, wts: cute.Pointer, dst: Int64,
                   c: Int32, err: Int64, K: Constexpr[int], nv: Constexpr[int], dtype: Constexpr):
    """dst vector c (token t = c // nv) = sum_j wts[t, j] * ey[slots[t, j]] over the slots >= 0
    (-1: expert not on this rank), fp32 in j order, cast once; a slot >= rows is refused."""
    t = c // nv
    v = c - t * nv
    acc = cute.full((vec_elems(dtype),), 0.0, Float32)
    for j in cutlass.range_constexpr(K):
        slot = cute.arch.load(slots + t * K + j, Int32)
        if slot >= 0:
            if in_range(slot, rows, err, Int32(E_BAD_SLOT), Int32(-1)):
                acc = acc + (vec_at(ey, slot, v, nv, dtype).load().to(Float32)
                             * cute.arch.load(wts + t * K + j, Float32))
    vec_at(dst, 0, c, nv, dtype).store(acc.to(dtype))


@cute.jit
def check_call(mTab: cute.Tensor, rank: Int32, lb: Int32, tidx: Int32, site: Int32,
               tokens: Int32, T: Int32, err: Int64, W: Constexpr[int]):
    """CTA 0's thread p < W: peer p's site word and T (peer_site) against this call's."""
    if (lb == 0) & (tidx < W):
        check_site(mTab, rank, tidx, site, err)
        if tokens != T:
            record_error(err, Int32(pb.E_OTHER_TOKENS), tidx, T, tokens)


@cute.kernel
def allreduce_kernel(mTab: cute.Tensor, T: Int32, epoch: Int32, rank0: Int32, skip_rank: Int32,
                     max_spins: Int32, algo: Constexpr[int],
                     hidden: Constexpr[int], K: Constexpr[int], W: Constexpr[int],
                     cpr: Constexpr[int], dtype: Constexpr):
    """mTab int64 [NUM_FIELDS, W] is the only tensor. Per rank r (F_ARG_* rows): output
    [T, hidden] (F_ARG_Y); with COMBINE also expert_y [F_ARG_ROWS, hidden] (F_ARG_EY),
    token_slot int32 [T, K] (F_ARG_SLOT; entries >= F_ARG_ROWS are refused: E_BAD_SLOT),
    topk_weights fp32 [T, K] (F_ARG_W)."""
    threads = THREADS
    nv = hidden // vec_elems(dtype)
    tidx, rl, lb, rank = block_rank(rank0, cpr)
    err = mTab[pb.F_ERR, rank]
    n = T * nv
    first, stride = lb * threads + tidx, cpr * threads
    out = mTab[pb.F_ARG_Y, rank]
    ins = [mTab[pb.F_AR_IN, r] for r in range(W)]
    two = (algo & TWOSHOT) != 0
    per = (n + (W - 1)) // W  # two-shot: rank r owns vectors [r * per, min(n, (r + 1) * per))
    if rank != skip_rank:
        if (lb == 0) & (tidx == 0):  # this call's site and T in this rank's own row (local
            # stores: a remote store here would put an NVLink round trip before the barrier's
            # release), released by the first barrier, pulled by the peers after it (they read
            # the previous call's before the last barrier of that call)
            box = i32_at(mTab[pb.F_SITE, rank]) + rank * pb.SITE_COLS
            cute.arch.store(box + 1, Int32(mTab[pb.F_ARG_SITE, rank]))
            cute.arch.store(box + 2, T)
        if cutlass.const_expr(algo & COMBINE):  # local combine -> this rank's F_AR_IN
            ey = mTab[pb.F_ARG_EY, rank]
            rows = Int32(mTab[pb.F_ARG_ROWS, rank])
            slots = i32_at(mTab[pb.F_ARG_SLOT, rank])
            wts = cute.make_ptr(Float32, mTab[pb.F_ARG_W, rank], GMEM, assumed_align=4)
            mine = mTab[pb.F_AR_IN, rank]
            if cutlass.const_expr(two):  # the CTA's part of every owner's slice
                for u in cutlass.range_constexpr(W):
                    for q in cutlass.range(first, slice_len(n, u * per, per), stride):
                        combine_vector(ey, rows, slots, wts, mine, u * per + q, err, K, nv, dtype)
            else:
                for c in cutlass.range(first, n, stride):
                    combine_vector(ey, rows, slots, wts, mine, c, err, K, nv, dtype)
        cross_rank_barrier(mTab, pb.F_SIG, rank, lb, epoch, tidx, err, max_spins,
                           Int32(7), W)
        site, tokens = Int32(0), T
        if (lb == 0) & (tidx < W):  # (thread tidx acquired peer tidx's flag in the barrier)
            site = peer_site(mTab, tidx, tidx, 1)  # loaded now, compared after the first reads
            tokens = peer_site(mTab, tidx, tidx, 2)
        if cutlass.const_expr(not two):
            for c in cutlass.range(first, n, stride):
                vec_at(out, 0, c, nv, dtype).store(sum_peers(ins, c, nv, dtype).to(dtype))
            check_call(mTab, rank, lb, tidx, site, tokens, T, err, W)
        else:
            lo = rank * per
            mid = mTab[pb.F_AR_MID, rank]
            for q in cutlass.range(first, slice_len(n, lo, per), stride):
                vec_at(mid, 0, lo + q, nv, dtype).store(
                    sum_peers(ins, lo + q, nv, dtype).to(dtype))
            check_call(mTab, rank, lb, tidx, site, tokens, T, err, W)
            cross_rank_barrier(mTab, pb.F_SIG, rank, lb, epoch + 1, tidx, err, max_spins,
                               Int32(8), W)
            for u in cutlass.range_constexpr(W):
                s = (rank + u) % W
                slo = s * per
                src = mTab[pb.F_AR_MID, s]
                for q in cutlass.range(first, slice_len(n, slo, per), stride):
                    vec_at(out, 0, slo + q, nv, dtype).store(
                        vec_at(src, 0, slo + q, nv, dtype).load())
        cross_rank_barrier(mTab, pb.F_SIG, rank, lb, epoch + (2 if two else 1),
                           tidx, err, max_spins, Int32(9), W)


@cute.jit
def allreduce_entry(mTab: cute.Tensor, T: Int32, epoch: Int32, rank0: Int32, skip_rank: Int32,
                    max_spins: Int32, stream: cuda.CUstream,
                    algo: Constexpr[int], hidden: Constexpr[int], K: Constexpr[int],
                    W: Constexpr[int], cpr: Constexpr[int], n_local: Constexpr[int],
                    dtype: Constexpr):
    allreduce_kernel(mTab, T, epoch, rank0, skip_rank, max_spins, algo, hidden, K, W, cpr,
                     dtype).launch(
        grid=(n_local * cpr, 1, 1), block=(THREADS, 1, 1), stream=stream, cooperative=True)


@functools.lru_cache(maxsize=None)
def compile_allreduce(algo: int, hidden: int, top_k: int, world: int, cpr: int, n_local: int,
                      dtype: str, arch: str | None = None):
    """Compiled TVM-FFI launch of algo ONESHOT or TWOSHOT, optionally | COMBINE. Call:
    f(table, T, epoch, rank0, skip_rank, max_spins) (output and combine inputs in F_ARG_* rows).

    Raises:
        ValueError: algo is not ONESHOT or TWOSHOT (| COMBINE)."""
    if algo & ~COMBINE not in (ONESHOT, TWOSHOT):
        raise ValueError(f"algo must be ONESHOT or TWOSHOT, optionally | COMBINE; got {algo}")
    return compile_tvm(
        allreduce_entry, fake_rows(Int64, world, pb.NUM_FIELDS), Int32(1), Int32(1), Int32(0),
        Int32(-1), Int32(1), fake_stream(), algo, hidden, top_k, world, cpr, n_local,
        DTYPES[dtype], arch=arch)


def pick_algo(algo: str, nbytes: int) -> str:
    """"oneshot" | "twoshot" | "auto" (one-shot up to ONESHOT_MAX_BYTES per rank)."""
    if algo not in ("auto", "oneshot", "twoshot"):
        raise ValueError(f"algo must be 'auto', 'oneshot' or 'twoshot', got {algo!r}")
    if algo == "auto":
        return "oneshot" if nbytes <= ONESHOT_MAX_BYTES else "twoshot"
    return algo


def ar_input(bufs: pb.PeerBuffers, T: int, local_rank: int = 0) -> torch.Tensor:
    """[T, H] view of a local rank's all-reduce input buffer: write partials here to skip the
    copy in all_reduce(x=None)."""
    bufs.check_tokens([T] * bufs.n_local)
    return bufs.view(pb.F_AR_IN, local_rank)[:T]


def _compiled(bufs, algo_code):
    """The compiled launch of algo_code for these buffers (compile before reserving epochs:
    a compile error then leaves the protocol state unchanged)."""
    s = bufs.spec
    return _launch_fn(algo_code, s.hidden, s.top_k, s.world_size, bufs.n_local, s.dtype)


def _launch_fn(algo_code: int, hidden: int, top_k: int, world: int, n_local: int,
               dtype: torch.dtype, arch: str | None = None):
    """compile_allreduce for `n_local` ranks of this process on the current device's SMs."""
    return compile_allreduce(algo_code, hidden, top_k, world, ctas_per_rank(n_local, True),
                             n_local, str(dtype).removeprefix("torch."), arch)


def compile_tp_combines(hidden: int, top_k: int, world: int, n_local: int, dtype: torch.dtype,
                        max_tokens: int, arch: str | None = None) -> int:
    """Compile now the tp combine all-reduce (`tp_combine_all_reduce`, algo "auto") of every
    algorithm that calls of 1..max_tokens tokens pick (`pick_algo`: one-shot up to
    ONESHOT_MAX_BYTES, two-shot above), for `n_local` ranks of this process on the current
    device (a serving warm-up: TPTopology.compile_kernels). Returns how many (0 for
    max_tokens < 1)."""
    if max_tokens < 1:
        return 0
    names = {pick_algo("auto", T * hidden * dtype.itemsize) for T in (1, max_tokens)}
    for name in names:
        _launch_fn(COMBINE | ALGOS[name], hidden, top_k, world, n_local, dtype, arch)
    return len(names)


def _launch(bufs, f, algo_code, T, out, args, sites, timeout_s, max_spins, check, skip_rank,
            what):
    """Launch f (= _compiled(bufs, algo_code)) after reserving its barrier epochs."""
    spins = wait_bounds(timeout_s, max_spins)
    bufs.set_args({pb.F_ARG_Y: [o.data_ptr() for o in out], pb.F_ARG_SITE: sites, **args})
    epoch = bufs.take_sig_epochs(SIG_EPOCHS[algo_code & 3])
    bufs.launch(f, T, epoch, bufs.rank0, skip_rank, spins)
    if check:
        bufs.check_errors(what)
    return out


def _out(bufs, T, out):
    s = bufs.spec
    shape = (bufs.n_local, T, s.hidden)
    if out is None:
        return torch.empty(shape, dtype=s.dtype, device=bufs.device)
    if (tuple(out.shape) != shape or out.dtype != s.dtype or not out.is_contiguous()
            or out.device != bufs.device):
        raise ValueError(f"out must be contiguous {s.dtype} {shape} on {bufs.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def all_reduce(bufs: pb.PeerBuffers, x: torch.Tensor | None, T: int | None = None, *,
               algo: str = "auto", out: torch.Tensor | None = None,
               sites: Sequence[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               max_spins: int | None = None, check: bool = True,
               skip_rank: int = -1) -> torch.Tensor:
    """Sum over ranks of x: out [n_local, T, H] (every local rank gets the full sum).

    Args:
        x: [n_local, T, H] partials of the local ranks (copied into the peer buffers), or None
            when they were already written into ar_input(bufs, T, i) (then pass T).
        algo: "auto" | "oneshot" | "twoshot". Others: see ep_dispatch (sites too).

    Raises:
        ValueError: T > max_tokens_per_rank (names the limit), bad shapes or sites; before
            launching. RuntimeError: inside a CUDA graph capture (PeerBuffers.refuse_capture).
        PeerTimeoutError: a peer never reached a barrier (names rank, phase, peer).
        PeerDataError: a peer's call at another site, or with another T.
    """
    s = bufs.spec
    bufs.check_usable()
    sites = pb.check_sites(sites, bufs.n_local)
    if x is not None:
        if x.dim() != 3 or x.shape[0] != bufs.n_local or x.shape[2] != s.hidden or x.dtype != s.dtype:
            raise ValueError(f"x must be {s.dtype} [{bufs.n_local}, T, {s.hidden}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        if x.device != bufs.device:
            raise ValueError(f"x must be on {bufs.device}, got {x.device}")
        T = x.shape[1]
    if T is None:
        raise ValueError("pass T when x is None")
    bufs.check_tokens([T] * bufs.n_local)
    if x is not None:
        for i in range(bufs.n_local):
            bufs.view(pb.F_AR_IN, i)[:T].copy_(x[i])
    name = pick_algo(algo, T * s.hidden * s.elem_bytes)
    out = _out(bufs, T, out)
    if T == 0:
        return out
    return _launch(bufs, _compiled(bufs, ALGOS[name]), ALGOS[name], T, out, {}, sites,
                   timeout_s, max_spins, check, skip_rank, f"all_reduce ({name})")


def tp_combine_all_reduce(bufs: pb.PeerBuffers, expert_y: Sequence[torch.Tensor],
                          token_slot: torch.Tensor, topk_weights: torch.Tensor, *,
                          algo: str = "auto", out: torch.Tensor | None = None,
                          sites: Sequence[int] | None = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S, max_spins: int | None = None,
                          check: bool = True, skip_rank: int = -1) -> torch.Tensor:
    """tp combine + all-reduce in ONE launch (COMBINE into F_AR_IN, then the one-shot or the
    two-shot): out[r] = sum over ranks of reference.combine(expert_y_r, token_slot_r,
    topk_weights) (partials rounded to the buffers' dtype, summed in fp32).

    Args:
        expert_y: n_local tensors [N_r, H] (expert-major rows of each local rank).
        token_slot: int32 [n_local, T, k] rows of expert_y per (t, j), -1 = not on that rank.
        topk_weights: fp32 [T, k] (replicated tokens: the same on every rank).
        algo: "auto" (pick_algo by T * H bytes: the same on every rank, T being replicated) |
            "oneshot" | "twoshot".
        sites: see ep_dispatch.
    Returns out [n_local, T, H].

    Raises:
        ValueError: bad shapes/dtypes/devices/sites, T > max_tokens_per_rank; before launching.
        RuntimeError: inside a CUDA graph capture (PeerBuffers.refuse_capture).
        PeerDataError: a token_slot entry >= N_r (refused on the device, nothing read with it);
            a peer's call at another site, or with another T.
        PeerTimeoutError: a peer never reached a barrier (names rank, phase, peer).
    """
    s = bufs.spec
    bufs.check_usable()
    sites = pb.check_sites(sites, bufs.n_local)
    eys = [expert_y] if isinstance(expert_y, torch.Tensor) else list(expert_y)
    T = topk_weights.shape[0]
    if (token_slot.dtype != torch.int32 or tuple(token_slot.shape) != (bufs.n_local, T, s.top_k)
            or topk_weights.dtype != torch.float32 or topk_weights.shape[1] != s.top_k):
        raise ValueError(f"token_slot must be int32 [{bufs.n_local}, T, {s.top_k}] and "
                         f"topk_weights fp32 [T, {s.top_k}]; got {token_slot.dtype} "
                         f"{tuple(token_slot.shape)}, {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if len(eys) != bufs.n_local or any(e.dim() != 2 or e.dtype != s.dtype or e.shape[1] != s.hidden
                                       or not e.is_contiguous() for e in eys):
        raise ValueError(f"expert_y: {bufs.n_local} contiguous {s.dtype} [N, {s.hidden}] tensors")
    if any(t.device != bufs.device for t in eys + [token_slot, topk_weights]):
        raise ValueError(f"expert_y, token_slot and topk_weights must be on {bufs.device}")
    bufs.check_tokens([T] * bufs.n_local)
    name = pick_algo(algo, T * s.hidden * s.elem_bytes)
    out = _out(bufs, T, out)
    if T == 0:
        return out
    code = COMBINE | ALGOS[name]
    f = _compiled(bufs, code)
    slot = token_slot.contiguous()
    w = topk_weights.contiguous()
    args = {pb.F_ARG_EY: [e.data_ptr() for e in eys], pb.F_ARG_ROWS: [e.shape[0] for e in eys],
            pb.F_ARG_SLOT: [t.data_ptr() for t in slot],
            pb.F_ARG_W: [w.data_ptr()] * bufs.n_local}
    out = _launch(bufs, f, code, T, out, args, sites, timeout_s, max_spins, check, skip_rank,
                  f"tp_combine_all_reduce ({name})")
    del slot, w  # (stream-ordered frees: safe while the kernel runs)
    return out
