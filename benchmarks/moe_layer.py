"""MoELayer (local topology, CuTeDSL kernels, bf16) against HF transformers' MoE block and two floors.

Shapes (bf16, released sizes): Qwen3-30B-A3B (H 2048, E 128, k 8, I 768), DeepSeek-V3 (7168, 256,
8, 2048; sigmoid + 8 groups / top-4 groups, scaling 2.5, 1 shared expert of I 2048), Mixtral
(4096, 8, 2, 14336); T in {1, 8, 64, 256, 1024, 4096, 16384}.

Per (shape, T), µs per call:
  eager   MoELayer forward, graphs off (back-to-back calls timed with CUDA events; at decode
          sizes this is the host's launch cost);
  graph   MoELayer forward with bucketed CUDA graphs (T <= 256): input copy + replay + output
          copy, i.e. what a caller of `layer(x)` gets (includes the host's Python cost);
  device  the layer's GPU time inside a CUDA graph (T <= 256): 8 forwards on the 8 inputs
          captured in one graph and replayed, i.e. what the layer costs inside a captured
          whole-model decode step (no host cost, no input/output copies);
  compiled  (--compiled) torch.compile(layer.forward, fullgraph=True, dynamic=False) under
          inference_mode, mode="reduce-overhead" (inductor's CUDA graphs) for T <= 256, the
          default mode above: the CuTeDSL kernels and quack's grouped GEMMs as custom ops
          (kernels/compiled_ops.py), the rest fused by inductor;
  hf      the HF transformers block of that family (Qwen3MoeSparseMoeBlock, DeepseekV3MoE,
          MixtralSparseMoeBlock) with experts_implementation="grouped_mm", on the SAME weights
          (our layer is made from it by swap_moe_layers, sharing storage);
  bytes floor  bytes of expert weights touched (routed experts that received >= 1 token, plus the
          shared expert and the router, each read once) at the device copy bandwidth measured in
          this run;
  flops floor  2 * (T*k*3*H*I + T*3*H*I_shared + T*E*H) at the bf16 matmul rate measured in this
          run (8192^3 torch.mm);
  tile fl  the same with each expert's rows rounded up to the grouped GEMM's M tile (what a
          tiled grouped GEMM computes; prefill sizes on the quack path only): at ~256 rows per
          expert about a fifth of the tile rows are padding.
Each timing cycles through 8 different random inputs, so consecutive calls route to different
experts (the weights of one call do not sit in L2 for the next). `vs floor` = best of ours
(eager, graph, device; not compiled) / max(floors); `speedup` = hf / that best; `diff` =
max |ours - hf| / max |hf| on one input (compiled_diff in the JSON: compiled against eager).

Targets (Qwen3-30B-A3B): T=1 <= 40 µs, T=4096 <= 600 µs; printed, never asserted.
`--stages` adds, per (shape, T), the layer's GPU kernels from torch.profiler over eager forwards
(µs per forward by kernel name, and their sum): where a row's time goes.
Usage: python benchmarks/moe_layer.py [--quick] [--shapes qwen3-30b-a3b,mixtral] [--tokens 1,4096]
       [--stages] [--compiled] [--out bench_out/moe_layer.json]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

from moe_runtime import MoELayer, swap_moe_layers
from moe_runtime.kernels.grouped_gemm import tile_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# the same copy-bandwidth floor as the kernel benchmark
from local_dispatch_combine import copy_bandwidth, graph_us, require_cuda  # noqa: E402

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK_TOKENS = (1, 8, 256, 4096)
NUM_INPUTS = 8
TARGETS_US = {("qwen3-30b-a3b", 1): 40.0, ("qwen3-30b-a3b", 4096): 600.0}

# name -> (transformers config class, block module, block class, config kwargs)
SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock",
                      dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                           moe_intermediate_size=768, norm_topk_prob=True)),
    "deepseek-v3": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE",
                    dict(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8,
                         moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
                         routed_scaling_factor=2.5, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "mixtral", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=14336)),
}
QUICK_SHAPES = ("qwen3-30b-a3b", "mixtral")


def hf_block(name: str) -> torch.nn.Module:
    """The HF block of `name` in bf16 on the GPU, experts_implementation="grouped_mm", random
    weights (std fan_in^-0.5; DeepSeek's correction bias uniform in [0, 0.05))."""
    import importlib

    import transformers
    cfg_name, module, block_name, kw = SHAPES[name]
    cfg = getattr(transformers, cfg_name)(experts_implementation="grouped_mm", **kw)
    cfg._experts_implementation = "grouped_mm"
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), block_name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = cls(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=p.shape[-1] ** -0.5)
        for b in block.buffers():
            b.uniform_(0.0, 0.05)
    return block


def timed_us(fn, inputs, min_s: float = 0.15, repeats: int = 3) -> float:
    """µs per call of fn(x) over back-to-back calls cycling through `inputs` (best of repeats)."""
    for x in inputs[:2]:
        fn(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(inputs[0])
    torch.cuda.synchronize()
    iters = max(len(inputs), min(400, int(min_s / max(time.perf_counter() - t0, 1e-6))))
    best = math.inf
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(iters):
            fn(inputs[i % len(inputs)])
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / iters)
    return best


def matmul_flops() -> float:
    """bf16 FLOP/s of an 8192^3 torch.mm (the rate the FLOPs floor uses)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = timed_us(lambda _: torch.mm(a, b), [None], min_s=0.3)
    return 2 * n ** 3 / (us * 1e-6)


def floors(layer: MoELayer, inputs, bw: float, flops: float) -> tuple[float, float]:
    """(bytes floor µs, flops floor µs), averaged over the inputs' routings."""
    c = layer.config
    H, I, E, k = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.top_k
    Is = c.shared_expert_intermediate_size
    expert_bytes = 3 * H * I * 2
    fixed = 3 * H * Is * 2 + layer.router.weight.numel() * layer.router.weight.element_size()
    hit = sum(int(torch.unique(layer.router(x)[0]).numel()) for x in inputs) / len(inputs)
    T = inputs[0].shape[0]
    nflop = 2 * (T * k * 3 * H * I + T * 3 * H * Is + T * E * H)
    return (hit * expert_bytes + fixed) / bw * 1e6, nflop / flops * 1e6


def tile_flops_floor(layer: MoELayer, inputs, flops: float) -> float | None:
    """µs of the FLOPs the grouped GEMMs compute when each expert's rows are rounded up to the
    quack tile's M (kernels/grouped_gemm.tile_config; every expert runs whole M tiles) at the
    bf16 matmul rate, plus the shared expert and the router; averaged over the inputs'
    routings. None where the layer takes the GEMV path (Experts._gemv: T * k rows within
    GEMV_MAX_ROWS and 1.5 x the experts) or quack does not run."""
    c = layer.config
    H, I, E, k = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.top_k
    T = inputs[0].shape[0]
    ex = layer.experts
    if ex._gemv(inputs[0], T * k) or not ex._quack(inputs[0].device, inputs[0].dtype):
        return None
    major = torch.cuda.get_device_capability()[0]
    tiles = {g: tile_config(T * k / E, g, major)[0] for g in ("gate_up", "down")}
    total = 0.0
    for x in inputs:
        counts = torch.bincount(layer.router(x)[0].flatten().long(), minlength=E)
        padded = {g: int((-(-counts // m) * m).sum()) for g, m in tiles.items()}
        total += 2 * (padded["gate_up"] * 2 * H * I + padded["down"] * H * I
                      + T * 3 * H * c.shared_expert_intermediate_size + T * E * H)
    return total / len(inputs) / flops * 1e6


def kernel_stages(fn, inputs) -> dict[str, float]:
    """µs per call of each GPU kernel fn(x) launches (by full kernel name: compiled variants of
    one kernel differ only in their constants, late in the name), from torch.profiler over one
    eager call per input; "sum" is their total."""
    from torch.profiler import ProfilerActivity, profile
    for x in inputs[:2]:
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for x in inputs:
            fn(x)
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / len(inputs)
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    per["sum"] = sum(per.values())
    return per


def run_shape(name: str, tokens, bw: float, flops: float, stages: bool = False,
              compiled: bool = False) -> list[dict]:
    block = hf_block(name)
    layer = swap_moe_layers(block, backend="cute")  # shares the block's weights
    rows = []
    for T in tokens:
        row = {"shape": name, "T": T}
        try:
            g = torch.Generator(device="cuda").manual_seed(T)
            inputs = [torch.randn(T, layer.config.hidden_size, device="cuda", generator=g)
                      .to(torch.bfloat16) for _ in range(NUM_INPUTS)]
            with torch.inference_mode():
                row["bytes_floor_us"], row["flops_floor_us"] = floors(layer, inputs, bw, flops)
                tile_floor = tile_flops_floor(layer, inputs, flops)
                if tile_floor is not None:
                    row["tile_flops_floor_us"] = tile_floor
                layer.disable_cuda_graphs()
                row["eager_us"] = timed_us(layer, inputs)
                if stages:
                    row["stages_us"] = kernel_stages(layer, inputs)
                y = layer(inputs[0]).float()
                if compiled:
                    try:
                        torch._dynamo.reset()
                        # (its forward: the swap's output-recording hooks read transformers'
                        # ContextVar, which dynamo traces only inside a compiled model)
                        fn = torch.compile(layer.forward, fullgraph=True, dynamic=False,
                                           mode="reduce-overhead" if T <= 256 else None)
                        row["compiled_us"] = timed_us(fn, inputs)
                        row["compiled_diff"] = float((fn(inputs[0]).float() - y).abs().max()
                                                     / y.abs().max())
                    except Exception as e:  # reported in its column; the others go on
                        row["compiled_error"] = f"{type(e).__name__}: {e}"[:500]
                hf = lambda x: block(x.view(1, *x.shape))  # noqa: E731
                try:
                    row["hf_us"] = timed_us(hf, inputs)
                    y_ref = hf(inputs[0]).view(T, -1).float()
                    row["diff_vs_hf"] = float((y - y_ref).abs().max() / y_ref.abs().max())
                except Exception as e:  # e.g. an older transformers without grouped_mm experts
                    row["hf_error"] = f"{type(e).__name__}: {e}"[:500]
                if T <= 256:
                    layer.enable_cuda_graphs()
                    row["graph_us"] = timed_us(layer, inputs)
                    row["graph_equals_eager"] = bool(torch.equal(layer(inputs[0]).float(), y))
                    layer.disable_cuda_graphs()
                    row["device_us"] = graph_us(lambda: [layer(x) for x in inputs], reps=1) / len(inputs)
            best = min(row.get("graph_us", math.inf), row.get("device_us", math.inf),
                       row["eager_us"])
            row["vs_floor"] = best / max(row["bytes_floor_us"], row["flops_floor_us"])
            if "hf_us" in row:
                row["speedup_vs_hf"] = row["hf_us"] / best
            target = TARGETS_US.get((name, T))
            if target is not None:
                row["target_us"], row["target_met"] = target, best <= target
        except Exception as e:  # record and go on: one failing case must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            layer.disable_cuda_graphs()
        rows.append(row)
        print(fmt(row), flush=True)
        for kname, us in row.get("stages_us", {}).items():
            print(f"    {us:9.1f} us  {kname if len(kname) <= 110 else kname[:60] + '..' + kname[-48:]}",
                  flush=True)
    del layer, block
    torch.cuda.empty_cache()
    return rows


HEADER = (f"{'shape':<14}{'T':>6}{'eager':>10}{'graph':>10}{'device':>10}{'compiled':>10}{'hf':>10}{'bytes fl':>10}{'flops fl':>10}{'tile fl':>10}"
          f"{'vs floor':>9}{'speedup':>9}{'diff':>9}  target")


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:<14}{r['T']:>6}  ERROR {r['error'][:150]}"
    def num(key, spec, suffix=""):
        return f"{format(r[key], spec)}{suffix}" if key in r else "-"
    tgt = ""
    if "target_us" in r:
        tgt = f"<= {r['target_us']:.0f} us: {'met' if r['target_met'] else 'NOT met'}"
    if "hf_error" in r:
        tgt += f" hf: {r['hf_error'][:80]}"
    if "compiled_error" in r:
        tgt += f" compiled: {r['compiled_error'][:80]}"
    return (f"{r['shape']:<14}{r['T']:>6}{num('eager_us', '.1f'):>10}{num('graph_us', '.1f'):>10}"
            f"{num('device_us', '.1f'):>10}{num('compiled_us', '.1f'):>10}{num('hf_us', '.1f'):>10}{num('bytes_floor_us', '.1f'):>10}{num('flops_floor_us', '.1f'):>10}"
            f"{num('tile_flops_floor_us', '.1f'):>10}{num('vs_floor', '.2f', 'x'):>9}{num('speedup_vs_hf', '.2f', 'x'):>9}"
            f"{num('diff_vs_hf', '.1e'):>9}  {tgt}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, T {QUICK_TOKENS}")
    ap.add_argument("--shapes", help=f"comma-separated subset of {sorted(SHAPES)}")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--stages", action="store_true", help="also profile the layer's kernels")
    ap.add_argument("--compiled", action="store_true",
                    help="also time the layer under torch.compile (one compile per T)")
    ap.add_argument("--out", default="bench_out/moe_layer.json")
    a = ap.parse_args(argv)
    require_cuda()
    shapes = a.shapes.split(",") if a.shapes else (QUICK_SHAPES if a.quick else tuple(SHAPES))
    tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else (QUICK_TOKENS if a.quick else TOKENS)
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    import transformers
    bw, flops = copy_bandwidth()["best"], matmul_flops()  # best D2D copy, read + write counted
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "transformers": transformers.__version__,
               "copy_bandwidth_TBps": bw / 1e12, "bf16_matmul_TFLOPs": flops / 1e12}
    print(f"# {machine}")
    print(HEADER)
    rows = []
    t0 = time.time()
    for name in shapes:
        try:
            rows += run_shape(name, tokens, bw, flops, a.stages, a.compiled)
        except Exception as e:  # building the HF block or the swap failed: report, go on
            rows.append({"shape": name, "T": 0, "error": f"{type(e).__name__}: {e}"[:500]})
            print(fmt(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    print(f"# {time.time() - t0:.0f} s\n{HEADER}")
    for r in rows:
        print(fmt(r))
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "num_inputs": NUM_INPUTS, "rows": rows}, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
