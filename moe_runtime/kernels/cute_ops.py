"""CuTeDSL backend of route / dispatch / combine (same signatures and semantics as reference.py).

Properties every function here keeps:
  * outputs come from torch.empty with sizes that depend on shapes only (dispatch allocates
    `dispatch_capacity(T, k, E_local, align)` rows), never on data;
  * no host synchronization and no data-dependent host branching, so calls can be captured in
    a CUDA graph (run each configuration once eagerly first: that compiles the kernel and
    creates its per-stream workspace);
  * kernels are compiled once per constexpr tuple (cute_compile.py) and launched through
    TVM-FFI on the current torch stream; the token count is dynamic (no recompile per T);
  * T == 0 (a shape fact) returns empty outputs without launching.

Hidden-size policy: rows move as 16-byte vectors, so `hidden * element_size` must be a
multiple of 16 (hidden % 8 == 0 for bf16/fp16, % 4 for fp32; true for every released MoE
model). Other sizes raise ValueError here rather than taking a slow scalar path.

Mode (dispatch, combine): "decode" for small problems, "prefill" for large ones, picked from
T * k * hidden * element_size against thresholds measured by benchmarks/local_dispatch_combine.py
(`select_dispatch_mode`, `select_combine_mode`). Dispatch decode is one barrier-free launch in
which every block derives the whole layout from the ids (kernels/dispatch_decode.py), so it
also needs T * k <= DISPATCH_DECODE_MAX_ITEMS; its layout is deterministic (token-major inside
each expert, as reference.dispatch). Prefill is a slots launch (ranks, per-expert totals) + a
copy launch (offsets from the totals, rows; kernels/dispatch_slots.py). Both dispatch
modes, the expert GEMV and combine use programmatic dependent launch (PDL): the decode
dispatch and the prefill slots launch start while the router kernel finishes, the prefill
copy loads its x rows and ids while the slots launch runs, the GEMVs and combine become
resident while the launch before them ends; each waits (griddepcontrol.wait) before it reads
what the launch before it writes.

Device errors (a bounded device-side wait that gave up, e.g. the grid-barrier test probe) are
recorded in mapped host memory and raised as moe_runtime.sync.DeviceSyncError at the start of a
later call, or by `check_errors()` (see moe_runtime/sync/host.py).
"""
from __future__ import annotations

import functools
import itertools

import torch

from ..sync.host import check_errors, device_zeros, error_flags, raise_pending, workspace
from . import cute_compile as cc, traceable_cache
from . import dispatch_slots as _dslots
from . import route_topk as _route
from .device_rows import num_segments
from .grouped_gemm import grouped_gemm, swiglu_grouped_gemm  # (quack's, for prefill rows)
from .reference import dispatch_capacity

__all__ = ["route", "dispatch", "combine", "dispatch_in_mode", "combine_in_mode", "linear_gemv",
           "select_dispatch_mode", "select_combine_mode", "check_errors", "expert_gemv",
           "compile_kernels", "route_unsupported", "rows_unsupported", "grouped_gemm",
           "swiglu_grouped_gemm"]

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Mode switch points in bytes of expert rows moved (T * k * hidden * element_size): the single
# threshold with the least total slowdown over the decode-vs-prefill sweep of
# benchmarks/local_dispatch_combine.py on an H200 (Qwen3-30B-A3B, DeepSeek-V3, Mixtral shapes).
# Dispatch (barrier-free decode, T = 1..1024): decode was faster at every point under its item
# cap (1.07-1.9x at T <= 128, 1.09-1.24x at the cap), so the bound is the largest size measured
# there, 28 MiB (DeepSeek-V3, T = 256, where it meets the item cap; the cap binds first for the
# narrower rows of Qwen3 and Mixtral). A later sweep with the one-thread-per-item slots launch
# (T = 32..8192) put the best dispatch threshold at 8 MiB, but the points between 8 and 28 MiB
# differ by at most 0.3 us either way (DeepSeek-V3 T = 128: 6.99 vs 6.67 and 6.92 vs 6.97 in two
# runs; Mixtral T = 1024: 7.69 vs 7.80), so the bound stays.
# Combine (both shapes use V = 1): the same sweep puts it at 4 MiB. Above it the two shapes are
# within 1% for Qwen3 and DeepSeek-V3 at T = 512..8192 and within 0.1 us at Qwen3 T = 256 and
# DeepSeek-V3 T = 64, 128 (DeepSeek-V3 T = 256: 6.00 against 5.74 us, the one point that lost),
# while Mixtral's 16-segment rows of only k = 2 gathers ran 3.13 / 5.71 us in the 4-warp decode
# shape against 2.64 / 4.01 in the 8-warp prefill shape at T = 512 / 1024 (2.55 / 3.87 in the
# run after the change); decode is faster below (Mixtral T = 256: 2.01 vs 2.26).
DISPATCH_DECODE_MAX_BYTES = 28 << 20
COMBINE_DECODE_MAX_BYTES = 4 << 20
# (t, j) items one decode dispatch takes (every block reads all of them)
DISPATCH_DECODE_MAX_ITEMS = cc.DISPATCH_DECODE_MAX_ITEMS
# Decode dispatch grid: at most DISPATCH_DECODE_BLOCKS_PER_SM blocks per SM (one (token,
# segment) unit per warp below that; above it warps loop over units), or one block per SM when
# T * k * E_local >= DISPATCH_DECODE_ONE_BLOCK_WORK: every block ranks all T * k ids itself, a
# cost that grows with the items and the experts, so for wide layouts fewer blocks that each
# copy more units win. H200, graph replay (bench_out diagnostic, one block per SM against four,
# us): DeepSeek-V3 T = 32 / 64 / 128 / 256: 2.43 / 3.45 / 5.80 / 9.74 against 2.52 / 3.67 /
# 6.01 / 10.60; Qwen3-30B-A3B T = 256: 4.74 against 5.08 (T = 64, 128: within 0.1); H 4096,
# E 64, k 8, T = 128 / 256: 3.94 / 6.52 against 4.26 / 7.57; H 2048, E 64, k 6, T = 256: 3.98
# against 4.23. Below the bound one block per SM lost up to 0.3 us (Mixtral T = 32..128; E 16
# and 32 with k 4 at T = 256).
DISPATCH_DECODE_BLOCKS_PER_SM = 4
DISPATCH_DECODE_ONE_BLOCK_WORK = 1 << 16


def dispatch_decode_grid(items: int, num_local_experts: int, sms: int) -> int:
    """Largest grid of the decode dispatch for `items` = T * k picks over `num_local_experts`
    experts on a GPU of `sms` SMs (the launch takes fewer blocks when the rows need fewer)."""
    if items * num_local_experts >= DISPATCH_DECODE_ONE_BLOCK_WORK:
        return sms
    return DISPATCH_DECODE_BLOCKS_PER_SM * sms

MAX_TOP_K = 32
MAX_EXPERTS = 1024
MAX_GRID_Y = 65535  # CUDA's gridDim.y limit (the GEMVs' grid rows)
_INT32_ELEMS = 2**31


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check(name: str, t, dtypes, ndim: int, device=None) -> None:
    """TypeError for a non-tensor or a dtype outside `dtypes`; ValueError for rank, device,
    contiguity or a data pointer that is not 16-byte aligned."""
    # one test of the good case (~0.35 us, most tensors pass it), then the detailed one
    if (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == ndim
            and t.is_cuda and (device is None or t.device == device)
            and t.is_contiguous() and t.data_ptr() % 16 == 0):
        return
    _check_slow(name, t, dtypes, ndim, device)


def _check_slow(name: str, t, dtypes, ndim: int, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    dev = t.device
    if dev.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {dev}")
    if device is not None and dev != device:
        raise ValueError(f"{name} is on {dev}, expected {device} (same as the first input)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.data_ptr() % 16 and t.numel():
        raise ValueError(f"{name} data pointer must be 16-byte aligned, got address "
                         f"{t.data_ptr():#x} (offset {t.data_ptr() % 16})")


def _hidden_problem(hidden: int, dtype: torch.dtype) -> str | None:
    if hidden == 0 or (hidden * dtype.itemsize) % 16:
        return (f"hidden size {hidden} x {dtype.itemsize} bytes must be a positive multiple of 16 "
                f"bytes (hidden % {16 // dtype.itemsize} == 0 for {dtype}); the kernels move rows "
                "as 16-byte vectors")
    return None


def _top_k_problem(k: int) -> str | None:
    return None if 1 <= k <= MAX_TOP_K else f"top_k must be in [1, {MAX_TOP_K}], got {k}"


def _num_local_experts_problem(n: int) -> str | None:
    return (None if 1 <= n <= MAX_EXPERTS
            else f"num_local_experts must be in [1, {MAX_EXPERTS}], got {n}")


def _route_problem(E: int, top_k: int, sigmoid: bool, n_group: int, topk_group: int) -> str | None:
    if not 1 <= E <= MAX_EXPERTS or top_k > E:
        return f"need 1 <= E <= {MAX_EXPERTS} and top_k <= E, got E={E}, top_k={top_k}"
    if sigmoid and (n_group < 1 or E % n_group or not 1 <= topk_group <= n_group):
        return (f"need E % n_group == 0 and 1 <= topk_group <= n_group, got E={E}, "
                f"n_group={n_group}, topk_group={topk_group}")
    return None


def _check_hidden(name: str, t: torch.Tensor) -> None:
    problem = _hidden_problem(t.shape[1], t.dtype)
    if problem:
        raise ValueError(f"{name} {problem}")


def _check_rows_fit(name: str, rows: int, hidden: int) -> None:
    if rows * hidden >= _INT32_ELEMS:
        raise ValueError(f"{name} has {rows} x {hidden} elements, the kernels index with int32 "
                         f"(< 2**31 elements)")


def _check_top_k(k: int) -> None:
    problem = _top_k_problem(k)
    if problem:
        raise ValueError(problem)


def _check_num_local_experts(n: int) -> None:
    problem = _num_local_experts_problem(n)
    if problem:
        raise ValueError(problem)


@traceable_cache  # (asked on every forward of an "auto" layer)
def route_unsupported(num_experts: int, top_k: int, dtype: torch.dtype, *, scoring: str,
                      n_group: int = 1, topk_group: int = 1) -> str | None:
    """Why `route` refuses logits of `dtype` over `num_experts` experts with these settings
    (one line), or None when it takes them. Backend "auto" takes the torch reference then."""
    if dtype not in _DTYPE_NAMES:
        return f"logits dtype {dtype} (the kernels take {', '.join(map(str, _DTYPE_NAMES))})"
    return _top_k_problem(top_k) or _route_problem(num_experts, top_k, scoring == "sigmoid",
                                                   n_group, topk_group)


@traceable_cache  # (asked on every forward of an "auto" layer)
def rows_unsupported(hidden: int, dtype: torch.dtype, num_local_experts: int,
                     top_k: int) -> str | None:
    """Why `dispatch` / `combine` refuse rows of `hidden` elements of `dtype` for
    `num_local_experts` experts and `top_k` picks per token (one line), or None when they take
    them (the per-call int32 size limit aside). Backend "auto" takes the torch reference then."""
    if dtype not in _DTYPE_NAMES:
        return f"rows of dtype {dtype} (the kernels take {', '.join(map(str, _DTYPE_NAMES))})"
    return (_hidden_problem(hidden, dtype) or _top_k_problem(top_k)
            or _num_local_experts_problem(num_local_experts))


# ---------------------------------------------------------------------------------- route
def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk_prob: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    with_counts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Router epilogue in one kernel (kernels/route_topk.py); semantics of reference.route.

    Args:
        logits: [T, E] bf16/fp16/fp32 CUDA, contiguous, 16-byte aligned; E <= 1024.
        top_k: k in [1, min(32, E)].
        scoring: "softmax" or "sigmoid".
        norm_topk_prob: renormalize the k weights (sigmoid: by sum + 1e-20).
        correction_bias: optional fp32-convertible [E] added to sigmoid scores for the choice.
        n_group, topk_group: group-limited selection for "sigmoid" (E % n_group == 0,
            1 <= topk_group <= n_group); ignored for "softmax", as in the reference.
        routed_scaling_factor: multiplies the final weights.
        with_counts: also count the tokens per expert (False: the kernel skips its atomics
            and cross-block step, and counts is None).

    Returns:
        topk_ids int32 [T, k] (descending score, ties to the smaller id), topk_weights fp32
        [T, k], counts int32 [E] or None.

    Raises:
        TypeError / ValueError: inputs outside the above.
    """
    _check("logits", logits, _DTYPE_NAMES, 2)
    T, E = logits.shape
    _check_top_k(top_k)
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    sigmoid = scoring == "sigmoid"
    if not sigmoid:
        n_group = topk_group = 1
    problem = _route_problem(E, top_k, sigmoid, n_group, topk_group)
    if problem:
        raise ValueError(problem)
    has_bias = sigmoid and correction_bias is not None
    dev = logits.device
    if has_bias:
        if not isinstance(correction_bias, torch.Tensor) or correction_bias.shape != (E,):
            raise ValueError(f"correction_bias must be a tensor of shape ({E},), got "
                             f"{getattr(correction_bias, 'shape', type(correction_bias).__name__)}")
        bias = correction_bias.to(device=dev, dtype=torch.float32).contiguous()
    else:
        bias = _const_zeros(dev.index, E, torch.float32)
    raise_pending()
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    if T == 0:
        return ids, weights, torch.zeros(E, dtype=torch.int32, device=dev) if with_counts else None
    counts = (torch.empty(E, dtype=torch.int32, device=dev) if with_counts
              else _const_zeros(dev.index, E, torch.int32))
    mode = "decode" if T <= cc.ROUTE_DECODE_MAX_TOKENS else "prefill"
    warps = cc.ROUTE_WARPS[mode]
    fn = cc.route_fn(_DTYPE_NAMES[logits.dtype], E, top_k, sigmoid, has_bias, n_group, topk_group,
                     bool(norm_topk_prob), bool(with_counts), warps)
    grid = min(-(-T // warps), (4 if mode == "decode" else 2) * _sm_count(dev.index))
    words = _route.workspace_words(E)  # (untouched without counts: a shared constant then)
    ws = (workspace(dev, "route", words) if with_counts
          else _const_zeros(dev.index, words, torch.int32))
    fn(logits, bias, ids, weights, counts, ws, float(routed_scaling_factor), grid)
    return ids, weights, counts if with_counts else None


@functools.lru_cache(maxsize=None)
def _const_zeros(index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached zero vector on CUDA device `index` that no kernel writes: the bias of routers
    without a correction bias, the counts and workspace of a route launch without counts
    (`device_zeros`: outside CUDA-graph memory pools)."""
    return device_zeros(n, dtype, torch.device("cuda", index))


# ------------------------------------------------------------------------------- dispatch
def select_dispatch_mode(num_tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> str:
    """"decode" when T*k <= DISPATCH_DECODE_MAX_ITEMS and T*k*hidden*element_size <=
    DISPATCH_DECODE_MAX_BYTES, else "prefill"."""
    moved = num_tokens * top_k * hidden * dtype.itemsize
    fits = num_tokens * top_k <= DISPATCH_DECODE_MAX_ITEMS
    return "decode" if moved <= DISPATCH_DECODE_MAX_BYTES and fits else "prefill"


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_start: int,
    num_local_experts: int,
    align: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute token rows into expert-major order for experts [expert_start, +E_local).

    Args and returns as reference.dispatch: x [T, H] bf16/fp16/fp32 (H * element_size a multiple
    of 16 bytes), topk_ids int32 [T, k] -> expert_x [dispatch_capacity(T, k, E_local, align), H]
    (rows past expert_offsets[-1] and padding rows unspecified), expert_offsets int32
    [E_local + 1], token_slot int32 [T, k] (-1 = expert not local). Within an expert the row
    order is unspecified (decode: token-major, as the reference). The mode comes from
    `select_dispatch_mode`.

    Raises:
        TypeError / ValueError: invalid inputs (see `_check`, the hidden-size policy, top_k <= 32,
        1 <= num_local_experts <= 1024, align >= 1, expert_start >= 0).
        moe_runtime.sync.DeviceSyncError: an earlier launch recorded a device error.
    """
    T, k = _check_dispatch(x, topk_ids, expert_start, num_local_experts, align)
    mode = select_dispatch_mode(T, k, x.shape[1], x.dtype)
    return _dispatch(x, topk_ids, expert_start, num_local_experts, align, mode)


def _check_dispatch(x, topk_ids, expert_start, num_local_experts, align) -> tuple[int, int]:
    _check("x", x, _DTYPE_NAMES, 2)
    _check("topk_ids", topk_ids, (torch.int32,), 2, x.device)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, x has {x.shape[0]}")
    _check_hidden("x", x)
    _check_top_k(topk_ids.shape[1])
    _check_num_local_experts(num_local_experts)
    if align < 1 or expert_start < 0:
        raise ValueError(f"need align >= 1 and expert_start >= 0, got align={align}, "
                         f"expert_start={expert_start}")
    T, k = topk_ids.shape
    _check_rows_fit("expert_x", dispatch_capacity(T, k, num_local_experts, align), x.shape[1])
    return T, k


def dispatch_in_mode(x: torch.Tensor, topk_ids: torch.Tensor, *, expert_start: int,
                     num_local_experts: int, align: int = 1, mode: str):
    """`dispatch` with the mode forced ("decode" or "prefill"); for tests and benchmarks.

    Raises:
        ValueError: as `dispatch`, an unknown mode, or "decode" with more than
        DISPATCH_DECODE_MAX_ITEMS (t, j) items.
    """
    T, k = _check_dispatch(x, topk_ids, expert_start, num_local_experts, align)
    if mode not in cc.MODES:
        raise ValueError(f"mode must be one of {cc.MODES}, got {mode!r}")
    if mode == "decode" and T * k > DISPATCH_DECODE_MAX_ITEMS:
        raise ValueError(f"decode dispatch takes at most {DISPATCH_DECODE_MAX_ITEMS} (t, j) "
                         f"items, got {T} x {k}; use mode='prefill'")
    return _dispatch(x, topk_ids, expert_start, num_local_experts, align, mode)


def _dispatch(x, topk_ids, expert_start: int, E: int, align: int, mode: str):
    """dispatch after validation."""
    T, k = topk_ids.shape
    H = x.shape[1]
    rows = dispatch_capacity(T, k, E, align)
    dev = x.device
    raise_pending()
    expert_x = torch.empty(rows, H, dtype=x.dtype, device=dev)
    token_slot = torch.empty(T, k, dtype=torch.int32, device=dev)
    if T == 0:
        return expert_x, torch.zeros(E + 1, dtype=torch.int32, device=dev), token_slot
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    # (every kernel compiled before any runs: the prefill slots launch leaves expert totals in
    # the workspace that only the copy launch consumes; the next slots launch clears them,
    # dispatch_slots.py)
    fns = _dispatch_kernels(_DTYPE_NAMES[x.dtype], H, E, T, k, mode)
    if mode == "decode":
        fns[0](x, topk_ids, expert_x, offsets, token_slot, expert_start, align,
               dispatch_decode_grid(T * k, E, _sm_count(dev.index)))
    else:
        slots, copy = fns
        rank = torch.empty(T, k, dtype=torch.int32, device=dev)
        ws = workspace(dev, "dispatch_slots", _dslots.workspace_words(E))
        slots(topk_ids, rank, ws, expert_start)
        try:
            copy(x, topk_ids, rank, ws, expert_x, offsets, token_slot, expert_start, align)
        except BaseException:
            ws.zero_()  # (stream-ordered after the slots launch; all zeros is a valid state)
            raise
    return expert_x, offsets, token_slot


def _dispatch_kernels(dtype: str, H: int, E: int, T: int, k: int, mode: str,
                      arch: str | None = None) -> tuple:
    """The compiled kernels a dispatch of T tokens (T >= 1) in `mode` launches, in order."""
    if mode == "decode":
        return (cc.dispatch_decode_fn(dtype, H, E, k, *cc.dispatch_decode_shape(T * k), arch),)
    return cc.dispatch_slots_fn(E, k, arch), cc.dispatch_copy_fn(dtype, H, E, k, arch)


# -------------------------------------------------------------------------------- combine
def select_combine_mode(num_tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> str:
    """"decode" when T*k*hidden*element_size <= COMBINE_DECODE_MAX_BYTES, else "prefill"."""
    moved = num_tokens * top_k * hidden * dtype.itemsize
    return "decode" if moved <= COMBINE_DECODE_MAX_BYTES else "prefill"


def combine(expert_y: torch.Tensor, token_slot: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted gather-sum back into token order: y[t] = sum_j w[t,j] * expert_y[slot[t,j]].

    Args:
        expert_y: [N, H] bf16/fp16/fp32 (H * element_size a multiple of 16 bytes).
        token_slot: int32 [T, k], entries in [-1, N) (-1 contributes nothing; not checked on
            the device: an entry >= N reads out of bounds).
        topk_weights: fp32 [T, k].

    Returns:
        y [T, H] in expert_y.dtype, accumulated in fp32 in order j = 0..k-1.

    Raises:
        TypeError / ValueError: invalid inputs.
    """
    T, k = _check_combine(expert_y, token_slot, topk_weights)
    return _combine(expert_y, token_slot, topk_weights,
                    select_combine_mode(T, k, expert_y.shape[1], expert_y.dtype))


def _check_combine(expert_y, token_slot, topk_weights) -> tuple[int, int]:
    _check("expert_y", expert_y, _DTYPE_NAMES, 2)
    _check("token_slot", token_slot, (torch.int32,), 2, expert_y.device)
    _check("topk_weights", topk_weights, (torch.float32,), 2, expert_y.device)
    if topk_weights.shape != token_slot.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != token_slot shape "
                         f"{tuple(token_slot.shape)}")
    _check_hidden("expert_y", expert_y)
    _check_top_k(token_slot.shape[1])
    _check_rows_fit("expert_y", expert_y.shape[0], expert_y.shape[1])
    _check_rows_fit("y", token_slot.shape[0], expert_y.shape[1])
    return token_slot.shape


def combine_in_mode(expert_y: torch.Tensor, token_slot: torch.Tensor, topk_weights: torch.Tensor,
                    *, mode: str) -> torch.Tensor:
    """`combine` with the grid shape forced ("decode" or "prefill"); for tests and benchmarks."""
    _check_combine(expert_y, token_slot, topk_weights)
    if mode not in cc.MODES:
        raise ValueError(f"mode must be one of {cc.MODES}, got {mode!r}")
    return _combine(expert_y, token_slot, topk_weights, mode)


def _combine(expert_y, token_slot, topk_weights, mode: str) -> torch.Tensor:
    """combine after validation."""
    T, k = token_slot.shape
    H = expert_y.shape[1]
    raise_pending()
    if T and expert_y.shape[0] == 0:  # every pick must be -1: nothing to gather
        return torch.zeros(T, H, dtype=expert_y.dtype, device=expert_y.device)
    y = torch.empty(T, H, dtype=expert_y.dtype, device=expert_y.device)
    if T:
        fn = _combine_kernel(_DTYPE_NAMES[expert_y.dtype], H, T, k, mode,
                             _sm_count(expert_y.device.index))
        fn(expert_y, token_slot, topk_weights, y)
    return y


def _combine_kernel(dtype: str, H: int, T: int, k: int, mode: str, sms: int,
                    arch: str | None = None):
    """The compiled kernel a combine of T tokens (T >= 1) in `mode` launches on `sms` SMs."""
    units = T * num_segments(H, cc.DTYPES[dtype], 1)  # the kernel's (token, segment) units
    return cc.combine_fn(dtype, H, k, *cc.combine_shape(mode, units, k, sms), arch)


# ----------------------------------------------------------------------------- warm-up
def compile_kernels(dtype: torch.dtype, hidden: int, num_local_experts: int, top_k: int,
                    max_tokens: int | None = None, *, sms: int, arch: str | None = None) -> int:
    """Compile every dispatch and combine kernel that `dispatch` / `combine` pick for calls of
    1..max_tokens tokens (None: any number) of `hidden`-wide `dtype` rows over
    `num_local_experts` experts with `top_k` picks on a GPU of `sms` SMs, so that no call
    compiles: each launch shape (the decode
    dispatch's item classes, combine's narrow and wide decode grids, the prefill launches) is a
    compile of 0.2-0.7 s on first use otherwise (H200: a decode batch of a new size class took
    0.45 s instead of 0.035). `arch=None` targets this process's GPU (the runtime case); CPU
    CI passes "sm_90a" / "sm_100a". Routing and the experts are not covered (their kernels
    do not depend on the token count beyond the two route modes a prefill and a decode step
    compile).

    Returns:
        The number of distinct compiled kernels (all cached: later calls compile nothing).

    Raises:
        TypeError / ValueError: a dtype or sizes `dispatch` would refuse; max_tokens < 0.
    """
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"dtype must be one of {[str(d) for d in _DTYPE_NAMES]}, got {dtype}")
    problem = rows_unsupported(hidden, dtype, num_local_experts, top_k)
    if problem or (max_tokens or 0) < 0:
        raise ValueError(problem or f"max_tokens must be >= 0, got {max_tokens}")
    name, compiled = _DTYPE_NAMES[dtype], set()
    tokens = itertools.count(1) if max_tokens is None else range(1, max_tokens + 1)
    for T in tokens:  # (the modes move from decode to prefill once, as T grows)
        modes = (select_dispatch_mode(T, top_k, hidden, dtype),
                 select_combine_mode(T, top_k, hidden, dtype))
        fns = (*_dispatch_kernels(name, hidden, num_local_experts, T, top_k, modes[0], arch),
               _combine_kernel(name, hidden, T, top_k, modes[1], sms, arch))
        compiled.update(map(id, fns))  # (the cached functions: ids stay valid)
        if modes == ("prefill", "prefill"):
            break  # (no shape depends on T from here on)
    return len(compiled)


# ---------------------------------------------------------------------------- expert GEMV
def expert_gemv(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor, *,
                swiglu: bool) -> torch.Tensor:
    """Per-row expert matrix-vector product over expert-major rows (decode-sized N).

    Args:
        x: [N, K] bf16/fp16/fp32 rows; row r belongs to the expert e with
            expert_offsets[e] <= r < expert_offsets[e+1].
        expert_offsets: int32 [E + 1] (as dispatch returns it).
        weight: [E, M, K] in x's dtype, HF layout (out-features first).
        swiglu: M is [gate; up] (HF gate_up_proj): out = silu(W_gate x) * (W_up x), [N, M/2];
            otherwise out = W x, [N, M].

    Returns:
        out in x.dtype; rows >= expert_offsets[E] are unspecified. fp32 accumulation.

    Each row re-reads its expert's weights, so this is for decode (a few rows per expert);
    `moe_runtime.experts.Experts` switches to the grouped GEMM above GEMV_MAX_ROWS rows.

    Raises:
        TypeError / ValueError: dtypes, shapes, devices, contiguity, 16-byte alignment of rows,
            more than MAX_GRID_Y rows.
    """
    _check("x", x, _DTYPE_NAMES, 2)
    _check("expert_offsets", expert_offsets, (torch.int32,), 1, x.device)
    _check("weight", weight, (x.dtype,), 3, x.device)
    E, M, K = weight.shape
    if x.shape[1] != K or expert_offsets.shape[0] != E + 1:
        raise ValueError(f"need x [N, {K}] and expert_offsets [{E + 1}] for weight "
                         f"{tuple(weight.shape)}, got x {tuple(x.shape)}, expert_offsets "
                         f"{tuple(expert_offsets.shape)}")
    if swiglu and M % 2:
        raise ValueError(f"swiglu needs an even number of weight rows [gate; up], got {M}")
    _check_hidden("x", x)
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"experts must be in [1, {MAX_EXPERTS}], got {E}")
    if x.shape[0] > MAX_GRID_Y:
        raise ValueError(f"the GEMV launches one block row per row of x (grid.y <= {MAX_GRID_Y}), "
                         f"got {x.shape[0]} rows; use a grouped GEMM for this many")
    out_cols = M // 2 if swiglu else M
    _check_rows_fit("out", x.shape[0], out_cols)
    raise_pending()
    out = torch.empty(x.shape[0], out_cols, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        cc.expert_gemv_fn(_DTYPE_NAMES[x.dtype], K, M, E, swiglu)(x, expert_offsets, weight, out)
    return out


def linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T for decode-sized x (a few rows), via the expert GEMV with one expert.

    Args:
        x: [T, K] bf16/fp16/fp32 CUDA rows (K * element size a multiple of 16 bytes).
        weight: [M, K] contiguous, x's dtype and device (nn.Linear layout).

    Returns:
        [T, M] in x.dtype, fp32 accumulation (as F.linear's, up to the summation order).

    Raises:
        TypeError / ValueError: as `expert_gemv`.
    """
    return expert_gemv(x, _one_expert_offsets(x.device.index), weight.unsqueeze(0), swiglu=False)


@functools.lru_cache(maxsize=None)
def _one_expert_offsets(index: int) -> torch.Tensor:
    """[0, 2**31 - 1]: every row of x belongs to expert 0 (the GEMV's rows come from x's shape,
    so one constant serves every T). Made on first use, which must be outside a CUDA-graph
    capture, as every kernel's first call here (`device_zeros`: outside CUDA-graph memory
    pools; the H2D copy allocates no device memory)."""
    offsets = device_zeros(2, torch.int32, torch.device("cuda", index))
    offsets.copy_(torch.tensor([0, 2**31 - 1], dtype=torch.int32))
    return offsets


# ---------------------------------------------------------------------------- test hook
def launch_barrier_probe(device: torch.device, grid: int, absent_block: int, rounds: int,
                         max_polls: int, ws: torch.Tensor | None = None) -> None:
    """Test hook: `rounds` grid barriers over `grid` cooperative blocks, block `absent_block`
    (-1: none) never arriving, on the barrier word ws[0] (int32 [4] on `device`; None: a new
    zeroed one; pass the same one to check its reuse across launches). Errors surface through
    check_errors() as "grid barrier probe timed out ..."."""
    if ws is None:
        ws = torch.zeros(4, dtype=torch.int32, device=device)
    cc.barrier_probe_fn()(ws, absent_block, rounds, grid, error_flags().device_addr, max_polls)
