"""Decode experts: CuTeDSL expert GEMV vs torch._grouped_mm on the same expert-major rows.

For each shape and T: the rows come from a real dispatch of T random tokens (k experts each);
both paths run gate_up -> SwiGLU -> down (`Experts.forward`), timed from CUDA-graph replay.
Floors: the weight bytes each path must read at the device copy bandwidth measured in the same
run: the grouped GEMM reads each active expert once; the GEMV reads its expert per row (rows of
one expert read it again, mostly from L2). `grouped/gemv` > 1 means the GEMV is faster; the
largest T*k rows where it stays faster is the crossover that `moe_runtime.experts.GEMV_MAX_ROWS`
encodes. Replaying one call keeps part of the weights in the 50 MB L2 for the small shapes, for
both paths alike. A second table times the router linear [T, H] x [E, H]^T: F.linear against
the one-expert GEMV (cute_ops.linear_gemv), the measurement behind Router.logits' rule
(moe_runtime.routing.ROUTER_GEMV_MAX_TOKENS / ROUTER_GEMV_MAX_WEIGHTS).
Prints the tables, writes JSON (--out); never asserts a time.

Usage: python benchmarks/expert_gemv.py [--out bench_out/expert_gemv.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from moe_runtime.experts import GEMV_MAX_ROWS, Experts
from moe_runtime.kernels import cute_ops
from moe_runtime.routing import ROUTER_GEMV_MAX_TOKENS, ROUTER_GEMV_MAX_WEIGHTS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from local_dispatch_combine import copy_bandwidth, graph_us, require_cuda  # noqa: E402

SHAPES = {  # name: (H, I, E, k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral": (4096, 14336, 8, 2),
}
TOKENS = (1, 2, 4, 8, 16)
ROUTER_TOKENS = (1, 8, 32, 64)


def expert_problem(name: str, T: int):
    """(fast, reference, expert_x, offsets, x, row_token) for shape `name` and T random tokens:
    `fast` are Experts with the default backend, `reference` the same weights with backend
    "reference" (torch._grouped_mm); expert_x/offsets from a real dispatch of the tokens x
    (k experts each); row_token int32 [T * k]: the token of each expert-major row (the gather
    index that reads expert_x from x). Shared with benchmarks/grouped_gemm.py."""
    H, I, E, k = SHAPES[name]
    torch.manual_seed(T)
    fast = Experts(E, H, I, dtype=torch.bfloat16, device="cuda")
    reference = Experts(E, H, I, gate_up_proj=fast.gate_up_proj, down_proj=fast.down_proj,
                        backend="reference")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.int()
    ex, off, slot = cute_ops.dispatch(x, ids, expert_start=0, num_local_experts=E)
    row_token = torch.empty(T * k, dtype=torch.int32, device="cuda")
    row_token[slot.flatten().long()] = torch.arange(T, dtype=torch.int32,
                                                    device="cuda").repeat_interleave(k)
    return fast, reference, ex.contiguous(), off, x, row_token


def measure(name: str, T: int, bw: float) -> dict:
    H, I, E, k = SHAPES[name]
    fast, grouped, ex, off, *_ = expert_problem(name, T)
    rows = T * k
    per_expert = 3 * H * I * 2
    active = int((off[1:] > off[:-1]).sum())
    res = {"shape": name, "T": T, "rows": rows, "active_experts": active,
           "grouped_us": graph_us(lambda: grouped(ex, off), reps=20),
           "grouped_floor_us": active * per_expert / bw * 1e6,
           "gemv_floor_us": rows * per_expert / bw * 1e6}
    res["gemv_us"] = graph_us(lambda: fast(ex, off), reps=20) if fast._gemv(ex) else None
    if res["gemv_us"] is not None:
        a, b = fast(ex, off)[:rows].double(), grouped(ex, off)[:rows].double()
        res["rel_diff"] = float((a - b).abs().max() / b.abs().max())
    return res


def measure_router(name: str, T: int) -> dict:
    """µs of the router linear of shape `name` at T tokens: F.linear and the one-expert GEMV."""
    H, _, E, _ = SHAPES[name]
    torch.manual_seed(T)
    w = (torch.randn(E, H, device="cuda") * H ** -0.5).to(torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, w).double()
    diff = (cute_ops.linear_gemv(x, w).double() - ref).abs().max() / ref.abs().max()
    return {"shape": name, "T": T, "weights": E * H,
            "linear_us": graph_us(lambda: torch.nn.functional.linear(x, w), reps=20),
            "gemv_us": graph_us(lambda: cute_ops.linear_gemv(x, w), reps=20),
            "rel_diff": float(diff)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/expert_gemv.json")
    args = ap.parse_args(argv)
    require_cuda()
    bw = copy_bandwidth()["best"]
    rows = [measure(name, T, bw) for name in SHAPES for T in TOKENS]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"GEMV_MAX_ROWS={GEMV_MAX_ROWS}")
    print(f"{'shape':15}{'T':>4}{'rows':>6}{'active':>7}{'gemv us':>10}{'floor':>8}{'grouped us':>12}"
          f"{'floor':>8}{'grouped/gemv':>14}{'diff':>9}")
    for r in rows:
        g = r["gemv_us"]
        gemv = f"{g:.1f}" if g else "-"
        ratio = f"{r['grouped_us'] / g:.2f}" if g else "-"
        print(f"{r['shape']:15}{r['T']:>4}{r['rows']:>6}{r['active_experts']:>7}{gemv:>10}"
              f"{r['gemv_floor_us']:>8.1f}{r['grouped_us']:>12.1f}{r['grouped_floor_us']:>8.1f}"
              f"{ratio:>14}{r.get('rel_diff', float('nan')):>9.1e}")
    routers = [measure_router(name, T) for name in SHAPES for T in ROUTER_TOKENS]
    print(f"router linear (ROUTER_GEMV_MAX_TOKENS={ROUTER_GEMV_MAX_TOKENS}, "
          f"ROUTER_GEMV_MAX_WEIGHTS={ROUTER_GEMV_MAX_WEIGHTS})")
    print(f"{'shape':15}{'T':>4}{'E*H':>10}{'linear us':>11}{'gemv us':>9}{'diff':>9}")
    for r in routers:
        print(f"{r['shape']:15}{r['T']:>4}{r['weights']:>10}{r['linear_us']:>11.2f}"
              f"{r['gemv_us']:>9.2f}{r['rel_diff']:>9.1e}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows,
                               "router": routers}, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
