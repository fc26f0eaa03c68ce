"""GPU: the multi-rank cute kernels with W in {2, 4, 8} VIRTUAL ranks on one GPU (one process,
one launch carrying every rank's CTAs, the same device code NVLink peers run).

Oracles: kernels/reference.py (dispatch applied per destination rank, combine over all ranks'
rows: comm/virtual.py) and torch's sum for the all-reduce. Every device wait is bounded; the
withheld-rank tests check that a missing peer becomes an exception naming rank and phase, and
out-of-range inputs become PeerDataError instead of an illegal address.
Run: source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_multirank_virtual_gpu.py
"""
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from moe_runtime.comm import peer_buffers as pb  # noqa: E402
from moe_runtime.comm.virtual import (VirtualRanks, apply_test_experts, expert_scale,  # noqa: E402
                                      kernel_token_slots, reference_dispatch_per_rank,
                                      reference_dp_combine)
from moe_runtime.kernels import reference  # noqa: E402
from _dist import run_distributed  # noqa: E402

H, K, E, T_MAX = 7168, 8, 256, 64
WORLDS = (2, 4, 8)
TIMEOUT_S = 5.0
UNEVEN = [T_MAX, 0, 17, 33, 1, T_MAX, 2, 40]   # rank 1 sends nothing


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def vr(request):
    v = VirtualRanks(request.param, T_MAX, H, K, E, device="cuda")
    yield v
    del v
    torch.cuda.empty_cache()


def routing(T, gen):
    """Distinct expert ids per token and normalized fp32 weights."""
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), dim=1)
    return ids, w


def inputs(tokens, gen):
    xs = [torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=gen) for t in tokens]
    rw = [routing(t, gen) for t in tokens]
    return xs, [r[0] for r in rw], [r[1] for r in rw]


def close(y, ref, what, tol=1e-2):
    """max |y - ref| / max(|ref|, 1) <= tol (bf16 rounding of the same fp32 sums, FMA vs mul+add)."""
    if y.numel() == 0:
        return
    err = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1.0)).max().item()
    assert err <= tol, f"{what}: max rel err {err:.3e} > {tol}"


def check_dispatch(v, handle, xs, ids):
    """expert_offsets equal reference.dispatch per destination; every (t, j) a rank owns sits
    exactly once inside its expert's segment holding x[t]; nothing else is mapped."""
    spec, El = v.spec, v.spec.num_local_experts
    X, I = torch.cat(xs), torch.cat(ids)
    ref = reference_dispatch_per_rank(X, I, spec)
    kslots = kernel_token_slots(v.bufs, handle)
    owner = (I.long() // El).cpu()
    for r in range(v.W):
        offs = handle.expert_offsets[r].cpu()
        assert torch.equal(offs, ref[r][1].cpu()), f"rank {r}: offsets {offs} != {ref[r][1]}"
        ks = kslots[r]
        mine = owner == r
        assert (ks[~mine] == -1).all(), f"rank {r}: rows mapped for experts it does not own"
        got = ks[mine]
        assert (got >= 0).all() and got.unique().numel() == got.numel(), f"rank {r}: slots"
        le = (I.long().cpu() - r * El)[mine]
        assert ((got >= offs[le]) & (got < offs[le + 1])).all(), f"rank {r}: row outside segment"
        t = torch.nonzero(mine)[:, 0]
        assert torch.equal(handle.expert_x[r][got.cuda()], X[t.cuda()]), f"rank {r}: row contents"
    return ref


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_dispatch_combine_match_reference(vr, mode):
    gen = torch.Generator(device="cuda").manual_seed(1 + vr.W)
    tokens = UNEVEN[:vr.W]
    xs, ids, ws = inputs(tokens, gen)
    for _ in range(2):  # the second call reuses every buffer and flag
        h = vr.dispatch(xs, ids, mode=mode, timeout_s=TIMEOUT_S)
        assert h.mode == mode
        ref = check_dispatch(vr, h, xs, ids)
        scale = expert_scale(E, "cuda")
        El = vr.spec.num_local_experts
        eys = [apply_test_experts(h.expert_x[r], h.expert_offsets[r], r * El, scale)
               for r in range(vr.W)]
        ys = vr.combine(h, eys, ws, timeout_s=TIMEOUT_S)
        y_ref = reference_dp_combine(ref, torch.cat(ids), torch.cat(ws), vr.spec, scale)
        for r, (y, yr) in enumerate(zip(ys, torch.split(y_ref, tokens))):
            assert y.shape == (tokens[r], H)
            close(y, yr, f"W={vr.W} {mode} combine rank {r}")


def test_capture_is_refused_and_leaves_the_buffers_usable(vr):
    """A CUDA graph would freeze each call's barrier epoch (a launch argument), so its replays
    would pass every wait: the calls refuse a capture before they change any state, and the
    same calls then run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens = UNEVEN[:vr.W]
    xs, ids, ws = inputs(tokens, gen)
    h = vr.dispatch(xs, ids, mode="decode", timeout_s=TIMEOUT_S)  # (compiled, eagerly)
    for call in (lambda: vr.dispatch(xs, ids, mode="decode", timeout_s=TIMEOUT_S, check=False),
                 lambda: vr.combine(h, h.expert_x, ws, timeout_s=TIMEOUT_S, check=False),
                 lambda: vr.all_reduce(torch.ones(vr.W, 4, H, device="cuda",
                                                  dtype=torch.bfloat16), check=False)):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                call()
    ys = vr.combine(h, h.expert_x, ws, timeout_s=TIMEOUT_S)  # (identity experts)
    for r in range(vr.W):
        ref = (ws[r].sum(1, keepdim=True) * xs[r].float()).bfloat16()
        close(ys[r], ref, f"W={vr.W} rank {r} after the refused captures")


def test_back_to_back_changing_tokens(vr):
    """200 calls, T per rank changing every call (zeros included), decode and prefill mixed, no
    memset in between: stale flags would hand out old rows or old counts."""
    gen = torch.Generator(device="cuda").manual_seed(100 + vr.W)
    El = vr.spec.num_local_experts
    for it in range(200):
        tokens = torch.randint(0, T_MAX + 1, (vr.W,), generator=torch.Generator().manual_seed(it)).tolist()
        if it % 7 == 0:
            tokens[it % vr.W] = 0
        xs, ids, ws = inputs(tokens, gen)
        h = vr.dispatch(xs, ids, mode="decode" if it % 3 else "prefill", timeout_s=TIMEOUT_S)
        I = torch.cat(ids).long()
        for r in range(vr.W):
            cnt = torch.bincount(I.flatten(), minlength=E)[r * El:(r + 1) * El]
            want = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)]).int()
            assert torch.equal(h.expert_offsets[r], want), f"call {it}: rank {r} offsets stale"
        ys = vr.combine(h, h.expert_x, ws, timeout_s=TIMEOUT_S)  # identity experts
        for r in range(vr.W):
            x32, w = xs[r].float(), ws[r]
            acc = torch.zeros_like(x32)
            for j in range(K):
                acc = acc + w[:, j:j + 1] * x32
            close(ys[r], acc.bfloat16(), f"call {it} rank {r} (tokens {tokens})")


def test_withheld_rank_times_out_naming_rank_and_phase(vr):
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs, ids, ws = inputs([8] * vr.W, gen)
    gone = vr.W - 1
    for mode in ("decode", "prefill"):
        t0 = time.time()
        with pytest.raises(pb.PeerTimeoutError) as ei:
            vr.dispatch(xs, ids, mode=mode, timeout_s=1.0, max_spins=200_000, skip_rank=gone)
        assert time.time() - t0 < 60, "the bounded waits took far too long"
        msg = str(ei.value)
        assert f"waiting for rank {gone}" in msg and "dispatch:" in msg, msg
        assert {e["rank"] for e in ei.value.errors} == set(range(vr.W)) - {gone}, msg
        with pytest.raises(RuntimeError, match="reset"):
            vr.dispatch(xs, ids, mode=mode)
        vr.bufs.reset()
    h = vr.dispatch(xs, ids, timeout_s=TIMEOUT_S)  # usable again after reset()
    check_dispatch(vr, h, xs, ids)
    x = torch.randn(vr.W, 4, H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(pb.PeerTimeoutError, match=f"all-reduce.*waiting for rank {gone}"):
        vr.all_reduce(x, algo="oneshot", timeout_s=1.0, max_spins=200_000, skip_rank=gone)
    vr.bufs.reset()


def test_withheld_rank_in_the_one_launch_combines(vr):
    """The decode combine (SEND + REDUCE in one launch) and the fused tp combine + all-reduce
    with one virtual rank withheld: the others raise PeerTimeoutError naming that rank and the
    phase, within the bounded waits; reset() makes the buffers usable again."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    xs, ids, ws = inputs([8] * vr.W, gen)
    gone, El = vr.W - 1, vr.spec.num_local_experts
    h = vr.dispatch(xs, ids, mode="decode", timeout_s=TIMEOUT_S)
    t0 = time.time()
    with pytest.raises(pb.PeerTimeoutError) as ei:
        vr.combine(h, h.expert_x, ws, timeout_s=1.0, max_spins=200_000, skip_rank=gone)
    assert time.time() - t0 < 60, "the bounded waits took far too long"
    errs = ei.value.errors
    assert errs and all(e["phase"] == 6 and e["peer"] == gone and e["rank"] != gone for e in errs)
    assert "combine: waiting for returned expert rows" in str(ei.value)
    vr.bufs.reset()
    ex, _o, slot = zip(*[reference.dispatch(xs[0], ids[0], expert_start=r * El,
                                            num_local_experts=El) for r in range(vr.W)])
    for algo in ("oneshot", "twoshot"):
        with pytest.raises(pb.PeerTimeoutError, match=f"all-reduce.*waiting for rank {gone}"):
            vr.tp_combine_all_reduce(list(ex), torch.stack(slot), ws[0], algo=algo,
                                     timeout_s=1.0, max_spins=200_000, skip_rank=gone)
        vr.bufs.reset()


@pytest.mark.parametrize("W", WORLDS)
def test_tp_combine_all_reduce_ragged_slices(W):
    """H = 40: 5 vectors per row, so n = 5 T vectors leave ragged two-shot slices (n % W != 0,
    per * W > n, n < W at T = 1): each vector must still be combined by the CTA index that reads
    it first. Outputs poisoned with NaN."""
    Hs = 40
    v = VirtualRanks(W, 8, Hs, K, E, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(31 + W)
    El, scale = v.spec.num_local_experts, expert_scale(E, "cuda")
    for T in (1, 2, 3, 8):
        x = torch.randn(T, Hs, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids, w = routing(T, gen)
        eys, slots, ref = [], [], torch.zeros(T, Hs, device="cuda")
        for r in range(W):
            ex, offs, slot = reference.dispatch(x, ids, expert_start=r * El, num_local_experts=El)
            eys.append(apply_test_experts(ex, offs, r * El, scale))
            slots.append(slot)
            ref += reference.combine(eys[-1], slot, w).float()
        for algo in ("oneshot", "twoshot"):
            out = torch.full((W, T, Hs), float("nan"), device="cuda", dtype=torch.bfloat16)
            v.tp_combine_all_reduce(eys, torch.stack(slots), w, algo=algo, out=out,
                                    timeout_s=TIMEOUT_S)
            for r in range(W):
                close(out[r], ref, f"tp combine + {algo} H={Hs} W={W} T={T} rank {r}")


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_all_reduce_matches_torch_sum(vr, algo):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for T in (1, 37, T_MAX, 5, T_MAX):  # repeated: barrier epochs advance, no memset
        x = torch.randn(vr.W, T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = vr.all_reduce(x, algo=algo, timeout_s=TIMEOUT_S)
        ref = x.float().sum(0)
        for r in range(vr.W):
            close(out[r], ref, f"{algo} W={vr.W} T={T} rank {r}")


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_tp_combine_all_reduce(vr, algo):
    """The combine and the all-reduce in ONE launch: each CTA combines the vectors its own
    all-reduce reads (two-shot: its part of every owner's slice), outputs poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    El, scale = vr.spec.num_local_experts, expert_scale(E, "cuda")
    for T in (1, 19, T_MAX, 3):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids, w = routing(T, gen)
        eys, slots, ref = [], [], torch.zeros(T, H, device="cuda")
        for r in range(vr.W):
            ex, offs, slot = reference.dispatch(x, ids, expert_start=r * El, num_local_experts=El)
            eys.append(apply_test_experts(ex, offs, r * El, scale))
            slots.append(slot)
            ref += reference.combine(eys[-1], slot, w).float()
        out = torch.full((vr.W, T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        vr.tp_combine_all_reduce(eys, torch.stack(slots), w, algo=algo, out=out,
                                 timeout_s=TIMEOUT_S)
        for r in range(vr.W):
            close(out[r], ref, f"tp combine + {algo} W={vr.W} T={T} rank {r}")


def test_out_of_range_inputs_are_refused_not_faulting(vr):
    """A topk_ids entry outside [0, E) and a token_slot entry past expert_y's rows are refused on
    the device (nothing is read or written with them) and raised as PeerDataError."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    xs, ids, _ = inputs([4] * vr.W, gen)
    ids[0][1, 2] = E + 5
    for mode in ("decode", "prefill"):
        with pytest.raises(pb.PeerDataError, match="topk_ids") as ei:
            vr.dispatch(xs, ids, mode=mode, timeout_s=TIMEOUT_S)
        assert ei.value.errors[0]["seen"] == E + 5 and ei.value.errors[0]["rank"] == 0
        vr.bufs.reset()
    El = vr.spec.num_local_experts
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    rid, w = routing(1, gen)
    eys, slots = [], []
    for r in range(vr.W):
        ex, _o, slot = reference.dispatch(x, rid, expert_start=r * El, num_local_experts=El)
        eys.append(ex)
        slots.append(slot)
    slots = torch.stack(slots)
    slots[0, 0, 0] = eys[0].shape[0]
    with pytest.raises(pb.PeerDataError, match="token_slot"):
        vr.tp_combine_all_reduce(eys, slots, w, timeout_s=TIMEOUT_S)
    vr.bufs.reset()


def test_ranks_at_other_sites_raise_on_every_rank(vr):
    """Every call carries its caller's site word (peer_buffers.site_word). The last virtual
    rank at another site (another layer) is reported by every rank that receives from it, and
    reports one of its peers; equal nonzero sites pass after a reset."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    W = vr.W
    xs, ids, ws = inputs([3] * W, gen)
    good = [pb.site_word(2, 1, 7)] * W
    odd = good[:-1] + [pb.site_word(3, 2, 7)]

    def check(ei):
        errs = {e["rank"]: e for e in ei.value.errors}
        assert sorted(errs) == list(range(W)), ei.value
        for r, e in errs.items():
            assert e["phase"] == pb.E_OUT_OF_STEP and e["apart_topology"] == 3, e
            if r < W - 1:
                assert (e["peer"], e["expected"], e["seen"]) == (W - 1, good[0], odd[-1]), e
            else:
                assert e["peer"] < W - 1 and (e["expected"], e["seen"]) == (odd[-1], good[0]), e
        vr.bufs.reset()

    for mode in ("decode", "prefill"):
        with pytest.raises(pb.PeerDataError, match="out of step") as ei:
            vr.dispatch(xs, ids, mode=mode, sites=odd, timeout_s=TIMEOUT_S)
        check(ei)
        check_dispatch(vr, vr.dispatch(xs, ids, mode=mode, sites=good, timeout_s=TIMEOUT_S),
                       xs, ids)
        vr.bufs.reset()
    x = torch.randn(W, 5, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    for algo in ("oneshot", "twoshot"):
        with pytest.raises(pb.PeerDataError, match="out of step") as ei:
            vr.all_reduce(x, algo=algo, sites=odd, timeout_s=TIMEOUT_S)
        check(ei)
        out = vr.all_reduce(x, algo=algo, sites=good, timeout_s=TIMEOUT_S)
        for r in range(W):
            close(out[r], x.float().sum(0), f"{algo} after a reset, rank {r}")
    El = vr.spec.num_local_experts
    rid, w = routing(2, gen)
    parts = [reference.dispatch(x[0, :2], rid, expert_start=r * El, num_local_experts=El)
             for r in range(W)]
    with pytest.raises(pb.PeerDataError, match="out of step") as ei:
        vr.tp_combine_all_reduce([p[0] for p in parts], torch.stack([p[2] for p in parts]), w,
                                 sites=odd, timeout_s=TIMEOUT_S)
    check(ei)


def w_reference_topologies(rank, world, x, ids, w, tokens, num_experts):
    """The REFERENCE dp_nvlink and tp topologies, one gloo process per rank on the CPU, with the
    row-wise test experts (x * c_e): per topology this rank's expert_offsets and y. dp_nvlink:
    rank r routes its own slice of tokens; tp: every rank holds the first tokens[0] tokens."""
    from moe_runtime.topologies import make_topology
    out, scale = {}, expert_scale(num_experts, "cpu")
    a = sum(tokens[:rank])
    batches = {"dp_nvlink": (x[a:a + tokens[rank]], ids[a:a + tokens[rank]], w[a:a + tokens[rank]]),
               "tp": (x[:tokens[0]], ids[:tokens[0]], w[:tokens[0]])}
    for name, (xr, ir, wr) in batches.items():
        topo = make_topology(name, num_experts, backend="reference")
        res = topo.dispatch(xr, ir, wr)
        ey = apply_test_experts(res.expert_x, res.expert_offsets, topo.expert_start, scale)
        out[name] = (res.expert_offsets, topo.combine(ey, res))
    return out


def test_equals_reference_topologies_over_gloo(vr):
    """Issue 5's oracle, literally: the same inputs through the reference dp_nvlink and tp
    topologies run by W gloo processes (CPU) and through the virtual ranks' kernels: equal
    expert_offsets on every rank, y within bf16 tolerance (dp_nvlink: uneven tokens with a zero
    rank, decode and prefill; tp: the local cute dispatch with each rank's expert range, then
    the fused combine + all-reduce)."""
    from moe_runtime.kernels import cute_ops
    gen = torch.Generator(device="cuda").manual_seed(21 + vr.W)
    tokens = UNEVEN[:vr.W]
    xs, ids, ws = inputs(tokens, gen)
    X, I, Wt = torch.cat(xs), torch.cat(ids), torch.cat(ws)
    ref = run_distributed(w_reference_topologies, vr.W, X.cpu(), I.cpu(), Wt.cpu(), tokens, E,
                          timeout_s=300)
    El, scale = vr.spec.num_local_experts, expert_scale(E, "cuda")
    for mode in ("decode", "prefill"):
        h = vr.dispatch(xs, ids, mode=mode, timeout_s=TIMEOUT_S)
        eys = [apply_test_experts(h.expert_x[r], h.expert_offsets[r], r * El, scale)
               for r in range(vr.W)]
        ys = vr.combine(h, eys, ws, timeout_s=TIMEOUT_S)
        for r in range(vr.W):
            offs, y_ref = ref[r]["dp_nvlink"]
            assert torch.equal(h.expert_offsets[r].cpu(), offs), f"dp {mode} rank {r} offsets"
            close(ys[r].cpu(), y_ref, f"dp_nvlink {mode} W={vr.W} rank {r} vs gloo reference")
    T = tokens[0]
    eys, slots = [], []
    for r in range(vr.W):
        ex, offs, slot = cute_ops.dispatch(xs[0], ids[0], expert_start=r * El, num_local_experts=El)
        assert torch.equal(offs.cpu(), ref[r]["tp"][0]), f"tp rank {r} offsets"
        eys.append(apply_test_experts(ex, offs, r * El, scale))
        slots.append(slot)
    out = vr.tp_combine_all_reduce(eys, torch.stack(slots), ws[0], timeout_s=TIMEOUT_S)
    for r in range(vr.W):
        assert out[r].shape == (T, H)
        close(out[r].cpu(), ref[r]["tp"][1], f"tp W={vr.W} rank {r} vs gloo reference")
