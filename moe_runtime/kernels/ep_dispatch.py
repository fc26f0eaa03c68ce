"""dp_nvlink dispatch (the `cute` backend): all-to-all of token rows over peer pointers.

Every rank routes its own tokens; rows travel straight into the receive buffers of the ranks
that own their experts (NVLink stores, or plain stores between virtual ranks on one GPU).

Protocol of one call with epoch e (rank s sending, rank r receiving; fields: peer_buffers):
  COUNT    s acks its previous call to every source (ack_src[s] = e-1: s is done reading its
           inbox of call e-1), then takes a slot per (t, j) with atomics on cnt[expert].
  PUBLISH  (after all of s's counts) s scans its counts per destination -> staging index
           i = offset_within_dest[expert] + slot, the inverse map inv[r, i] = t*k+j, and waits
           for ack_s[r] >= e-1 before it writes cnt[r's experts] into inbox_r[s], its call's
           site word into site_r[s] and inbox_flag_r[s] = e (release.sys).
  SEND     s copies its rows in chunks of `chunk` staging rows: rows + meta (local expert, item)
           into recv_r[s, i], then chunk_flag_r[s, i // chunk] = e (release.sys): per-token
           release flags when chunk = 1, per-chunk flags otherwise. Counters are re-zeroed.
  RECV     r acquire-polls inbox_flag_r[s] >= e for every s, compares site_r[s] with its own
           call's site (a mismatch is recorded as E_OUT_OF_STEP), derives expert_offsets (per-expert
           totals padded to `align`, exclusive scan) and each (s, expert) sub-segment base, then
           acquire-polls each chunk flag and compacts the rows into expert-major order
           (F_XOUT), remembering pos[s, i] for the combine.
  Within an expert, rows are ordered by source rank, then by the source's slot order (atomics,
  so not deterministic): tests compare through the handle, as for reference.dispatch.

Modes: "decode" = ONE cooperative launch, the phases separated by a rank-local grid barrier
(CTAs of all virtual ranks co-resident: one or two per SM, peer_sync.cooperative_ctas_per_sm);
"prefill" = four launches (COUNT,
PUBLISH, SEND, RECV), the kernel boundary being the barrier, grid >> SMs allowed.
Every wait is bounded (a poll count, from timeout_s or max_spins); a timeout raises
PeerTimeoutError naming the rank, the phase and the peer waited for.

Flags never go stale: epochs grow per call and waits use a wrap-safe >=, so buffers are reused
without a memset.

Topology hook: topologies/dp_nvlink.py (the `cute` backend) creates the buffers on its first
call, or reuses those of an earlier topology with the same group and shapes
(PeerBuffers.from_process_group; topologies/distributed.py, PeerBufferTopology), and calls

    h = ep_dispatch(bufs, x, topk_ids)                  # [T, H], int32 [T, k]; one rank
    DispatchResult(h.expert_x[0][:h.rows_used[0]], h.expert_offsets[0], {"ep": h, ...})
    y = ep_combine(bufs, h, expert_y, topk_weights)     # y [T, H]
h.expert_x[0] is the full-capacity view [xout_rows, H]; the topology slices it to the rows the
dispatch used (h.rows_used, expert_offsets[-1] read on the host with the error words), so the
experts compute only those rows and expert_y needs >= rows_used rows.

Status (issue 5, H200, W in {2, 4, 8} virtual ranks): this dispatch (both modes), ep_combine
(decode: SEND + REDUCE in one launch) and the tp combine + all-reduce (one launch) equal their
torch references in tests/gpu/test_multirank_virtual_gpu.py (uneven tokens with a zero rank,
200 back-to-back calls, withheld rank -> PeerTimeoutError, out-of-range ids/slots ->
PeerDataError). The "illegal memory access" that once forced the combines into two launches was
traced to the timer read of the bounded waits (sync/grid_barrier.py): the one-launch combines
faulted at the first flag poll after a %globaltimer (or %clock64) read, with valid addresses
in every lane (core dump), and pass at W = 2/4/8 with no timer read, whatever the poll's
scope, ordering, sleep or polling lanes. Waits are bounded by poll counts. Real ranks (one
process each, PeerBuffers.from_process_group): the dp_nvlink topology's GPU test
(tests/gpu/test_topologies_cute_gpu.py) runs two processes on one GPU over CUDA IPC, and
tests/gpu/test_multi_gpu.py one process per GPU over CUDA IPC between NVLink peers (passed on
2 H200s, NV18). `benchmarks/multirank_virtual.py --real` on those 2 H200s (H 7168, k 8, E 256,
bf16, symm_mem buffers; 2026-11-30, timed calls started together by an NCCL rendezvous):
decode dispatch 28.6 us at 1 token per rank (NCCL's all_to_all_single of the same rows 12.8
us, its all_reduce of one float ~21 us in the same timing), dispatch + combine 103 us at 128
tokens per rank (decode mode; NCCL's two all_to_all_single 92 us; 96.7 us against NCCL's 96.1
with two CTAs per SM, peer_sync.cooperative_ctas_per_sm) and 1919 us at 4096 (NCCL 1605 us).
The same decode dispatch with W = 2 virtual ranks on one H200 takes 13 us at T = 1: about half
of the real-rank time is the cross-GPU flag round trips. PUBLISH and RECV scan the
counts in shared memory (device_counts.shared_exclusive_scan) instead of a serial sum per
thread (up to E_l dependent loads): W = 2 virtual, T = 1 / 8 15.0 / 16.3 -> 13.0 / 13.7 us.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Constexpr, Int32, Int64

from ..comm import peer_buffers as pb
from .device_counts import round_up, shared_exclusive_scan
from .peer_sync import (DEFAULT_TIMEOUT_S, DTYPES, THREADS, block_rank, check_site, chunk_of,
                        compile_tvm, copy_row, ctas_per_rank, decode_grids, fake_rows,
                        fake_stream, i32_at, in_range, peer_site, rank_grid_barrier, vec_elems,
                        wait_bounds, wait_ge)

PH_COUNT, PH_PUBLISH, PH_SEND, PH_RECV = 1, 2, 4, 8
PH_ALL = PH_COUNT | PH_PUBLISH | PH_SEND | PH_RECV
PREFILL_PHASES = (PH_COUNT, PH_PUBLISH, PH_SEND, PH_RECV)
DECODE_MAX_TOKENS = 128     # auto mode: decode up to this many tokens on the busiest rank
DECODE_CHUNK = 1            # per-token release flags
PREFILL_CHUNK = 4           # one flag per 4 staging rows
# error codes of refused values (peer_buffers.PHASES)
E_BAD_ID, E_OVERFLOW, E_BAD_COUNT, E_BAD_ROW = 16, 17, 18, 19


def _ld(p):
    return cute.arch.load(p, Int32)


@cute.kernel
def dispatch_kernel(mTab: cute.Tensor, epoch: Int32, S: Int32, rank0: Int32, skip_rank: Int32,
                    max_spins: Int32, phases: Constexpr[int], hidden: Constexpr[int],
                    K: Constexpr[int], W: Constexpr[int], E_l: Constexpr[int],
                    chunk: Constexpr[int], cpr: Constexpr[int], align: Constexpr[int],
                    dtype: Constexpr):
    """Phases `phases` (bit set of PH_*) of the dispatch for the ranks of this launch: CTA b
    serves rank rank0 + b // cpr. mTab int64 [NUM_FIELDS, W] is the only tensor: rank r's
    tokens x [T_r, hidden], topk_ids int32 [T_r, K] and T_r come from its F_ARG_X / F_ARG_IDS /
    F_ARG_T rows (set by the host per call)."""
    threads = THREADS
    nv = hidden // vec_elems(dtype)
    tidx, rl, lb, rank = block_rank(rank0, cpr)
    T = Int32(mTab[pb.F_ARG_T, rank])
    ids = i32_at(mTab[pb.F_ARG_IDS, rank])
    err = mTab[pb.F_ERR, rank]
    smem = cutlass.memory.SmemAllocator()
    sA = smem.allocate_tensor(Int32, cute.make_layout(W * E_l + 1), byte_alignment=16)
    sB = smem.allocate_tensor(Int32, cute.make_layout(W * E_l), byte_alignment=16)
    sC = smem.allocate_tensor(Int32, cute.make_layout(W * E_l), byte_alignment=16)
    sT = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1), byte_alignment=16)
    sN = smem.allocate_tensor(Int32, cute.make_layout(W), byte_alignment=16)
    sX = smem.allocate_tensor(Int32, cute.make_layout(W * E_l + 1), byte_alignment=16)
    sW = smem.allocate_tensor(Int32, cute.make_layout(threads // 32), byte_alignment=16)
    cnt = i32_at(mTab[pb.F_CNT, rank])
    stage = i32_at(mTab[pb.F_STAGE, rank])
    inv = i32_at(mTab[pb.F_INV, rank])
    nsend = i32_at(mTab[pb.F_NSEND, rank])
    stride = cpr * threads
    if rank != skip_rank:
        # ---------------------------------------------------------------- COUNT
        if cutlass.const_expr(phases & PH_COUNT):
            if lb == 0:
                if tidx < W:  # this rank is past call e-1: its inbox may be rewritten
                    cute.arch.store(i32_at(mTab[pb.F_ACK, tidx]) + rank, epoch - 1,
                                    sem="release", scope="sys")
            for i in cutlass.range(lb * threads + tidx, T * K, stride):
                e = _ld(ids + i)
                if in_range(e, Int32(W * E_l), err, Int32(E_BAD_ID), Int32(-1)):
                    cute.arch.store(stage + i, cute.arch.atomic_add(cnt + e, Int32(1)))
        if cutlass.const_expr((phases & PH_COUNT) and (phases & PH_PUBLISH)):
            rank_grid_barrier(mTab[pb.F_BAR, rank], lb, cpr, tidx, err, max_spins,
                              Int32(1))
        # ---------------------------------------------------------------- PUBLISH
        if cutlass.const_expr(phases & PH_PUBLISH):
            for q in cutlass.range(tidx, W * E_l, threads):
                sC[q] = _ld(cnt + q)
            cute.arch.sync_threads()
            shared_exclusive_scan(sC, sX, W * E_l, sW, threads)
            for q in cutlass.range(tidx, W * E_l, threads):  # scan within each dest segment
                sA[q] = sX[q] - sX[(q // E_l) * E_l]
            if tidx < W:
                acc = sX[tidx * E_l + E_l] - sX[tidx * E_l]
                if lb == 0:  # rows past S are refused below (E_OVERFLOW): never sent
                    cute.arch.store(nsend + tidx, acc if acc < S else S)
            cute.arch.sync_threads()
            for i in cutlass.range(lb * threads + tidx, T * K, stride):
                e = _ld(ids + i)
                if (e >= 0) & (e < W * E_l):  # (COUNT recorded E_BAD_ID)
                    si = sA[e] + _ld(stage + i)
                    if in_range(si, S, err, Int32(E_OVERFLOW), e // E_l):
                        cute.arch.store(stage + i, si)
                        cute.arch.store(inv + (e // E_l) * S + si, i)
            if lb == 0:
                if tidx < W:  # dest tidx finished reading our previous counts
                    wait_ge(i32_at(mTab[pb.F_ACK, rank]) + tidx, epoch - 1, err, max_spins,
                            Int32(2), tidx)
                cute.arch.sync_threads()
                for q in cutlass.range(tidx, W * E_l, threads):
                    r = q // E_l
                    box = i32_at(mTab[pb.F_INBOX_CNT, r])
                    cute.arch.store(box + (rank * E_l + q - r * E_l), _ld(cnt + q))
                if tidx < W:  # with the counts: this call's site (the flag's release covers it)
                    cute.arch.store(i32_at(mTab[pb.F_SITE, tidx]) + rank * pb.SITE_COLS,
                                    Int32(mTab[pb.F_ARG_SITE, rank]))
                cute.arch.sync_threads()
                if tidx < W:
                    cute.arch.store(i32_at(mTab[pb.F_INBOX_FLAG, tidx]) + rank, epoch,
                                    sem="release", scope="sys")
        if cutlass.const_expr((phases & PH_PUBLISH) and (phases & PH_SEND)):
            rank_grid_barrier(mTab[pb.F_BAR, rank], lb, cpr, tidx, err, max_spins,
                              Int32(3))
        # ---------------------------------------------------------------- SEND
        if cutlass.const_expr(phases & PH_SEND):
            for q in cutlass.range(lb * threads + tidx, W * E_l, stride):
                cute.arch.store(cnt + q, Int32(0))  # every CTA read cnt before the barrier
            counts = [_ld(nsend + q) for q in range(W)]
            _p, _c, _n, total = chunk_of(Int32(0), rank, counts, chunk, W)
            x_addr = mTab[pb.F_ARG_X, rank]
            for g in cutlass.range(lb, total, cpr):
                r, c, n, _t = chunk_of(g, rank, counts, chunk, W)
                dst = mTab[pb.F_RECV_X, r]
                meta = i32_at(mTab[pb.F_RECV_META, r])
                for q in cutlass.range_constexpr(chunk):
                    i = c * chunk + q
                    if i < n:
                        item = _ld(inv + r * S + i)
                        t = item // K
                        copy_row(x_addr, t, dst, rank * S + i, tidx, threads, nv, dtype)
                        if tidx == 0:
                            e = _ld(ids + item)
                            cute.arch.store(meta + (rank * S + i) * 2, e % E_l)
                            cute.arch.store(meta + (rank * S + i) * 2 + 1, item)
                cute.arch.sync_threads()
                if tidx == 0:
                    cute.arch.store(i32_at(mTab[pb.F_CHUNK_FLAG, r]) + (rank * S + c), epoch,
                                    sem="release", scope="sys")
        # ---------------------------------------------------------------- RECV
        if cutlass.const_expr(phases & PH_RECV):
            if tidx < W:
                wait_ge(i32_at(mTab[pb.F_INBOX_FLAG, rank]) + tidx, epoch, err, max_spins,
                        Int32(4), tidx)
            cute.arch.sync_threads()
            site = Int32(0)
            if (lb == 0) & (tidx < W):  # source tidx's site, loaded with the counts
                site = peer_site(mTab, rank, tidx, 0)
            box = i32_at(mTab[pb.F_INBOX_CNT, rank])
            for q in cutlass.range(tidx, W * E_l, threads):  # counts [source, local expert]
                sC[q] = _ld(box + q)
            cute.arch.sync_threads()
            if (lb == 0) & (tidx < W):
                check_site(mTab, rank, tidx, site, err)
            for le in cutlass.range(tidx, E_l, threads):  # padded per-expert totals
                tot = Int32(0)
                for s in cutlass.range_constexpr(W):
                    tot = tot + sC[s * E_l + le]
                sT[le] = round_up(tot, align)
            cute.arch.sync_threads()
            shared_exclusive_scan(sC, sX, W * E_l, sW, threads)  # within each source: sX - base
            shared_exclusive_scan(sT, sA, E_l, sW, threads)  # sA[0:E_l+1] = expert offsets
            offs = i32_at(mTab[pb.F_OFFS, rank])
            if lb == 0:
                for le in cutlass.range(tidx, E_l + 1, threads):
                    cute.arch.store(offs + le, sA[le])
            if tidx < W:
                acc = sX[tidx * E_l + E_l] - sX[tidx * E_l]
                sN[tidx] = acc if in_range(acc, S + 1, err, Int32(E_BAD_COUNT), tidx) else 0
                if lb == 0:
                    cute.arch.store(i32_at(mTab[pb.F_NRECV, rank]) + tidx, sN[tidx])
            for q in cutlass.range(tidx, W * E_l, threads):  # (source, expert) sub-segments
                s = q // E_l
                le = q - s * E_l
                within = Int32(0)
                for u in cutlass.range(0, s, 1):
                    within = within + sC[u * E_l + le]
                # row = sB[s, le] + staging index i (i counts from the start of source s)
                sB[q] = sA[le] + within - (sX[q] - sX[s * E_l])
            cute.arch.sync_threads()
            counts = [sN[q] for q in range(W)]
            _p, _c, _n, total = chunk_of(Int32(0), rank, counts, chunk, W)
            recv = mTab[pb.F_RECV_X, rank]
            xout = mTab[pb.F_XOUT, rank]
            meta = i32_at(mTab[pb.F_RECV_META, rank])
            pos = i32_at(mTab[pb.F_POS, rank])
            cflag = i32_at(mTab[pb.F_CHUNK_FLAG, rank])
            xcap = W * S + E_l * (align - 1)  # rows of F_XOUT
            for g in cutlass.range(lb, total, cpr):
                s, c, n, _t = chunk_of(g, rank, counts, chunk, W)
                if tidx == 0:
                    wait_ge(cflag + (s * S + c), epoch, err, max_spins, Int32(5), s)
                cute.arch.sync_threads()
                ok = cute.arch.load(i32_at(err), Int32, sem="relaxed", scope="gpu") == 0
                for q in cutlass.range_constexpr(chunk):
                    i = c * chunk + q
                    if ok & (i < n):
                        row = s * S + i
                        le = _ld(meta + row * 2)
                        if in_range(le, Int32(E_l), err, Int32(E_BAD_ROW), s):
                            p = sB[s * E_l + le] + i
                            if in_range(p, xcap, err, Int32(E_BAD_ROW), s):
                                copy_row(recv, row, xout, p, tidx, threads, nv, dtype)
                                if tidx == 0:
                                    cute.arch.store(pos + row, p)


@cute.jit
def dispatch_entry(mTab: cute.Tensor, epoch: Int32, S: Int32, rank0: Int32, skip_rank: Int32,
                   max_spins: Int32, stream: cuda.CUstream,
                   phases: Constexpr[int],
                   hidden: Constexpr[int], K: Constexpr[int], W: Constexpr[int],
                   E_l: Constexpr[int], chunk: Constexpr[int], cpr: Constexpr[int],
                   n_local: Constexpr[int], align: Constexpr[int], dtype: Constexpr):
    dispatch_kernel(mTab, epoch, S, rank0, skip_rank, max_spins,
                    phases, hidden, K, W, E_l, chunk, cpr, align, dtype).launch(
        grid=(n_local * cpr, 1, 1), block=(THREADS, 1, 1), stream=stream,
        cooperative=phases == PH_ALL)


@functools.lru_cache(maxsize=None)
def compile_dispatch(phases: int, hidden: int, top_k: int, world: int, local_experts: int,
                     chunk: int, cpr: int, n_local: int, align: int, dtype: str,
                     arch: str | None = None):
    """Compiled TVM-FFI dispatch for one configuration (phases PH_ALL = decode, one PH_* =
    one prefill launch). Call: f(table, epoch, S, rank0, skip_rank, max_spins) on
    the current torch stream (the table's F_ARG_* rows hold the per-call inputs)."""
    return compile_tvm(
        dispatch_entry, fake_rows(Int64, world, pb.NUM_FIELDS), Int32(1), Int32(1), Int32(0),
        Int32(-1), Int32(1), fake_stream(), phases, hidden, top_k, world,
        local_experts, chunk, cpr, n_local, align, DTYPES[dtype], arch=arch)


# ------------------------------------------------------------------------------------- host
@dataclass
class EPDispatchHandle:
    """What ep_combine needs, plus the outputs of the dispatch.

    Attributes:
        epoch: the call's epoch (combine must use the newest dispatch's handle).
        tokens: tokens per local rank.
        topk_ids: int32 [sum T, k] (the dispatch's, kept alive for the combine, which reads it).
        x: the dispatched rows (kept alive until the kernels that read them have run).
        mode, chunk: how the rows were moved (combine reuses chunk: its flags mirror it).
        expert_x: per local rank, [xout_rows, H] rows in expert-major order (views into the
            peer buffers: valid until the next dispatch).
        expert_offsets: per local rank, int32 [E_local + 1] (views, same lifetime).
        rows_used: per local rank, expert_offsets[-1] read on the host with the error words
            (None with check=False): the rows the experts must compute and expert_y must hold.
    """

    epoch: int
    tokens: list[int]
    topk_ids: torch.Tensor = field(repr=False)
    x: torch.Tensor = field(repr=False)
    mode: str
    chunk: int
    expert_x: list[torch.Tensor] = field(repr=False)
    expert_offsets: list[torch.Tensor] = field(repr=False)
    rows_used: list[int] | None = None


def row_addrs(t: torch.Tensor, tokens: Sequence[int]) -> list[int]:
    """Address of each local rank's first row of a row-major [sum T_r, ...] tensor."""
    row = t.stride(0) * t.element_size()
    starts = [0]
    for n in tokens[:-1]:
        starts.append(starts[-1] + n)
    return [t.data_ptr() + s * row for s in starts]


def pick_mode(mode: str, max_tokens: int) -> str:
    """"decode" | "prefill" | "auto" (decode up to DECODE_MAX_TOKENS tokens per rank).

    Every rank of a call must use the same mode: the chunk of the release flags (decode 1,
    prefill PREFILL_CHUNK) is part of the protocol between sender and receiver. ep_dispatch
    therefore passes the busiest virtual rank's T (one launch serves all of them) or, for a
    real rank, which cannot see its peers' T, the buffers' max_tokens_per_rank."""
    if mode not in ("auto", "decode", "prefill"):
        raise ValueError(f"mode must be 'auto', 'decode' or 'prefill', got {mode!r}")
    if mode == "auto":
        return "decode" if max_tokens <= DECODE_MAX_TOKENS else "prefill"
    return mode


def check_inputs(bufs: pb.PeerBuffers, x: torch.Tensor, topk_ids: torch.Tensor,
                 tokens_per_rank: Sequence[int] | None) -> list[int]:
    """Validate shapes/dtypes/limits on the host before any launch; returns tokens per rank.

    Raises:
        ValueError: token counts over max_tokens_per_rank (names the limit), shape mismatches.
        TypeError: wrong dtypes.
    """
    s = bufs.spec
    bufs.check_usable()
    if not s.all_to_all:
        raise ValueError("these peer buffers hold the all-reduce fields only "
                         "(PeerSpec.all_to_all=False); ep_dispatch needs all_to_all=True")
    tokens = [x.shape[0]] if tokens_per_rank is None else [int(t) for t in tokens_per_rank]
    bufs.check_tokens(tokens)
    if x.dim() != 2 or x.shape[1] != s.hidden or x.shape[0] != sum(tokens):
        raise ValueError(f"x must be [sum(tokens)={sum(tokens)}, H={s.hidden}], got {tuple(x.shape)}")
    if x.dtype != s.dtype:
        raise TypeError(f"x must be {s.dtype} (the buffers' dtype), got {x.dtype}")
    if topk_ids.dtype != torch.int32 or tuple(topk_ids.shape) != (x.shape[0], s.top_k):
        raise ValueError(f"topk_ids must be int32 [{x.shape[0]}, {s.top_k}], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if x.device != bufs.device or topk_ids.device != bufs.device:
        raise ValueError(f"inputs must be on {bufs.device}")
    return tokens


def ep_dispatch(bufs: pb.PeerBuffers, x: torch.Tensor, topk_ids: torch.Tensor,
                tokens_per_rank: Sequence[int] | None = None, *, mode: str = "auto",
                sites: Sequence[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, max_spins: int | None = None,
                check: bool = True, skip_rank: int = -1) -> EPDispatchHandle:
    """dp_nvlink dispatch of the local rank(s) of `bufs`.

    Args:
        bufs: PeerBuffers (virtual: all W ranks here; real: this rank only).
        x: [sum T_r, H] tokens of the local ranks, concatenated in rank order (real mode: [T, H]).
        topk_ids: int32 [sum T_r, k] global expert ids (distinct within a token, in [0, E)).
        tokens_per_rank: T_r per local rank (default [x.shape[0]]); each <= max_tokens_per_rank.
        mode: "auto" | "decode" (one cooperative launch) | "prefill" (four launches); auto
            decides from the busiest virtual rank's T, or for a real rank (n_local = 1) from
            max_tokens_per_rank, so that every rank picks the same (see pick_mode).
        sites: per local rank, the int32 site word of its call (peer_buffers.site_word; default
            0): each receiver compares every source's with its own and records E_OUT_OF_STEP
            on a mismatch, so ranks that paired calls of different layers raise.
        timeout_s, max_spins: bound of every device wait: max_spins polls, or by default
            timeout_s at one poll per peer_sync.POLL_NS (~1.5x timeout_s on the H200).
        check: read the error words after the launch (host sync) and raise PeerTimeoutError;
            then also read each local rank's row count (handle.rows_used). False: no host
            sync here; call bufs.check_errors() later. (No call of the multi-rank kernels may
            be captured in a CUDA graph: PeerBuffers.refuse_capture.)
        skip_rank: test hook: the CTAs of this (virtual) rank do nothing (a withheld rank).

    Returns:
        EPDispatchHandle (expert_x / expert_offsets views per local rank).

    Raises:
        ValueError / TypeError: bad inputs or sites, before anything is launched.
        RuntimeError: inside a CUDA graph capture, before anything is launched.
        PeerDataError (check=True): a topk_ids entry outside [0, E), or more rows for one
            destination than the buffers hold (repeated ids in a token); refused on the device.
            A source's call at another site (the outputs are then wrong).
        PeerTimeoutError: a wait timed out (names rank, phase and peer); bufs need reset().
    """
    s = bufs.spec
    tokens = check_inputs(bufs, x, topk_ids, tokens_per_rank)
    sites = pb.check_sites(sites, bufs.n_local)
    mode = pick_mode(mode, max(tokens) if bufs.n_local == s.world_size else s.max_tokens_per_rank)
    chunk = DECODE_CHUNK if mode == "decode" else PREFILL_CHUNK
    spins = wait_bounds(timeout_s, max_spins)
    dname = str(s.dtype).removeprefix("torch.")
    cpr = ctas_per_rank(bufs.n_local, mode == "decode", max(tokens) * s.top_k)
    # every launch compiled before the epoch advances: a compile error changes no protocol
    # state; in decode mode both grids (decode_grids), so a later, larger batch compiles nothing
    grids = decode_grids(bufs.n_local) if mode == "decode" else [cpr]
    compiled = {c: [compile_dispatch(ph, s.hidden, s.top_k, s.world_size, s.num_local_experts,
                                     chunk, c, bufs.n_local, s.align, dname)
                    for ph in ((PH_ALL,) if mode == "decode" else PREFILL_PHASES)]
                for c in grids}
    launches = compiled[cpr]
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    bufs.set_args({pb.F_ARG_X: row_addrs(x, tokens), pb.F_ARG_IDS: row_addrs(topk_ids, tokens),
                   pb.F_ARG_T: tokens, pb.F_ARG_SITE: sites})
    epoch = bufs.next_epoch()
    for f in launches:
        bufs.launch(f, epoch, s.stage_rows, bufs.rank0, skip_rank, spins)
    handle = EPDispatchHandle(epoch, tokens, topk_ids, x, mode, chunk,
                              [bufs.expert_x(i) for i in range(bufs.n_local)],
                              [bufs.expert_offsets(i) for i in range(bufs.n_local)])
    bufs._last_dispatch = epoch
    if check:
        handle.rows_used = bufs.check_errors(f"ep_dispatch ({mode}, epoch {epoch})",
                                             also=[o[-1] for o in handle.expert_offsets])
    return handle
