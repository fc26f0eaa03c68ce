"""Grouped expert GEMMs for prefill-sized rows on Hopper/Blackwell through quack (Dao-AILab/quack).

quack's varlen-M GEMM takes the expert segment starts as `cu_seqlens_m` (device int32, no host
read) and fuses SwiGLU into the gate/up GEMM's epilogue, so the [N, 2I] gate/up activations are
never written: against torch._grouped_mm + silu(gate) * up on the H200 (bf16, random routing,
benchmarks/grouped_gemm.py, one 128x192 tile for both GEMMs) the two GEMMs took 646 µs instead
of 884 µs for Qwen3-30B-A3B at T=4096, 308 instead of 437 µs at T=256, 8.7 instead of 10.3 ms
for DeepSeek-V3 at T=4096 and 4.3 instead of 5.2 ms for Mixtral at T=4096; the per-GEMM tiles
below (`tile_config`) bring DeepSeek-V3 at T=4096 to 4.8 + 2.4 ms (GEMMs timed alone).

Layouts are HF transformers' fused expert weights (experts.py): gate_up_proj [E, 2I, H] with the
gate rows first, down_proj [E, H, I], both K-major B operands (no copy): down_proj enters quack
as its (k, n) view [E, I, H], gate_up_proj as stored, with `concat_layout=("B",)`, which tells
quack's gated epilogue that B's N dimension holds [gate; up] rather than interleaved pairs.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import _log_once

# Tile configurations (tile_m, tile_n, pingpong, cluster_m, cluster_n; static persistent
# schedule; the cluster pair shares A tiles by multicast), picked per GEMM from the rows each
# expert is expected to get, r = rows / E (host-side, no sync). Every expert's rows are
# computed in whole M tiles, so r decides the padding: at r ~ 128 (DeepSeek-V3, T = 4096) a
# 128-row tile needs two tiles for the half of the experts above 128 rows while one 192-row
# tile holds nearly all of them (P(rows > 192) ~ 0 for binomial routing), and the weights of
# most experts are read once. Measured with `benchmarks/grouped_gemm.py --sweep` on the H200
# (bf16, random routing; 8 configurations x Qwen3-30B-A3B / DeepSeek-V3 / Mixtral x T = 256,
# 1024, 4096, 16384, i.e. r = 8 .. 4096):
#   * r in ONE_TILE_192_ROWS: 192x128 ping-pong for both GEMMs, DeepSeek-V3 T = 4096
#     gate/up 4760 instead of 6040 us, down 2398 instead of 2569 us; at r = 64 and r = 256 it
#     lost by 10-40%;
#   * otherwise gate/up 128x192 ping-pong (best or within 3% of the best in 9 of 12 cases);
#     down 128x128 ping-pong (best or within 3% in all 12; 2-10% faster than 128x192 in 9).
# A second sweep added cluster 1x1 tiles and 64-row ping-pong tiles (less padding at r ~ 256):
# 64-row tiles lost 25-30% on gate/up (Qwen3-30B-A3B, T = 4096: 543-552 against 428 us);
# cluster 1x1 moved with the run (Qwen3 T = 4096 gate/up 397 and 424 us in two runs against
# 428-429 for 128x192 1x2; down 195 and 243 against 231-238) and lost at r <= 64, so the
# choice above stays. Timed alone as kernel durations (torch.profiler, three interleaved rounds,
# uniform random routing; bench_out diagnostics gg_prof2-4), gate/up 128x192 without the pair
# was faster for Qwen3-30B-A3B at r = 192-256 (T = 4096: 362-371 against 396-431 us; even at
# r = 288-384, slower at r <= 64 and >= 512) but slower for Mixtral at r = 256-320 (1-3%) and
# DeepSeek-V3 at r = 256-320 (10.3-12.3 against 7.1-9.4 ms); inside the Qwen3-30B-A3B layer at
# T = 4096 (five interleaved rounds) the gain did not show: gate/up 394-526 against 396-434 us,
# layer 681-758 against 710-756 us (the kernel durations there move by 10-20% between rounds,
# with the power state of the GPU), so no rule was added for it. quack's scheduler knobs on
# these tiles (Qwen3-30B-A3B T = 4096, four interleaved rounds, best gate/up + down in us;
# bench_out diagnostic swz.py, 2026-12-01): static persistent with max_swizzle_size 8 (the
# default kept here) 429.6 + 232.7; swizzle 1 427.8 + 237.3, 2 432.0 + 247.4, 16 449.6 + 235.5;
# the dynamic persistent scheduler 455.5 + 245.4, and with cluster 1x1 432.0 + 252.1. None
# gains. (The varlen scheduler walks expert by expert, and one expert's 2-3 M tiles by 8-16 N
# tiles fit in one wave of 132 CTAs whatever the swizzle, which would explain it; not checked.)
# What the padding costs (Qwen3-30B-A3B T = 4096, same 32768 rows, these tiles, four
# interleaved rounds, best, bench_out diagnostic pad.py, 2026-12-01): random routing (319 M
# tiles) 412.1 + 211.8 us; every expert 256 rows (256 tiles, no padding) 400.3 + 192.5; 257
# rows each (384 tiles) 493.7 + 275.3. So a tail-tile scheme could gain at most ~30 us of the
# 624. The ceilings of the same FLOPs (dense.py, same day): one weight for all rows (quack
# dense, weights in L2) 298.9 + 158.2 us; cuBLAS bmm of the balanced [128, 256, H] problem
# 329.4 + 188.2; torch._grouped_mm balanced 366.9 + 214.5. What separates quack's varlen GEMM
# from the dense one is reading 128 experts' weights (805 + 403 MB) while computing.
# The rest of quack's own SM90 tuning space on the same problem (bench_out diagnostic cfg.py,
# 2026-12-01, random routing, four interleaved rounds, best, outputs bit-identical; this run's
# clocks were lower than pad.py's): gate/up 128x192 ping-pong 1x2 (kept) 463.8 us against
# 2x1 479.9, 128x160 ping-pong 483.0, 128x256 cooperative 1x2 / 2x1 471.1 / 505.6, 128x224
# cooperative 541.4; down 128x128 ping-pong 1x2 (kept) 258.7 against 2x1 292.2, 128x256
# cooperative 1x2 / 2x1 277.0 / 298.8, 128x208 ping-pong 263.5. N-major weights ([E, K, N]
# stored) 488.0 / 266.8 (quack's concat [gate; up] layout does not apply to them). cuBLAS runs
# the balanced bmm (347.8 + 200.6 in this run) with nvjet_sm90_tst_256x128_64x4_1x2 (256-row
# cooperative tiles): one tile per expert, each weight tile read by one CTA. Under random
# routing (r = 256 +- 16) 256-row tiles would give half the experts a second, nearly empty tile.
# quack's gather_A (A_idx: the gate/up GEMM reads x's rows through a slot -> token index, so
# the dispatch would not copy rows) loads A with cp.async on sm_90 and needs cluster_n = 1; on
# the H200 (graph replay, best of three interleaved rounds, same outputs bit for bit) it was
# slower than the dispatch copy plus this GEMM: Qwen3-30B-A3B T = 1024 / 4096 / 16384 279.5 /
# 557.8 / 1439.4 us against 11.8 + 213.4 / 39.3 + 394.3 / 166.1 + 1157.2, DeepSeek-V3 T = 4096
# 6218 against 145 + 4948, Mixtral T = 4096 2948 against 27 + 2846 (bench_out diagnostic
# gather_a.py); not used.
GATE_UP_TILE = (128, 192, True, 1, 2)
DOWN_TILE = (128, 128, True, 1, 2)
ONE_TILE_192 = (192, 128, True, 1, 2)
ONE_TILE_192_ROWS = (96, 176)  # r in (lo, hi]: one 192-row tile for nearly every expert


def tile_config(rows_per_expert: float, gemm: str, arch_major: int = 9
                ) -> tuple[int, int, bool, int, int]:
    """The quack tile configuration for `gemm` ("gate_up" or "down") when experts expect
    `rows_per_expert` rows on average (see ONE_TILE_192_ROWS), on a GPU of compute capability
    `arch_major`.x. The 192-row tile is sm_90 only (measured there; quack's SM100 MMA takes
    tile M of 64, 128 or 256).

    Raises:
        ValueError: an unknown gemm name.
    """
    if gemm not in ("gate_up", "down"):
        raise ValueError(f"gemm must be 'gate_up' or 'down', got {gemm!r}")
    lo, hi = ONE_TILE_192_ROWS
    if arch_major == 9 and lo < rows_per_expert <= hi:
        return ONE_TILE_192
    return GATE_UP_TILE if gemm == "gate_up" else DOWN_TILE


def tile_probe_rows(arch_major: int = 9) -> tuple[float, ...]:
    """Rows per expert, one for each distinct pair of tile configurations that tile_config
    picks on a GPU of compute capability `arch_major`.x (a warm-up compiles each: Experts.warm_up)."""
    lo, hi = ONE_TILE_192_ROWS
    picks = {(tile_config(r, "gate_up", arch_major), tile_config(r, "down", arch_major)): r
             for r in ((lo + hi) / 2, 2 * hi)}
    return tuple(picks.values())


@functools.lru_cache(maxsize=None)
def quack_available() -> bool:
    """True when quack-kernels is importable (the `gpu` extra installs it)."""
    return importlib.util.find_spec("quack") is not None


def quack_keys_installed_code(cutlass_file: str) -> bool:
    """Whether quack 0.6 can key its compiled epilogues with cutlass at `cutlass_file`.

    quack fingerprints an epilogue by the source and globals of every function it calls, and
    stops at functions it considers installed: files under a `site-packages` or
    `dist-packages` directory or the standard library
    (quack.gemm_runtime.identity._is_extern_function). With nvidia-cutlass-dsl anywhere else
    (`pip install --target` + PYTHONPATH, an unpacked bundle) the walk enters cutlass's
    internals and the first gated GEMM raises TypeError (a ContextVar has no key).
    """
    parts = os.path.abspath(cutlass_file).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


@torch.compiler.assume_constant_result
def quack_supported(device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether the quack grouped GEMM runs here: quack importable, sm_90 or sm_100 (its SM90
    and SM100 kernels), 16-bit operands, nvidia-cutlass-dsl installed where quack can key its
    epilogues (`quack_keys_installed_code`; otherwise logged once, torch._grouped_mm is used).
    Cached per (device_index, dtype); torch.compile takes the answer as a constant (the
    probe's import lookups are not traceable)."""
    return _quack_supported(device_index, dtype)


@functools.lru_cache(maxsize=None)
def _quack_supported(device_index: int | None, dtype: torch.dtype) -> bool:
    if dtype not in (torch.bfloat16, torch.float16) or not quack_available():
        return False
    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] not in (9, 10):
        return False
    spec = importlib.util.find_spec("cutlass")  # (quack requires it)
    where = spec.origin if spec is not None else None
    if not where or not quack_keys_installed_code(where):
        _log_once(f"moe_runtime: quack cannot key its GEMM epilogues with nvidia-cutlass-dsl at "
                  f"{where or 'no importable location'} (it needs it under site-packages / "
                  "dist-packages); the experts use torch._grouped_mm instead of quack")
        return False
    return True


quack_supported.cache_clear = _quack_supported.cache_clear


@functools.lru_cache(maxsize=None)
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.lru_cache(maxsize=None)
def _config(device_index: int, tile: tuple[int, int, bool, int, int]):
    from quack.gemm_config import GemmConfig
    m, n, pingpong, cm, cn = tile
    return GemmConfig(tile_m=m, tile_n=n, pingpong=pingpong, cluster_m=cm, cluster_n=cn,
                      is_dynamic_persistent=False, device_capacity=_major(device_index))


def _check(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"rows [N, K] and weights [E, M, K] must agree on K, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if not w.is_contiguous():
        raise ValueError("expert weights must be contiguous [E, M, K] (quack reads them K-major)")
    if x.dtype != w.dtype:
        raise TypeError(f"rows and weights must share a dtype, got {x.dtype} and {w.dtype}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (w.shape[0] + 1,):
        raise ValueError(f"expert_offsets must be int32 [{w.shape[0] + 1}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if not (x.device == offsets.device == w.device) or x.device.type != "cuda":
        raise ValueError(f"rows, offsets and weights must be on one CUDA device, got {x.device}, "
                         f"{offsets.device}, {w.device}")


# quack's launch plans, one per (SwiGLU or not, tile, device index, dtype, K, weight shape and
# strides). quack's torch-facing gemm_act resolves the plan again on every call (config,
# epilogue module, a plan-cache key over every operand; its own warm fast path skips the concat
# [gate; up] layout). Here EpiMod.gemm resolves it once (and launches that call) and later calls
# allocate the output and launch through quack.gemm_runtime.host.run_gemm_epi_plan, as quack's
# warm path does. Host µs per call on an H200 host (bench_out diagnostic gemm_host.py,
# 2026-12-02, Qwen3-30B-A3B T = 256 / 4096, min of 3 rounds): gate/up 15.1 / 15.6 against
# 50.9 / 52.8 through gemm_act, down 16.3 / 17.1 against 31.8 / 33.8; the eager layer's host
# time per forward 178-207 against 244-291 µs (eager_ab.py, T = 64..4096), outputs bit-equal.
# The row count N is not in the key: a plan is built from dtypes and majors (row-major x and
# output here) and quack compiles M as a symbolic size, so one plan serves every T (quack's
# own key holds N: a plan resolution per new prefill size).
_PLANS: dict[tuple, object] = {}


def _run(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, gated: bool,
         expected_rows: int | None) -> torch.Tensor:
    """out = act(x @ w[e].T) per expert segment, w [E, M, K] HF layout (K-major rows): gated
    (SwiGLU over [gate; up] halves of M) -> [N, M // 2], else -> [N, M]."""
    from quack.gemm_runtime.host import run_gemm_epi_plan
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[1] // 2 if gated else w.shape[1], dtype=x.dtype,
                      device=x.device)
    if x.numel() == 0 or out.numel() == 0:
        return out.zero_()  # (no rows, or K = 0: x @ w.T is zero, as is silu(0) * 0)
    rows = x.shape[0] if expected_rows is None else expected_rows
    index = x.device.index  # (a CUDA tensor's device always has an index)
    tile = tile_config(rows / w.shape[0], "gate_up" if gated else "down", _major(index))
    # B crosses as quack's (k, n) view [E, K, M], except with the concat [gate; up] layout, which
    # quack reads from the physical [E, M, K] (its b_kn relabel does not apply there)
    b = w if gated else w.mT
    epi = {"mAuxOut": out}
    key = (gated, tile, index, x.dtype, x.shape[1], b.shape, b.stride())
    plan = _PLANS.get(key)
    if plan is not None:
        run_gemm_epi_plan(plan, x, b, None, None, epi, cu_seqlens_m=offsets)
        return out
    from quack.epilogue.library import linear_act_mod
    mod = linear_act_mod("swiglu" if gated else None, gated=gated, has_c=False,
                         has_rowvec=False, has_colvec=False, sr=False, has_alpha=False)
    # (the arguments gemm_act passes: the same cached epilogue module and compiled kernels)
    cfg = _config(index, tile)
    _PLANS[key] = mod.gemm(
        x, b, None, None, epi_args=epi, tile_M=cfg.tile_m, tile_N=cfg.tile_n, tile_K=cfg.tile_k,
        cluster_M=cfg.cluster_m, cluster_N=cfg.cluster_n, pingpong=cfg.pingpong,
        persistent=True, is_dynamic_persistent=False, max_swizzle_size=cfg.max_swizzle_size,
        cu_seqlens_m=offsets, b_kn=not gated, concat_layout=("B",) if gated else None)
    return out


def swiglu_grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor,
                        gate_up_proj: torch.Tensor, *, expected_rows: int | None = None
                        ) -> torch.Tensor:
    """act[r] = silu(x[r] @ Wg[e].T) * (x[r] @ Wu[e].T) for the rows r of expert e.

    Args:
        x: [N, H] bf16/fp16 expert-major rows; expert e owns rows [offsets[e], offsets[e+1]).
        expert_offsets: int32 [E + 1] on x's device (offsets[0] = 0, non-decreasing).
        gate_up_proj: [E, 2I, H] in x.dtype (gate rows, then up rows).
        expected_rows: host estimate of offsets[E] (None: N); picks the tile (`tile_config`).

    Returns:
        [N, I] in x.dtype (fp32 accumulation; rows past offsets[E] unspecified).

    Raises:
        ValueError / TypeError: mismatched shapes, dtypes or devices; non-contiguous weights.
    """
    _check(x, expert_offsets, gate_up_proj)
    return _run(x, expert_offsets, gate_up_proj, True, expected_rows)


def grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor, *,
                 expected_rows: int | None = None) -> torch.Tensor:
    """out[r] = x[r] @ W[e].T for the rows r of expert e.

    Args:
        x: [N, K] bf16/fp16 expert-major rows; expert e owns rows [offsets[e], offsets[e+1]).
        expert_offsets: int32 [E + 1] on x's device.
        weight: [E, M, K] in x.dtype (HF layout: out-features first).
        expected_rows: host estimate of offsets[E] (None: N); picks the tile (`tile_config`).

    Returns:
        [N, M] in x.dtype (fp32 accumulation; rows past offsets[E] unspecified).

    Raises:
        ValueError / TypeError: mismatched shapes, dtypes or devices; non-contiguous weights.
    """
    _check(x, expert_offsets, weight)
    return _run(x, expert_offsets, weight, False, expected_rows)
