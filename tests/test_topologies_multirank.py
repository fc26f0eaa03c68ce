"""tp / dp_nvlink / dp_p2p (reference backend) in 1, 2 and 4 gloo processes vs the `local` topology.

One spawned pool per world size serves every case (tests/_dist.py). Each case dispatches, runs
identity experts and real per-expert functions on the segments given by expert_offsets, combines,
and the parent checks: offsets, the rows each expert received, identity combine = x * sum(w),
and equality with LocalTopology on the concatenated tokens (DP) or the shared batch (TP).
"""
from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _dist import DistPool, RankError, run_distributed
from moe_runtime.comm import CollectiveError
from moe_runtime.topologies import LocalTopology, fixed_capacity, make_topology

TOPOS = ("tp", "dp_nvlink", "dp_p2p")
WORLDS = (1, 2, 4)
E = 8  # divisible by every world size above


# ---------------------------------------------------------------------------------------------
# data and experts (deterministic, imported by the workers too)
def tiny_cfg():
    """The fp32 MoEConfig of the layer-level workers: H 8, E experts, top-2, I 4."""
    from moe_runtime import MoEConfig
    return MoEConfig(hidden_size=8, num_experts=E, top_k=2, moe_intermediate_size=4,
                     dtype=torch.float32)


def planted_failure(module, args):
    """Forward pre-hook of the experts (an error between a dispatch and its combine) or of the
    router (an error before the dispatch)."""
    raise RuntimeError("planted expert failure")


def make_batch(case: dict, world: int):
    """Global batch: x [sum(T), H] (case dtype), ids int32 [sum(T), k], weights fp32, T list."""
    g = torch.Generator().manual_seed(case["seed"])
    Ts = [case["T"][r % len(case["T"])] for r in range(world)]
    T, k, H, E = sum(Ts), case["k"], case["H"], case["E"]
    x = torch.randn(T, H, generator=g).to(case["dtype"])
    mode = case.get("route", "random")
    if mode == "random":
        ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    elif mode == "one":  # every token to the same k experts (the last ones: last rank)
        ids = (E - 1 - torch.arange(k)).expand(T, k)
    elif mode == "even":  # odd experts never chosen
        ids = torch.rand(T, E // 2, generator=g).argsort(-1)[:, :k] * 2
    else:
        raise ValueError(mode)
    w = torch.rand(T, k, generator=g) + 0.1
    return x, ids.to(torch.int32).contiguous(), w.float(), Ts


def expert_fn(kind: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Global expert e applied row-wise to x [n, H] (same weights on every rank)."""
    if kind == "identity":
        return x
    if kind == "scale":
        return (x.float() * (1.0 + 0.25 * e)).to(x.dtype)
    if kind == "swiglu":
        H, inter = x.shape[1], 8
        g = torch.Generator().manual_seed(1000 + e)
        w1, w3 = (torch.randn(H, inter, generator=g).to(x.device) / H ** 0.5 for _ in range(2))
        w2 = torch.randn(inter, H, generator=g).to(x.device) / inter ** 0.5
        xf = x.float()
        return ((torch.nn.functional.silu(xf @ w1) * (xf @ w3)) @ w2).to(x.dtype)
    raise ValueError(kind)


def run_experts(kind: str, expert_x, offsets, expert_start: int) -> torch.Tensor:
    """expert_y: each local expert's function on its segment (padding/tail rows: zeros)."""
    y = torch.zeros_like(expert_x)
    off = offsets.tolist()
    for e in range(len(off) - 1):
        y[off[e]:off[e + 1]] = expert_fn(kind, expert_start + e, expert_x[off[e]:off[e + 1]])
    return y


def my_inputs(case, rank, world, topo_name):
    x, ids, w, Ts = make_batch(case, world)
    if not topo_name.startswith("tp"):  # DP: this rank's slice of the batch
        a = sum(Ts[:rank])
        x, ids, w = x[a:a + Ts[rank]], ids[a:a + Ts[rank]], w[a:a + Ts[rank]]
    if case.get("noncontig"):
        x, ids, w = (t.t().contiguous().t() for t in (x, ids, w))
    return x, ids, w


# ---------------------------------------------------------------------------------------------
# worker functions: fn(rank, world, *args)
_NCCL_GROUP = []  # per worker process: the NCCL group of case["nccl"] runs, made once


def rank_device_and_group(rank: int, case: dict):
    """(device, group) of a case: CPU and the default (gloo) group; with case["nccl"] (the
    multi-GPU runs, tests/gpu/test_multi_gpu.py) cuda:rank and an NCCL group of all ranks."""
    if not case.get("nccl"):
        return torch.device("cpu"), None
    from moe_runtime.comm import new_group
    torch.cuda.set_device(rank)
    if not _NCCL_GROUP:
        _NCCL_GROUP.append(new_group(backend="nccl", timeout_s=60.0))
    return torch.device("cuda", rank), _NCCL_GROUP[0]


def w_case(rank, world, topo_name, case):
    dev, group = rank_device_and_group(rank, case)
    topo = make_topology(topo_name, case["E"], group=group, align=case["align"],
                         backend="reference")
    x, ids, w = (t.to(dev) for t in my_inputs(case, rank, world, topo_name))
    with (fixed_capacity([topo], max(max(make_batch(case, world)[3]), 1)) if case.get("fixed")
          else contextlib.nullcontext()):
        res = topo.dispatch(x, ids, w)
        y_id = topo.combine(res.expert_x, res)
        y = topo.combine(run_experts(case["experts"], res.expert_x, res.expert_offsets,
                                     topo.expert_start), res)
    assert bool(res.handle.get("fixed")) == bool(case.get("fixed"))
    n = int(res.expert_offsets[-1])
    return {"y_id": y_id.cpu(), "y": y.cpu(), "offsets": res.expert_offsets.cpu(),
            "rows": res.expert_x[:n].clone().cpu(), "expert_start": topo.expert_start,
            "x_contig": x.is_contiguous(), "T": x.shape[0], "device": str(y.device)}


def w_bad_inputs(rank, world, topo_name):
    """Every bad call, caught here: [(label, exception class name, message)]."""
    x = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    w = torch.rand(4, 2)
    calls = {
        "id_high": lambda t: t.dispatch(x, torch.full_like(ids, E), w),
        "id_negative": lambda t: t.dispatch(x, ids - 1, w),
        "id_repeat": lambda t: t.dispatch(x, torch.zeros_like(ids), w),
        "ids_int64": lambda t: t.dispatch(x, ids.long(), w),
        "w_fp64": lambda t: t.dispatch(x, ids, w.double()),
        "x_int": lambda t: t.dispatch(x.long(), ids, w),
        "x_3d": lambda t: t.dispatch(x.view(4, 4, 4), ids, w),
        "ids_rows": lambda t: t.dispatch(x, ids[:3], w[:3]),
        "w_shape": lambda t: t.dispatch(x, ids, w[:, :1]),
        "device": lambda t: t.dispatch(x, ids, w.to("meta")),
        "k_gt_E": lambda t: t.dispatch(x, torch.zeros(4, E + 1, dtype=torch.int32),
                                       torch.zeros(4, E + 1)),
        "combine_shape": lambda t: t.combine(torch.zeros(1, 16), t.dispatch(x, ids, w)),
        "E_indivisible": lambda t: make_topology(topo_name, 4 * world + 1, backend="reference"),
        # (CPU: refused at construction; with CUDA: by the first call with CPU tensors)
        "backend_cute": lambda t: make_topology(topo_name, E, backend="cute").dispatch(x, ids, w),
        "backend_bogus": lambda t: make_topology(topo_name, E, backend="bogus"),
        "align_0": lambda t: make_topology(topo_name, E, align=0),
    }
    topo = make_topology(topo_name, E, backend="reference")
    out = []
    for label, call in calls.items():
        try:
            call(topo)
            out.append((label, None, ""))
        except Exception as e:  # noqa: BLE001 - the parent checks the type
            out.append((label, type(e).__name__, str(e), isinstance(e, ValueError)))
    return out


def w_stall(rank, world, topo_name, use_call_timeout):
    """Rank 1 never joins; rank 0 must raise within the bound. Returns (error or None, secs)."""
    from moe_runtime.comm import new_group
    bound = 1.0
    group = new_group(timeout_s=60.0 if use_call_timeout else bound)
    topo = make_topology(topo_name, E, group=group, backend="reference",
                         timeout_s=bound if use_call_timeout else None)
    if rank == 1:
        time.sleep(bound + 1.5)
        return None, 0.0
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    t0 = time.monotonic()
    try:
        res = topo.dispatch(x, ids, torch.rand(3, 2))
        topo.combine(res.expert_x, res)
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def w_mismatched_topology(rank, world, topo_name, other):
    """Rank 1 builds `other` = (topology, num_experts, backend), rank 0 (topo_name, E,
    "reference"): each returns (exception type, message) of its first dispatch."""
    name, experts, backend = (topo_name, E, "reference") if rank == 0 else other
    topo = make_topology(name, experts, backend=backend)
    x, ids = torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 3]], dtype=torch.int32)
    try:
        topo.dispatch(x, ids, torch.rand(3, 2))
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("topo_name", TOPOS)
def test_ranks_with_another_topology_raise_on_every_rank(pools, topo_name):
    """Another num_experts (or topology) on one rank: its rows would have other sizes (gloo
    aborts the process) or, under tp, another split's partial sums would be added silently."""
    other = "dp_p2p" if topo_name == "tp" else "tp"
    shown = lambda name, experts, backend: (  # noqa: E731 (transport: where peer buffers may be)
        f"('{name}', {experts}, '{backend}', "
        f"'{'-' if name == 'dp_p2p' or backend == 'reference' else 'auto'}')")
    cases = [(topo_name, E // 2, "reference"), (other, E, "reference")]
    if topo_name != "dp_p2p":  # (another backend: on a GPU the two would wait in different
        cases.append((topo_name, E, "auto"))  # collectives until the group's timeout)
    for peer in cases:
        for typ, msg in pools(2).run(w_mismatched_topology, topo_name, peer):
            assert typ == "ValueError" and "every rank must build the same topology" in msg, msg
            assert f"[{shown(topo_name, E, 'reference')}, {shown(*peer)}]" in msg, msg


def w_out_of_step(rank, world, topo_name, failure):
    """Call 1 on both ranks; on call 2 rank 1 fails (`failure`: "validation", x in float64 to
    the topology's dispatch; "layer_input", the same x refused by the MoELayer before its
    dispatch; "router", an error in the MoELayer's router; or "experts", an error between
    dispatch and combine in a MoELayer) and goes on; each rank then makes calls 2 and 3.
    Calls 1 and 3 take the same tokens, call 2 others. Returns each call's (exception type,
    message) or "ok", then whether calls 1 and 3 returned the same output."""
    from moe_runtime import MoELayer
    from moe_runtime.comm import new_group
    cfg = tiny_cfg()
    torch.manual_seed(0)
    group = new_group()  # (a timed-out gloo collective leaves its group unusable: not the pool's)
    layer = MoELayer(cfg, topology=make_topology(topo_name, E, group=group, backend="reference",
                                                 timeout_s=3), backend="reference")
    torch.manual_seed(rank if topo_name != "tp" else 0)
    x = torch.randn(3, 8)

    out, ys = [], {}
    for call in (1, 2, 3):
        handle = None
        xx, fails = (2 * x if call == 2 else x), call == 2 and (
            rank == 1 or failure.endswith("_everywhere"))
        if fails and failure.startswith(("validation", "layer_input")):
            xx = x.double()
        elif fails and failure == "router":
            handle = layer.router.register_forward_pre_hook(planted_failure)
        elif fails and failure.startswith("experts"):
            handle = layer.experts.register_forward_pre_hook(planted_failure)
        try:
            with torch.no_grad():
                if failure in ("validation", "combine_check"):  # the topology itself
                    ids, w = layer.router(xx.float())
                    res = layer.topology.dispatch(xx, ids, w)
                    ey = res.expert_x.double() if fails else res.expert_x
                    ys[call] = layer.topology.combine(ey, res)
                else:
                    ys[call] = layer(xx)
            out.append("ok")
        except Exception as e:
            out.append((type(e).__name__, str(e)))
        finally:
            if handle is not None:
                handle.remove()
    return out + [1 in ys and 3 in ys and torch.equal(ys[1], ys[3])]


@pytest.mark.parametrize("failure", ["validation", "layer_input", "layer_input_everywhere",
                                     "router", "experts", "experts_everywhere", "combine_check"])
@pytest.mark.parametrize("topo_name", ["tp", "dp_p2p"])
def test_a_rank_that_goes_on_after_an_error_is_caught(pools, topo_name, failure):
    """No silent pairing of different calls, no process aborted by gloo:
    * validation: a rank that failed the topology's own checks and went on meets its peers at
      another dispatch number (ValueError on both; the ranks stay apart, so the topology then
      refuses calls: RuntimeError without a collective);
    * layer_input / router: a rank whose MoELayer raised before its dispatch (the layer's
      input checks, its router) dispatches nothing and abandons the call: its peer raises
      CallAbandoned naming it, and the next call works on both, with the right output (the
      call was not accounted for: under tp the next call paired with the peer's pending one,
      whose tokens differ, and returned a wrong output silently);
    * experts / combine_check: a rank that raised between dispatch and combine takes its part
      in the combine without a result: its peer raises RuntimeError naming it, the next call
      works on both;
    * layer_input_everywhere / experts_everywhere: every rank raised there (e.g. OOM): a
      retry works."""
    r0, r1 = pools(2).run(w_out_of_step, topo_name, failure, timeout_s=60)
    assert r0[0] == r1[0] == "ok"
    if failure == "validation":
        assert r1[1][0] == "TypeError", r1[1]
        for typ, msg in (r0[1], r1[2]):
            assert typ == "ValueError" and "the ranks are out of step" in msg, msg
        # the ranks cannot get back in step: rank 0's third call raises without a collective
        assert r0[2][0] == "RuntimeError" and "out of step" in r0[2][1], r0[2]
        return
    if failure == "experts_everywhere":
        assert r0[1] == r1[1] == ("RuntimeError", "planted expert failure")
    elif failure == "layer_input_everywhere":
        assert r0[1][0] == r1[1][0] == "TypeError", (r0[1], r1[1])
    else:
        assert r1[1][0] == ("TypeError" if failure in ("layer_input", "combine_check")
                            else "RuntimeError"), r1[1]
        assert r0[1][0] == "CallAbandoned" and "rank" in r0[1][1] and (
            "left dispatch #2 " in r0[1][1] and "without its combine" in r0[1][1]), r0[1]
    assert r0[2] == r1[2] == "ok"
    assert r0[3] and r1[3]  # calls 1 and 3: the same tokens, the same output


def w_raise_on_rank1(rank, world):
    if rank == 1:
        raise KeyError("planted failure")
    return rank


def w_rank(rank, world):
    return rank


def w_hang(rank, world):
    time.sleep(600)


# ---------------------------------------------------------------------------------------------
_pools: dict[int, DistPool] = {}


@pytest.fixture(scope="module")
def pools():
    def get(world: int) -> DistPool:
        if world not in _pools:
            _pools[world] = DistPool(world, group_timeout_s=30.0)
        return _pools[world]
    yield get
    for p in _pools.values():
        p.close()
    _pools.clear()


BASE = dict(seed=0, E=E, T=[5, 3, 7, 1], H=16, k=2, dtype=torch.float32, align=1, experts="swiglu")
CASES = {
    "base": {},
    "bf16_align8_scale": dict(dtype=torch.bfloat16, align=8, experts="scale", seed=1),
    "fp16_scale": dict(dtype=torch.float16, experts="scale", seed=11),
    "T0_on_rank0": dict(T=[0, 4, 2, 6], seed=2),
    "T1_k1": dict(T=[1], k=1, seed=3),
    "all_to_one_expert_k1": dict(route="one", k=1, T=[6, 2, 5, 3], seed=4, experts="scale"),
    "all_to_same_k_bf16": dict(route="one", k=3, dtype=torch.bfloat16, seed=5, experts="scale"),
    "empty_experts_align8": dict(route="even", k=3, align=8, seed=6),
    "k_eq_E": dict(k=E, T=[3, 2, 0, 4], seed=7),
    "noncontig_bf16": dict(noncontig=True, dtype=torch.bfloat16, seed=8, experts="scale"),
    "all_ranks_empty": dict(T=[0], seed=9),
    "odd_H_bf16": dict(H=15, dtype=torch.bfloat16, experts="scale", seed=12),
}


def _expected_offsets(ids: torch.Tensor, num_experts: int, expert_start: int, e_local: int,
                      align: int):
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)[expert_start:expert_start + e_local]
    padded = (counts + align - 1) // align * align
    return torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)]).to(torch.int32), counts


def _tol(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("topo_name", TOPOS)
@pytest.mark.parametrize("world", WORLDS)
def test_matches_local(pools, world, topo_name, case_name):
    check_against_local(pools(world), world, topo_name, {**BASE, **CASES[case_name]})


@pytest.mark.parametrize("case_name", ["base", "T0_on_rank0", "all_to_one_expert_k1",
                                       "empty_experts_align8", "k_eq_E", "bf16_align8_scale",
                                       "odd_H_bf16", "fp16_scale"])
@pytest.mark.parametrize("topo_name", ["dp_nvlink", "dp_p2p"])
@pytest.mark.parametrize("world", [2, 4])
def test_dp_fixed_capacity_protocol_matches_local(pools, world, topo_name, case_name):
    """fixed_capacity (the engine's graphed decode under dp): blocks of T_max * min(k, E_local)
    rows to every peer, the same offsets, rows and outputs as the split-size protocol."""
    check_against_local(pools(world), world, topo_name, {**BASE, **CASES[case_name], "fixed": True})


def w_fixed_capacity_limits(rank, world):
    dp = make_topology("dp_nvlink", E, backend="reference", timeout_s=10)
    auto = make_topology("dp_p2p", E, timeout_s=10)  # (CPU tensors: the reference path)
    tp = make_topology("tp", E, backend="reference", timeout_s=10)
    x, w = torch.randn(3, 8), torch.rand(3, 2)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    with fixed_capacity([dp, auto, tp], 2):
        assert (dp.fixed_tokens, auto.fixed_tokens, tp.__dict__.get("fixed_tokens")) == (2, 2, None)
        for t in (dp, auto):
            with pytest.raises(ValueError, match=f"{t.name} rank {rank}: 3 tokens in a call of at most 2"):
                t.dispatch(x, ids, w)
    assert dp.fixed_tokens is auto.fixed_tokens is None
    with fixed_capacity((t for t in (dp, tp)), 4):  # an iterator ...
        assert dp.fixed_tokens == 4
        with fixed_capacity([dp], 2):  # ... and nested blocks
            assert dp.fixed_tokens == 2
        assert dp.fixed_tokens == 4
    assert dp.fixed_tokens is None
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="tokens must be an int >= 1"):
            with fixed_capacity([dp], bad):
                pass
    with pytest.raises(TypeError, match="fixed_capacity takes topologies, got 'dp_nvlink'"):
        with fixed_capacity(["dp_nvlink"], 2):
            pass
    return True


def test_fixed_capacity_refuses_calls_above_it_and_leaves_tp_alone(pools):
    assert pools(2).run(w_fixed_capacity_limits, timeout_s=60) == [True, True]


def w_fixed_capacity_abandon(rank, world):
    """Rank 1 leaves a fixed-capacity call between its dispatch and combine (an error in its
    experts): rank 0's combine raises CallAbandoned naming it; the block resets the mode."""
    from moe_runtime.topologies import CallAbandoned
    dp = make_topology("dp_nvlink", E, backend="reference", timeout_s=10)
    x, w = torch.randn(3, 8), torch.rand(3, 2)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    try:
        with fixed_capacity([dp], 3):
            res = dp.dispatch(x, ids, w)
            if rank == 1:
                dp.abandon(res, RuntimeError("planted expert failure"))
                raise RuntimeError("planted expert failure")
            dp.combine(res.expert_x, res)
    except (CallAbandoned, RuntimeError) as e:
        return type(e).__name__, str(e), dp.fixed_tokens
    return None


def test_fixed_capacity_peers_of_an_abandoning_rank_raise(pools):
    (kind0, msg0, mode0), (kind1, msg1, mode1) = pools(2).run(w_fixed_capacity_abandon, timeout_s=60)
    assert kind0 == "CallAbandoned" and "rank(s) [1] left" in msg0, msg0
    assert (kind1, msg1) == ("RuntimeError", "planted expert failure")
    assert mode0 is mode1 is None


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.sampled_from([2, 4]), topo_name=st.sampled_from(TOPOS),
       experts_per_rank=st.integers(1, 3), data=st.data())
def test_random_configs_match_local(pools, world, topo_name, experts_per_rank, data):
    num_experts = world * experts_per_rank
    route = data.draw(st.sampled_from(["random", "one"] + (["even"] if num_experts > 1 else [])))
    k = data.draw(st.integers(1, num_experts // 2 if route == "even" else num_experts))
    case = dict(BASE, E=num_experts, k=k, route=route, seed=data.draw(st.integers(0, 999)),
                T=data.draw(st.lists(st.integers(0, 6), min_size=world, max_size=world)),
                H=data.draw(st.sampled_from([1, 8, 24])), align=data.draw(st.sampled_from([1, 4])),
                dtype=data.draw(st.sampled_from([torch.float32, torch.bfloat16])),
                experts="scale")
    check_against_local(pools(world), world, topo_name, case)


def check_against_local(pool, world, topo_name, case):
    """Run `case` on every rank of `pool` and compare with LocalTopology in this process."""
    out = pool.run(w_case, topo_name, case)
    x, ids, w, Ts = make_batch(case, world)
    E = case["E"]
    local = LocalTopology(E, align=case["align"], backend="reference")
    ref = local.dispatch(x, ids, w)
    y_ref = local.combine(run_experts(case["experts"], ref.expert_x, ref.expert_offsets, 0), ref)
    tol = _tol(case["dtype"])
    e_local = E // world
    for r, o in enumerate(out):
        assert o["device"] == (f"cuda:{r}" if case.get("nccl") else "cpu"), (r, o["device"])
        assert o["y"].dtype == case["dtype"] and o["offsets"].dtype == torch.int32
        # offsets and the multiset of rows of every local expert
        exp_off, counts = _expected_offsets(ids, E, o["expert_start"], e_local, case["align"])
        assert torch.equal(o["offsets"], exp_off), (r, o["offsets"], exp_off)
        for e in range(e_local):
            seg = o["rows"][int(exp_off[e]):int(exp_off[e]) + int(counts[e])]
            want = x[(ids == o["expert_start"] + e).any(1)]
            assert sorted(map(tuple, seg.tolist())) == sorted(map(tuple, want.tolist())), (r, e)
        if case.get("noncontig") and o["T"] > 1:  # a [1, H] view counts as contiguous
            assert not o["x_contig"]
    if topo_name == "tp":  # every rank returns the whole batch
        ys, y_ids = [o["y"] for o in out], [o["y_id"] for o in out]
        for y in ys[1:]:
            assert torch.equal(y, ys[0])
    else:  # each rank its own tokens, concatenated in rank order
        ys, y_ids = [torch.cat([o["y"] for o in out])], [torch.cat([o["y_id"] for o in out])]
    ident = (x.float() * w.sum(-1, keepdim=True)).to(case["dtype"])
    # bit-level checks hold where the ranks ran on the CPU like LocalTopology here; on GPUs
    # (case["nccl"]) the fp32 sums may round in another order
    exact = not case.get("nccl")
    for y, y_id in zip(ys, y_ids):
        assert y.shape == (x.shape[0], case["H"])
        torch.testing.assert_close(y_id.float(), ident.float(), atol=tol, rtol=tol)
        if exact and topo_name != "tp" and case["experts"] != "swiglu":
            # row-wise experts, same fp32 accumulation order as local: bit-identical
            assert torch.equal(y, y_ref)
        else:
            torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
        if topo_name == "tp" and case["dtype"] != torch.float32 and case["experts"] != "swiglu":
            # fp32 all-reduce, one rounding: only the fp32 summation order differs from local,
            # so almost every element is bit-identical (a bf16 all-reduce misses this badly);
            # on GPUs the order differs more (looser bound)
            bound = y.numel() // (100 if exact else 10)
            assert int((y != y_ref).sum()) <= max(1, bound), (y != y_ref).sum()


@pytest.mark.parametrize("topo_name", TOPOS)
def test_bad_inputs_raise_expected_vs_got(pools, topo_name):
    expect = {
        "id_high": ("ValueError", "[0, 8)"), "id_negative": ("ValueError", "got values in [-1"),
        "id_repeat": ("ValueError", "distinct"), "ids_int64": ("TypeError", "torch.int64"),
        "w_fp64": ("TypeError", "torch.float64"), "x_int": ("TypeError", "torch.int64"),
        "x_3d": ("ValueError", "(4, 4, 4)"), "ids_rows": ("ValueError", "(3, 2)"),
        "w_shape": ("ValueError", "(4, 1)"), "device": ("ValueError", "meta"),
        "k_gt_E": ("ValueError", "k=9"), "combine_shape": ("ValueError", "(1, 16)"),
        "E_indivisible": ("ValueError", "divisible"),
        "backend_cute": (("BackendNotImplementedError", "not implemented") if topo_name == "dp_p2p"
                         else ("ValueError", "backend 'cute' needs")),
        "backend_bogus": ("ValueError", "'bogus'"), "align_0": ("ValueError", "align"),
    }
    for rank_out in pools(2).run(w_bad_inputs, topo_name):
        assert [o[0] for o in rank_out] == list(expect)
        for label, typ, msg, *is_value_error in rank_out:
            assert typ == expect[label][0], (label, typ, msg)
            assert expect[label][1] in msg, (label, msg)
            if label == "backend_cute":
                assert is_value_error == [True]


@pytest.mark.parametrize("use_call_timeout", [False, True], ids=["group_timeout", "call_timeout"])
@pytest.mark.parametrize("topo_name", TOPOS)
def test_stalled_peer_raises_within_timeout(pools, topo_name, use_call_timeout):
    (err, secs), (none, _) = pools(2).run(w_stall, topo_name, use_call_timeout, timeout_s=30)
    assert err is not None and none is None
    assert "rank 0/2" in err and f"{topo_name}." in err, err
    assert secs < 1.0 + 3.0, secs  # the bound is 1 s; slack for a loaded CI machine


def w_abandon_twice(rank, world, topo_name):
    """Rank 1's experts fail on call 2 and it abandons that result twice (MoELayer-style, then
    a user's own handler): the second is a no-op, so call 3 works on both ranks."""
    from moe_runtime.comm import new_group
    topo = make_topology(topo_name, E, group=new_group(), backend="reference", timeout_s=3)
    x = torch.randn(3, 8) if topo_name != "tp" else torch.ones(3, 8)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    out = []
    for call in (1, 2, 3):
        res = topo.dispatch(x, ids, w)
        try:
            if rank == 1 and call == 2:
                error = RuntimeError("planted")
                topo.abandon(res, error)
                topo.abandon(res, error)
                raise error
            topo.combine(res.expert_x, res)
            out.append("ok")
        except Exception as e:
            out.append(type(e).__name__)
    return out


def w_oom_after_the_counts_exchange(rank, world):
    """dp_p2p: rank 1's dispatch fails after the counts exchange on call 2 (an OOM in the
    receiver's layout), then both ranks go on: per call, the exception type or "ok"."""
    from moe_runtime.comm import new_group
    from moe_runtime.topologies import distributed
    topo = make_topology("dp_p2p", E, group=new_group(), backend="reference", timeout_s=3)
    real = distributed.reference.dispatch
    x, ids = torch.randn(3, 8), torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    out = []
    for call in (1, 2, 3):
        def planted(*a, **kw):
            raise torch.OutOfMemoryError("planted")
        distributed.reference.dispatch = planted if rank == 1 and call == 2 else real
        try:
            res = topo.dispatch(x, ids, torch.full((3, 2), 0.5))
            topo.combine(res.expert_x, res)
            out.append("ok")
        except Exception as e:
            out.append(type(e).__name__ + (": out of step" if "out of step" in str(e) else ""))
        finally:
            distributed.reference.dispatch = real
    return out


def test_an_error_after_the_dp_counts_exchange_marks_the_rank_out_of_step(pools):
    """Its peer waits in that call's row exchange: the rank must not go on (a dispatch paired
    with it aborts gloo); the peer times out and is marked too."""
    r0, r1 = pools(2).run(w_oom_after_the_counts_exchange, timeout_s=60)
    assert r0 == ["ok", "CollectiveError", "RuntimeError: out of step"], r0
    assert r1 == ["ok", "OutOfMemoryError", "RuntimeError: out of step"], r1


@pytest.mark.parametrize("topo_name", ["tp", "dp_p2p"])
def test_abandoning_a_result_twice_is_a_no_op(pools, topo_name):
    r0, r1 = pools(2).run(w_abandon_twice, topo_name, timeout_s=60)
    assert r0 == ["ok", "CallAbandoned", "ok"] and r1 == ["ok", "RuntimeError", "ok"], (r0, r1)


def w_retry_after_a_refused_combine(rank, world, topo_name, how):
    """Rank 0's combine refuses its expert_y (`how`: "shape", or "tuple": an expert function
    that returned (out, aux)), then rank 0 retries with the right tensor; rank 1 combines once.
    Then both make one more call: per step, the exception type or "ok"."""
    from moe_runtime.comm import new_group
    topo = make_topology(topo_name, E, group=new_group(), backend="reference", timeout_s=3)
    x = torch.ones(3, 8) if topo_name == "tp" else torch.randn(3, 8)
    ids, w = torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32), torch.full((3, 2), 0.5)
    res = topo.dispatch(x, ids, w)
    bad = res.expert_x[:, :4] if how == "shape" else (res.expert_x, None)
    out = []
    for ey in ([bad, res.expert_x] if rank == 0 else [res.expert_x]):
        try:
            topo.combine(ey, res)
            out.append("ok")
        except Exception as e:
            out.append(type(e).__name__ + (": abandoned" if "was abandoned" in str(e) else ""))
    res, ref = topo.dispatch(x, ids, w), LocalTopology(E).dispatch(x, ids, w)
    y = topo.combine(res.expert_x, res)
    out.append("ok" if torch.equal(y, LocalTopology(E).combine(ref.expert_x, ref)) else "wrong")
    return out


@pytest.mark.parametrize("topo_name", ["tp", "dp_p2p"])
@pytest.mark.parametrize("how, error", [("shape", "ValueError"), ("tuple", "TypeError")])
def test_a_refused_combine_is_not_taken_again(pools, topo_name, how, error):
    """A combine that refused its input has taken its part (the peers raised CallAbandoned):
    a retry on that result must raise before any collective (it would pair with the peers'
    next call: wrong sums, or gloo aborting on the sizes), and the next call works."""
    r0, r1 = pools(2).run(w_retry_after_a_refused_combine, topo_name, how, timeout_s=60)
    assert r0 == [error, "RuntimeError: abandoned", "ok"], r0
    assert r1 == ["CallAbandoned", "ok"], r1


def w_default_group_destroyed_and_initialized(rank, world):
    """A dp_p2p topology used after destroy_process_group, and one built while no default group
    exists (a world of one), used once a 2-rank group is initialized: their messages (or "ok");
    then a topology built after the init: "ok" when it matches the local result."""
    import torch.distributed as dist

    from _dist import _free_port
    from moe_runtime.comm import init_process_group
    x, ids = torch.randn(3, 8), torch.tensor([[0, 7], [1, 6], [2, 5]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)

    def call(topo):
        try:
            res = topo.dispatch(x, ids, w)
            return topo.combine(res.expert_x, res)
        except RuntimeError as e:
            return str(e)
    topo = make_topology("dp_p2p", E, backend="reference", timeout_s=5)
    assert isinstance(call(topo), torch.Tensor)
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    out = [call(topo)]
    early = make_topology("dp_p2p", E, backend="reference")
    init_process_group(rank, world, backend="gloo", master_port=port[0], timeout_s=30)
    out.append(call(early))
    y = call(make_topology("dp_p2p", E, backend="reference", timeout_s=5))
    ref = LocalTopology(E).dispatch(x, ids, w)
    out.append("ok" if torch.equal(y, LocalTopology(E).combine(ref.expert_x, ref)) else y)
    return out


def test_a_topology_of_another_default_group_refuses_calls():
    """After destroy_process_group a dp topology fell back to this rank's experts alone
    (silently wrong sums); one built before init_process_group all-reduced one-rank headers
    over two ranks (a nonsense out-of-step error that also refused the topologies built
    after the init). Both now refuse with the reason; a topology built after init works."""
    for destroyed, early, late in run_distributed(w_default_group_destroyed_and_initialized, 2,
                                                  timeout_s=90):
        assert "destroy_process_group" in destroyed, destroyed
        assert "built before init_process_group" in early, early
        assert late == "ok", late


@pytest.mark.parametrize("topo_name", TOPOS)
def test_a_world_of_one_goes_on_after_an_interrupt_in_the_experts(topo_name):
    """No peers, nothing to release or refuse: the call after an interrupt works."""
    from moe_runtime import MoELayer
    cfg = tiny_cfg()
    layer = MoELayer(cfg, topology=make_topology(topo_name, E, backend="reference"),
                     backend="reference")

    def interrupt(module, args):
        raise KeyboardInterrupt
    handle = layer.experts.register_forward_pre_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        layer(torch.randn(3, 8))
    handle.remove()
    with torch.no_grad():
        assert layer(torch.randn(3, 8)).shape == (3, 8)


@pytest.mark.parametrize("topo_name", TOPOS)
def test_single_process_without_torch_distributed(topo_name, caplog):
    # group=None and no initialized torch.distributed: a world of one rank (with a warning:
    # a forgotten init_process_group), same answers
    from moe_runtime.topologies import distributed
    assert not torch.distributed.is_initialized()
    case = dict(BASE, T=[9], dtype=torch.bfloat16, align=4, experts="scale", seed=21)
    distributed._warn_alone.cache_clear()
    with caplog.at_level(logging.WARNING, logger="moe_runtime"):
        topo = make_topology(topo_name, E, align=4, backend="reference")
    assert f"{topo.name} topology built while torch.distributed is not initialized" in caplog.text
    assert (topo.rank, topo.world_size, topo.num_local_experts) == (0, 1, E)
    x, ids, w, _ = make_batch(case, 1)
    res, ref = topo.dispatch(x, ids, w), LocalTopology(E, align=4).dispatch(x, ids, w)
    assert torch.equal(res.expert_offsets, ref.expert_offsets)
    y = topo.combine(run_experts("scale", res.expert_x, res.expert_offsets, 0), res)
    assert torch.equal(y, LocalTopology(E, align=4).combine(
        run_experts("scale", ref.expert_x, ref.expert_offsets, 0), ref))



def w_layer_backward(rank, world, topo_name):
    """A MoELayer on `topo_name` with gradients on: (max |y - local layer's y|, the backward's
    error or None, whether the output under no_grad carries a graph, x without grad, the error
    of a forward-mode AD call or None); an in-place add into a recorded output must work."""
    from moe_runtime import MoEConfig, MoELayer
    cfg = MoEConfig(hidden_size=16, num_experts=E, top_k=2, moe_intermediate_size=8,
                    dtype=torch.float32)
    torch.manual_seed(3)  # the same weights on every rank
    local = MoELayer(cfg, topology=LocalTopology(E, backend="reference"), backend="reference")
    layer = MoELayer(cfg, topology=make_topology(topo_name, E, backend="reference"),
                     backend="reference")
    layer.router.load_state_dict(local.router.state_dict())
    layer.load_expert_weights(local.experts.gate_up_proj.data, local.experts.down_proj.data)
    seed = 0 if topo_name == "tp" else rank  # tp: the same tokens on every rank
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    y = layer(x)
    diff = float((y - local(x)).abs().max())
    try:
        y.sum().backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    with torch.no_grad():
        graph = layer(x).grad_fn is not None
    h = layer(x)
    h += 1  # in place into the output of a recorded forward (a residual add)
    import torch.autograd.forward_ad as fwAD
    with torch.no_grad(), fwAD.dual_level():  # forward-mode AD: torch's bare "implement jvp"
        try:
            layer(fwAD.make_dual(x.detach(), torch.ones_like(x)))
            fw_err = None
        except RuntimeError as e:
            fw_err = str(e)
    return diff, err, graph, x.grad is None, fw_err


@pytest.mark.parametrize("topo_name", TOPOS)
def test_layer_backward_on_multirank_topologies_raises(pools, topo_name):
    """Found by a review: gradients through the collectives came back wrong without an error
    (tp: x.grad off by about its own size; dp_p2p: expert weights without grad). The output of
    a multi-rank forward is right (and writable in place) and its backward now raises, naming the
    topology."""
    for diff, err, graph, no_x_grad, fw_err in pools(2).run(w_layer_backward, topo_name):
        assert diff <= 1e-5, diff
        for e in (err, fw_err):
            assert e is not None and f"'{topo_name}' topology has no backward" in e, e
        assert not graph and no_x_grad

def test_make_topology_names():
    with pytest.raises(ValueError, match=r"\['dp_nvlink', 'dp_p2p', 'local', 'tp'\]"):
        make_topology("ep", E)
    assert make_topology("local", E).world_size == 1


def test_dist_helper_reports_child_traceback_and_hang(pools):
    pool = pools(2)
    with pytest.raises(RankError, match=r"(?s)--- rank 1 ---.*w_raise_on_rank1.*planted failure"):
        pool.run(w_raise_on_rank1)
    assert pool.run(w_rank) == [0, 1]  # the pool is still usable
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not answer within 1.0s"):
        run_distributed(w_hang, 1, timeout_s=1.0)
    assert time.monotonic() - t0 < 60


def w_mismatched_rows(rank, world, topo_name, what):
    """Rank 1 dispatches rows of another hidden size or dtype than rank 0."""
    topo = make_topology(topo_name, E, backend="reference", timeout_s=10)
    H = 16 if (what == "hidden" and rank == 1) else 8
    dtype = torch.bfloat16 if (what == "dtype" and rank == 1) else torch.float32
    x = torch.randn(3, H).to(dtype)
    ids = torch.tensor([[0, 5]] * 3, dtype=torch.int32)
    try:
        topo.dispatch(x, ids, torch.rand(3, 2))
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("what", ["hidden", "dtype"])
@pytest.mark.parametrize("topo_name", ["dp_nvlink", "dp_p2p"])
def test_dp_ranks_with_different_rows_raise_instead_of_aborting(pools, topo_name, what):
    """Before the check, gloo aborted the process (SIGABRT) on the row all-to-all."""
    for rank, msg in enumerate(pools(2).run(w_mismatched_rows, topo_name, what, timeout_s=30)):
        assert msg is not None and "same hidden size and dtype" in msg and f"rank {rank}" in msg, msg


def w_tp_different_tokens(rank, world, what):
    """tp with rank 1 passing other tokens (3 more, or a wider hidden, or top_k 1, or bf16
    rows) than rank 0."""
    topo = make_topology("tp", E, backend="reference", timeout_s=10)
    T = 6 if (what == "tokens" and rank == 1) else 3
    H = 16 if (what == "hidden" and rank == 1) else 8
    k = 1 if (what == "top_k" and rank == 1) else 2
    x = torch.randn(T, H).to(torch.bfloat16 if (what == "dtype" and rank == 1) else torch.float32)
    ids = torch.tensor([[0, 5][:k]] * T, dtype=torch.int32)
    res = topo.dispatch(x, ids, torch.rand(T, k))
    try:
        topo.combine(res.expert_x, res)
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("what", ["tokens", "hidden", "top_k", "dtype"])
def test_tp_ranks_with_different_tokens_raise_instead_of_aborting(pools, what):
    """Before the check, gloo aborted rank 1's process (SIGABRT) in the combine's all-reduce
    (other T or H), or the ranks summed partial results of another top_k or dtype silently."""
    want = {"tokens": "(6, 8, 2, torch.float32)", "hidden": "(3, 16, 2, torch.float32)",
            "top_k": "(3, 8, 1, torch.float32)", "dtype": "(3, 8, 2, torch.bfloat16)"}[what]
    for rank, msg in enumerate(pools(2).run(w_tp_different_tokens, what, timeout_s=30)):
        assert msg is not None and "same tokens" in msg and f"rank {rank}" in msg, msg
        assert want in msg and "(3, 8, 2, torch.float32)" in msg, msg


def test_make_topology_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        make_topology("local", 0)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        make_topology("local", "4")
    with pytest.raises(TypeError, match="align must be an int"):
        make_topology("local", 4, align=2.5)
    for align in (0, 1025, 10 ** 9):  # (10**9 tried to allocate E * 10**9 padding rows)
        with pytest.raises(ValueError, match=rf"align must be in \[1, 1024\], got {align}"):
            make_topology("local", 4, align=align)
    assert make_topology("local", 4, align=1024).align == 1024
    with pytest.raises(ValueError, match="'bogus'"):
        make_topology("local", 4, backend="bogus")
    with pytest.raises(TypeError, match="ProcessGroup"):
        make_topology("local", 4, group="world")


def w_wait_bounds(rank, world):
    """The timeout each bounded collective's wait gets: the call's timeout_s, else none (the
    group's own timeout applies inside the backend: gloo's ops, NCCL's watchdog)."""
    import torch.distributed as dist

    from moe_runtime.comm import all_reduce_sum, all_to_all_single, new_group
    waits, real = [], (dist.all_reduce, dist.all_to_all_single)

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kw):
            waits.append(kw.get("timeout", args[0] if args else None))
            return self.work.wait(*args, **kw)

    dist.all_reduce = lambda *a, **kw: Work(real[0](*a, **kw))
    dist.all_to_all_single = lambda *a, **kw: Work(real[1](*a, **kw))
    try:
        g = new_group(timeout_s=2.5)
        all_reduce_sum(torch.ones(1))
        all_reduce_sum(torch.ones(1), group=g)
        all_reduce_sum(torch.ones(1), group=g, timeout_s=1.5)
        all_to_all_single(torch.empty(2), torch.ones(2), group=g)
    finally:
        dist.all_reduce, dist.all_to_all_single = real
    return [None if w is None else w.total_seconds() for w in waits]


def test_collectives_wait_with_the_call_timeout(pools):
    assert pools(2).run(w_wait_bounds) == [[None, None, 1.5, None]] * 2


class _FakeWork:
    """An async collective that completes after `polls` is_completed() queries (never: None)."""

    def __init__(self, polls):
        self.polls, self.waits = polls, []

    def is_completed(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None):  # (blocks until complete; a stalled one times out at once)
        self.waits.append(timeout.total_seconds())
        if self.polls is None:
            raise RuntimeError("Watchdog caught collective operation timeout")
        while not self.is_completed():
            pass


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_waits_poll_completion_themselves(monkeypatch, backend):
    """On NCCL a bounded wait polls the work's completion (torch's own bounded NCCL wait
    sleeps 1 ms between polls: tens of ms per decode step under tp) and then waits with the
    time left: at once when done, torch's timeout path (an error naming the step) when the
    bound ran out. gloo works wait with the whole bound, as before."""
    from moe_runtime.comm import groups
    monkeypatch.setattr(groups.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(groups.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 2)
    done = _FakeWork(5)
    groups._bounded("layer 3 all_reduce", None, 2.0, lambda: done)
    assert len(done.waits) == 1
    assert (1.9 < done.waits[0] <= 2.0) if backend == "nccl" else done.waits[0] == 2.0
    if backend == "nccl":
        assert done.polls < 0  # (polled until complete)
        stalled = _FakeWork(None)
        t0 = time.monotonic()
        with pytest.raises(groups.CollectiveError, match="rank 1/2: collective 'layer 3 "
                                                         "all_reduce' failed or timed out"):
            groups._bounded("layer 3 all_reduce", None, 0.05, lambda: stalled)
        assert 0.05 <= time.monotonic() - t0 < 1.0 and stalled.waits == [0.001]


class _RecordedWork:
    """An async work as a CUDA graph capture sees it: waiting orders the stream (no timeout);
    a completion query would be an illegal call while capturing."""

    def __init__(self):
        self.waits = []

    def is_completed(self):
        raise AssertionError("polled inside a capture")

    def wait(self, timeout=None):
        self.waits.append(timeout)


def test_collectives_inside_a_capture_are_recorded_not_polled(monkeypatch):
    """Inside a CUDA graph capture (the engine's tp decode step) a bounded NCCL collective
    orders the capturing stream and returns: its completion is bounded at the replay."""
    from moe_runtime.comm import groups
    monkeypatch.setattr(groups.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(groups, "stream_capturing", lambda: True)
    work = _RecordedWork()
    groups._bounded("layer 0 attention o_proj all_reduce", None, 2.0, lambda: work)
    assert work.waits == [None]


class _FakeEvent:
    """torch.cuda.Event stand-in: done after `polls` queries (None: never)."""
    made = []

    def __init__(self, polls):
        self.polls, self.recorded = polls, None
        _FakeEvent.made.append(self)

    def record(self, stream):
        self.recorded = stream

    def query(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


@pytest.mark.parametrize("polls", [3, None])
def test_a_replayed_graph_is_waited_for_within_the_bound(monkeypatch, polls):
    """wait_stream_bounded (after each multi-rank decode graph replay) polls an event recorded
    on the current stream; a replay that does not complete (a peer stalled or did not replay)
    raises CollectiveError naming the rank and the step within the bound, not a hang."""
    from moe_runtime.comm import groups
    _FakeEvent.made.clear()
    monkeypatch.setattr(groups.torch.cuda, "Event", lambda: _FakeEvent(polls))
    monkeypatch.setattr(groups.torch.cuda, "current_stream", lambda device=None: ("stream", device))
    monkeypatch.setattr(groups, "group_rank_size", lambda group=None: (1, 2))
    t0 = time.monotonic()
    if polls is not None:
        groups.wait_stream_bounded("decode step", timeout_s=5.0, device="cuda:1")
        assert _FakeEvent.made[0].polls < 0 and time.monotonic() - t0 < 1.0
    else:
        with pytest.raises(CollectiveError, match=r"rank 1/2: 'decode step' did not complete "
                                                  r"within 0.05s"):
            groups.wait_stream_bounded("decode step", timeout_s=0.05, device="cuda:1")
        assert 0.05 <= time.monotonic() - t0 < 1.0
    assert _FakeEvent.made[0].recorded == ("stream", "cuda:1")


def w_replay_timeout(rank, world, fault=False):
    """A multi-rank decode graph whose replay does not complete (a stand-in wait that times
    out; with `fault`, one that reports a CUDA error): CollectiveError (the error), and the
    model's MoE topologies then refuse calls at once."""
    from types import SimpleNamespace

    from moe_runtime import MoEConfig, MoELayer
    from moe_runtime.engine import decode_graph
    from moe_runtime.models import Parallel

    def stalled(step, **kw):
        if fault:  # (an error the replay's event reports, as a sticky CUDA error does)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        raise CollectiveError(f"rank {rank}/{world}: '{step}' did not complete within 0.05s")

    decode_graph.wait_stream_bounded = stalled
    layer = MoELayer(MoEConfig(hidden_size=8, num_experts=E, top_k=2, moe_intermediate_size=4,
                               dtype=torch.float32), topology=make_topology("tp", E, backend="reference"))
    model = SimpleNamespace(device=torch.device("cpu"), parallel=Parallel("tp", rank, world),
                            layers=[SimpleNamespace(mlp=layer)])
    graph = decode_graph.DecodeGraph(model, SimpleNamespace(max_len=8), 2)
    with pytest.raises(RuntimeError if fault else CollectiveError) as e:
        graph._wait_for_replay()
    stalled_msg = str(e.value)
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="refuses calls"):
        layer(x)
    return stalled_msg


def test_a_stalled_graph_replay_stops_the_model_s_topologies(pools):
    for rank, msg in enumerate(pools(2).run(w_replay_timeout, timeout_s=60)):
        assert msg.startswith(f"rank {rank}/2: 'decode step (CUDA graph replay over 0 cached"), msg


def test_a_faulting_graph_replay_stops_the_model_s_topologies(pools):
    for msg in pools(2).run(w_replay_timeout, True, timeout_s=60):
        assert msg == "CUDA error: an illegal memory access was encountered"


def w_tp_capture(rank, world, backend_of_group):
    """tp (reference) in a pretended capture: the combine skips the token check (one
    collective, not two) and gives the same y; records_collectives per backend and group."""
    import torch.distributed as dist

    from moe_runtime.topologies import tp as tp_module
    from moe_runtime.comm import groups
    calls = []
    real = groups._bounded
    groups._bounded = lambda step, *a: (calls.append(step), real(step, *a))[1]
    try:
        topo = make_topology("tp", E, backend="reference", timeout_s=10)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([[0, 5], [1, 2], [7, 6], [3, 4]], dtype=torch.int32)
        w = torch.rand(4, 2, generator=torch.Generator().manual_seed(1))
        ys = []
        for capturing in (False, True):
            tp_module.stream_capturing = lambda: capturing
            res = topo.dispatch(x, ids, w)
            del calls[:]
            ys.append(topo.combine(res.expert_x * 2, res))
            ys.append(len(calls))
    finally:
        groups._bounded = real
        tp_module.stream_capturing = groups.stream_capturing
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: backend_of_group
    try:
        capturable = [make_topology("tp", E, backend=b, timeout_s=10).records_collectives()
                      for b in ("reference", "auto")]  # (cute needs CUDA)
    finally:
        dist.get_backend = real_backend
    return ys, capturable


@pytest.mark.parametrize("backend_of_group", ["nccl", "gloo"])
def test_tp_in_a_capture_records_its_all_reduce_only(pools, backend_of_group):
    for y, n_eager, y_captured, n_captured, capturable in (
            (*ys, c) for ys, c in pools(2).run(w_tp_capture, backend_of_group, timeout_s=60)):
        assert (n_eager, n_captured) == (2, 1)  # the token check, then the all-reduce
        torch.testing.assert_close(y_captured, y, rtol=0, atol=0)
        assert capturable == [backend_of_group == "nccl", False]  # (auto: not settled yet)


def test_timeout_s_validated(monkeypatch):
    """0 (or under 1 ms) would be c10d's "no timeout"; NaN / inf / not a number are refused
    too, before anything is started (also in a process without torch.distributed)."""
    from moe_runtime.comm import all_reduce_sum, all_to_all_single, init_process_group, new_group
    t = torch.ones(2)
    for bad in (0, 0.0, 0.0009, -2.0, float("nan"), float("inf")):
        for call in (lambda: all_reduce_sum(t, timeout_s=bad),
                     lambda: all_to_all_single(torch.empty(2), t, timeout_s=bad),
                     lambda: new_group(timeout_s=bad),
                     lambda: init_process_group(0, 1, backend="gloo", timeout_s=bad)):
            with pytest.raises(ValueError, match="timeout_s must be None or a finite number"):
                call()
    with pytest.raises(TypeError, match="timeout_s must be None or a number"):
        all_reduce_sum(t, timeout_s="1")
    for bad, why in (("0", "got 0.0"), ("abc", "could not convert"), ("nan", "got nan")):
        monkeypatch.setenv("MOE_RUNTIME_COMM_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"MOE_RUNTIME_COMM_TIMEOUT_S='{bad}'.*{why}"):
            init_process_group(0, 1, backend="gloo")
    assert not torch.distributed.is_initialized()
    assert all_reduce_sum(t, timeout_s=0.001) is t



def w_fsdp2_mixed_precision(rank, world, seed, nested):
    """A local fp32 layer under FSDP2 with bf16 parameters (MixedPrecisionPolicy): FSDP sets
    bf16 copies of the weights for forward and casts the input; the layer computes in bf16.
    nested: the experts in their own FSDP group (their pre-forward unshards and casts them only
    after the layer's forward began)."""
    import copy

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moe_runtime import MoEConfig, MoELayer
    torch.manual_seed(seed)  # the same weights on every rank
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                    dtype=torch.float32, shared_expert_intermediate_size=8)
    layer = MoELayer(cfg, backend="reference")
    ref = copy.deepcopy(layer).to(torch.bfloat16)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(seed + 1 + rank))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if nested:
        fully_shard(layer.experts, mp_policy=policy)
    fully_shard(layer, mp_policy=policy)
    y = layer(x)
    y.float().square().sum().backward()
    grads = [p.grad.full_tensor() for p in layer.parameters()]
    with torch.no_grad():
        y_ref = ref(x.bfloat16())
    return (y.dtype, bool(torch.equal(y, y_ref)), all(bool(torch.isfinite(g).all()) for g in grads),
            all(g.dtype == torch.float32 and bool(g.abs().sum() > 0) for g in grads))


@pytest.mark.parametrize("nested", [False, True])
def test_fsdp2_mixed_precision_runs_the_layer_in_bf16(pools, nested):
    assert pools(2).run(w_fsdp2_mixed_precision, 0, nested) == [(torch.bfloat16, True, True, True)] * 2


def w_shared_topology_skip(rank, world, topo_name, rank0_fails=False):
    """Two MoELayers share one topology (as swap_moe_layers(topology=...) makes them). Call 1:
    both layers on both ranks. Call 2: rank 1 skips layer 0 (it raised before it), so its
    layer 1 meets rank 0's layer 0 at the same dispatch number; with rank0_fails, rank 0's
    layer 0 raises in its experts (it sends an "abandoned" header). Then one more call each."""
    from moe_runtime import MoELayer
    from moe_runtime.comm import new_group
    cfg = tiny_cfg()
    torch.manual_seed(0)
    topo = make_topology(topo_name, E, group=new_group(), backend="reference", timeout_s=5)
    layers = [MoELayer(cfg, topology=topo, backend="reference") for _ in range(2)]

    x, out = torch.randn(3, 8), []
    for call in (1, 2, 3):
        hook = layers[0].experts.register_forward_pre_hook(planted_failure) if (
            call == 2 and rank == 0 and rank0_fails) else None
        try:
            with torch.no_grad():
                for i, layer in enumerate(layers):
                    if not (call == 2 and rank == 1 and i == 0):
                        layer(x)
            out.append("ok")
        except Exception as e:
            out.append((type(e).__name__, str(e)))
        finally:
            if hook is not None:
                hook.remove()
    return out


def w_own_topologies_skip(rank, world, topo_name, fresh):
    """Three MoELayers with their own topologies (the default, as MoELayer(topology=<name>),
    swap_moe_layers and the engine build them). Call 1: all on both ranks; call 2: rank 1
    skips layer 0, so its layer 1 meets rank 0's layer 0 at the same dispatch number of each
    topology. Call 3 on the same layers, or (fresh) on new layers with new topologies."""
    from moe_runtime import MoELayer
    from moe_runtime.comm import new_group
    cfg = tiny_cfg()
    group = new_group()

    def build():
        torch.manual_seed(0)
        return [MoELayer(cfg, topology=make_topology(topo_name, E, group=group,
                                                     backend="reference", timeout_s=5),
                         backend="reference") for _ in range(3)]
    layers, x, out = build(), torch.randn(3, 8), []
    for call in (1, 2, 3):
        if call == 3 and fresh:
            layers = build()
        try:
            with torch.no_grad():
                ys = [layer(x) for i, layer in enumerate(layers)
                      if not (call == 2 and rank == 1 and i == 0)]
            out.append(("ok", ys[-1]))
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.parametrize("fresh", [False, True], ids=["same_layers", "new_layers"])
@pytest.mark.parametrize("topo_name", ["tp", "dp_nvlink"])
def test_layers_with_own_topologies_out_of_step_raise_on_every_rank(pools, topo_name, fresh):
    """The reviewer's repro: every topology's numbers matched, so rows went to the wrong layer
    on every later call, silently. Now ValueError on every rank; then every topology built
    before refuses calls (no collective), and new layers on new topologies work again."""
    r0, r1 = pools(2).run(w_own_topologies_skip, topo_name, fresh, timeout_s=60)
    for r in (r0, r1):
        assert r[0][0] == "ok", r
        typ, msg = r[1]
        assert typ == "ValueError" and "out of step" in msg and "of topology #" in msg and (
            "Build new topologies" in msg), r[1]
        if fresh:
            assert r[2][0] == "ok", r[2]
        else:
            assert r[2][0] == "RuntimeError" and "out of step" in r[2][1], r[2]
    if fresh and topo_name == "tp":  # same tokens and weights on both ranks
        assert torch.equal(r0[2][1], r1[2][1]) and torch.equal(r0[0][1], r0[2][1])


@pytest.mark.parametrize("topo_name", ["tp", "dp_nvlink"])
def test_layers_sharing_a_topology_out_of_step_raise_on_every_rank(pools, topo_name):
    """Before the layer ids, the dispatch numbers matched and the ranks exchanged rows of
    different layers silently (wrong outputs, no error)."""
    for r in pools(2).run(w_shared_topology_skip, topo_name, timeout_s=60):
        assert r[0] == "ok", r
        typ, msg = r[1]
        assert typ == "ValueError" and "out of step" in msg and "of layer 0 " in msg and (
            "of layer 1 " in msg) and "Build new topologies" in msg, r[1]
        assert r[2][0] == "RuntimeError" and "out of step" in r[2][1], r[2]


def test_an_abandoning_rank_out_of_step_stops_too(pools):
    """Its peer raised out of step at the abandoned header and refused further calls, while
    the abandoning rank went on into a collective nobody joined (CollectiveError at the
    timeout); now both refuse at once."""
    r0, r1 = pools(2).run(w_shared_topology_skip, "tp", True, timeout_s=60)
    assert r0[0] == r1[0] == "ok"
    assert r0[1] == ("RuntimeError", "planted expert failure"), r0[1]
    assert r1[1][0] == "ValueError" and "out of step" in r1[1][1], r1[1]
    for r in (r0, r1):
        assert r[2][0] == "RuntimeError" and "out of step" in r[2][1], r[2]


def w_expert_weight_forms(rank, world):
    from moe_runtime import MoELayer
    cfg = tiny_cfg()
    layer = MoELayer(cfg, topology="dp_p2p", backend="reference")
    full_gu, full_d = torch.randn(E, 8, 8), torch.randn(E, 8, 4)
    local = slice(rank * E // 2, (rank + 1) * E // 2)
    msgs = []
    for gu, d in ((full_gu, full_d[local]), (full_gu[local], full_d), (full_gu[:3], full_d[:3])):
        try:
            layer.load_expert_weights(gu, d)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    layer.load_expert_weights(full_gu, full_d)  # both full: this rank's views
    same = layer.experts.gate_up_proj.data_ptr() == full_gu[local].data_ptr()
    layer.load_expert_weights(full_gu[local].clone(), full_d[local].clone())  # both local
    return msgs, same


def test_load_expert_weights_takes_one_form_for_both_tensors(pools):
    """A full gate_up with a local down fit rank 0 (its slice starts at 0) and not rank 1:
    the ranks went different ways; now every rank refuses it, naming what was passed."""
    for rank, (msgs, same) in enumerate(pools(2).run(w_expert_weight_forms, timeout_s=30)):
        assert same
        for m in msgs:
            assert m is not None and "both hold all 8 experts" in m and f"{4 * rank}..{4 * rank + 3}" in m, m
        assert "got gate_up_proj (8, 8, 8) and down_proj (4, 8, 4)" in msgs[0], msgs[0]


def w_not_a_member(rank, world):
    import torch.distributed as dist
    g = dist.new_group([0])
    if rank == 0:
        return make_topology("dp_p2p", E, group=g, backend="reference").world_size
    try:
        make_topology("dp_p2p", E, group=g, backend="reference")
    except ValueError as e:
        return str(e)


def test_a_group_without_this_rank_is_named(pools):
    """torch gives non-members an int placeholder: the error said 'group must be a
    ProcessGroup ..., got int'."""
    r0, r1 = pools(2).run(w_not_a_member, timeout_s=30)
    assert r0 == 1
    assert "rank 1" in r1 and "not a member" in r1, r1


def w_copies_in_other_orders(rank, world, topo_name):
    """Layer B = deepcopy(layer A) (its topology copied too); rank 0 runs A then B, rank 1 B
    then A. A copy kept its original's site, so the two paired silently."""
    import copy
    from moe_runtime import MoELayer
    cfg = tiny_cfg()
    torch.manual_seed(0)
    a = MoELayer(cfg, topology=make_topology(topo_name, E, backend="reference", timeout_s=5),
                 backend="reference")
    b = copy.deepcopy(a)
    state = a.topology.__getstate__()
    del state["topology_id"]  # (as pickled before topologies had ids)
    old = type(a.topology).__new__(type(a.topology))
    old.__setstate__(state)
    ids = (a.topology.topology_id, b.topology.topology_id, old.topology_id)
    x = torch.randn(3, 8)
    try:
        with torch.no_grad():
            for layer in ((a, b) if rank == 0 else (b, a)):
                layer(x)
        return ids, None
    except ValueError as e:
        return ids, str(e)


@pytest.mark.parametrize("topo_name", ["tp", "dp_nvlink"])
def test_copies_of_a_layer_run_in_other_orders_raise(pools, topo_name):
    for ids, msg in pools(2).run(w_copies_in_other_orders, topo_name, timeout_s=60):
        assert len(set(ids)) == 3, ids  # the copy and the old pickle take new ids
        assert msg is not None and "out of step" in msg, msg
