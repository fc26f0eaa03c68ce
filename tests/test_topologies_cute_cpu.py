"""CPU: the `cute` backends of tp and dp_nvlink up to the kernel launch.

Backend resolution and the "auto" rule; the errors of "cute" without CUDA; and the host code of
both backends with the compiled kernels replaced by recorders (tests/_recorded.py) and the cute
device type set to "cpu": peer buffers created on the first call, sized from it, the checks of
later calls (before any launch), buffers shared by the topologies of equal shapes, and, in 2
gloo processes, the real-rank buffers (PeerBuffers.from_process_group with transport "ipc"),
the launches every rank makes, errors raised on every rank, and "auto" settled by all ranks
together.
The kernels themselves run in tests/gpu/test_topologies_cute_gpu.py.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from _dist import run_distributed
from moe_runtime import kernels
from moe_runtime.comm import peer_buffers as pb
from moe_runtime.topologies import (BackendNotImplementedError, auto_picks_cute, distributed,
                                    make_topology, resolve_group_backend)

E = 8


# ------------------------------------------------------------------------ backend resolution
def test_resolve_rules(monkeypatch):
    for topo in ("tp", "dp_nvlink", "dp_p2p"):
        assert resolve_group_backend(topo, "reference") == "reference"
        with pytest.raises(ValueError, match="'bogus'"):
            resolve_group_backend(topo, "bogus")
    with pytest.raises(BackendNotImplementedError, match="not implemented") as ei:
        resolve_group_backend("dp_p2p", "cute")
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, NotImplementedError)
    for cuda, cute in ((False, True), (True, False), (False, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(kernels, "cute_available", lambda: cute)
        assert resolve_group_backend("dp_p2p", "auto") == "reference"
        with pytest.raises(BackendNotImplementedError):
            resolve_group_backend("dp_p2p", "cute")
        for topo in ("tp", "dp_nvlink"):
            # "auto" is settled by the first CUDA call, together with the peers, on any rank
            assert resolve_group_backend(topo, "auto") == "auto"
            assert make_topology(topo, E).backend == "auto"
            if cuda and cute:
                assert resolve_group_backend(topo, "cute") == "cute"
                assert make_topology(topo, E, backend="cute").backend == "cute"
                continue
            with pytest.raises(ValueError, match=f"CUDA available={cuda}, cutlass importable={cute}"):
                resolve_group_backend(topo, "cute")
            with pytest.raises(ValueError, match="backend 'cute' needs a CUDA device"):
                make_topology(topo, E, backend="cute")


def test_peer_buffer_arguments_are_checked():
    for topo in ("tp", "dp_nvlink"):
        t = make_topology(topo, E, backend="reference", max_tokens_per_rank=7, transport="ipc")
        assert (t.max_tokens_per_rank, t.transport, t.peer_buffers) == (7, "ipc", None)
        assert t.max_tokens_per_call() == math.inf  # (the reference path takes any number)
        assert make_topology(topo, E).max_tokens_per_rank == distributed.DEFAULT_MAX_TOKENS_PER_RANK
        with pytest.raises(ValueError, match="max_tokens_per_rank must be >= 1"):
            make_topology(topo, E, max_tokens_per_rank=0)
        with pytest.raises(TypeError, match="max_tokens_per_rank must be an int"):
            make_topology(topo, E, max_tokens_per_rank=8.0)
        with pytest.raises(ValueError, match="transport must be one of"):
            make_topology(topo, E, transport="nvshmem")
    for topo in ("local", "dp_p2p"):
        with pytest.raises(ValueError, match="not to topology"):
            make_topology(topo, E, max_tokens_per_rank=8)


def facts(**over):
    """Two ranks on two GPUs of one host with peer access to each other; `over` = {rank: {..}}."""
    out = [{"host": "h", "gpu": f"g{r}", "peers": [f"g{1 - r}"], "cute": True, "unsupported": None}
           for r in range(2)]
    for r, changes in over.items():
        out[int(r[1:])].update(changes)
    return out


@pytest.mark.parametrize("over,ok,reason", [
    ({}, True, "2 ranks on 2 GPUs of one host"),
    ({"r1": {"cute": False}}, False, "rank 1: nvidia-cutlass-dsl is not importable"),
    ({"r0": {"unsupported": "dtype must be bf16"}}, False, "rank 0: no peer buffers for this call "
                                                           "(dtype must be bf16)"),
    ({"r1": {"host": "other"}}, False, "2 hosts"),
    ({"r1": {"gpu": "g0", "peers": []}, "r0": {"peers": []}}, False, "2 ranks share 1 GPU"),
    ({"r0": {"peers": []}}, False, "rank 0 has no CUDA peer access to the GPUs of ranks [1]"),
])
def test_auto_rule(over, ok, reason):
    got, why = auto_picks_cute(facts(**over))
    assert got is ok and reason in why, why


def test_auto_rule_needs_two_ranks():
    assert auto_picks_cute(facts()[:1]) == (False, "one rank: nothing to exchange over peer buffers")


# --------------------------------------------------------------- host code, launches recorded
@pytest.fixture
def cute_on_cpu(monkeypatch, recorded):
    """"cute" constructible and taking CPU tensors; kernels recorded; the local tp dispatch is
    the reference one (the CuTeDSL one needs CUDA tensors). Yields the recorded launches."""
    from moe_runtime.kernels import cute_ops, reference
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "cute_available", lambda: True)
    monkeypatch.setattr(distributed, "CUTE_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cute_ops, "dispatch", reference.dispatch)
    yield recorded


def batch(T, H=64, k=2, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k].to(torch.int32)
    return torch.randn(T, H, generator=g).to(dtype), ids, torch.rand(T, k, generator=g)


def test_cute_needs_cuda_tensors_and_auto_takes_the_reference_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "cute_available", lambda: True)
    x, ids, w = batch(3)
    for topo in ("tp", "dp_nvlink"):
        with pytest.raises(ValueError, match="backend 'cute' needs cuda tensors, got x on cpu"):
            make_topology(topo, E, backend="cute").dispatch(x, ids, w)
        auto, ref = make_topology(topo, E, backend="auto"), make_topology(topo, E, backend="reference")
        ys = []
        for t in (auto, ref):
            res = t.dispatch(x, ids, w)
            ys.append(t.combine(res.expert_x, res))
        assert torch.equal(ys[0], ys[1])
        assert auto.backend == "auto" and auto.peer_buffers is None  # CPU calls settle nothing


@pytest.mark.parametrize("topo", ["tp", "dp_nvlink"])
def test_buffers_sized_by_the_first_call_and_later_calls_checked_before_launch(cute_on_cpu, topo):
    calls = cute_on_cpu
    t = make_topology(topo, E, backend="cute", max_tokens_per_rank=16, align=4)
    x, ids, w = batch(5)
    res = t.dispatch(x, ids, w)
    b = t.peer_buffers
    assert b is res.handle["peer_buffers"] and b.mode == "virtual" and b.n_local == 1
    assert b.spec == pb.PeerSpec(1, 16, 64, 2, E, torch.bfloat16, 4, all_to_all=topo != "tp")
    t.combine(res.expert_x, res)
    kernels_run = [c[0] for c in calls]
    # one launch each (tp: combine + all-reduce fused; dp_nvlink decode: dispatch, combine)
    assert kernels_run == (["allreduce"] if topo == "tp" else ["dispatch", "combine"])
    n = len(calls)
    bad = {"hidden=32": batch(5, H=32), "dtype=torch.float16": batch(5, dtype=torch.float16),
           "top_k=3": batch(5, k=3), "max_tokens_per_rank=16": batch(17)}
    for what, args in bad.items():
        with pytest.raises(ValueError, match=what.replace("[", r"\[")):
            t.dispatch(*args)
    assert len(calls) == n, "launched despite a failed check"
    b.broken = "a device error"
    with pytest.raises(RuntimeError, match="reset"):
        t.dispatch(x, ids, w)
    assert len(calls) == n
    b.reset()
    res = t.dispatch(*batch(16))  # the limit itself is allowed
    t.combine(res.expert_x, res)
    assert len(calls) == 2 * n


@pytest.mark.parametrize("topo", ["tp", "dp_nvlink"])
def test_a_deep_copy_shares_the_peer_buffers(cute_on_cpu, topo):
    """copy.deepcopy of a topology holding peer buffers (e.g. of a model): the copy uses the
    same buffers (a copy of them kept the original's heap addresses in its table) and its
    calls run on them. Pickling it is refused (the same stale table), before any use it works."""
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(make_topology(topo, E, backend="cute"))).peer_buffers is None
    t = make_topology(topo, E, backend="cute", max_tokens_per_rank=16)
    x, ids, w = batch(5)
    res = t.dispatch(x, ids, w)
    t.combine(res.expert_x, res)
    t2 = copy.deepcopy(t)
    b = t2.peer_buffers
    assert b is t.peer_buffers
    res = t2.dispatch(x, ids, w)
    assert res.handle["peer_buffers"] is b
    t2.combine(res.expert_x, res)
    with pytest.raises(TypeError, match="PeerBuffers cannot be pickled"):
        pickle.dumps(t2)


@pytest.mark.parametrize("topo", ["tp", "dp_nvlink"])
def test_auto_over_the_token_limit(cute_on_cpu, monkeypatch, topo):
    """Settled on cute, "auto" runs a tp call over max_tokens_per_rank on the reference path
    (same T on every rank); dp_nvlink raises, naming the limit, before any launch."""
    calls = cute_on_cpu
    monkeypatch.setattr(distributed, "rank_peer_facts", lambda device: {})
    monkeypatch.setattr(distributed, "auto_picks_cute", lambda facts: (True, "forced by the test"))
    t = make_topology(topo, E, backend="auto", max_tokens_per_rank=8)
    ref = make_topology(topo, E, backend="reference")
    limit = 8 if topo == "dp_nvlink" else math.inf  # (what the engine's prefills keep within)
    assert t.max_tokens_per_call() == limit
    res = t.dispatch(*batch(8))
    t.combine(res.expert_x, res)
    assert t.backend == "cute" and calls and t.max_tokens_per_call() == limit
    n = len(calls)
    x, ids, w = batch(9)
    if topo == "dp_nvlink":
        with pytest.raises(ValueError, match="max_tokens_per_rank=8"):
            t.dispatch(x, ids, w)
    else:
        res, res_ref = t.dispatch(x, ids, w), ref.dispatch(x, ids, w)
        assert res.handle["peer_buffers"] is None
        assert torch.equal(t.combine(res.expert_x, res), ref.combine(res_ref.expert_x, res_ref))
    assert len(calls) == n, "launched over the limit"


@pytest.mark.parametrize("topo", ["tp", "dp_nvlink"])
def test_token_limit_of_a_call_follows_the_backend(cute_on_cpu, monkeypatch, topo):
    """max_tokens_per_call: max_tokens_per_rank on "cute"; none once "auto" settled on
    "reference" (the engine's warm-up and prefills read it: a dp_nvlink rank under Ray, one GPU
    per actor, settles there and had its prefills cut at 1024 tokens all the same)."""
    assert make_topology(topo, E, backend="cute", max_tokens_per_rank=8).max_tokens_per_call() == 8
    monkeypatch.setattr(distributed, "rank_peer_facts", lambda device: {})
    monkeypatch.setattr(distributed, "auto_picks_cute", lambda facts: (False, "refused by the test"))
    t = make_topology(topo, E, backend="auto", max_tokens_per_rank=8)
    res = t.dispatch(*batch(8))
    t.combine(res.expert_x, res)
    assert t.backend == "reference" and not cute_on_cpu
    assert t.max_tokens_per_call() == math.inf
    res = t.dispatch(*batch(9))  # (taken: the reference path has no peer buffers to fill)
    assert res.expert_x.shape[0] >= 9


@pytest.mark.parametrize("topo", ["tp", "dp_nvlink"])
def test_unsupported_first_call_raises_before_making_buffers(cute_on_cpu, topo):
    t = make_topology(topo, E, backend="cute")
    with pytest.raises(TypeError, match=f"{topo} rank 0, backend 'cute': dtype must be"):
        t.dispatch(*batch(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="16 bytes"):
        t.dispatch(*batch(4, H=12))
    assert t.peer_buffers is None and not cute_on_cpu
    big = make_topology(topo, 2048, backend="cute")  # (the kernels' limits, not PeerSpec's)
    with pytest.raises(ValueError, match="num_local_experts must be in"):
        big.dispatch(*batch(4))
    assert big.peer_buffers is None and not cute_on_cpu


def test_topologies_share_peer_buffers_per_group_spec_device_transport(cute_on_cpu):
    """Every MoE layer builds its own topology: those with the same group, PeerSpec, device and
    transport share one PeerBuffers (made by the first), held weakly by the registry."""
    import gc
    calls = cute_on_cpu

    def mk(topo, **kw):
        return make_topology(topo, E, backend="cute", max_tokens_per_rank=16, **kw)

    x, ids, w = batch(5)
    layers = [mk("dp_nvlink") for _ in range(3)] + [mk("tp"), mk("dp_nvlink", transport="ipc"),
                                                     mk("dp_nvlink", align=4)]
    for t in layers:
        t.dispatch(x, ids, w)
    b = layers[0].peer_buffers
    assert all(t.peer_buffers is b for t in layers[:3])
    assert len({id(t.peer_buffers) for t in layers}) == 4  # tp, transport, align: other buffers
    # back-to-back layers: combine each dispatch before the next; an older one is stale
    r1 = layers[1].dispatch(x, ids, w)
    layers[1].combine(r1.expert_x, r1)
    r2 = layers[2].dispatch(x, ids, w)
    n = len(calls)
    with pytest.raises(ValueError, match="stale"):
        layers[1].combine(r1.expert_x, r1)
    assert len(calls) == n
    layers[2].combine(r2.expert_x, r2)
    # a device error breaks the buffers for every sharer; one reset repairs them for all
    b.broken = "a device error"
    for t in layers[:3]:
        with pytest.raises(RuntimeError, match="reset"):
            t.dispatch(x, ids, w)
    b.reset()
    layers[0].dispatch(x, ids, w)
    # the registry does not keep buffers alive: without topologies, new ones are made
    key = (None, b.spec, x.device, "auto")
    assert distributed._SHARED[key] is b
    del layers, t, b, r1, r2
    gc.collect()
    assert key not in distributed._SHARED
    t = mk("dp_nvlink")
    t.dispatch(x, ids, w)
    assert distributed._SHARED[key] is t.peer_buffers


# ----------------------------------------------------------------- two real ranks (gloo, CPU)
def w_two_ranks(rank, world):
    """Both cute topologies on 2 real ranks, host code only (a throwaway process: the patches
    stay). Returns what the parent checks."""
    os.environ["MOE_RUNTIME_SMS"] = "132"
    torch.cuda.is_available = lambda: True
    from _recorded import record_launches
    from moe_runtime.kernels import cute_ops, reference
    distributed.CUTE_DEVICE_TYPE = "cpu"
    cute_ops.dispatch = reference.dispatch
    calls = record_launches(setattr)
    out = {}
    # dp: uneven T (5 and 1), buffers for 200 > DECODE_MAX_TOKENS: both ranks must pick prefill
    dp = make_topology("dp_nvlink", E, backend="cute", max_tokens_per_rank=200, transport="ipc")
    x, ids, w = batch(5 if rank == 0 else 1, seed=rank)
    res = dp.dispatch(x, ids, w)
    dp.combine(res.expert_x, res)
    b = dp.peer_buffers
    out["dp"] = dict(mode=b.mode, rank0=b.rank0, n_local=b.n_local, xshape=tuple(res.expert_x.shape),
                     rows_used=int(res.expert_offsets[-1]),
                     xout_rows=b.spec.xout_rows, T_row=b.table[pb.F_ARG_T].tolist(),
                     launches=[(c[0], c[1][0], c[2][3]) for c in calls], ep_mode=res.handle["ep"].mode)
    calls.clear()
    # tp: the same batch on both ranks; one-shot, then two-shot above 1 MiB of partials
    tp = make_topology("tp", E, backend="cute", max_tokens_per_rank=9000, transport="ipc")
    algos = []
    for T in (3, 8200):
        x, ids, w = batch(T, seed=7)
        res = tp.dispatch(x, ids, w)
        tp.combine(res.expert_x, res)
        algos.append([(c[0], c[1][0], c[2][1]) for c in calls])  # (kernel, algo, T)
        calls.clear()
    out["tp"] = dict(mode=tp.peer_buffers.mode, algos=algos,
                     recv_rows=tp.peer_buffers.view(pb.F_RECV_X).numel())
    # a first call that differs across ranks: every rank raises
    odd = make_topology("dp_nvlink", E, backend="cute", transport="ipc")
    try:
        odd.dispatch(*batch(2, H=64 if rank == 0 else 32))
        out["odd"] = None
    except ValueError as e:
        out["odd"] = str(e)
    out["odd_buffers"] = odd.peer_buffers
    # a second layer with dp's shapes reuses dp's buffers (after the same setup gather)
    dp2 = make_topology("dp_nvlink", E, backend="cute", max_tokens_per_rank=200, transport="ipc")
    res = dp2.dispatch(*batch(2, seed=rank))
    dp2.combine(res.expert_x, res)
    out["shared"] = dp2.peer_buffers is dp.peer_buffers
    # rank 0 lost its registry entry: every rank makes new buffers (none waits in a lone gather)
    if rank == 0:
        distributed._SHARED.clear()
    dp3 = make_topology("dp_nvlink", E, backend="cute", max_tokens_per_rank=200, transport="ipc")
    dp3.dispatch(*batch(2, seed=rank))
    out["remade"] = dp3.peer_buffers is not dp.peer_buffers
    # an unsupported first call on rank 1 only: every rank raises, naming rank 1, same type
    for bad in (dict(dtype=torch.float32), dict(H=12)):
        t = make_topology("dp_nvlink", E, backend="cute", transport="ipc")
        try:
            t.dispatch(*batch(2, **(bad if rank == 1 else {})))
        except (TypeError, ValueError) as e:
            out.setdefault("unsupported", []).append((type(e).__name__, str(e)))
    return out


def test_two_real_ranks_host_code():
    from moe_runtime.kernels import allreduce
    from moe_runtime.kernels.ep_combine import PH_CREDUCE, PH_CSEND
    from moe_runtime.kernels.ep_dispatch import PREFILL_PHASES
    outs = run_distributed(w_two_ranks, 2, timeout_s=120)
    for rank, o in enumerate(outs):
        dp = o["dp"]
        assert (dp["mode"], dp["rank0"], dp["n_local"]) == ("ipc", rank, 1)
        assert dp["xshape"] == (dp["rows_used"], 64) and dp["ep_mode"] == "prefill"
        assert dp["T_row"][rank] == (5 if rank == 0 else 1)
        assert dp["launches"] == ([("dispatch", ph, rank) for ph in PREFILL_PHASES]
                                  + [("combine", PH_CSEND, rank), ("combine", PH_CREDUCE, rank)])
        tp = o["tp"]
        assert tp["mode"] == "ipc" and tp["recv_rows"] == 0
        assert tp["algos"] == [[("allreduce", allreduce.COMBINE | allreduce.ONESHOT, 3)],
                               [("allreduce", allreduce.COMBINE | allreduce.TWOSHOT, 8200)]]
        assert o["odd"] and "the first CUDA call differs across ranks in hidden: rank 0 64, " \
                            "rank 1 32" in o["odd"], o["odd"]
        assert o["odd_buffers"] is None
        assert o["shared"] and o["remade"]
        (kind0, msg0), (kind1, msg1) = o["unsupported"]
        assert kind0 == "TypeError" and msg0.startswith(
            "dp_nvlink rank 1, backend 'cute': dtype must be torch.bfloat16"), msg0
        assert kind1 == "ValueError" and msg1.startswith(
            "dp_nvlink rank 1, backend 'cute': hidden=12: rows must be a multiple of 16 bytes"), msg1


def w_broken_then_reset(rank, world):
    """Two ranks of the cute tp host code (kernels recorded): call 1, buffers broken (as after
    a device error), call 2 refused, every rank resets, call 3 works."""
    os.environ["MOE_RUNTIME_SMS"] = "132"
    torch.cuda.is_available = lambda: True
    from _recorded import record_launches
    from moe_runtime.kernels import cute_ops, reference
    from moe_runtime.topologies import distributed
    distributed.CUTE_DEVICE_TYPE = "cpu"
    cute_ops.dispatch = reference.dispatch
    record_launches(setattr)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(3)]).int()
    w = torch.rand(3, 2, generator=g)
    tp = make_topology("tp", E, backend="cute", max_tokens_per_rank=16, transport="ipc")
    out = []
    for call in (1, 2, 3):
        if call == 2:
            tp.peer_buffers.broken = "a device error"
        if call == 3:
            tp.peer_buffers.reset()
        try:
            res = tp.dispatch(x, ids, w)
            tp.combine(res.expert_x, res)
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
    return out


def test_cute_buffers_broken_then_reset_work_again():
    """A device error breaks the buffers until every rank resets them; the topology itself is
    not marked out of step (that is for failed reference collectives)."""
    for out in run_distributed(w_broken_then_reset, 2, timeout_s=120):
        assert out[0] == out[2] == "ok" and "call reset()" in out[1], out


def w_sites(rank, world, name):
    """Two ranks of the cute host code (kernels recorded) with two layers on their own
    topologies: each call passes its site word to the kernels; an out-of-step record in the
    error words (what the kernels write when a peer's site differs) becomes the reference
    backends' ValueError; both topologies then refuse calls; a new one makes new buffers."""
    os.environ["MOE_RUNTIME_SMS"] = "132"
    torch.cuda.is_available = lambda: True
    from _recorded import record_launches
    from moe_runtime.kernels import cute_ops, reference
    distributed.CUTE_DEVICE_TYPE = "cpu"
    cute_ops.dispatch = reference.dispatch
    record_launches(setattr)

    def make():
        t = make_topology(name, E, backend="cute", max_tokens_per_rank=16, transport="ipc")
        t.register_layer()
        return t

    def call(t):
        res = t.dispatch(*batch(3, seed=7))
        t.combine(res.expert_x, res)
        return t.peer_buffers.table[pb.F_ARG_SITE, rank].item()

    a, b = make(), make()
    out = dict(ids=(a.topology_id, b.topology_id),
               words=[call(a), call(b), call(a)], sites=[pb.site_word(*t.site) for t in (a, b)])
    bufs = a.peer_buffers
    # what the kernels record when the peer is at layer a's third call and this rank at b's
    # second: the first mismatch, and the highest topology id of the sites they saw
    theirs = (a.topology_id, 0, 3)
    record = [pb.E_OUT_OF_STEP, 1 - rank, pb.site_word(b.topology_id, 0, 2), pb.site_word(*theirs),
              b.topology_id % (1 << pb.SITE_BITS[0])]
    bufs.view(pb.F_ERR, 0)[:5].copy_(torch.tensor(record, dtype=torch.int32))
    try:
        call(b)
    except ValueError as e:
        out["apart"] = str(e)
    out["refused"] = []
    for t in (a, b):
        try:
            call(t)
        except RuntimeError as e:
            out["refused"].append(str(e))
    c = make()
    out["new"] = (call(c), pb.site_word(*c.site), c.peer_buffers is not bufs, bufs.broken)
    return out


@pytest.mark.parametrize("name", ["tp", "dp_nvlink"])
def test_calls_send_their_site_and_ranks_out_of_step_raise(name):
    for rank, o in enumerate(run_distributed(w_sites, 2, name, timeout_s=120)):
        ia, ib = o["ids"]
        assert o["words"] == [pb.site_word(ia, 0, 1), pb.site_word(ib, 0, 1),
                              pb.site_word(ia, 0, 2)]
        assert o["sites"] == [pb.site_word(ia, 0, 2), pb.site_word(ib, 0, 1)]
        msg = o.get("apart")
        assert msg and "the ranks are out of step: this rank is at the dispatch #2 of layer 0 " \
            f"of topology #{ib}, rank {1 - rank} at the dispatch #3 of layer 0 of topology #{ia}" \
            in msg and "Build new topologies" in msg, msg
        assert len(o["refused"]) == 2 and all("out of step" in m for m in o["refused"]), o
        word, want, new_buffers, broken = o["new"]
        assert word == want and new_buffers and broken, o["new"]


def _as_cuda_rank(rank: int, cute: bool = True) -> list:
    """This spawned rank pretends to hold one of two GPUs with peer access (CPU tensors take the
    cute path, the compiled kernels are recorded, not run); returns the recorded launches."""
    os.environ["MOE_RUNTIME_SMS"] = "132"
    torch.cuda.is_available = lambda: True
    from _recorded import record_launches
    from moe_runtime.kernels import cute_ops, reference
    kernels.cute_available = lambda: cute
    distributed.CUTE_DEVICE_TYPE = "cpu"
    distributed.rank_peer_facts = lambda device: {"host": "h", "gpu": f"g{rank}",
                                                  "peers": [f"g{1 - rank}"]}
    cute_ops.dispatch = reference.dispatch
    return record_launches(setattr)


def w_auto_two_ranks(rank, world, cute_on, experts=E):
    """backend "auto" on 2 real ranks whose CuTeDSL availability is cute_on[rank]: the
    construction leaves it unresolved on both, so both join the first CUDA call's gather and
    settle the same way. Facts of two GPUs with peer access stand in for the CUDA queries."""
    calls = _as_cuda_rank(rank, cute_on[rank])
    t = make_topology("tp", experts, backend="auto", transport="ipc")
    before = t.backend
    res = t.dispatch(*batch(3, seed=7))
    t.combine(res.expert_x, res)
    out = dict(before=before, after=t.backend, reason=t.backend_reason, launches=len(calls),
               buffers=None if t.peer_buffers is None else t.peer_buffers.mode)
    try:  # CPU tensors once settled: the reference path while "reference", an error on cute
        x, ids, w = batch(3, seed=7)
        distributed.CUTE_DEVICE_TYPE = "cuda"
        res = t.dispatch(x, ids, w)
        out["cpu_call"] = "reference"
    except ValueError as e:
        out["cpu_call"] = str(e)
    return out


@pytest.mark.parametrize("cute_on", [(True, False), (True, True)])
def test_auto_is_settled_by_every_rank_together(cute_on):
    for rank, o in enumerate(run_distributed(w_auto_two_ranks, 2, cute_on, timeout_s=120)):
        assert o["before"] == "auto"
        if all(cute_on):
            assert (o["after"], o["buffers"], o["launches"]) == ("cute", "ipc", 1), o  # tp: 1 launch
            assert "backend 'cute' needs cuda tensors, got x on cpu" in o["cpu_call"]
        else:
            assert (o["after"], o["buffers"], o["launches"]) == ("reference", None, 0), o
            assert "rank 1: nvidia-cutlass-dsl is not importable" in o["reason"]
            assert o["cpu_call"] == "reference"


def test_auto_settles_on_the_reference_past_the_kernels_limits():
    """2048 local experts per rank (the kernels take 1024): both ranks settle on the reference,
    naming the limit, instead of raising at the first call."""
    for o in run_distributed(w_auto_two_ranks, 2, (True, True), 4096, timeout_s=120):
        assert (o["after"], o["buffers"], o["launches"]) == ("reference", None, 0), o
        assert "num_local_experts must be in [1, 1024], got 2048" in o["reason"], o


def w_capture_refused_in_combine(rank, world):
    """tp on cute, 2 ranks: a combine inside a (pretended) CUDA graph capture, which the cute
    calls refuse on every rank. What it raised, and how the topology and buffers were left."""
    from moe_runtime.comm import peer_buffers
    _as_cuda_rank(rank)
    t = make_topology("tp", E, backend="cute", transport="ipc")
    res = t.dispatch(*batch(3, seed=7))
    t.combine(res.expert_x, res)
    res = t.dispatch(*batch(3, seed=8))
    def refuse(self):  # (what refuse_capture raises on a CUDA device while capturing)
        raise RuntimeError("the multi-rank cute kernels cannot be captured in a CUDA graph")
    peer_buffers.PeerBuffers.refuse_capture = refuse
    distributed.stream_capturing = lambda: True
    try:
        t.combine(res.expert_x, res)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    return dict(raised=raised, out_of_step=t.__dict__.get("_out_of_step"),
                broken=t.peer_buffers.broken)


def test_a_combine_refused_for_a_capture_breaks_the_buffers_not_the_topology():
    """The ranks then reset() their buffers and go on (a topology out of step would refuse
    every later call)."""
    for o in run_distributed(w_capture_refused_in_combine, 2, timeout_s=120):
        assert "cannot be captured in a CUDA graph" in o["raised"], o
        assert o["out_of_step"] is None and "without its combine" in o["broken"], o


def w_setup_disagrees_or_fails(rank, world, backends, fail_rank):
    """tp with backend backends[rank] on 2 real ranks; rank `fail_rank` (if any) cannot allocate
    its peer heap. Returns what the first call and the second call did on this rank."""
    calls = _as_cuda_rank(rank)
    empty = torch.empty
    peer_bytes = pb.HeapLayout.of(pb.PeerSpec(world, 512, 64, 2, E, all_to_all=False)).peer_bytes

    def failing_empty(*size, **kw):
        if rank == fail_rank and size == (peer_bytes,):
            raise RuntimeError(f"CUDA out of memory on rank {rank}")
        return empty(*size, **kw)

    torch.empty = failing_empty
    t = make_topology("tp", E, backend=backends[rank], transport="ipc", max_tokens_per_rank=512)
    out = {}
    for i in range(2):  # the second call must not repeat the setup
        try:
            res = t.dispatch(*batch(3, seed=7))
            out[i] = ("ok", t.combine(res.expert_x, res))
        except Exception as e:  # noqa: BLE001 - the parent checks the type
            out[i] = (type(e).__name__, str(e))
    out.update(backend=t.backend, reason=t.backend_reason, buffers=t.peer_buffers,
               launches=len(calls))
    return out


def test_ranks_asking_different_backends_raise_on_every_rank():
    """One rank built with "cute", one with "auto" (or "reference", which never joins the peer
    buffer setup): the backend asked for is part of the first call's topology check, so both
    raise ValueError before any other collective (before: KeyError on the auto rank while the
    cute rank waited in the buffer exchange; a reference rank waited out the group timeout)."""
    for backends in (("cute", "auto"), ("cute", "reference")):
        outs = run_distributed(w_setup_disagrees_or_fails, 2, backends, -1, timeout_s=120,
                               group_timeout_s=20)
        for o in outs:
            kind, msg = o[0]
            assert kind == "ValueError" and "every rank must build the same topology" in msg, msg
            transport = "-" if backends[1] == "reference" else "ipc"  # (reference: no buffers)
            assert f"[('tp', 8, 'cute', 'ipc'), ('tp', 8, '{backends[1]}', '{transport}')]" in msg, \
                msg


@pytest.mark.parametrize("backend", ["auto", "cute"])
def test_peer_buffers_failing_on_one_rank(backend):
    """Making the buffers fails on rank 1 only: "auto" settles EVERY rank on "reference" (the
    reason names rank 1 and its error; the calls take the reference path, the second call does
    no setup again); "cute" raises on every rank, naming rank 1."""
    outs = run_distributed(w_setup_disagrees_or_fails, 2, (backend,) * 2, 1, timeout_s=120,
                           group_timeout_s=20)
    want = ("peer buffers: CUDA IPC heaps failed on rank(s) 1: RuntimeError: CUDA out of memory "
            "on rank 1")
    ref = make_topology("tp", E, backend="reference")
    res = ref.dispatch(*batch(3, seed=7))
    y = ref.combine(res.expert_x, res)
    for o in outs:
        assert o["buffers"] is None and o["launches"] == 0
        if backend == "auto":
            assert o["backend"] == "reference" and want in o["reason"], o["reason"]
            for call in (o[0], o[1]):
                assert call[0] == "ok" and torch.equal(call[1], y), call
        else:
            assert o["backend"] == "cute" and o[0] == ("PeerSetupError", want), o[0]


def test_setup_gather_runs_on_the_call_device(cute_on_cpu, monkeypatch):
    """The first cute call's setup gather runs with x's device current (NCCL object gathers use
    the current device)."""
    current = []
    on_device = pb._on_device

    class Recorder:
        def __init__(self, device):
            self.device, self.inner = device, on_device(device)

        def __enter__(self):
            current.append(self.device)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            current.pop()
            return self.inner.__exit__(*exc)

    gathered_on = []
    gather = distributed.all_gather_object

    def all_gather_object(obj, **kw):
        gathered_on.append(current[-1] if current else None)
        return gather(obj, **kw)

    monkeypatch.setattr(pb, "_on_device", Recorder)
    monkeypatch.setattr(distributed, "all_gather_object", all_gather_object)
    x, ids, w = batch(3)
    make_topology("tp", E, backend="cute").dispatch(x, ids, w)
    assert gathered_on == [x.device]


def test_timeout_s_checked_at_construction(monkeypatch):
    """A bad timeout_s fails when the topology is built: 0 (c10d: no bound), under 1 ms, NaN,
    not a number; with backend "cute" also above the kernels' MAX_TIMEOUT_S."""
    for topo in ("local", "tp", "dp_nvlink", "dp_p2p"):  # "local" ignores a valid one
        for bad in (0, 0.0004, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="timeout_s must be None or a finite number"):
                make_topology(topo, E, backend="reference", timeout_s=bad)
        for bad in ("10", True):
            with pytest.raises(TypeError, match="timeout_s must be None or a number"):
                make_topology(topo, E, timeout_s=bad)
        if topo != "local":
            assert make_topology(topo, E, timeout_s=0.001).timeout_s == 0.001
    assert make_topology("local", E, timeout_s=0.001).name == "local"
    pytest.importorskip("cutlass")
    from moe_runtime.kernels.peer_sync import MAX_TIMEOUT_S
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "cute_available", lambda: True)
    for topo in ("tp", "dp_nvlink"):
        with pytest.raises(ValueError, match="above the cute kernels' limit"):
            make_topology(topo, E, backend="cute", timeout_s=MAX_TIMEOUT_S * 2)
        assert make_topology(topo, E, backend="cute", timeout_s=MAX_TIMEOUT_S).timeout_s == \
            MAX_TIMEOUT_S
        # "auto" builds (the reference path takes any bound); the first CUDA call reports it
        assert make_topology(topo, E, timeout_s=MAX_TIMEOUT_S * 2).backend == "auto"


def test_auto_reports_a_timeout_the_kernels_refuse(cute_on_cpu, monkeypatch):
    """"auto" with timeout_s above the kernels' limit: this rank reports the call as one
    without peer buffers, so the auto rule keeps every rank on "reference"."""
    from moe_runtime.kernels.peer_sync import MAX_TIMEOUT_S
    seen = []
    monkeypatch.setattr(distributed, "rank_peer_facts", lambda device: {})
    monkeypatch.setattr(distributed, "auto_picks_cute",
                        lambda facts: seen.extend(facts) or (False, "recorded"))
    t = make_topology("tp", E, timeout_s=MAX_TIMEOUT_S * 2)
    t.dispatch(*batch(3))
    assert "above the cute kernels' limit" in seen[0]["unsupported"]
    assert t.backend == "reference" and not cute_on_cpu
