"""GPU: the `cute` backends of the tp and dp_nvlink topologies with REAL ranks: W = 2 processes
on ONE GPU (cuda:0 in both), each mapping the other's peer buffers with CUDA IPC (transport
"ipc": IPC handles work between processes on one device), a gloo group for the rendezvous.

Without MPS the two processes' kernels time-slice on the GPU, so a kernel waiting for the other
process's flags makes progress once the GPU switches to that process. Bounds: every device-side
wait KERNEL_TIMEOUT_S (the topologies' timeout_s), every pool call RUN_TIMEOUT_S (then the pool
kills its processes and the test fails naming the ranks); nothing can hang.

Each call runs the same inputs through the cute topology (cuda:0) and the reference topology
(CPU, gloo) in the same processes, with row-wise test experts (x * c_e): expert_offsets equal,
every expert receives the same multiset of rows, y within bf16 tolerance (tp: identical on both
ranks). Calls change T every time (T = 0 on one rank, T = 1, both ranks empty); dp_nvlink runs
with decode-mode buffers (max_tokens_per_rank <= 128: one launch) and prefill-mode buffers
(four launches, align 8); tp includes a call above 1 MiB of partials (two-shot) with the local
prefill dispatch. Also: "auto" stays "reference" when the ranks share a GPU; a rank that skips
a call makes its peer raise PeerTimeoutError naming rank, phase and peer; a rank that skips a
layer (its next layer meets its peer's skipped one) makes both ranks raise ValueError (out of
step), and tp ranks passing different T raise PeerDataError; W = 1 (one process).

Run: source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_topologies_cute_gpu.py
"""
import time

import pytest
import torch

pytestmark = pytest.mark.gpu  # (conftest skips these without CUDA)
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from _dist import DistPool  # noqa: E402
from moe_runtime.comm.peer_buffers import PeerTimeoutError  # noqa: E402
from moe_runtime.comm.virtual import apply_test_experts, expert_scale  # noqa: E402
from moe_runtime.topologies import make_topology  # noqa: E402

W, E, K, H = 2, 8, 4, 1024
KERNEL_TIMEOUT_S = 20.0
RUN_TIMEOUT_S = 180.0

# name -> (constructor arguments, per call: tokens per rank (tp: the replicated batch twice))
CASES = {
    "tp": (dict(max_tokens_per_rank=640, align=4),
           [(1, 1), (0, 0), (9, 9), (600, 600), (33, 33)]),
    "dp_nvlink_decode": (dict(max_tokens_per_rank=64, align=1),
                         [(5, 0), (1, 1), (0, 7), (64, 3), (0, 0), (2, 9)]),
    "dp_nvlink_prefill": (dict(max_tokens_per_rank=256, align=8),
                          [(200, 0), (1, 37), (0, 5), (256, 131)]),
}


def batch(seed: int, T: int):
    """x bf16 [T, H], distinct topk_ids int32 [T, K], softmax topk_weights fp32 (CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K].to(torch.int32)
    return x, ids, torch.softmax(torch.randn(T, K, generator=g), dim=1)


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal multisets of bf16 rows (bit patterns)."""
    ua, ca = torch.unique(a.view(torch.int16), dim=0, return_counts=True)
    ub, cb = torch.unique(b.view(torch.int16), dim=0, return_counts=True)
    return torch.equal(ua, ub) and torch.equal(ca, cb)


# ---------------------------------------------------------------- worker functions (per rank)
def w_compare(rank, world, name, kw, plan, gpu_per_rank=False):
    """Run `plan` through backend "cute" (cuda:0, or cuda:rank with gpu_per_rank: the
    multi-GPU runs of test_multi_gpu.py) and "reference" (CPU); per call what the parent
    checks."""
    dev = torch.device("cuda", rank if gpu_per_rank else 0)
    torch.cuda.set_device(dev)
    cute = make_topology(name, E, backend="cute", timeout_s=KERNEL_TIMEOUT_S, transport="ipc", **kw)
    ref = make_topology(name, E, backend="reference", align=kw["align"])
    El, start = cute.num_local_experts, cute.expert_start
    scale = expert_scale(E, "cpu")
    out = []
    for i, tokens in enumerate(plan):
        tokens = tokens[:world]
        if name == "tp":
            x, ids, w = mine = batch(100 + i, tokens[0])
        else:  # the global batch, this rank's slice
            x, ids, w = batch(100 + i, sum(tokens))
            a = sum(tokens[:rank])
            mine = tuple(t[a:a + tokens[rank]] for t in (x, ids, w))
        res = cute.dispatch(*(t.to(dev) for t in mine))
        offsets = res.expert_offsets.cpu()  # (dp: a view of the peer buffers; read it now)
        expert_x = res.expert_x.cpu()
        y = cute.combine(apply_test_experts(res.expert_x, res.expert_offsets, start,
                                            scale.to(dev)), res).cpu()
        rr = ref.dispatch(*mine)
        y_ref = ref.combine(apply_test_experts(rr.expert_x, rr.expert_offsets, start, scale), rr)
        counts = torch.bincount(ids.flatten().long(), minlength=E)[start:start + El].tolist()
        ro = rr.expert_offsets.tolist()
        bad_rows = [e for e in range(El) if not same_rows(
            expert_x[int(offsets[e]):int(offsets[e]) + counts[e]],
            rr.expert_x[ro[e]:ro[e] + counts[e]])]
        out.append(dict(tokens=tokens, offsets=offsets, ref_offsets=rr.expert_offsets,
                        bad_rows=bad_rows, y=y, y_ref=y_ref,
                        ep_mode=res.handle["ep"].mode if "ep" in res.handle else None))
    return dict(backend=cute.backend, mode=cute.peer_buffers.mode, out=out)


def w_auto(rank, world, gpu_per_rank=False):
    """backend "auto": the first CUDA call settles it (a collective); the tp reference dispatch
    is local, so no collective runs on CUDA tensors over gloo."""
    torch.cuda.set_device(rank if gpu_per_rank else 0)
    t = make_topology("tp", E, backend="auto")
    before = t.backend
    t.dispatch(*(a.cuda() for a in batch(3, 5)))
    return before, t.backend, t.backend_reason, t.peer_buffers is None


def w_missing_peer(rank, world, name):
    """One good call (makes the buffers), then rank 1 skips the next call: rank 0's kernels must
    give up after their bound and raise PeerTimeoutError."""
    torch.cuda.set_device(0)
    topo = make_topology(name, E, backend="cute", timeout_s=KERNEL_TIMEOUT_S, transport="ipc",
                         max_tokens_per_rank=8)
    args = [t.cuda() for t in batch(5, 4)]
    res = topo.dispatch(*args)
    topo.combine(res.expert_x, res)
    if rank == 1:
        return None
    topo.timeout_s = 2.0
    t0 = time.monotonic()
    try:
        res = topo.dispatch(*args)
        topo.combine(res.expert_x, res)
    except PeerTimeoutError as e:
        return dict(msg=str(e), ranks=[err["rank"] for err in e.errors], secs=time.monotonic() - t0)
    return dict(msg=None, secs=time.monotonic() - t0)


def w_out_of_step(rank, world, name, gpu_per_rank=False):
    """Three layers on their own cute topologies (as MoELayer(topology=<name>) builds them).
    Call 1: all on both ranks; call 2: rank 1 skips layer 0 (it raised before it), so its
    layer 1 meets rank 0's layer 0; call 3 on new topologies. tp also: ranks passing different
    T to one call (new topologies again). cuda:0, or cuda:rank with gpu_per_rank."""
    torch.cuda.set_device(rank if gpu_per_rank else 0)
    scale = expert_scale(E, "cuda")

    def build():
        topos = [make_topology(name, E, backend="cute", timeout_s=KERNEL_TIMEOUT_S,
                               transport="ipc", max_tokens_per_rank=64) for _ in range(3)]
        for t in topos:
            t.register_layer()
        return topos

    def layers(topos, T, skip=None):
        x, ids, w = (t.cuda() for t in batch(40 + rank * (name != "tp"), T))
        for i, t in enumerate(topos):
            if i != skip:
                res = t.dispatch(x, ids, w)
                y = t.combine(apply_test_experts(res.expert_x, res.expert_offsets,
                                                 t.expert_start, scale), res)
        return y.cpu()

    out, topos = [], build()
    for call in (1, 2, 3):
        if call == 3:
            topos = build()
        try:
            out.append(("ok", layers(topos, 9, skip=0 if call == 2 and rank == 1 else None)))
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    if name == "tp":
        try:
            layers(build()[:1], 3 + 2 * rank)
            out.append(("ok", None))
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    return out


# ---------------------------------------------------------------------------------- the tests
_pools: dict[int, DistPool] = {}


@pytest.fixture(scope="module")
def run():
    """run(fn, *args, world=W): fn on every rank of a pool of `world` processes, bounded by
    RUN_TIMEOUT_S. A failing call closes its pool (a faulted CUDA context must not leak into the
    next test); the next call starts a new one."""
    def call(fn, *args, world=W):
        if world not in _pools:
            _pools[world] = DistPool(world, group_timeout_s=60.0)
        try:
            return _pools[world].run(fn, *args, timeout_s=RUN_TIMEOUT_S)
        except BaseException as e:
            _pools.pop(world).close()
            if isinstance(e, TimeoutError):
                pytest.fail(f"{fn.__name__}: a rank hung or died; its processes were killed "
                            f"after {RUN_TIMEOUT_S:.0f} s: {e}")
            raise
    yield call
    for world in list(_pools):
        _pools.pop(world).close()


def check(case: str, results, world: int):
    name = "tp" if case == "tp" else "dp_nvlink"
    tol = 2e-2 if name == "tp" else 1e-2  # tp: partials rounded to bf16 before the sum
    want_ep = {"dp_nvlink_decode": "decode", "dp_nvlink_prefill": "prefill"}.get(case)
    for rank, r in enumerate(results):
        assert (r["backend"], r["mode"]) == ("cute", "ipc" if world > 1 else "virtual")
        for i, o in enumerate(r["out"]):
            where = f"{case} call {i} tokens {o['tokens']} rank {rank}"
            assert torch.equal(o["offsets"], o["ref_offsets"]), (where, o["offsets"], o["ref_offsets"])
            assert not o["bad_rows"], f"{where}: experts {o['bad_rows']} got other rows"
            assert o["y"].shape == o["y_ref"].shape == (o["tokens"][0 if name == "tp" else rank], H)
            torch.testing.assert_close(o["y"].float(), o["y_ref"].float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{where}: {m}")
            assert o["ep_mode"] == want_ep, where
    if name == "tp":  # every rank holds the whole result
        for rank, r in enumerate(results[1:], 1):
            for i, (a, b) in enumerate(zip(results[0]["out"], r["out"])):
                assert torch.equal(a["y"], b["y"]), f"tp call {i}: ranks 0 and {rank} disagree"


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_reference(run, case):
    kw, plan = CASES[case]
    check(case, run(w_compare, "tp" if case == "tp" else "dp_nvlink", kw, plan), W)


@pytest.mark.parametrize("case", ["tp", "dp_nvlink_decode"])
def test_one_rank_matches_reference(run, case):
    kw, plan = CASES[case]
    check(case, run(w_compare, "tp" if case == "tp" else "dp_nvlink", kw, plan, world=1), 1)


def test_auto_stays_reference_when_ranks_share_a_gpu(run):
    for before, after, reason, no_buffers in run(w_auto):
        assert (before, after, no_buffers) == ("auto", "reference", True)
        assert "2 ranks share 1 GPU" in reason, reason


@pytest.mark.parametrize("name,phase", [
    ("tp", "all-reduce: cross-rank barrier before reading peers' inputs"),
    ("dp_nvlink", "dispatch:"),  # (the ack of the previous call, or the row counts)
])
def test_skipped_call_raises_peer_timeout_naming_rank_phase_peer(run, name, phase):
    got, skipped = run(w_missing_peer, name)
    assert skipped is None
    assert got["msg"] is not None, f"no PeerTimeoutError after {got['secs']:.1f} s"
    assert got["ranks"] == [0] and phase in got["msg"] and "waiting for rank 1" in got["msg"], \
        got["msg"]
    assert got["secs"] < 30, got["secs"]


@pytest.mark.parametrize("name", ["tp", "dp_nvlink"])
def test_ranks_out_of_step_raise_on_every_rank(run, name):
    """Before the kernels compared sites, rank 0's layer 0 exchanged rows (dp) or partial sums
    (tp) with rank 1's layer 1 silently. Now ValueError on both ranks; new topologies (with new
    buffers: the old ones broke) give the first call's outputs again."""
    check_out_of_step(name, run(w_out_of_step, name))


def check_out_of_step(name, results):
    r0, r1 = results
    for rank, r in enumerate((r0, r1)):
        assert r[0][0] == "ok" and r[2][0] == "ok", (r[0][0], r[2][0])
        typ, msg = r[1]
        assert typ == "ValueError" and "the ranks are out of step" in msg and (
            f"rank {1 - rank} at the dispatch #2 of layer 0 of topology #") in msg, r[1]
        assert torch.equal(r[0][1], r[2][1]), f"rank {rank}: call 3 differs from call 1"
    if name == "tp":
        assert torch.equal(r0[0][1], r1[0][1])
        for rank, r in enumerate((r0, r1)):
            typ, msg = r[3]
            assert typ == "PeerDataError" and (
                f"this rank passed T={3 + 2 * rank}, rank {1 - rank} T={5 - 2 * rank}") in msg, r[3]
