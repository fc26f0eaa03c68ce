"""Local (TP=1) dispatch and combine: CuTeDSL kernels vs device copy bandwidth and vs the torch
reference; also measures the decode/prefill switch point that kernels/cute_ops.py uses.

Shapes (bf16): Qwen3-30B-A3B (H 2048, E 128, k 8), DeepSeek-V3 (7168, 256, 8), Mixtral
(4096, 8, 2); T in {1, 8, 64, 128, 512, 4096, 16384}.
Per row: µs per call from CUDA-graph replay (REPS calls captured in one graph), achieved TB/s on
the bytes read + written once (dispatch: x and T*k rows; combine: T*k rows and y; plus the int32
index tensors), the ratio to the device copy bandwidth measured in the same run (the best of
graph-replayed torch copy_ and an elementwise kernel on 256 MiB and 1 GiB), the speedup over the torch reference (eager; it syncs the host), and the
targets: T >= 4096 -> >= 90% of copy bandwidth; T <= 128 -> <= 1.2 x (graph-replayed empty
CuTeDSL kernel + the bytes at copy bandwidth). Measured references stand next to each target:
torch kernels that move the same bytes with no layout work (`same_bytes_torch`: a gather, and a
broadcast copy / batched GEMV with no gather); the bytes the op writes at the best write-only
rate of the run (driver memset, cuMemsetD32Async, and torch fill_: sequential writes; dispatch
writes k bytes per byte it reads, to k scattered rows); for a prefill dispatch, its copy launch
alone with the ranks and expert totals precomputed (what the slots launch costs on top); for
every dispatch, a scatter: a kernel that stores each row to its slots, given, after one
dependent load of them (no layout work; a reference, not a bound: one launch shape).
`--tune` times other launch shapes of the router, the decode dispatch, the prefill slots and
copy launches and combine (the measurements behind cute_compile's launch-shape constants).
Switch point: decode vs prefill timed over a finer T sweep per shape (dispatch decode only where
T*k <= cute_ops.DISPATCH_DECODE_MAX_ITEMS, its item cap); the per-shape crossing, in bytes of
expert rows moved (T*k*H*2), and the single threshold with the least total slowdown over all
sweep points are printed and stored under "crossing_bytes" / "switch_point".
Never asserts a time. Usage: python benchmarks/local_dispatch_combine.py --out bench_out/x.json
(--shapes / --tokens / --sweep-tokens restrict the run, e.g. to the decode rows:
--tokens 1,8,64,128 --sweep-tokens 1,8,32,64,128,256).
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass import BFloat16, Constexpr, Int32

from moe_runtime.kernels import cute_compile, cute_ops, dispatch_slots, reference, route_topk
from moe_runtime.kernels.device_rows import (load_segment, num_segments, row_vectors,
                                             store_segment, vec_width, warp_unit)

SHAPES = {"qwen3-30b-a3b": (2048, 128, 8), "deepseek-v3": (7168, 256, 8), "mixtral": (4096, 8, 2)}
TOKENS = (1, 8, 64, 128, 512, 4096, 16384)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REPS = 20


@cute.kernel
def _empty_kernel(m: cute.Tensor):
    cute.arch.thread_idx()


@cute.jit
def _empty(m: cute.Tensor, stream):
    _empty_kernel(m).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


@cute.kernel
def _scatter_kernel(mX: cute.Tensor, mSlot: cute.Tensor, mOut: cute.Tensor, H: Constexpr[int],
                    K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    VEC = vec_width(mX.element_type)
    lane = cute.arch.lane_idx()
    t, seg = warp_unit(WARPS, num_segments(H, mX.element_type, V))
    cute.arch.griddepcontrol_wait()  # launched as our kernels are (PDL): resident early
    if t < mX.shape[0]:
        frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), mX.element_type)
        load_segment(row_vectors(mX[t, None], VEC), frag, lane, seg, V, H // VEC)
        slot = Int32(-1)
        if lane < K:
            slot = mSlot[t, lane]
        for j in cutlass.range_constexpr(K):
            dst = cute.arch.shuffle_sync(slot, offset=j)
            if dst >= 0:
                store_segment(row_vectors(mOut[dst, None], VEC), frag, lane, seg, V, H // VEC)


@cute.jit
def _scatter(mX: cute.Tensor, mSlot: cute.Tensor, mOut: cute.Tensor, stream, H: Constexpr[int],
             K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    units = mX.shape[0] * num_segments(H, mX.element_type, V)
    _scatter_kernel(mX, mSlot, mOut, H, K, WARPS, V).launch(
        grid=(cute.ceil_div(units, WARPS), 1, 1), block=(WARPS * 32, 1, 1), stream=stream,
        use_pdl=True)


@functools.lru_cache(maxsize=None)
def _scatter_fn(H: int, K: int):
    rows, n = cute_compile._rows, cute.sym_int()  # x and slot share T
    return cute.compile(_scatter, rows(BFloat16, H, n), rows(Int32, K, n), rows(BFloat16, H),
                        make_fake_stream(use_tvm_ffi_env_stream=True), H, K, 4, 1,
                        options="--enable-tvm-ffi")


def scatter_us(x, slot, out) -> float:
    """µs of a dispatch without its layout work: one kernel whose warps load a token's row
    segment and its K slots (given), then store the segment to each slot (the stores wait for
    one dependent load). A reference, not a bound (one launch shape, 4 warps per block and
    V = 1, the most warps in flight at decode sizes; ours are tuned per size). Graph-replayed
    and, like our kernels, a programmatic dependent launch that waits first."""
    fn = _scatter_fn(x.shape[1], slot.shape[1])
    return graph_us(lambda: fn(x, slot, out))


def require_cuda() -> None:
    """Exit with one line where no CUDA GPU is visible (every benchmark here times kernels)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the benchmarks time CUDA kernels)")


def graph_us(fn, reps=REPS) -> float:
    """µs per call of fn, from replaying `reps` calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm: compile, workspaces
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    del g
    return best


def eager_us(fn, reps=5) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def copy_bandwidth() -> dict:
    """Bytes/s (read + write counted) of device copies of 256 MiB and 1 GiB: torch copy_
    (cudaMemcpy D2D) and an elementwise kernel (mul by 1); "best" of these is the baseline.
    Also the write-only rates of torch fill_ and of the driver's memset (cuMemsetD32Async;
    dispatch writes k bytes per byte it reads)."""
    res = {}
    for mib in (256, 1024):
        n = mib << 19  # bf16 elements
        src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        res[f"copy_{mib}MiB"] = 4 * n / (graph_us(lambda: dst.copy_(src), reps=5) * 1e-6)
        res[f"mul1_{mib}MiB"] = 4 * n / (graph_us(lambda: torch.mul(src, 1, out=dst), reps=5) * 1e-6)
        res[f"fill_{mib}MiB"] = 2 * n / (graph_us(lambda: dst.fill_(1.0), reps=5) * 1e-6)
        res[f"memset_{mib}MiB"] = 2 * n / (graph_us(lambda: _memset(dst), reps=5) * 1e-6)
        del src, dst
    res["best"] = max(v for k, v in res.items() if k.startswith(("copy", "mul1")))
    return res


def _memset(t: torch.Tensor) -> None:
    """Zero t (a multiple of 4 bytes) with the driver's memset on the current stream."""
    from cuda.bindings import driver  # (a dependency of nvidia-cutlass-dsl)
    err, = driver.cuMemsetD32Async(t.data_ptr(), 0, t.numel() * t.element_size() // 4,
                                   driver.CUstream(torch.cuda.current_stream().cuda_stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD32Async failed: {err}")


def empty_kernel_us() -> float:
    t = torch.zeros(4, device="cuda")
    fn = cute.compile(_empty, make_fake_compact_tensor(Int32, (4,), assumed_align=16),
                      make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    ti = t.view(torch.int32)
    return graph_us(lambda: fn(ti), reps=100)


def problem(T, H, E, k):
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(T, k, device="cuda")
    return x, ids, w


def dispatch_bytes(T, H, k):
    return T * H * 2 + T * k * H * 2 + 2 * T * k * 4


def combine_bytes(T, H, k):
    return T * k * H * 2 + T * H * 2 + T * k * 8


def modes_for(T, k):
    """Dispatch modes that take T tokens of k picks (decode has an item cap)."""
    return ("decode", "prefill") if T * k <= cute_ops.DISPATCH_DECODE_MAX_ITEMS else ("prefill",)


def same_bytes_torch(x, ex, slot, w):
    """Torch kernels that move dispatch's and combine's bytes with no layout work, one launch
    each. Returns ((gather, stream) for dispatch, (gather, stream) for combine):
      dispatch gather: index_select of x into the T*k expert-major rows (sources precomputed);
      dispatch stream: a broadcast copy of x into [T, k, H] (x read once, k contiguous copies
                       written: dispatch's DRAM traffic with no gather);
      combine gather:  index_select of the T*k expert rows into token-major [T, k, H] (reads
                       and writes T*k rows: more bytes than combine);
      combine stream:  a batched GEMV w[t] @ rows[t] over token-major [T, k, H] rows."""
    T, k = slot.shape
    H = x.shape[1]
    src = torch.zeros(ex.shape[0], dtype=torch.long, device=x.device)
    src[slot.flatten().long()] = torch.arange(T, device=x.device).repeat_interleave(k)
    rows = torch.empty_like(ex)
    bcast = torch.empty(T, k, H, dtype=x.dtype, device=x.device)
    flat_slot = slot.flatten().long()
    tok_rows = ex[flat_slot].view(T, k, H)
    gathered = torch.empty_like(tok_rows)
    wb = w.to(x.dtype).view(T, 1, k)
    y = torch.empty(T, 1, H, dtype=x.dtype, device=x.device)
    return ((lambda: torch.index_select(x, 0, src, out=rows),
             lambda: bcast.copy_(x.unsqueeze(1).expand(T, k, H))),
            (lambda: torch.index_select(ex, 0, flat_slot, out=gathered.view(T * k, H)),
             lambda: torch.bmm(wb, tok_rows, out=y)))


def prefill_ranks(ids, E, k):
    """(rank, workspace) of `ids` from the prefill slots launch, ready for copy launches alone
    (each adds the two sets of totals, one of them zero, and clears nothing)."""
    rank = torch.empty_like(ids)
    ws = torch.zeros(dispatch_slots.workspace_words(E), dtype=torch.int32, device="cuda")
    cute_compile.dispatch_slots_fn(E, k)(ids, rank, ws, 0)
    return rank, ws


def copy_only_us(x, ids, E, k, warps=cute_compile.DISPATCH_COPY_WARPS, v=None):
    """µs of the prefill dispatch's copy launch alone (ranks and expert totals already
    computed): the dispatch's row traffic without the slots launch. v None: the launch's own
    (cute_compile.dispatch_copy_v)."""
    rank, ws = prefill_ranks(ids, E, k)
    ex = torch.empty(ids.numel(), x.shape[1], dtype=x.dtype, device="cuda")
    offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
    slot = torch.empty_like(ids)
    fn = cute_compile.dispatch_copy_fn("bfloat16", x.shape[1], E, k, warps=warps, v=v)
    return graph_us(lambda: fn(x, ids, rank, ws, ex, offsets, slot, 0, 1))


def measure(name, H, E, k, T, bw, empty, write_bw):
    """Table rows for dispatch and combine at T tokens. Next to the target: `gather_us` and
    `stream_us`, graph-replayed torch kernels moving the same bytes without any layout work
    (same_bytes_torch); `write_floor_us`, the bytes the op writes at the best sequential
    write-only rate (memset / fill_: a reference for scattered rows, not a bound); and for
    a prefill dispatch `copy_only_us`, its copy launch alone with ranks and totals precomputed;
    for dispatch `scatter_us`, a scatter of the rows to their known slots (the stores after
    one dependent load, no layout work)."""
    x, ids, w = problem(T, H, E, k)
    rows = []
    dmode = cute_ops.select_dispatch_mode(T, k, H, x.dtype)
    cmode = cute_ops.select_combine_mode(T, k, H, x.dtype)
    ex, _, slot = cute_ops.dispatch(x, ids, expert_start=0, num_local_experts=E)
    torch_dispatch, torch_combine = same_bytes_torch(x, ex, slot, w)
    for op, mode, fn, ref, same, nbytes, written in (
        ("dispatch", dmode,
         lambda: cute_ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=dmode),
         lambda: reference.dispatch(x, ids, expert_start=0, num_local_experts=E),
         torch_dispatch, dispatch_bytes(T, H, k), T * k * (H * 2 + 4)),
        ("combine", cmode, lambda: cute_ops.combine_in_mode(ex, slot, w, mode=cmode),
         lambda: reference.combine(ex, slot, w), torch_combine, combine_bytes(T, H, k),
         T * H * 2)):
        us = graph_us(fn)
        ref_us = eager_us(ref)
        gather_us, stream_us = graph_us(same[0]), graph_us(same[1])
        write_floor_us = written / write_bw * 1e6
        floor_us = empty + nbytes / bw * 1e6
        if T >= 4096:
            target, met = ">=90% copy BW", nbytes / (us * 1e-6) >= 0.9 * bw
        elif T <= 128:
            target, met = f"<={1.2 * floor_us:.1f}us", us <= 1.2 * floor_us
        else:
            target, met = "-", None
        copy_us = copy_only_us(x, ids, E, k) if (op, mode) == ("dispatch", "prefill") else None
        scatter = scatter_us(x, slot, torch.empty_like(ex)) if op == "dispatch" else None
        rows.append(dict(shape=name, T=T, op=op, mode=mode, us=us, copy_only_us=copy_us,
                         scatter_us=scatter,
                         tbps=nbytes / (us * 1e-6) / 1e12,
                         ratio_copy=nbytes / (us * 1e-6) / bw, ref_us=ref_us, speedup=ref_us / us,
                         gather_us=gather_us, stream_us=stream_us,
                         write_floor_us=write_floor_us, floor_us=floor_us, target=target,
                         target_met=met, bytes=nbytes))
    return rows


def sweep(name, H, E, k, tokens=SWEEP):
    """decode vs prefill µs over `tokens` for dispatch and combine; crossing in bytes moved."""
    pts, cross = [], {}
    for T in tokens:
        x, ids, w = problem(T, H, E, k)
        ex, _, slot = cute_ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E,
                                                mode="prefill")
        pt = dict(T=T, moved=T * k * H * 2)
        for mode in modes_for(T, k):
            pt[f"dispatch_{mode}"] = graph_us(lambda: cute_ops.dispatch_in_mode(
                x, ids, expert_start=0, num_local_experts=E, mode=mode))
        for mode in ("decode", "prefill"):
            pt[f"combine_{mode}"] = graph_us(lambda: cute_ops.combine_in_mode(ex, slot, w, mode=mode))
        pts.append(pt)
    for op in ("dispatch", "combine"):
        both = [p for p in pts if f"{op}_decode" in p]  # decode above its item cap: no point
        faster = [p["moved"] for p in both if p[f"{op}_decode"] <= p[f"{op}_prefill"]]
        slower = [p["moved"] for p in both if p[f"{op}_decode"] > p[f"{op}_prefill"]]
        # largest size where decode still wins, below the first size where it loses
        first_loss = min(slower, default=float("inf"))
        cross[op] = max([m for m in faster if m < first_loss], default=0)
    return pts, cross


def tune(name, H, E, k):
    """Launch shapes, µs per variant: the router kernel's warps per block (without counts, as
    MoELayer runs it) from decode to prefill sizes (cute_compile.ROUTE_DECODE_MAX_TOKENS);
    the decode dispatch's block shapes (warps, item cap) that hold T * k, at T <= 256
    (cute_compile.DISPATCH_DECODE_SHAPES); at large T the warps of the prefill slots launch,
    (warps, V) of the prefill copy launch (alone, ranks and totals precomputed) and of combine."""
    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bias = torch.zeros(E, device="cuda")
    for T in (1, 128, 256, 512, 1024, 4096):
        logits = torch.randn(T, E, device="cuda").to(torch.bfloat16)
        ids, w = torch.empty(T, k, dtype=torch.int32, device="cuda"), torch.empty(T, k, device="cuda")
        counts = torch.empty(E, dtype=torch.int32, device="cuda")
        ws = torch.zeros(route_topk.workspace_words(E), dtype=torch.int32, device="cuda")
        for mode, warps in cute_compile.ROUTE_WARPS.items():
            fn = cute_compile.route_fn("bfloat16", E, k, False, False, 1, 1, True, False, warps)
            grid = min(-(-T // warps), (4 if mode == "decode" else 2) * sms)
            us = graph_us(lambda: fn(logits, bias, ids, w, counts, ws, 1.0, grid))
            out.append(dict(shape=name, T=T, op="route", warps=warps, us=us, bytes=T * E * 2))
    for T in (1, 8, 32, 64, 128, 256):
        x, ids, _ = problem(T, H, E, k)
        ex = torch.empty(T * k, H, dtype=x.dtype, device="cuda")
        offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        slot = torch.empty_like(ids)
        for warps, cap in cute_compile.DISPATCH_DECODE_SHAPES:
            if T * k > cap:
                continue
            fn = cute_compile.dispatch_decode_fn("bfloat16", H, E, k, warps, cap)
            us = graph_us(lambda: fn(x, ids, ex, offsets, slot, 0, 1,
                                     cute_ops.dispatch_decode_grid(T * k, E, sms)))
            out.append(dict(shape=name, T=T, op="dispatch_decode", warps=warps, cap=cap, us=us,
                            bytes=dispatch_bytes(T, H, k)))
    for T in (4096, 16384):
        x, ids, w = problem(T, H, E, k)
        rank, ws = prefill_ranks(ids, E, k)  # (slots alone keeps adding into one set)
        ex, _, slot = cute_ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E,
                                                mode="prefill")  # combine's input rows
        y = torch.empty_like(x)
        for warps in (8, 16):
            fn = cute_compile.dispatch_slots_fn(E, k, warps=warps)
            us = graph_us(lambda: fn(ids, rank, ws, 0))
            out.append(dict(shape=name, T=T, op="dispatch_slots", warps=warps, us=us,
                            bytes=T * k * 8))
        for warps in (4, 8):
            for v in (2, 4, 8):
                us = copy_only_us(x, ids, E, k, warps, v)
                out.append(dict(shape=name, T=T, op="dispatch_copy", warps=warps, v=v, us=us,
                                bytes=dispatch_bytes(T, H, k)))
            for v in (1, 2, 4):
                fn = cute_compile.combine_fn("bfloat16", H, k, warps, v)
                us = graph_us(lambda: fn(ex, slot, w, y))
                out.append(dict(shape=name, T=T, op="combine", warps=warps, v=v, us=us,
                                bytes=combine_bytes(T, H, k)))
    return out


def best_threshold(sweeps: dict, op: str) -> int:
    """The decode-if-moved<=threshold rule with the least total slowdown over every sweep point
    of every shape (sum of chosen time / best time), candidates = the measured sizes. Points
    where decode does not apply (dispatch above its item cap) run prefill whatever the rule."""
    pts = [p for ps in sweeps.values() for p in ps]

    def cost(th):
        total = 0.0
        for p in pts:
            dec = p.get(f"{op}_decode", float("inf"))
            chosen = dec if p["moved"] <= th and f"{op}_decode" in p else p[f"{op}_prefill"]
            total += chosen / min(dec, p[f"{op}_prefill"])
        return total
    return min(sorted({0} | {p["moved"] for p in pts}), key=cost)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/local_dispatch_combine.json")
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode/prefill sweep")
    ap.add_argument("--tune", action="store_true", help="also time other launch shapes")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of "
                    + ", ".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="T of the table rows")
    ap.add_argument("--sweep-tokens", default=",".join(map(str, SWEEP)),
                    help="T of the decode/prefill sweep")
    args = ap.parse_args()
    require_cuda()
    shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")]
    t0 = time.time()
    dev = torch.cuda.get_device_properties(0)
    copies = copy_bandwidth()
    bw = copies["best"]
    write_bw = max(v for k, v in copies.items() if k.startswith(("fill", "memset")))
    empty = empty_kernel_us()
    print(f"{dev.name} ({dev.multi_processor_count} SMs): copy bandwidth (best) {bw / 1e12:.2f} TB/s "
          f"[{', '.join(f'{k} {v / 1e12:.2f}' for k, v in copies.items() if k != 'best')}], "
          f"graph-replayed empty CuTeDSL kernel {empty:.2f} us")
    rows, sweeps, cross, tuned = [], {}, {}, []
    for name, (H, E, k) in shapes.items():
        for T in tokens:
            rows += measure(name, H, E, k, T, bw, empty, write_bw)
        if not args.no_sweep:
            sweeps[name], cross[name] = sweep(name, H, E, k, sweep_tokens)
        if args.tune:
            tuned += tune(name, H, E, k)
    switch = {op: best_threshold(sweeps, op) for op in ("dispatch", "combine")} if cross else {}
    result = dict(device=dev.name, sms=dev.multi_processor_count, copy_tbps=bw / 1e12,
                  copy_variants_tbps={k: v / 1e12 for k, v in copies.items()},
                  empty_kernel_us=empty, rows=rows, sweep=sweeps, crossing_bytes=cross,
                  switch_point=dict(
                      measured_bytes=switch,
                      in_code=dict(dispatch=cute_ops.DISPATCH_DECODE_MAX_BYTES,
                                   dispatch_items=cute_ops.DISPATCH_DECODE_MAX_ITEMS,
                                   combine=cute_ops.COMBINE_DECODE_MAX_BYTES)),
                  tune=tuned, seconds=time.time() - t0)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if cross:
        print("decode/prefill sweep, µs (dispatch decode | prefill, combine decode | prefill):")
        for name, pts in sweeps.items():
            for p in pts:
                print(f"  {name:14s} T={p['T']:5d} dispatch {p.get('dispatch_decode', float('nan')):8.2f} "
                      f"{p['dispatch_prefill']:8.2f}  combine {p['combine_decode']:8.2f} "
                      f"{p['combine_prefill']:8.2f}")
        print("decode/prefill crossing (bytes of expert rows moved, T*k*H*2):")
        for name, c in cross.items():
            print(f"  {name:14s} dispatch <= {c['dispatch']:>10d}  combine <= {c['combine']:>10d}")
        print(f"  best single threshold: dispatch {switch['dispatch']} B, combine {switch['combine']} B "
              f"(in code now: {cute_ops.DISPATCH_DECODE_MAX_BYTES}, {cute_ops.COMBINE_DECODE_MAX_BYTES})")
    print("gather / stream: torch kernels moving the same bytes with no layout work (an "
          "index_select; a broadcast copy or batched GEMV without gather); wr: the bytes "
          "written at the best sequential write-only rate, memset or fill_ (a reference); "
          "copy: the prefill dispatch's copy launch alone, ranks and totals precomputed; "
          "scatter: a kernel storing each row to its known slots after one dependent load "
          "(no layout work)")
    print(f"{'shape':14s} {'T':>6s} {'op':8s} {'mode':7s} {'us':>9s} {'TB/s':>6s} {'/copy':>6s} "
          f"{'copy':>8s} {'scatter':>8s} {'gather':>8s} {'stream':>8s} {'wr':>8s} "
          f"{'ref us':>9s} "
          f"{'speedup':>7s} {'target':>15s} met")
    for r in rows:
        met = "-" if r["target_met"] is None else ("yes" if r["target_met"] else "NO")
        copy = "-" if r["copy_only_us"] is None else f"{r['copy_only_us']:.2f}"
        scatter = "-" if r["scatter_us"] is None else f"{r['scatter_us']:.2f}"
        print(f"{r['shape']:14s} {r['T']:6d} {r['op']:8s} {r['mode']:7s} {r['us']:9.2f} "
              f"{r['tbps']:6.2f} {r['ratio_copy']:6.2f} {copy:>8s} {scatter:>8s} "
              f"{r['gather_us']:8.2f} "
              f"{r['stream_us']:8.2f} {r['write_floor_us']:8.2f} {r['ref_us']:9.1f} "
              f"{r['speedup']:7.1f} {r['target']:>15s} {met}")
    if tuned:
        print("launch shapes (µs, fraction of copy bandwidth):")
        for r in tuned:
            cap = f" cap={r['cap']}" if "cap" in r else ""
            print(f"  {r['shape']:14s} T={r['T']:5d} {r['op']:15s} warps={r['warps']}{cap} "
                  f"V={r.get('v', cute_compile.DISPATCH_DECODE_V)} {r['us']:8.2f} us "
                  f"{r['bytes'] / (r['us'] * 1e-6) / bw:5.2f}")
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
