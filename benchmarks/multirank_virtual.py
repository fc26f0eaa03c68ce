#!/usr/bin/env python3
"""Multi-rank cute kernels: µs per call and bytes moved, W in {2, 4, 8} virtual ranks on ONE GPU.

A functional proxy: every "link" is this GPU's HBM, so the numbers show the kernels' cost and
protocol overhead, not NVLink speed. Per (W, tokens per rank T):
    dispatch (decode and/or prefill mode), dispatch + combine (identity experts: expert_y is the
    expert_x view), all-reduce one-shot / two-shot of [T, H] per rank, and the tp decode combine
    fused with the one-shot or the two-shot in one launch (tp_combine_all_reduce).
Timing: `gpu us` = GPU time per call with the launches queued behind a sleep kernel (host cost
hidden); `host us` = wall time per call of the eager Python call (TVM-FFI launches, no sync).
Bytes moved = rows that cross between ranks (dispatch/combine: W*T*k rows of H; one-shot:
W*(W-1)*T*H; two-shot: 2*(W-1)*T*H elements). Ceilings measured in the same run: the device copy
bandwidth (local_dispatch_combine.copy_bandwidth, read + write counted; `of copy` = 2 * bytes
moved / time over it, each moved byte being read and written once on this one GPU) and the
graph-replayed empty kernel (the floor of any launch). Never asserts a time.

    python3 benchmarks/multirank_virtual.py                     # H 7168, k 8, E 256, bf16
    python3 benchmarks/multirank_virtual.py --worlds 2 --tokens 128 --iters 5
    torchrun --nproc-per-node 2 benchmarks/multirank_virtual.py --real --tokens 128,4096
        # one rank per GPU, peer buffers from symmetric memory / CUDA IPC, next to NCCL
Writes JSON (--out, default bench_out/multirank_virtual.json) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_runtime.comm import peer_buffers as pb  # noqa: E402
from moe_runtime.comm.virtual import VirtualRanks  # noqa: E402
from moe_runtime.kernels import reference  # noqa: E402
from moe_runtime.kernels.allreduce import all_reduce, ar_input, tp_combine_all_reduce  # noqa: E402
from moe_runtime.kernels.ep_combine import ep_combine  # noqa: E402
from moe_runtime.kernels.ep_dispatch import DECODE_MAX_TOKENS, ep_dispatch  # noqa: E402


def gpu_us(fn, n, rendezvous=None):
    """GPU time per call: a sleep kernel holds the stream while the host queues n calls.

    rendezvous: with one process per GPU, a collective queued after the sleep and before the
    start event (e.g. an NCCL all_reduce of one element), so that every rank's timed calls
    start together. Without it the ranks' sleeps end apart (their host queueing and SM clocks
    differ: 0.5% of 0.1 s is 0.5 ms) and the first call's wait for its peers is charged to the
    n calls: on 2 H200s an NCCL all_reduce of one float then measured 40 us per call."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e8))  # ~0.1 s at ~2 GHz: longer than queueing n calls
    if rendezvous is not None:
        rendezvous()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def host_us(fn, n):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return dt


def routing(T, E, K, gen, device):
    ids = torch.rand(T, E, device=device, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    return ids, torch.softmax(torch.randn(T, K, device=device, generator=gen), dim=1)


def bench_world(W, tokens, a, rows):
    dev = torch.device("cuda")
    H, K, E = a.hidden, a.topk, a.experts
    vr = VirtualRanks(W, max(tokens), H, K, E, device=dev)
    b, gen = vr.bufs, torch.Generator(device=dev).manual_seed(W)
    print(f"# {b.describe()}", flush=True)
    for T in tokens:
        n = a.iters
        x = torch.randn(W * T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        ids, w = routing(W * T, E, K, gen, dev)
        toks = [T] * W
        row_bytes = H * 2
        modes = ["decode", "prefill"] if T <= a.decode_max else ["prefill"]
        for mode in modes:
            h = ep_dispatch(b, x, ids, toks, mode=mode, timeout_s=a.timeout)  # warm + checked
            ep_combine(b, h, h.expert_x, w, timeout_s=a.timeout)
            disp = lambda: ep_dispatch(b, x, ids, toks, mode=mode, timeout_s=a.timeout,  # noqa: E731
                                       check=False)

            y = torch.empty_like(x)

            def pair():
                hh = disp()
                ep_combine(b, hh, hh.expert_x, w, out=y, timeout_s=a.timeout, check=False)
            moved = W * T * K * row_bytes
            for name, fn, nbytes in (("dispatch", disp, moved), ("dispatch+combine", pair, 2 * moved)):
                g, hst = gpu_us(fn, n), host_us(fn, n)
                b.check_errors(f"{name} W={W} T={T}")
                rows.append(dict(W=W, T=T, op=name, mode=mode, gpu_us=g, host_us=hst, bytes=nbytes,
                                 gbps=nbytes / g / 1e3))
                print(f"  W={W} T={T} {name:<17} {mode:<8} gpu {g:9.1f} us  host {hst:8.1f} us  "
                      f"{nbytes / 2**20:9.1f} MiB  {nbytes / g / 1e3:7.1f} GB/s", flush=True)
        for algo in ("oneshot", "twoshot"):
            for i in range(W):
                ar_input(b, T, i).normal_(generator=gen)
            out = torch.empty(W, T, H, device=dev, dtype=torch.bfloat16)
            fn = lambda: all_reduce(b, None, T, algo=algo, out=out, timeout_s=a.timeout,  # noqa: E731
                                    check=False)
            all_reduce(b, None, T, algo=algo, timeout_s=a.timeout)
            g, hst = gpu_us(fn, n), host_us(fn, n)
            b.check_errors(f"{algo} W={W} T={T}")
            nbytes = (W * (W - 1) if algo == "oneshot" else 2 * (W - 1)) * T * row_bytes
            rows.append(dict(W=W, T=T, op=f"allreduce {algo}", mode="-", gpu_us=g, host_us=hst,
                             bytes=nbytes, gbps=nbytes / g / 1e3))
            print(f"  W={W} T={T} allreduce {algo:<7}  gpu {g:9.1f} us  host {hst:8.1f} us  "
                  f"{nbytes / 2**20:9.1f} MiB  {nbytes / g / 1e3:7.1f} GB/s", flush=True)
        if T <= a.decode_max and not a.skip_tp_combine:  # tp decode: local combine + one-shot
            xr, El = x[:T], E // W
            idr, wr = ids[:T], w[:T]
            eys, slots = [], []
            for r in range(W):
                ex, _o, slot = reference.dispatch(xr, idr, expert_start=r * El, num_local_experts=El)
                eys.append(ex)
                slots.append(slot)
            slots = torch.stack(slots)
            out = torch.empty(W, T, H, device=dev, dtype=torch.bfloat16)
            for algo in ("oneshot", "twoshot"):
                fn = lambda: tp_combine_all_reduce(b, eys, slots, wr, algo=algo,  # noqa: E731
                                                   out=out, timeout_s=a.timeout, check=False)
                tp_combine_all_reduce(b, eys, slots, wr, algo=algo, timeout_s=a.timeout)
                g, hst = gpu_us(fn, n), host_us(fn, n)
                b.check_errors(f"tp combine+{algo} W={W} T={T}")
                nbytes = (W * (W - 1) if algo == "oneshot" else 2 * (W - 1)) * T * row_bytes
                rows.append(dict(W=W, T=T, op=f"tp combine+{algo}", mode="decode", gpu_us=g,
                                 host_us=hst, bytes=nbytes, gbps=nbytes / g / 1e3))
                print(f"  W={W} T={T} tp combine+{algo:<7} gpu {g:9.1f} us  host {hst:8.1f} us",
                      flush=True)
    del vr, b
    torch.cuda.empty_cache()


def real_mode(a):
    """One rank per GPU under torchrun (issue 6), next to NCCL on the same data in the same run:
    dp_nvlink dispatch, and dispatch + combine, in each mode that takes T (decode up to
    ep_dispatch.DECODE_MAX_TOKENS; peer buffers from PeerBuffers.from_process_group) vs one /
    two all_to_all_single of the T*k rows each rank sends, per T; the
    one-shot / two-shot all-reduce of [T, H] per rank vs dist.all_reduce. Rank 0 prints a table
    and writes JSON (--out). Keep NCCL_NVLS_ENABLE=0 (no NVLink multicast on shared hosts)."""
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, W = dist.get_rank(), dist.get_world_size()
    H, K, E = a.hidden, a.topk, a.experts
    if any(T * K % W for T in a.tokens):
        raise SystemExit(f"--real: tokens * topk must divide by the {W} ranks (NCCL's even "
                         f"all_to_all_single splits), got tokens {a.tokens}, topk {K}")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(rank)
    token = torch.zeros(1, device="cuda")

    def rendezvous():  # the ranks' timed calls start together (gpu_us)
        dist.all_reduce(token)
    for T in a.tokens:  # buffers sized T per rank: dispatch decode (one launch) up to 128
        b = pb.PeerBuffers.from_process_group(pb.PeerSpec(W, T, H, K, E))
        if rank == 0:
            print(f"# {b.describe()}", flush=True)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids, w = routing(T, E, K, gen, "cuda")
        y = torch.empty_like(x)
        send = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        recv = torch.empty_like(send)

        def nccl_a2a():  # the T*k rows, evenly split over the ranks
            dist.all_to_all_single(recv, send)

        def nccl_pair():  # out and back
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(send, recv)
        a2a_bytes = T * K * H * 2 * (W - 1) // W
        cases = []
        for mode in (["decode", "prefill"] if T <= DECODE_MAX_TOKENS else ["prefill"]):
            def disp(mode=mode):
                return ep_dispatch(b, x, ids, mode=mode, timeout_s=a.timeout, check=False)

            def pair(disp=disp):
                h = disp()
                ep_combine(b, h, h.expert_x, w, out=y, timeout_s=a.timeout, check=False)
            cases += [(f"dispatch {mode}", disp, nccl_a2a, a2a_bytes),
                      (f"dispatch+combine {mode}", pair, nccl_pair, 2 * a2a_bytes)]
        ar = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        for algo in ("oneshot", "twoshot"):
            def ours(algo=algo):
                all_reduce(b, None, T, algo=algo, timeout_s=a.timeout, check=False)
            ar_input(b, T).copy_(ar)
            cases.append((f"allreduce {algo}", ours, lambda: dist.all_reduce(ar),
                          T * H * 2 * (W - 1) // W * 2))
        for op, fn, ref, nbytes in cases:
            fn()
            b.check_errors(f"{op} T={T} warm-up")
            dist.barrier()
            g = gpu_us(fn, a.iters, rendezvous)
            b.check_errors(f"{op} T={T}")
            dist.barrier()
            g_ref = gpu_us(ref, a.iters, rendezvous)
            dist.barrier()
            rows.append(dict(W=W, T=T, op=op, gpu_us=g, nccl_us=g_ref, bytes_per_gpu=nbytes,
                             transport=b.mode,
                             gbps_per_gpu=nbytes / g / 1e3, nccl_gbps_per_gpu=nbytes / g_ref / 1e3,
                             rank=rank))
        del b
        torch.cuda.empty_cache()
    if rank == 0:
        out = a.out.replace(".json", "_real.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(gpus=W, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        print(f"{W} x {torch.cuda.get_device_name()}, H {H}, k {K}, E {E}, bf16 (rank 0's view; "
              f"GB/s per GPU: all-to-all = bytes this rank sends to the others, all-reduce = "
              f"NCCL's bus bandwidth 2 (W-1)/W x bytes)")
        print(f"{'op':<26}{'T/rank':>7}{'ours us':>10}{'NCCL us':>10}{'ours GB/s':>11}{'NCCL GB/s':>11}")
        for r in rows:
            print(f"{r['op']:<26}{r['T']:>7}{r['gpu_us']:>10.1f}{r['nccl_us']:>10.1f}"
                  f"{r['gbps_per_gpu']:>11.1f}{r['nccl_gbps_per_gpu']:>11.1f}")
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--tokens", default="128,4096", help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--decode-max", type=int, default=128, help="also time decode mode up to this T")
    ap.add_argument("--timeout", type=float, default=10.0, help="device wait bound, s")
    ap.add_argument("--out", default="bench_out/multirank_virtual.json")
    ap.add_argument("--skip-tp-combine", action="store_true",
                    help="leave out the tp decode combine + all-reduce")
    ap.add_argument("--real", action="store_true", help="one rank per GPU under torchrun (multi-GPU)")
    a = ap.parse_args(argv)
    a.worlds = [int(v) for v in a.worlds.split(",")]
    a.tokens = [int(v) for v in a.tokens.split(",")]
    if not torch.cuda.is_available():  # (as the other benchmarks: stderr, exit 1)
        raise SystemExit("needs a CUDA GPU (the benchmark times CUDA kernels)")
    if a.real:
        return real_mode(a)
    from local_dispatch_combine import copy_bandwidth, empty_kernel_us
    bw, empty = copy_bandwidth()["best"], empty_kernel_us()
    rows = []
    for W in a.worlds:
        try:
            bench_world(W, a.tokens, a, rows)
        except Exception as ex:  # report and go on with the next W
            print(f"  W={W}: FAILED {type(ex).__name__}: {ex}", flush=True)
            rows.append(dict(W=W, op="error", error=f"{type(ex).__name__}: {ex}"))
    for r in rows:
        if "gpu_us" in r:
            r["of_copy_bw"] = 2 * r["bytes"] / (r["gpu_us"] * 1e-6) / bw
    meta = dict(device=torch.cuda.get_device_name(), copy_bw=bw, empty_kernel_us=empty,
                hidden=a.hidden, topk=a.topk,
                experts=a.experts, dtype="bfloat16", iters=a.iters, note="virtual ranks on one "
                "GPU: HBM stands in for NVLink (functional proxy)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n# {meta['device']}, H={a.hidden} k={a.topk} E={a.experts} bf16, {a.iters} calls each;"
          f" copy {bw / 1e12:.2f} TB/s, graph-replayed empty kernel {empty:.2f} us; JSON: {a.out}")
    print(f"{'W':>2} {'T/rank':>6} {'op':<22} {'mode':<8} {'gpu us':>9} {'host us':>9} "
          f"{'MiB moved':>10} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        if r.get("op") == "error":
            print(f"{r['W']:>2} {'':>6} ERROR {r['error'][:100]}")
            continue
        print(f"{r['W']:>2} {r['T']:>6} {r['op']:<22} {r['mode']:<8} {r['gpu_us']:>9.1f} "
              f"{r['host_us']:>9.1f} {r['bytes'] / 2**20:>10.1f} {r['gbps']:>8.1f} "
              f"{r['of_copy_bw']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
