"""Grouped expert GEMMs for prefill-sized rows on Hopper/Blackwell through quack (Dao-AILab/quack).

quack's varlen-M GEMM takes the expert segment starts as `cu_seqlens_m` (device int32, no host
read) and fuses SwiGLU into the gate/up GEMM's epilogue, so the [N, 2I] gate/up activations are
never written: against torch._grouped_mm + silu(gate) * up on the H200 (bf16, random routing,
benchmarks/grouped_gemm.py) the two GEMMs take 625 µs instead of 828 µs for Qwen3-30B-A3B at
T=4096, 322 instead of 441 µs at T=256, 9.0 instead of 11.0 ms for DeepSeek-V3 at T=4096 and
4.8 instead of 5.4 ms for Mixtral at T=4096.

Layouts are HF transformers' fused expert weights (experts.py): gate_up_proj [E, 2I, H] with the
gate rows first, down_proj [E, H, I]. They enter quack as the transposed views [E, H, 2I] and
[E, I, H] (K-major B operands, no copy); `concat_layout=("B",)` tells quack's gated epilogue that
B's N dimension holds [gate; up] rather than interleaved pairs.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

# One tile configuration for every shape: 128x192 tiles, ping-pong warpgroups, a 1x2 cluster
# (B tiles multicast to the CTA pair), static persistent schedule. In the sweep of
# benchmarks/grouped_gemm.py on the H200 it was the best or within 6% of the best of 12
# (tile 64x256 .. 256x128, cooperative/ping-pong, clusters 2x1/1x2, static/dynamic scheduler) on
# Qwen3-30B-A3B, DeepSeek-V3 and Mixtral at T = 256 and 4096, and quack's default (cluster 2x1)
# was up to 50% slower on DeepSeek-V3 at T=256.
TILE_M, TILE_N, CLUSTER_M, CLUSTER_N = 128, 192, 1, 2


@functools.lru_cache(maxsize=None)
def quack_available() -> bool:
    """True when quack-kernels is importable (the `gpu` extra installs it)."""
    return importlib.util.find_spec("quack") is not None


@functools.lru_cache(maxsize=None)
def quack_supported(device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether the quack grouped GEMM runs here: quack importable, sm_90 or sm_100 (its SM90
    and SM100 kernels), 16-bit operands."""
    if dtype not in (torch.bfloat16, torch.float16) or not quack_available():
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


@functools.lru_cache(maxsize=None)
def _config(device_index: int):
    from quack.gemm_config import GemmConfig
    major = torch.cuda.get_device_capability(device_index)[0]
    return GemmConfig(tile_m=TILE_M, tile_n=TILE_N, pingpong=True, cluster_m=CLUSTER_M,
                      cluster_n=CLUSTER_N, is_dynamic_persistent=False, device_capacity=major)


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


def _run(x: torch.Tensor, offsets: torch.Tensor, b: torch.Tensor, activation) -> torch.Tensor:
    from quack.gemm_interface import gemm_act
    kw = dict(concat_layout=("B",)) if activation == "swiglu" else {}
    _, out = gemm_act(x.contiguous(), b, activation=activation, cu_seqlens_m=offsets,
                      store_preact=False, tuned=False, config=_config(x.device.index), **kw)
    return out


def swiglu_grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor,
                        gate_up_proj: torch.Tensor) -> torch.Tensor:
    """act[r] = silu(x[r] @ Wg[e].T) * (x[r] @ Wu[e].T) for the rows r of expert e.

    Args:
        x: [N, H] bf16/fp16 expert-major rows; expert e owns rows [offsets[e], offsets[e+1]).
        expert_offsets: int32 [E + 1] on x's device (offsets[0] = 0, non-decreasing).
        gate_up_proj: [E, 2I, H] in x.dtype (gate rows, then up rows).

    Returns:
        [N, I] in x.dtype (fp32 accumulation; rows past offsets[E] unspecified).

    Raises:
        ValueError / TypeError: mismatched shapes, dtypes or devices; non-contiguous weights.
    """
    _check(x, expert_offsets, gate_up_proj)
    return _run(x, expert_offsets, gate_up_proj.transpose(-2, -1), "swiglu")


def grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ W[e].T for the rows r of expert e.

    Args:
        x: [N, K] bf16/fp16 expert-major rows; expert e owns rows [offsets[e], offsets[e+1]).
        expert_offsets: int32 [E + 1] on x's device.
        weight: [E, M, K] in x.dtype (HF layout: out-features first).

    Returns:
        [N, M] in x.dtype (fp32 accumulation; rows past offsets[E] unspecified).

    Raises:
        ValueError / TypeError: mismatched shapes, dtypes or devices; non-contiguous weights.
    """
    _check(x, expert_offsets, weight)
    return _run(x, expert_offsets, weight.transpose(-2, -1), None)
