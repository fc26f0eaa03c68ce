"""Prefill experts: quack's varlen grouped GEMM with fused SwiGLU vs torch._grouped_mm + SwiGLU.

For each shape and T: T random tokens routed to k experts each are dispatched into expert-major
rows; both paths run gate_up -> SwiGLU -> down (`Experts.forward` with backend "auto" = quack, and
backend "reference" = torch._grouped_mm, silu(gate) * up, torch._grouped_mm). Times are CUDA
events over back-to-back calls. Floors, measured in the same run: FLOPs (2 * rows * 3 * H * I) at
the bf16 rate of an 8192^3 torch.mm, and the expert weights read once at the device copy
bandwidth. `--sweep` also times quack tile configurations (the sweep behind
kernels/grouped_gemm.py's choice). Prints a table, writes JSON (--out); never asserts a time.

Usage: python benchmarks/grouped_gemm.py [--sweep [--configs A,B] [--gather]] [--shapes S,..]
           [--tokens 256,4096] [--out bench_out/grouped_gemm.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from moe_runtime.experts import Experts
from moe_runtime.kernels.grouped_gemm import quack_supported

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expert_gemv import SHAPES, expert_problem  # noqa: E402
from local_dispatch_combine import copy_bandwidth  # noqa: E402
from moe_layer import matmul_flops, timed_us  # noqa: E402

TOKENS = (256, 1024, 4096, 16384)
# (tile_m, tile_n, pingpong, cluster_m, cluster_n) tried by --sweep for each GEMM on its own
# 64-row ping-pong tiles round each expert's rows up to 64 instead of 128 (less padding at
# r ~ 256) at a lower arithmetic intensity per tile; cluster 1x1 tiles share nothing by
# multicast but never wait for a partner tile.
SWEEP = ((128, 128, True, 1, 2), (128, 192, True, 1, 2), (128, 192, True, 2, 1),
         (128, 256, False, 1, 2), (192, 128, True, 1, 2), (256, 128, False, 1, 2),
         (256, 192, False, 1, 2), (128, 128, True, 2, 1), (64, 256, True, 1, 2),
         (64, 192, True, 1, 2), (64, 256, True, 2, 1), (128, 192, True, 1, 1),
         (128, 128, True, 1, 1), (192, 128, True, 1, 1), (128, 256, False, 1, 1),
         (256, 128, False, 1, 1), (64, 256, True, 1, 1))


def config_name(m: int, n: int, pp: bool, cm: int, cn: int) -> str:
    return f"{m}x{n}{'pp' if pp else 'coop'}_c{cm}x{cn}"


def sweep_configs(ex, off, fast: Experts, x, row_token, only: set[str] | None = None,
                  gather: bool = False) -> dict:
    """{"gate_up": {config: µs}, "down": {config: µs}, "gate_up_gather": {config: µs}}: each
    GEMM timed alone per SWEEP entry (those named in `only`, when given); with `gather`,
    "gate_up_gather" is the gate/up GEMM reading its rows straight from the tokens x through
    quack's gather_A (A_idx = row_token; cluster_n = 1 configurations only), i.e. without the
    dispatch copy (H200, Qwen3-30B-A3B, T = 4096: 466-541 µs against 397-419 for the same
    tiles on dispatched rows, more than the ~40 µs copy it saves)."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_act
    cap = torch.cuda.get_device_capability()[0]
    out = {"gate_up": {}, "down": {}} | ({"gate_up_gather": {}} if gather else {})
    for m, n, pp, cm, cn in SWEEP:
        name = config_name(m, n, pp, cm, cn)
        if only is not None and name not in only:
            continue
        cfg = GemmConfig(tile_m=m, tile_n=n, pingpong=pp, cluster_m=cm, cluster_n=cn,
                         is_dynamic_persistent=False, device_capacity=cap)
        kw = dict(cu_seqlens_m=off, store_preact=False, tuned=False, config=cfg)
        try:
            def gate_up(x):
                return gemm_act(x, fast.gate_up_proj.transpose(-2, -1), activation="swiglu",
                                concat_layout=("B",), **kw)[1]
            act = gate_up(ex)
            out["gate_up"][name] = timed_us(gate_up, [ex])
            out["down"][name] = timed_us(lambda a: gemm_act(a, fast.down_proj.transpose(-2, -1),
                                                            activation=None, **kw), [act])
        except Exception as e:  # a configuration quack rejects for this shape: record, go on
            out["gate_up"][name] = out["down"][name] = f"{type(e).__name__}: {e}"[:200]
            continue
        if not gather or cn != 1:
            continue
        try:
            def gathered(t):
                return gemm_act(t, fast.gate_up_proj.transpose(-2, -1), activation="swiglu",
                                concat_layout=("B",), A_idx=row_token, **kw)[1]
            err = (gathered(x).double() - act.double()).abs().max().item()
            if err > 0:  # same rows, same tile order: the gathered GEMM must agree exactly
                raise AssertionError(f"gathered gate/up differs by {err}")
            out["gate_up_gather"][name] = timed_us(gathered, [x])
        except Exception as e:
            out["gate_up_gather"][name] = f"{type(e).__name__}: {e}"[:200]
    return out


def measure(name: str, T: int, bw: float, flops: float, sweep: bool,
            only: set[str] | None = None, gather: bool = False) -> dict:
    H, I, E, k = SHAPES[name]
    fast, ref, ex, off, x, row_token = expert_problem(name, T)
    rows = T * k
    a, b = fast(ex, off)[:rows].double(), ref(ex, off)[:rows].double()
    res = {"shape": name, "T": T, "rows": rows, "quack_path": fast._quack(ex.device, ex.dtype),
           "quack_us": timed_us(lambda y: fast(y, off), [ex]),
           "torch_us": timed_us(lambda y: ref(y, off), [ex]),
           "flops_floor_us": 2 * rows * 3 * H * I / flops * 1e6,
           "bytes_floor_us": int((off[1:] > off[:-1]).sum()) * 3 * H * I * 2 / bw * 1e6,
           "rel_diff": float((a - b).abs().max() / b.abs().max())}
    if sweep:
        res["sweep_us"] = sweep_configs(ex, off, fast, x, row_token, only, gather)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--configs", default=None,
                   help="with --sweep: comma-separated configuration names, e.g. 64x256pp_c1x2 "
                        "(default: all of SWEEP)")
    p.add_argument("--gather", action="store_true",
                   help="with --sweep: also time the gate/up GEMM gathering rows from the tokens")
    p.add_argument("--out", default="bench_out/grouped_gemm.json")
    a = p.parse_args(argv)
    if (a.configs or a.gather) and not a.sweep:
        p.error("--configs and --gather need --sweep")
    only = set(a.configs.split(",")) if a.configs else None
    unknown = (only or set()) - {config_name(*c) for c in SWEEP}
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}; known: "
                f"{', '.join(config_name(*c) for c in SWEEP)}")
    if not torch.cuda.is_available() or not quack_supported(torch.cuda.current_device(),
                                                            torch.bfloat16):
        sys.exit("needs quack-kernels (pip install 'moe_runtime[gpu]') on an sm_90/sm_100 GPU")
    bw = copy_bandwidth()["best"]  # bytes/s, read + write counted
    flops = matmul_flops()
    rows = [measure(s, T, bw, flops, a.sweep, only, a.gather) for s in a.shapes.split(",")
            for T in map(int, a.tokens.split(","))]
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12,
                                "matmul_TFLOPs": flops / 1e12, "rows": rows}, indent=1))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 mm {flops / 1e12:.0f} TFLOP/s")
    print(f"{'shape':15s} {'T':>6s} {'quack µs':>9s} {'torch µs':>9s} {'speedup':>8s} "
          f"{'flops fl.':>9s} {'bytes fl.':>9s} {'vs floor':>8s} {'diff':>8s}")
    for r in rows:
        floor = max(r["flops_floor_us"], r["bytes_floor_us"])
        print(f"{r['shape']:15s} {r['T']:6d} {r['quack_us']:9.1f} {r['torch_us']:9.1f} "
              f"{r['torch_us'] / r['quack_us']:7.2f}x {r['flops_floor_us']:9.1f} "
              f"{r['bytes_floor_us']:9.1f} {r['quack_us'] / floor:7.2f}x {r['rel_diff']:8.1e}")
        for gemm, cfgs in r.get("sweep_us", {}).items():
            timed = {c: us for c, us in cfgs.items() if isinstance(us, float)}
            best = min(timed, key=timed.get) if timed else None
            print(f"    {gemm:8s} " + "  ".join(f"{c} {us:.1f}" if isinstance(us, float) else
                                               f"{c} failed" for c, us in cfgs.items())
                  + (f"  | best {best}" if best else ""))


if __name__ == "__main__":
    main()
