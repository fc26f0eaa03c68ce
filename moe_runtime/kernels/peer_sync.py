"""Device helpers of the multi-rank kernels (ep_dispatch, ep_combine, allreduce): bounded
release/acquire waits with an error record, a rank-local grid barrier, a cross-rank per-CTA
barrier, 16-byte vector access at int64 addresses, and the compile helper.

The per-rank grid barrier runs the bit-31 barrier core of moe_runtime/sync/grid_barrier.py
(`arrive_and_wait`) over the cpr CTAs of one rank. The flag waits stay here because they differ
from the local kernels' needs in three ways the multi-rank protocol relies on: flags at *system*
scope, a wait that also stops when its rank already recorded an error (so a withheld peer costs
one timeout, not one per flag), and errors kept per rank in the peer heap (phase, peer,
expected, seen) rather than in the host-mapped flags of sync/host.py. Every wait is bounded by
a poll count (wait_bounds converts a timeout); no timer is read in device code (see
sync/grid_barrier.py for the fault a timer read caused in these kernels).

Addresses: every buffer is reached through an Int64 address (peer pointer or local), never a
cute tensor of dynamic extent, and row offsets are computed in Int64 (rows * H overflows int32
for the big expert-major buffers).
"""
from __future__ import annotations

import functools
import os

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float16, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.experimental.primitives import nanosleep

from ..comm import peer_buffers as pb
from ..sync.grid_barrier import arrive_and_wait

GMEM = cute.AddressSpace.gmem
VEC_BYTES = 16
DTYPES = {"bfloat16": BFloat16, "float16": Float16}
SLEEP_NS = 64          # back-off per poll after a miss


def vec_elems(dtype) -> int:
    """Elements per 16-byte vector (8 for bf16/fp16)."""
    return VEC_BYTES * 8 // dtype.width


# ------------------------------------------------------------------------- pointers / vectors
@cute.jit
def i32_at(addr: Int64) -> cute.Pointer:
    """Int32 gmem pointer at a raw address (peer or local)."""
    return cute.make_ptr(Int32, addr, GMEM, assumed_align=4)


@cute.jit
def vec_at(addr: Int64, row: Int32, v: Int32, nv: Constexpr[int], dtype: Constexpr):
    """16-byte vector v of row `row` of a row-major [*, nv * VEC] buffer at `addr`, as a
    (VEC,) tensor: .load() / .store() give ld/st.global.v4.b32. Offsets in Int64."""
    off = (Int64(row) * nv + Int64(v)) * VEC_BYTES
    p = cute.make_ptr(dtype, addr + off, GMEM, assumed_align=16)
    return cute.make_tensor(p, cute.make_layout(vec_elems(dtype)))


@cute.jit
def copy_row(src: Int64, src_row: Int32, dst: Int64, dst_row: Int32, tidx: Int32,
             threads: Constexpr[int], nv: Constexpr[int], dtype: Constexpr):
    """The CTA copies one row of nv vectors: all loads first (clamped index), then stores."""
    n_iter = (nv + threads - 1) // threads
    vals = []
    for i in cutlass.range_constexpr(n_iter):
        c = tidx + i * threads
        if cutlass.const_expr((i + 1) * threads > nv):
            c = c if c < nv else nv - 1
        vals.append(vec_at(src, src_row, c, nv, dtype).load())
    for i in cutlass.range_constexpr(n_iter):
        c = tidx + i * threads
        if cutlass.const_expr((i + 1) * threads <= nv):
            vec_at(dst, dst_row, c, nv, dtype).store(vals[i])
        else:
            if c < nv:
                vec_at(dst, dst_row, c, nv, dtype).store(vals[i])


@cute.jit
def block_rank(rank0: Int32, cpr: Constexpr[int]):
    """(thread, local rank index, CTA index within its rank, rank) of this thread: the CTAs of a
    launch are split among its ranks, cpr per rank, CTA b serving rank rank0 + b // cpr (one
    rank per GPU: rank0 = that rank; W virtual ranks on one GPU: rank0 = 0)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    rl = bidx // cpr
    return tidx, rl, bidx - rl * cpr, rank0 + rl


# ------------------------------------------------------------------------------ bounded waits
@cute.jit
def record_error(err: Int64, phase: Int32, peer: Int32, expected: Int32, seen: Int32):
    """Keep the first error of a rank: err[0] = phase (CAS from 0), then peer/expected/seen."""
    p = i32_at(err)
    old = cute.arch.atomic_cas(p, cmp=Int32(0), val=phase, sem="relaxed", scope="gpu")
    if old == 0:
        cute.arch.store(p + 1, peer)
        cute.arch.store(p + 2, expected)
        cute.arch.store(p + 3, seen)


@cute.jit
def wait_ge(flag: cute.Pointer, target: Int32, err: Int64, max_spins: Int32, phase: Int32,
            peer: Int32):
    """One thread waits for *flag - target >= 0 (monotonic epochs, wrap-safe, never `==`,
    which would hang on a missed epoch) with ld.acquire.sys. Gives up after max_spins polls, or at
    once when this rank already recorded an error; a timeout is recorded as (phase, peer)."""
    v = cute.arch.load(flag, Int32, sem="acquire", scope="sys")
    n = Int32(0)
    stop = False
    while v - target < 0 and not stop:
        nanosleep(SLEEP_NS)
        v = cute.arch.load(flag, Int32, sem="acquire", scope="sys")
        n = n + 1
        aborted = cute.arch.load(i32_at(err), Int32, sem="relaxed", scope="gpu") != 0
        stop = aborted | (n >= max_spins)
    if v - target < 0:
        record_error(err, phase, peer, target, v)


@cute.jit
def in_range(v: Int32, hi: Int32, err: Int64, phase: Int32, peer: Int32):
    """v in [0, hi)? If not, record (phase, peer, expected=hi, seen=v) as this rank's error, so a
    bad input or a corrupt peer value becomes a Python exception instead of an illegal address.
    Returns the (dynamic) boolean."""
    ok = (v >= 0) & (v < hi)
    if not ok:
        record_error(err, phase, peer, hi, v)
    return ok


@cute.jit
def peer_site(mTab: cute.Tensor, owner: Int32, row: Int32, col: Constexpr[int]) -> Int32:
    """F_SITE[row, col] in rank `owner`'s buffers (comm/peer_buffers.py: column 0 pushed by
    the dispatch's sources into the receiver's rows; columns 1-2, the all-reduce's site word
    and T, kept by every rank in its own row and pulled by its peers). Read after acquiring a
    flag its writer released after writing it; load it early, compare it late (`check_site`):
    its latency then hides behind other loads."""
    return cute.arch.load(i32_at(mTab[pb.F_SITE, owner]) + (row * pb.SITE_COLS + col), Int32)


@cute.jit
def check_site(mTab: cute.Tensor, rank: Int32, peer: Int32, theirs: Int32, err: Int64):
    """`peer`'s site word (peer_site) against this call's own (F_ARG_SITE); a mismatch records
    (E_OUT_OF_STEP, peer, own, peer's) and raises err[ERR_APART] to the larger topology id
    field of the two: the ranks paired calls of different layers, topologies or dispatch
    numbers (comm/peer_buffers.py, `site_word`)."""
    mine = Int32(mTab[pb.F_ARG_SITE, rank])
    if theirs != mine:
        record_error(err, Int32(pb.E_OUT_OF_STEP), peer, mine, theirs)
        top = mine if mine > theirs else theirs
        cute.arch.atomic_max(i32_at(err) + pb.ERR_APART, top >> pb.TOPOLOGY_SHIFT,
                             sem="relaxed", scope="gpu")


@cute.jit
def signal_release(flag: cute.Pointer, value: Int32, tidx: Int32):
    """After every thread's stores of this CTA (bar.sync), thread 0 publishes `value` with a
    st.release.sys (cumulative: covers the CTA's prior stores under the PTX memory model)."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.store(flag, value, sem="release", scope="sys")


@cute.jit
def rank_grid_barrier(bar_addr: Int64, lb: Int32, cpr: Constexpr[int], tidx: Int32, err: Int64,
                      max_spins: Int32, phase: Int32):
    """Barrier among the cpr CTAs of one rank (the bit-31 flip of sync/grid_barrier.py,
    self-resetting, one word per rank). Needs the CTAs co-resident (cooperative launch).
    Bounded by TWICE max_spins: a CTA held up by a peer wait (bound 1x) reports that peer first
    and the barrier waiters then stop on its error; a barrier timeout of its own records
    (phase, peer=-1) and leaves the word dirty (reset() clears it)."""
    cute.arch.sync_threads()
    if tidx == 0:
        bar = cute.make_ptr(Uint32, bar_addr, GMEM, assumed_align=4)
        cute.arch.fence_acq_rel_gpu()
        timed_out, cur = arrive_and_wait(bar, lb == 0, Uint32(cpr), max_spins * 2, err, SLEEP_NS)
        if timed_out:
            record_error(err, phase, Int32(-1), Int32(cpr), Int32(cur & Uint32(0x7FFFFFFF)))
        cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()


@cute.jit
def cross_rank_barrier(mTab: cute.Tensor, sig_field: Constexpr[int], rank: Int32, lb: Int32,
                       epoch: Int32, tidx: Int32, err: Int64, max_spins: Int32, phase: Int32,
                       W: Constexpr[int]):
    """CTA lb of every rank meets CTA lb of every other rank: thread s < W stores epoch into
    pad_s[lb, rank] (release.sys), then waits pad_rank[lb, s] >= epoch. Every rank must launch
    the same number of CTAs per rank; epochs only grow (host take_sig_epochs)."""
    cute.arch.sync_threads()
    if tidx < W:
        peer = i32_at(mTab[sig_field, tidx])
        cute.arch.store(peer + (lb * W + rank), epoch, sem="release", scope="sys")
        mine = i32_at(mTab[sig_field, rank])
        wait_ge(mine + (lb * W + tidx), epoch, err, max_spins, phase, tidx)
    cute.arch.sync_threads()


@cute.jit
def chunk_of(g: Int32, first: Int32, counts: list, chunk: Constexpr[int], W: Constexpr[int]):
    """Map a global chunk number g to (peer, chunk within peer, rows of that peer) over the
    peers first, first+1, ... (mod W): peer q contributes ceil(counts[q] / chunk) chunks.
    counts: W Int32 values (Python list, unrolled). Returns (peer, c, n, total_chunks)."""
    base = Int32(0)
    peer, c, n = Int32(0), Int32(0), Int32(0)
    for q in cutlass.range_constexpr(W):
        p = (first + q) % W
        nq = counts[0]
        for u in cutlass.range_constexpr(1, W):
            nq = counts[u] if p == u else nq
        ch = (nq + (chunk - 1)) // chunk
        hit = (g >= base) & (g < base + ch)
        peer = p if hit else peer
        c = (g - base) if hit else c
        n = nq if hit else n
        base = base + ch
    return peer, c, n, base


# ----------------------------------------------------------------------------- compilation
def fake_rows(dtype, cols, rows=None):
    """Fake row-major [rows, cols] tensor (16-B aligned); rows symbolic unless given."""
    rows = cute.sym_int() if rows is None else rows
    return make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=16)


def fake_vec(dtype, n=None):
    """Fake 1-D tensor of n elements (symbolic when None), 16-B aligned."""
    return make_fake_compact_tensor(dtype, (cute.sym_int() if n is None else n,), assumed_align=16)


def fake_stream():
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_tvm(entry, *args, arch: str | None = None):
    """cute.compile with TVM-FFI (torch tensors in, current torch stream) for `arch`
    (None: the detected GPU; CPU CI passes "sm_90a" / "sm_100a" and then also gets the PTX
    kept as `f.__ptx__` for its checks)."""
    opts = "--enable-tvm-ffi" + (f" --gpu-arch {arch} --keep-ptx" if arch else "")
    return cute.compile(entry, *args, options=opts)


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """SMs of the current CUDA device (132 on the H200); MOE_RUNTIME_SMS overrides."""
    if os.environ.get("MOE_RUNTIME_SMS"):
        return int(os.environ["MOE_RUNTIME_SMS"])
    import torch
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# ------------------------------------------------------------------------------ host helpers
DEFAULT_TIMEOUT_S = 10.0
THREADS = 256          # threads per CTA of every multi-rank kernel
MAX_SPINS = 0x3FFFFFFF  # grid barriers wait up to 2 * max_spins polls: keep that inside int32
MAX_TIMEOUT_S = 3600.0


# Assumed duration of one poll (a 64 ns nanosleep back-off + a strong .sys load): measured 384 ns
# on the H200 (probe: a withheld peer, 1e6..2e7 polls, 0.1..2 s timeouts); a lower value keeps a
# faster part from ending a wait much before timeout_s (here a wait lasts ~1.5x timeout_s).
POLL_NS = 250


def wait_bounds(timeout_s: float, max_spins: int | None) -> int:
    """The max_spins kernel argument: the poll count of every device wait. Default: timeout_s
    at one poll per POLL_NS (a wait lasts about timeout_s * measured poll / POLL_NS: ~1.5x on
    the H200), capped at MAX_SPINS polls (~270 s nominal, ~400 s there): a longer timeout_s
    is accepted but waits no longer than that. Device code reads no timer (see
    sync/grid_barrier.py), so this count is the bound.

    Raises:
        ValueError: timeout_s not in (0, MAX_TIMEOUT_S], max_spins not in [1, MAX_SPINS].
    """
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S}], got {timeout_s}")
    if max_spins is None:
        return max(1, min(MAX_SPINS, int(timeout_s * 1e9) // POLL_NS))
    if not 1 <= int(max_spins) <= MAX_SPINS:
        raise ValueError(f"max_spins must be in [1, {MAX_SPINS}], got {max_spins}")
    return int(max_spins)


@functools.lru_cache(maxsize=None)
def device_major() -> int:
    """Compute capability major of the current CUDA device (9 on the H200); 0 where none can
    be queried (the host-only tests, which fake CUDA and set MOE_RUNTIME_SMS)."""
    import torch
    try:
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0]
    except (AssertionError, RuntimeError):  # (torch without CUDA, or no device)
        return 0


WIDE_DECODE_ITEMS = 256  # (t, j) items of the busiest local rank from which decode runs 2 CTAs/SM


def cooperative_ctas_per_sm(items: int, arch_major: int) -> int:
    """CTAs per SM of a cooperative launch (its CTAs wait on each other, so all must be
    co-resident): 2 on sm_90 when the busiest local rank moves at least WIDE_DECODE_ITEMS (t, j)
    items (T * k; the decode dispatch and combine), else 1. More CTAs keep more rows in flight
    behind each row's barrier and release flag. Measured on the H200 (benchmark-style GPU time
    with launch gaps, W = 2 virtual ranks, H 7168, k 8, E 256, dispatch + combine, one / two per
    SM): T = 1 18.3 / 18.5 us, T = 8 19.1 / 20.8, T = 32 30.2 / 26.7, T = 128 99.9 / 70.9; four
    per SM are not co-resident there (cudaErrorCooperativeLaunchTooLarge). Between 2 H200s
    (one rank per GPU, benchmarks/multirank_virtual.py --real) the NVLink round trips dominate:
    T = 128 dispatch 63.6 -> 59.5 us, dispatch + combine 103.0 -> 96.7. Other architectures
    keep one per SM: co-residency depends on the kernels' register use, not measured there.
    Two per SM were run for H 7168, k 8, E 256 (W = 2 / 4 / 8 virtual, 2 real ranks); the kernels'
    registers and shared memory do not grow with H, k or E beyond the E-sized count arrays."""
    return 2 if arch_major == 9 and items >= WIDE_DECODE_ITEMS else 1


def decode_grids(n_local: int) -> list[int]:
    """Every CTAs-per-rank count a decode launch may take here (`ctas_per_rank` for few and for
    many items). ep_dispatch and ep_combine compile all of them at their first decode call, so
    that a rank whose batch grows never compiles while its peers' kernels wait for it (those
    waits are bounded by timeout_s)."""
    return sorted({ctas_per_rank(n_local, True, n) for n in (0, WIDE_DECODE_ITEMS)})


def ctas_per_rank(n_local: int, cooperative: bool, items: int = 0) -> int:
    """CTAs per rank: a cooperative launch (its CTAs wait on each other: decode dispatch and
    combine, one-/two-shot) takes cooperative_ctas_per_sm(items) CTAs per SM in all; other
    launches 4 per SM (prefill: no wait on a CTA of the same launch)."""
    sms = sm_count()
    per_sm = cooperative_ctas_per_sm(items, device_major()) if cooperative else 4
    return max(1, min(per_sm * sms // n_local, 1024))
