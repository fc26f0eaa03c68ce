"""CPU: under `tp` the experts choose their path from the rows a rank expects to use
(DispatchResult.expected_rows = ceil(T*k/W)), not from expert_x's T*k capacity rows; the
output does not depend on the path, skewed routing included.

W ranks are faked in one process (group_rank_size patched; the reference all-reduce of a world
of one process is the identity, so each "rank" returns its partial sum). "CuTeDSL on CUDA" is
faked for Experts with the GEMV replaced by kernels/reference.expert_gemv (same semantics),
recorded.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_runtime import MoEConfig, MoELayer, experts
from moe_runtime.kernels import reference as R
from moe_runtime.topologies import distributed
from moe_runtime.topologies.local import LocalTopology
from moe_runtime.topologies.tp import TPTopology

E, W, T, K, H, I = 128, 4, 16, 8, 64, 32   # Qwen3-like E and k: 128 capacity rows, ~32 per rank
CFG = MoEConfig(hidden_size=H, num_experts=E, top_k=K, moe_intermediate_size=I, dtype=torch.bfloat16)


@pytest.fixture
def gemv_rows(monkeypatch):
    """Experts behave as on CUDA with CuTeDSL; returns the row counts the GEMV was called with."""
    calls = []

    def expert_gemv(x, offsets, w, *, swiglu):
        calls.append(x.shape[0])
        return R.expert_gemv(x, offsets, w, swiglu=swiglu)

    monkeypatch.setattr(experts.Experts, "_cute", lambda self, device: True)
    monkeypatch.setattr(experts, "get_ops", lambda backend: SimpleNamespace(expert_gemv=expert_gemv))
    return calls


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to bf16 roundings: max |a - b| <= 2% of max |b| (the paths round differently)."""
    return float((a.double() - b.double()).abs().max()) <= 2e-2 * float(b.double().abs().max())


def tp(monkeypatch, rank: int) -> TPTopology:
    monkeypatch.setattr(distributed, "group_rank_size", lambda group: (rank, W))
    # the cross-rank checks need real peers (their all-reduces are the identity here)
    monkeypatch.setattr(TPTopology, "_check_same_tokens", lambda self, partial, call: None)
    monkeypatch.setattr(TPTopology, "_check_same_topology", lambda self, device: None)
    return TPTopology(E, backend="reference")


def layers(monkeypatch):
    """The local layer (all experts) and the W tp layers sharing its router and expert weights."""
    torch.manual_seed(0)
    local = MoELayer(CFG, topology=LocalTopology(E, backend="reference"), backend="reference")
    ranks = []
    for r in range(W):
        layer = MoELayer(CFG, topology=tp(monkeypatch, r), backend="reference")
        layer.router.load_state_dict(local.router.state_dict())
        layer.load_expert_weights(local.experts.gate_up_proj, local.experts.down_proj)
        ranks.append(layer)
    return local, ranks


def test_tp_decode_takes_the_gemv_from_the_expected_rows(monkeypatch, gemv_rows):
    local, ranks = layers(monkeypatch)
    x = torch.randn(T, H).to(CFG.dtype)
    res = ranks[1].topology.dispatch(x, *ranks[1].router(x))
    assert res.expert_x.shape[0] == T * K > experts.GEMV_MAX_ROWS and res.expected_rows == T * K // W
    assert LocalTopology(E).dispatch(x, *local.router(x)).expected_rows is None

    with torch.no_grad():
        y_local = local(x)                   # 128 rows on one rank: the grouped path, as before
        assert gemv_rows == []
        partials = [layer(x) for layer in ranks]
    assert gemv_rows == [T * K] * 2 * W      # gate_up + down on every rank, over capacity rows
    assert close(sum(p.float() for p in partials), y_local)


def test_skewed_routing_is_correct_on_the_gemv(monkeypatch, gemv_rows):
    """Every (token, j) on rank 1's experts: 128 real rows although 32 are expected."""
    topo = tp(monkeypatch, 1)
    torch.manual_seed(1)
    ex = experts.Experts(topo.num_local_experts, H, I)
    loop = experts.Experts(topo.num_local_experts, H, I, gate_up_proj=ex.gate_up_proj,
                           down_proj=ex.down_proj, use_grouped_mm=False)
    ids = (topo.expert_start + torch.rand(T, topo.num_local_experts).argsort(-1)[:, :K]).to(torch.int32)
    x, w = torch.randn(T, H).to(CFG.dtype), torch.rand(T, K)
    res = topo.dispatch(x, ids, w)
    assert int(res.expert_offsets[-1]) == T * K and res.expected_rows == T * K // W
    y_gemv = topo.combine(ex(res.expert_x, res.expert_offsets, res.expected_rows), res)
    assert gemv_rows == [T * K] * 2
    y_loop = topo.combine(loop(res.expert_x, res.expert_offsets, res.expected_rows), res)
    assert close(y_gemv, y_loop)
