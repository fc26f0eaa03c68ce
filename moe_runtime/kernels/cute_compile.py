"""Compile cache of the CuTeDSL kernels: one compiled TVM-FFI function per constexpr tuple.

Every getter compiles from fake tensors (no GPU, no torch needed), with the token count a
`cute.sym_int()` so one binary serves every T, and caches the result in memory keyed by
(constexpr tuple, arch). `arch=None` targets the GPU the DSL detects (the runtime case);
CPU CI passes "sm_90a" / "sm_100a". The compiled functions take torch tensors directly
(`--enable-tvm-ffi`), run on the tensors' current torch stream, and check dtypes, static
extents, 16-byte alignment and the shared token dimension at call time.

Launch shapes per mode (warps per block, V = 16-byte vectors per lane per row segment):
    route             ROUTE_WARPS[mode], mode "decode" up to ROUTE_DECODE_MAX_TOKENS tokens
    dispatch decode   one launch, no grid barrier (T * k <= DISPATCH_DECODE_MAX_ITEMS),
                      warps and item cap by T * k (DISPATCH_DECODE_SHAPES), V = DISPATCH_DECODE_V,
                      grid <= one or a few blocks per SM (cute_ops.dispatch_decode_grid)
    dispatch prefill  slots launch (DISPATCH_SLOTS_WARPS) + copy launch (DISPATCH_COPY_WARPS,
                      V = dispatch_copy_v(top_k))
    combine           combine_shape(mode, units, top_k, sms)
The copy and combine getters also take (warps, v) so benchmarks/local_dispatch_combine.py
--tune can time other launch shapes. On the H200 the prefill copy (it runs at the HBM write
rate: it writes k bytes per byte read) was best with V = 4 or 8 at k = 8 (V = 2 up to 9%
slower) and with V = 2 at k = 2 (DISPATCH_COPY_SMALL_K); combine was best with V = 1.
"""
from __future__ import annotations

import functools

import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..sync import grid_barrier as _gb
from ..sync.host import SITE_BARRIER_PROBE
from . import combine as _combine
from . import dispatch_copy as _dcopy
from . import dispatch_decode as _ddec
from . import dispatch_slots as _dslots
from . import expert_gemv as _gemv
from . import route_topk as _route

DTYPES = {"bfloat16": BFloat16, "float16": Float16, "float32": Float32}
MODES = ("decode", "prefill")

# routing: one warp per token; few tokens spread over many small blocks, many tokens over
# fewer large ones. H200, routers of Qwen3 / DeepSeek-V3 / Mixtral without counts
# (benchmarks/local_dispatch_combine.py --tune, two runs): 4 warps 0.1-1.3 us faster than 16
# from T = 128 to 1024 (equal at T = 1); at T = 4096 16 warps 7.4-8.0 us against 8.6-13.9
# for DeepSeek-V3 and 2.7 against 3.2 for Mixtral, Qwen3 5.6-6.9 against 6.2-6.3 (mixed).
ROUTE_WARPS = {"decode": 4, "prefill": 16}
ROUTE_DECODE_MAX_TOKENS = 1024
DISPATCH_DECODE_V = 1
# The decode dispatch: every block reads all T * k ids, ranks them in chunks of 32 per warp
# and keeps a slot per item in shared memory; each block shape is compiled for its row's item
# cap, and every chunk past the items still costs (its ids are loaded, its branch unrolled).
# Rows are (warps, largest T * k); the first row that fits is used. H200, graph replay:
#   * 2 warps at T * k <= 64: 1.7-2.2 us against 2.0-2.7 with 8 (an 8-chunks-per-warp cap
#     took the T = 1 dispatch to 1.98 / 1.95 / 1.67 us for Qwen3 / DeepSeek-V3 / Mixtral);
#   * caps of exactly the items (--tune times every row that holds T * k): DeepSeek-V3 T = 128
#     6.15 us at cap 1024 against 7.05 at cap 2048, Qwen3 T = 128 3.03 against 3.34, Mixtral
#     T = 64 1.72 at (4 warps, cap 128) against 1.91 at cap 512; with caps that fit, 8 warps
#     beat 4 at 512 items (Qwen3 2.28 against 2.45, DeepSeek-V3 3.77 against 4.00) and tie at
#     256 (Mixtral T = 128 2.04 / 2.08); 4 warps win at 128 (Mixtral T = 64 1.72 / 1.83);
#   * 16 warps (cap 2048) were no better than 8 at T * k in (512, 2048]: -0.4 to +1.6 us.
# The whole dispatch with this table against (2, 64), (4, 512 for E <= 128), (8, 2048):
# DeepSeek-V3 T = 64 / 128 3.99 / 6.89 -> 3.69 / 6.05 us, Qwen3 T = 128 3.32 -> 3.02, Mixtral
# T = 64 / 128 1.80 / 2.25 -> 1.67 / 2.06 (local_dispatch_combine.py, graph replay).
DISPATCH_DECODE_SHAPES = ((2, 64), (4, 128), (8, 256), (8, 512), (8, 1024), (8, 2048))
DISPATCH_DECODE_MAX_ITEMS = DISPATCH_DECODE_SHAPES[-1][1]
# prefill slots launch (one thread per item): at T = 4096 and 16384 (H200, --tune, when it
# still looped over items on at most 2 blocks per SM) 16 warps per block took 3.8-4.6 us
# against 4.1-4.9 with 8 for the k = 8 shapes (Qwen3, DeepSeek-V3; 4.2 vs 5.0 for DeepSeek-V3
# at 4096), 3.3-3.5 against 3.1-3.4 for Mixtral (k = 2). One thread per item (ranks kept in
# registers, written once) and PDL brought the whole prefill dispatch to within 2.1-2.6 us of
# its copy launch alone (was 3.2-3.7): Qwen3 T = 4096 41.4 -> 40.2 us. Moving the offset scan
# from the slots launch's last block into the copy launch (dispatch_copy.py) left 0.2-2 us:
# Qwen3 T = 4096 40.1 -> 39.4 us, Mixtral 31.3 -> 27.6, DeepSeek-V3 146.1 -> 144.3 (one run)
DISPATCH_SLOTS_WARPS = 16
# prefill copy launch: 4 warps per block; V = 4 (2 KiB row segments for 16-bit rows), or
# DISPATCH_COPY_SMALL_K_V = 2 for top_k <= DISPATCH_COPY_SMALL_K. H200, the whole prefill
# dispatch (slots + copy, best of two in one process, graph replay): Mixtral (k = 2) T = 4096 /
# 16384 with V = 2 26.63 / 103.87 us (0.887 / 0.910 of copy bandwidth) against 27.00 / 105.46
# (0.875 / 0.896) with V = 4; its copy launch alone in two earlier --tune runs 28.72 / 105.76
# against 29.10 / 107.56 and 27.30 / 104.33 against 27.53 / 104.77. For k = 8, V = 2 lost:
# Qwen3-30B-A3B T = 4096 / 16384 41.60 / 166.16 against 39.02 / 164.61, DeepSeek-V3 within
# 0.3%; V = 1 lost or tied everywhere, 8 warps per block too (bench_out diagnostic copy_v).
# local_dispatch_combine.py with V = 2 on a later machine start (copy 4.25 TB/s): Mixtral
# T = 4096 / 16384 27.28 / 105.62-105.69 us (0.87 / 0.897-0.899) against 27.14 / 105.93 (0.87 /
# 0.888, copy 4.28 TB/s) with V = 4 earlier that day: a small gain, within run-to-run spread.
DISPATCH_COPY_WARPS = 4
DISPATCH_COPY_V = 4
DISPATCH_COPY_SMALL_K = 2
DISPATCH_COPY_SMALL_K_V = 2
COMBINE_WARPS = {"decode": 4, "prefill": 8}
COMBINE_NARROW_MIN_K = 4
COMBINE_NARROW_UNITS_PER_SM = 2

# the source files whose text decides the generated code (tests hash them for their cache)
KERNEL_MODULES = (_gb, _combine, _dcopy, _ddec, _dslots, _gemv, _route)


def combine_shape(mode: str, units: int = 0, top_k: int = 0, sms: int = 0) -> tuple[int, int]:
    """(warps per block, V) of combine for `units` = T * row segments (512-byte segments at
    V = 1), top_k picks per token and `sms` SMs. V = 1 in both modes: with all top_k gathers of
    a segment in flight, V = 1 measured best at every size on the H200 (`--tune`: 0.94-1.02 of
    copy bandwidth at T >= 4096 vs 0.86-1.01 for V = 2, 4). Decode uses 4 warps per block so a
    few tokens still spread over many SMs, and ONE warp per block while the units fit in
    COMBINE_NARROW_UNITS_PER_SM per SM and top_k >= COMBINE_NARROW_MIN_K: each SM then
    gathers the top_k rows of one warp instead of four. H200 (graph replay, µs, one warp
    against four): Qwen3-30B-A3B T = 1 / 8 1.27 / 1.34 against 1.54 / 1.60, DeepSeek-V3 1.38 /
    1.45 against 1.59 / 1.66; Mixtral (k = 2) 1.12 / 1.23 against 1.07 / 1.17; at T = 64 four
    warps win (Qwen3 1.75 against 1.84, DeepSeek-V3 2.40 against 2.65). The bound (Qwen3 T <= 33,
    DeepSeek-V3 T <= 18 on 132 SMs) lies between those measured points. Prefill uses 8."""
    if (mode == "decode" and top_k >= COMBINE_NARROW_MIN_K
            and 0 < units <= COMBINE_NARROW_UNITS_PER_SM * sms):
        return 1, 1
    return COMBINE_WARPS[mode], 1


def _options(arch: str | None) -> str:
    return "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")


def _rows(dtype, cols: int, rows=None):
    """Fake row-major [rows, cols] tensor, 16-byte aligned; rows symbolic unless given."""
    rows = cute.sym_int() if rows is None else rows
    return make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=16)


def _vec(dtype, n: int):
    return make_fake_compact_tensor(dtype, (n,), assumed_align=16)


def _stream():
    return make_fake_stream(use_tvm_ffi_env_stream=True)


@functools.lru_cache(maxsize=None)
def route_fn(dtype: str, E: int, K: int, sigmoid: bool, has_bias: bool, n_group: int,
             topk_group: int, norm: bool, counts: bool = True, warps: int = ROUTE_WARPS["decode"],
             arch: str | None = None):
    """fn(logits [T,E], bias fp32 [E], ids [T,K], weights [T,K], counts [E], ws, scale, grid);
    counts is written only when `counts`; warps: ROUTE_WARPS[mode]."""
    T = cute.sym_int()
    return cute.compile(
        _route.route_topk, _rows(DTYPES[dtype], E, T), _vec(Float32, E), _rows(Int32, K, T),
        _rows(Float32, K, T), _vec(Int32, E), _vec(Int32, _route.workspace_words(E)),
        Float32(1.0), Int32(1), _stream(), E, K, sigmoid, has_bias, n_group, topk_group, norm,
        counts, warps, options=_options(arch))


def dispatch_decode_shape(items: int) -> tuple[int, int]:
    """(warps per block, item cap) of the decode dispatch for T * k = items: the first
    DISPATCH_DECODE_SHAPES row that holds them.

    Raises:
        ValueError: items above DISPATCH_DECODE_MAX_ITEMS.
    """
    for warps, cap in DISPATCH_DECODE_SHAPES:
        if items <= cap:
            return warps, cap
    raise ValueError(f"the decode dispatch takes at most {DISPATCH_DECODE_MAX_ITEMS} (t, j) "
                     f"items, got {items}")


@functools.lru_cache(maxsize=None)
def dispatch_decode_fn(dtype: str, H: int, E: int, K: int, warps: int, cap: int,
                       arch: str | None = None):
    """fn(x, ids, out, offsets, slot, expert_start, align, max_grid) for T * K <= cap items,
    (warps, cap) a DISPATCH_DECODE_SHAPES row (cap a whole number of 32-item chunks per warp).

    Raises:
        ValueError: cap not a multiple of warps * 32.
    """
    if cap % (warps * 32):
        raise ValueError(f"item cap {cap} is not whole 32-item chunks for {warps} warps")
    dt, T = DTYPES[dtype], cute.sym_int()
    return cute.compile(
        _ddec.dispatch_decode, _rows(dt, H, T), _rows(Int32, K, T), _rows(dt, H),
        _vec(Int32, E + 1), _rows(Int32, K, T), Int32(0), Int32(1), Int32(1), _stream(),
        H, E, K, warps, DISPATCH_DECODE_V, cap, options=_options(arch))


@functools.lru_cache(maxsize=None)
def dispatch_slots_fn(E: int, K: int, arch: str | None = None, warps: int = DISPATCH_SLOTS_WARPS):
    """fn(ids, rank, ws, expert_start); T >= 1."""
    T = cute.sym_int()
    return cute.compile(
        _dslots.dispatch_slots, _rows(Int32, K, T), _rows(Int32, K, T),
        _vec(Int32, _dslots.workspace_words(E)), Int32(0), _stream(), E, K, warps,
        options=_options(arch))


def dispatch_copy_v(top_k: int) -> int:
    """V (16-byte vectors per lane per row segment) of the prefill copy launch for top_k."""
    return DISPATCH_COPY_SMALL_K_V if top_k <= DISPATCH_COPY_SMALL_K else DISPATCH_COPY_V


@functools.lru_cache(maxsize=None)
def dispatch_copy_fn(dtype: str, H: int, E: int, K: int, arch: str | None = None,
                     warps: int = DISPATCH_COPY_WARPS, v: int | None = None):
    """fn(x, ids, rank, ws, out, offsets, slot, expert_start, align); v None: dispatch_copy_v(K)."""
    v = dispatch_copy_v(K) if v is None else v
    dt, T = DTYPES[dtype], cute.sym_int()
    return cute.compile(
        _dcopy.dispatch_copy, _rows(dt, H, T), _rows(Int32, K, T), _rows(Int32, K, T),
        _vec(Int32, _dslots.workspace_words(E)), _rows(dt, H), _vec(Int32, E + 1),
        _rows(Int32, K, T), Int32(0), Int32(1), _stream(), H, E, K, warps, v,
        options=_options(arch))


@functools.lru_cache(maxsize=None)
def combine_fn(dtype: str, H: int, K: int, warps: int, v: int, arch: str | None = None):
    """fn(expert_y [N,H], slot [T,K], weights [T,K], out [T,H]); (warps, v) = combine_shape()."""
    dt, T = DTYPES[dtype], cute.sym_int()
    return cute.compile(
        _combine.combine, _rows(dt, H), _rows(Int32, K, T), _rows(Float32, K, T), _rows(dt, H, T),
        _stream(), H, K, warps, v, options=_options(arch))


# expert GEMV launch shape: output rows per warp, warps per block, 16-byte vectors per lane in
# flight per chunk (SwiGLU reads two weight rows per output row, so fewer rows per warp).
GEMV_WARPS = 4
GEMV_CH = 4


def gemv_rows(swiglu: bool) -> int:
    return 2 if swiglu else 4


@functools.lru_cache(maxsize=None)
def expert_gemv_fn(dtype: str, K: int, M: int, E: int, swiglu: bool, arch: str | None = None):
    """fn(x [N,K], offsets int32 [E+1], w [E,M,K], out [N, M/2 if swiglu else M])."""
    dt = DTYPES[dtype]
    N = cute.sym_int()
    w = make_fake_compact_tensor(dt, (E, M, K), stride_order=(2, 1, 0), assumed_align=16)
    return cute.compile(
        _gemv.expert_gemv, _rows(dt, K, N), _vec(Int32, E + 1), w,
        _rows(dt, M // 2 if swiglu else M, N), _stream(), K, M, E, swiglu, gemv_rows(swiglu),
        GEMV_WARPS, GEMV_CH, options=_options(arch))


@functools.lru_cache(maxsize=None)
def barrier_probe_fn(arch: str | None = None):
    """fn(ws int32 [4], absent_block, rounds, grid, err_addr, max_iters)."""
    return cute.compile(
        _gb.barrier_probe, _vec(Int32, 4), Int32(-1), Int32(1), Int32(1), Int64(0), Int32(1),
        _stream(), SITE_BARRIER_PROBE, options=_options(arch))
