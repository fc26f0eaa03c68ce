"""MoEConfig, Router, Experts, local topology and MoELayer on the CPU (reference backend)."""
import copy
import logging
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, settings, strategies as st

from moe_runtime import MoEConfig, MoELayer
from moe_runtime.experts import Experts, SharedExpert
from moe_runtime.kernels import reference as R
from moe_runtime.topologies.local import LocalTopology


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token float64 MoE with the layer's own routing decisions."""
    c = layer.config
    ids, w = layer.router(x)
    xd = x.double()
    gu, dn = layer.experts.gate_up_proj.double(), layer.experts.down_proj.double()
    y = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for j in range(c.top_k):
            e = int(ids[t, j])
            g, u = (gu[e] @ xd[t]).split(c.moe_intermediate_size)
            y[t] += float(w[t, j]) * (dn[e] @ (F.silu(g) * u))
    if layer.shared_expert is not None:
        y += layer.shared_expert.double()(xd)
        layer.shared_expert.to(c.dtype)
    return y


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("family", ["softmax", "sigmoid_groups_shared", "softmax_gated_shared"])
def test_layer_matches_float64(dtype, tol, align, family):
    torch.manual_seed(hash((family, align)) % 2**31)
    kw = dict(hidden_size=40, num_experts=8, top_k=3, moe_intermediate_size=24, dtype=dtype)
    if family == "sigmoid_groups_shared":
        kw.update(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  use_correction_bias=True, shared_expert_intermediate_size=32, router_logits_fp32=True)
    elif family == "softmax_gated_shared":
        kw.update(norm_topk_prob=False, shared_expert_intermediate_size=16, shared_expert_gate=True)
    cfg = MoEConfig(**kw)
    layer = MoELayer(cfg, topology=LocalTopology(8, align=align, backend="reference"), backend="reference")
    if cfg.use_correction_bias:
        layer.router.e_score_correction_bias.normal_()
    x = torch.randn(2, 9, 40).to(dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y.reshape(-1, 40), naive_moe(layer, x.reshape(-1, 40))) <= tol


def test_layer_empty_and_single_token():
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8, dtype=torch.float32)
    layer = MoELayer(cfg, topology=LocalTopology(4, backend="reference"), backend="reference")
    assert layer(torch.randn(0, 16)).shape == (0, 16)
    x = torch.randn(1, 16)
    assert rel_err(layer(x), naive_moe(layer, x)) <= 1e-5


def test_layer_bad_input():
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8, dtype=torch.float32)
    layer = MoELayer(cfg, topology=LocalTopology(4, backend="reference"), backend="reference")
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        layer(torch.randn(3, 15))
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\], got \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match="hidden_states is on meta but the layer's weights are on cpu"):
        layer(torch.empty(3, 16, device="meta"))
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, got list"):
        layer([[0.0] * 16])
    with pytest.raises(TypeError, match="dense tensor .* got layout torch.sparse_coo"):
        layer(torch.randn(3, 16).to_sparse())
    nested = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(2, 16)], layout=torch.jagged)
    with pytest.raises(TypeError, match="dense tensor .* got layout torch.jagged"):
        layer(nested)


@pytest.mark.parametrize("bad,exc,msg", [
    (dict(top_k=9), ValueError, "top_k"),
    (dict(n_group=3), ValueError, "divisible by n_group"),
    (dict(n_group=4, topk_group=5), ValueError, "topk_group"),
    (dict(scoring="relu"), ValueError, "scoring"),
    (dict(dtype="float64"), ValueError, "dtype"),
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(hidden_size=2.5), TypeError, "hidden_size must be an int"),
    (dict(num_experts=4.0), TypeError, "num_experts must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(norm_topk_prob="no"), TypeError, "norm_topk_prob must be a bool, got str"),
    (dict(router_logits_fp32=0), TypeError, "router_logits_fp32 must be a bool, got int"),
    (dict(shared_expert_intermediate_size=-1), ValueError, "shared_expert_intermediate_size"),
    (dict(shared_expert_gate=True), ValueError, "shared_expert_gate needs a shared expert"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor must be a number, got str"),
    (dict(n_group=2), ValueError, r"scoring='softmax' .* n_group=2, use_correction_bias=False"),
    (dict(use_correction_bias=True), ValueError, r"scoring='softmax' .* use_correction_bias=True"),
    (dict(scoring="sigmoid", n_group=4, topk_group=1, top_k=3), ValueError,
     r"top_k \(3\) must be <= topk_group \(1\) \* experts per group \(num_experts 8 // n_group 4\)"),
])
def test_config_rejects(bad, exc, msg):
    kw = dict(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8)
    kw.update(bad)
    with pytest.raises(exc, match=msg):
        MoEConfig(**kw)


def test_repr_shows_the_sizes():
    layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8),
                     device="meta")
    text = repr(layer)
    assert text.startswith("MoELayer(\n  topology=local\n"), text
    assert "Router(num_experts=4, hidden_size=16, top_k=2, scoring=softmax, backend=auto)" in text
    assert "Experts(num_local_experts=4, hidden_size=16, intermediate_size=8, backend=auto)" in text


def test_config_takes_integer_types_as_ints():
    """Sizes read from numpy arrays: stored as the Python ints they hold; tensors and numpy
    bools are refused as other non-ints."""
    import numpy as np
    cfg = MoEConfig(hidden_size=np.int64(16), num_experts=np.uint16(8), top_k=np.int32(2),
                    moe_intermediate_size=8)
    assert cfg == MoEConfig(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8)
    assert type(cfg.hidden_size) is int and type(cfg.num_experts) is int
    for bad in (torch.tensor(2), np.True_):
        with pytest.raises(TypeError, match="top_k must be an int"):
            MoEConfig(hidden_size=16, num_experts=8, top_k=bad, moe_intermediate_size=8)
    scaled = MoEConfig(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8,
                       routed_scaling_factor=np.float32(2.5))  # (a float from numpy too)
    assert type(scaled.routed_scaling_factor) is float and scaled.routed_scaling_factor == 2.5
    for bad in (torch.tensor(2.5), np.True_):
        with pytest.raises(TypeError, match="routed_scaling_factor must be a number"):
            MoEConfig(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8,
                      routed_scaling_factor=bad)


def test_experts_grouped_equals_loop():
    torch.manual_seed(1)
    ex = Experts(5, 32, 16, dtype=torch.float32, use_grouped_mm=True)
    loop = Experts(5, 32, 16, gate_up_proj=ex.gate_up_proj, down_proj=ex.down_proj, use_grouped_mm=False)
    offsets = torch.tensor([0, 3, 3, 11, 12, 20], dtype=torch.int32)  # expert 1 empty
    x = torch.randn(20, 32)
    torch.testing.assert_close(ex(x, offsets), loop(x, offsets), rtol=1e-5, atol=1e-5)


def test_experts_share_storage_and_check_shapes():
    gu, dn = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
    ex = Experts(3, 4, 4, gate_up_proj=gu, down_proj=dn)
    assert ex.gate_up_proj.data_ptr() == gu.data_ptr()
    with pytest.raises(ValueError, match="gate_up_proj"):
        Experts(3, 4, 5, gate_up_proj=gu, down_proj=dn)
    with pytest.raises(ValueError, match="backend must be one of"):  # (not only once on CUDA)
        Experts(3, 4, 4, gate_up_proj=gu, down_proj=dn, backend="cuda")


# --- routing reference against an independent float64 computation --------------------------------

def _naive_route(logits, k, scoring, norm, bias, n_group, topk_group, scale):
    T, E = logits.shape
    ids, ws = [], []
    for t in range(T):
        l = logits[t].double()
        s = torch.softmax(l, 0) if scoring == "softmax" else torch.sigmoid(l)
        c = s.clone() if bias is None else s + bias.double()
        if n_group > 1:
            g = c.view(n_group, -1)
            gs = torch.stack([row.sort(descending=True).values[:2].sum() for row in g])
            keep = sorted(range(n_group), key=lambda i: (-float(gs[i]), i))[:topk_group]
            mask = torch.zeros(n_group, dtype=torch.bool)
            mask[keep] = True
            c = torch.where(mask.repeat_interleave(E // n_group), c, torch.full_like(c, float("-inf")))
        order = sorted(range(E), key=lambda e: (-float(c[e]), e))[:k]
        w = s[order]
        if norm:
            w = w / w.sum()
        ids.append(order)
        ws.append(w * scale)
    if T == 0:
        return torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k)
    return torch.tensor(ids, dtype=torch.int32), torch.stack(ws).float()


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 12), E=st.sampled_from([4, 8, 16]), k=st.integers(1, 4),
       scoring=st.sampled_from(["softmax", "sigmoid"]), norm=st.booleans(),
       groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_route_reference_matches_naive(T, E, k, scoring, norm, groups, seed):
    n_group, topk_group = groups if scoring == "sigmoid" else (1, 1)
    k = min(k, topk_group * E // n_group)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) if scoring == "sigmoid" else None
    scale = 2.5 if scoring == "sigmoid" else 1.0
    ids, w, counts = R.route(logits, k, scoring=scoring, norm_topk_prob=norm, correction_bias=bias,
                             n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    nids, nw = _naive_route(logits, k, scoring, norm, bias, n_group, topk_group, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and counts.dtype == torch.int32
    assert torch.equal(ids, nids.view(T, k))
    torch.testing.assert_close(w, nw.view(T, k), rtol=1e-6, atol=1e-6)
    assert torch.equal(counts, torch.bincount(nids.view(-1).long(), minlength=E).int())


def test_route_ties_go_to_smaller_id():
    ids, _, _ = R.route(torch.zeros(2, 6), 3)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("kw", [dict(scoring="softmax"),
                                dict(scoring="sigmoid", n_group=4, topk_group=2,
                                     correction_bias=torch.linspace(-0.1, 0.1, 16))])
def test_route_nan_logits_give_nan_weights_and_valid_ids(kw):
    """A NaN router logit (a corrupted weight) reaches the output as NaN, as in HF (sigmoid
    routing chose around it and returned finite weights); a NaN counts as the lowest finite
    value in the choice, so the ids stay distinct and in range; other tokens are untouched."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 16, generator=g)
    logits[1, 6] = logits[3, :] = float("nan")
    ids, w, counts = R.route(logits, 4, **kw)
    assert torch.isnan(w[[1, 3]]).all() and not torch.isnan(w[[0, 2, 4]]).any()
    assert all(len(set(r)) == 4 and 0 <= min(r) and max(r) < 16 for r in ids.tolist())
    assert 6 not in ids[1].tolist()
    if kw["scoring"] == "softmax":  # (every score of a NaN row is NaN: the first k ids)
        assert ids[1].tolist() == ids[3].tolist() == [0, 1, 2, 3]
    clean, cw, _ = R.route(logits[[0, 2, 4]], 4, **kw)
    assert torch.equal(ids[[0, 2, 4]], clean) and torch.equal(w[[0, 2, 4]], cw)
    assert torch.equal(counts, torch.bincount(ids.flatten().long(), minlength=16).int())


# --- dispatch/combine reference properties --------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 20), E=st.sampled_from([1, 4, 8]), k=st.integers(1, 4), align=st.sampled_from([1, 4, 16]),
       shard=st.sampled_from([(0, 1), (1, 2), (3, 4)]), seed=st.integers(0, 2**16))
def test_dispatch_combine_reference(T, E, k, align, shard, seed):
    rank, world = shard
    if E % world:
        world, rank = 1, 0
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)] or
                      [torch.zeros(0, k, dtype=torch.long)]).int().view(T, k)
    x = torch.randn(T, 6, generator=g)
    w = torch.rand(T, k, generator=g)
    el = E // world
    ex, off, slot = R.dispatch(x, ids, expert_start=rank * el, num_local_experts=el, align=align)
    assert ex.shape[0] == R.dispatch_capacity(T, k, el, align) and off.dtype == torch.int32
    local = (ids >= rank * el) & (ids < (rank + 1) * el)
    assert torch.equal(slot >= 0, local)
    assert bool((off % align == 0).all()) and off[0] == 0
    for e in range(el):
        mine = slot[ids == rank * el + e]
        n = mine.numel()
        assert sorted(mine.tolist()) == list(range(int(off[e]), int(off[e]) + n))
        assert int(off[e + 1]) - int(off[e]) == (n + align - 1) // align * align
    t_idx = torch.arange(T).unsqueeze(1).expand(T, k)
    assert torch.equal(ex[slot[local].long()], x[t_idx[local]])
    unused = torch.ones(ex.shape[0], dtype=torch.bool)
    unused[slot[local].long()] = False
    assert bool((ex[unused] == 0).all())  # padding rows and rows past the last expert: zero
    y = R.combine(ex, slot, w)
    expected = x * torch.where(local, w, torch.zeros_like(w)).sum(1, keepdim=True)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_local_topology_identity_and_validation():
    topo = LocalTopology(8, backend="reference")
    x = torch.randn(6, 16)[:, ::2]  # non-contiguous input
    ids = torch.tensor([[0, 1]] * 6, dtype=torch.int32)
    w = torch.rand(6, 2)
    res = topo.dispatch(x, ids, w)
    y = topo.combine(res.expert_x, res)
    torch.testing.assert_close(y, x * w.sum(1, keepdim=True))
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        topo.dispatch(x, torch.tensor([[0, 8]] * 6, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="distinct"):
        topo.dispatch(x, torch.tensor([[3, 3]] * 6, dtype=torch.int32), w)
    with pytest.raises(TypeError, match="int32"):
        topo.dispatch(x, ids.long(), w)
    with pytest.raises(TypeError, match="float32"):
        topo.dispatch(x, ids, w.double())
    with pytest.raises(ValueError, match=r"\[6, 2\]"):
        topo.dispatch(x, ids, w[:, :1])
    with pytest.raises(ValueError, match="expert_y"):
        topo.combine(res.expert_x[:, :4], res)
    with pytest.raises(ValueError, match="backend"):
        LocalTopology(8, backend="magic").dispatch(x, ids, w)


def test_experts_unaligned_rows_use_loop():
    """H or I not a multiple of 16 bytes: torch._grouped_mm would raise; Experts loops instead."""
    torch.manual_seed(2)
    ex = Experts(3, 6, 5, dtype=torch.float32)
    offsets = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    x = torch.randn(7, 6)
    ref = Experts(3, 6, 5, gate_up_proj=ex.gate_up_proj, down_proj=ex.down_proj, use_grouped_mm=False)
    torch.testing.assert_close(ex(x, offsets), ref(x, offsets))


@pytest.mark.parametrize("use_grouped_mm", [None, True])
def test_experts_strided_weight_views_use_loop(use_grouped_mm):
    """Weights torch._grouped_mm rejects (a view taking every other input feature: last stride
    2) take the per-expert loop, even with use_grouped_mm=True, and give the contiguous answer;
    so does a layer given such weights by load_expert_weights."""
    torch.manual_seed(4)
    gu, dn = torch.randn(3, 10, 16)[..., ::2], torch.randn(3, 8, 5)
    assert gu.stride(-1) == 2
    ex = Experts(3, 8, 5, gate_up_proj=gu, down_proj=dn, use_grouped_mm=use_grouped_mm)
    ref = Experts(3, 8, 5, gate_up_proj=gu.contiguous(), down_proj=dn, use_grouped_mm=False)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    x = torch.randn(9, 8)
    torch.testing.assert_close(ex(x, offsets), ref(x, offsets))
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                    dtype=torch.float32)
    layer, dense = MoELayer(cfg), MoELayer(cfg)
    gu, dn = torch.randn(4, 16, 32)[..., ::2], torch.randn(4, 16, 8)
    layer.load_expert_weights(gu, dn)
    dense.router.load_state_dict(layer.router.state_dict())
    dense.load_expert_weights(gu.contiguous(), dn)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense(x))


def test_expert_gemv_takes_contiguous_weights_in_the_grouped_mm_layout(monkeypatch):
    """The CuTeDSL expert GEMV (faked as available) is chosen only for contiguous weights whose
    strides and storage offset are 16-byte multiples: not for a contiguous view at an odd
    offset, nor for one expert whose size-1 dim has a stride is_contiguous() ignores."""
    monkeypatch.setattr(Experts, "_cute", lambda self, device: True)
    E, H, I = 3, 16, 8
    x = torch.randn(2, H, dtype=torch.bfloat16)

    def gemv(gu, dn, e=E):  # (one row for one expert: the GEMV's rows <= 1.5 E rule)
        ex = Experts(e, H, I, dtype=torch.bfloat16, gate_up_proj=gu, down_proj=dn)
        return ex._gemv(x[:1] if e == 1 else x)

    gu, dn = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()
    assert gemv(gu, dn)
    shifted = torch.randn(gu.numel() + 1).bfloat16()[1:].view(E, 2 * I, H)
    assert shifted.is_contiguous() and shifted.storage_offset() == 1
    assert not gemv(shifted, dn)
    one = torch.randn(2 * I * H + 3).bfloat16().as_strided((1, 2 * I, H), (3, H, 1))
    assert one.is_contiguous() and one.stride(0) * 2 % 16
    assert not gemv(one, dn[:1].contiguous(), e=1)
    assert gemv(gu[:1], dn[:1], e=1)


def test_layer_rejects_bad_construction_and_inputs_of_another_dtype():
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="'bogus'"):
        MoELayer(cfg, backend="bogus")
    with pytest.raises(TypeError, match="topology must be a name or a Topology"):
        MoELayer(cfg, topology=None)
    layer = MoELayer(cfg, backend="reference")
    with pytest.raises(TypeError, match="gate_up_proj must be torch.float32"):
        layer.load_expert_weights(torch.randn(4, 16, 16, dtype=torch.bfloat16),
                                  torch.randn(4, 16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="down_proj is on meta but the layer's other parameters "
                                         "are on cpu"):
        layer.load_expert_weights(torch.randn(4, 16, 16), torch.empty(4, 16, 8, device="meta"))
    with pytest.raises(TypeError, match="gate_up_proj must be a torch.Tensor, got ndarray"):
        layer.load_expert_weights(torch.randn(4, 16, 16).numpy(), torch.randn(4, 16, 8))
    layer.to(torch.bfloat16)  # converts the layer: config.dtype follows its weights
    assert layer.config.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"hidden_states must be torch.bfloat16 \(the dtype of the "
                                        r"layer's weights\), got torch.float32"):
        layer(torch.randn(3, 16))


def test_combine_rejects_another_dtype():
    topo = LocalTopology(4, backend="reference")
    x = torch.randn(3, 8)
    res = topo.dispatch(x, torch.tensor([[0, 1]] * 3, dtype=torch.int32), torch.rand(3, 2))
    with pytest.raises(TypeError, match="expert_x's dtype"):
        topo.combine(res.expert_x.bfloat16(), res)


def test_reference_combine_of_no_expert_rows_is_zero():
    """Every pick -1 and no expert rows (a rank whose experts got nothing): zeros, as the cute
    combine returns."""
    y = R.combine(torch.zeros(0, 8), torch.full((3, 2), -1, dtype=torch.int32), torch.ones(3, 2))
    torch.testing.assert_close(y, torch.zeros(3, 8), rtol=0, atol=0)


def test_auto_takes_the_reference_where_the_cute_kernels_refuse_the_shapes(monkeypatch, caplog):
    """backend "auto" on CUDA: the cute kernels only for shapes they take (no GPU needed: the
    resolution is host logic); an explicit "cute" is left to the kernels' own errors."""
    from moe_runtime import kernels
    from moe_runtime.routing import Router
    monkeypatch.setattr(kernels, "cute_available", lambda: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    local = LocalTopology(8)
    assert local.resolved_backend(cuda, 16, bf16, 2) == "cute"
    assert local.resolved_backend(cuda, 12, torch.float32, 2) == "cute"  # 48-byte rows
    for hidden, dtype, top_k in ((12, bf16, 2), (16, torch.float64, 2), (16, bf16, 33)):
        assert local.resolved_backend(cuda, hidden, dtype, top_k) == "reference"
    assert LocalTopology(2048).resolved_backend(cuda, 16, bf16, 2) == "reference"
    assert LocalTopology(8, backend="cute").resolved_backend(cuda, 12, bf16, 2) == "cute"
    assert "the CuTeDSL kernels do not take this layer" in caplog.text

    def router(**kw):
        cfg = dict(hidden_size=16, num_experts=64, top_k=4, moe_intermediate_size=8)
        return Router(MoEConfig(**{**cfg, **kw}), device="meta")
    assert router().resolved_backend(cuda, bf16) == "cute"
    assert router().resolved_backend(cuda, torch.float64) == "reference"
    assert router(num_experts=2048).resolved_backend(cuda, bf16) == "reference"
    monkeypatch.setattr(MoELayer, "_kernels_sync_free", lambda self, device: True)
    for hidden, graphs in ((12, False), (16, True)):  # (12: CUDA graphs refused, not a failed
        layer = MoELayer(MoEConfig(hidden_size=hidden, num_experts=4, top_k=2,  # capture)
                                   moe_intermediate_size=8), device="meta")
        assert layer.host_sync_free(cuda) == graphs


def test_auto_without_cutedsl_on_cuda_says_so_once(monkeypatch, caplog):
    """backend "auto" on CUDA without nvidia-cutlass-dsl: the reference kernels, and one warning
    naming the install (never silently, never once per call); CPU devices warn nothing."""
    from moe_runtime import kernels
    monkeypatch.setattr(kernels, "cute_available", lambda: False)
    kernels._log_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="moe_runtime"):
            assert kernels.resolve_backend("auto", torch.device("cpu")) == "reference"
            assert not caplog.records
            for _ in range(3):
                assert kernels.resolve_backend("auto", torch.device("cuda")) == "reference"
                assert LocalTopology(8).resolved_backend(torch.device("cuda", 0), 16,
                                                         torch.bfloat16, 2) == "reference"
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "nvidia-cutlass-dsl is not importable" in said[0] \
            and "moe_runtime[gpu]" in said[0], said
        with pytest.raises(ValueError, match="needs a CUDA device and nvidia-cutlass-dsl"):
            kernels.resolve_backend("cute", torch.device("cuda"))
    finally:
        kernels._log_once.cache_clear()


def test_compiled_kernels_follow_grad_mode(monkeypatch):
    """While torch.compile traces with grad mode on, "auto" on CUDA with CuTeDSL resolves to the
    reference (the CuTeDSL kernels have no backward: traced in, compiled training on the H200
    lost the routed experts' gradients) and an explicit "cute" fails fullgraph=True naming the
    way out (without fullgraph, dynamo runs it eagerly); with grad mode off both resolve to
    "cute", and get_ops("cute") gives the kernels as custom ops (compiled_ops). No GPU needed:
    host logic."""
    pytest.importorskip("cutlass")  # (compiled_ops imports the CuTeDSL kernels)
    from moe_runtime import kernels
    from moe_runtime.kernels import compiled_ops
    monkeypatch.setattr(kernels, "cute_available", lambda: True)
    cuda = torch.device("cuda")
    assert kernels.resolve_backend("auto", cuda) == "cute"  # (eager)

    def pick(backend):
        return lambda x: x + len(kernels.resolve_backend(backend, cuda))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(pick("auto"), fullgraph=True, backend="eager")(
        torch.zeros(2)), torch.full((2,), float(len("reference"))))
    with pytest.raises(Exception, match="inference-only") as err:
        torch.compile(pick("cute"), fullgraph=True, backend="eager")(torch.zeros(2))
    assert "torch.no_grad()" in str(err.value) and "backend 'auto'" in str(err.value)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(pick("cute"), backend="eager")(torch.zeros(2)),
                       torch.full((2,), float(len("cute"))))
    torch._dynamo.reset()
    ops = torch.compile(lambda x: x + (kernels.get_ops("cute") is compiled_ops), fullgraph=True,
                        backend="eager")
    with torch.no_grad():
        for backend in ("auto", "cute"):
            assert torch.equal(torch.compile(pick(backend), fullgraph=True, backend="eager")(
                torch.zeros(2)), torch.full((2,), float(len("cute"))))
        assert torch.equal(ops(torch.zeros(1)), torch.ones(1))


def test_autograd_records_traces_under_torch_compile():
    """kernels.autograd_records (the layer's grad-mode test, reached by the multi-rank layers
    under compile) traces in one graph: dynamo cannot trace torch.is_inference_mode_enabled."""
    from moe_runtime.kernels import autograd_records
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1 if autograd_records() else x - 1, fullgraph=True,
                      backend="eager")
    with torch.no_grad():
        assert torch.equal(f(torch.zeros(1)), -torch.ones(1))
    assert torch.equal(f(torch.zeros(1)), torch.ones(1))


def test_torch_compile_fp32_on_cpu():
    """torch.compile's _grouped_mm lowering takes bf16 only: fp32 layers loop under compile."""
    torch._dynamo.reset()
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8, dtype=torch.float32)
    layer = MoELayer(cfg, backend="reference")
    x = torch.randn(3, 16)
    torch.testing.assert_close(torch.compile(layer, backend="aot_eager")(x), layer(x))


def test_a_layer_on_the_meta_device_says_to_materialize_it():
    cfg = MoEConfig(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16,
                    dtype=torch.float32)
    layer = MoELayer(cfg, device="meta")
    with pytest.raises(ValueError, match="needs real tensors, got the meta device"):
        layer(torch.empty(3, 32, device="meta"))
    layer.to_empty(device="cpu")
    for m in layer.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    y = layer(torch.randn(3, 32))
    assert y.shape == (3, 32) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_on_cpu(dynamic, dtype):
    """A layer compiles into one graph (no break: the path choice traces, e.g. the weight
    layout check; fp16 / fp32 take the per-expert loop, one op under compile: its host read
    broke fullgraph before) and matches eager; dynamo has
    nothing to warn about (it warned that it traced through an lru_cache'd probe)."""
    import warnings
    torch._dynamo.reset()
    torch.manual_seed(3)
    cfg = MoEConfig(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16, dtype=dtype)
    layer = MoELayer(cfg, backend="reference")
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for T in (10, 7, 0):  # (T = 0: no data-dependent read of the empty counts)
            x = torch.randn(T, 32, dtype=dtype)
            torch.testing.assert_close(compiled(x), layer(x), rtol=2e-2, atol=2e-2)
    assert not [w for w in seen if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inductor_trains_a_looping_layer_in_one_graph(dtype):
    """torch.compile(fullgraph=True, dynamic=True) with inductor of an fp32 / fp16 layer in
    training (the experts' per-expert loop, expert_loop.py: inductor could not generate the
    backward of its host-read row slices, "expected [u9, u10] to have been codegen-ed"):
    T = 9 and 13 compile nothing after T = 6 (T = 0 is a size dynamo always specializes),
    outputs and every gradient equal to eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    torch.manual_seed(4)
    cfg = MoEConfig(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16, dtype=dtype,
                    shared_expert_intermediate_size=16)
    layer = MoELayer(cfg, backend="reference")
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=cnt)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for T in (6, 9, 13, 0):
        x = torch.randn(T, 32, dtype=dtype)
        runs = []
        for fn in (compiled, layer):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.float().square().sum().backward()
            runs.append([y, xi.grad, *(p.grad for p in layer.parameters())])
        for got, want in zip(*runs):
            assert got is not None and want is not None
            torch.testing.assert_close(got, want, **tol)
        if T == 6:
            first = cnt.frame_count  # (dynamo may restart its first analysis: 1 or 2)
        elif T in (9, 13):
            assert cnt.frame_count == first, T


def test_torch_compile_dynamic_token_counts_compile_once():
    """With dynamic shapes nothing in forward guards on the token count on CPU (the CUDA GEMV's
    row rule is tested only for CUDA bf16/fp16 rows): one graph for T = 5..200."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    cnt = CompileCounter()
    compiled = torch.compile(_shared_layer(torch.bfloat16), backend=cnt, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for T in (5, 7, 40, 200):
            compiled(torch.randn(T, 16, dtype=torch.bfloat16))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_export_with_a_dynamic_token_count(dtype):
    """The reference dispatch sizes everything from shapes (no host read of the routing), so a
    layer exports (non-strict) with a dynamic sequence length and matches eager (fp16 / fp32:
    the per-expert loop, one op there; its host-read bounds failed export before). The layer,
    run eagerly before (its walk of the tree cached), keeps working after, deep-copies and
    pickles (the exporter swaps the modules' tensor dicts: the cache must not keep its fakes)."""
    import pickle
    from torch.export import Dim
    from moe_runtime.cuda_graphs import storage_fingerprint
    layer = _shared_layer(dtype).eval()
    x = torch.randn(2, 9, 16, dtype=dtype)
    with torch.no_grad():
        before = layer(x)
    ep = torch.export.export(layer, (torch.randn(2, 5, 16, dtype=dtype),),
                             dynamic_shapes={"hidden_states": {1: Dim("S", max=1024)}})
    assert layer._storage_fingerprint() == storage_fingerprint(layer)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), before)
        assert torch.equal(layer(x), before)
        assert torch.equal(copy.deepcopy(layer)(x), before)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), before)


def test_torch_compile_forced_grouped_mm_fp32_takes_the_loop():
    """use_grouped_mm=True in fp32 runs torch._grouped_mm eagerly, but torch.compile's lowering
    takes bf16 only: compiled, the experts take the per-expert loop instead of failing."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    cfg = MoEConfig(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16,
                    dtype=torch.float32)
    layer = MoELayer(cfg, backend="reference")
    layer.experts.use_grouped_mm = True
    x = torch.randn(10, 32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, backend="aot_eager")(x), layer(x),
                                   rtol=1e-5, atol=1e-5)


def test_config_must_be_a_moe_config():
    from transformers import Qwen3MoeConfig
    for bad in ({"hidden_size": 32}, Qwen3MoeConfig()):
        with pytest.raises(TypeError, match=r"config must be a moe_runtime.MoEConfig, got .*swap_moe_layers"):
            MoELayer(bad)


def _shared_layer(dtype=torch.float32) -> MoELayer:
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                    dtype=dtype, shared_expert_intermediate_size=8, shared_expert_gate=True)
    return MoELayer(cfg, backend="reference")


def test_replaced_weights_and_submodules_must_fit_the_config():
    """A tensor or submodule assigned after construction keeps the config's sizes and dtype
    (else routing to experts that do not exist, or dropped tokens, without an error); a
    replacement that fits is used."""
    layer = _shared_layer()
    x = torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"Router.weight must keep its shape \(4, 16\).*\(6, 16\)"):
        layer.router.weight = nn.Parameter(torch.randn(6, 16))
    biased = _bias_layer()
    biased.router.e_score_correction_bias = torch.full((4,), 0.5, dtype=torch.bfloat16)
    assert biased.router.e_score_correction_bias.dtype == torch.float32  # (kept fp32)
    with pytest.raises(ValueError, match=r"MoELayer.experts must match the layer's config: weight \(4, 16, 16\)"):
        layer.experts = Experts(2, 16, 8, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"MoELayer.experts must be a Experts .*ModuleDict"):
        layer.experts = nn.ModuleDict({"base_layer": layer.experts})
    with pytest.raises(ValueError, match=r"SharedExpert.up_proj.weight must keep its shape \(8, 16\)"):
        layer.shared_expert.up_proj = nn.Linear(16, 4, bias=False)
    with pytest.raises(TypeError, match=r"MoELayer.router must be a Router"):
        layer.router = nn.Linear(16, 4)
    with torch.no_grad():
        y = layer(x)
        layer.router.weight = nn.Parameter(layer.router.weight.flip(0))  # fits: used
        layer.shared_expert.up_proj = nn.Linear(16, 8, bias=False)
        assert not torch.allclose(layer(x), y)


def test_transparent_wrappers_and_same_module_reassignment_are_accepted():
    """torch.compile / activation checkpointing wrappers, a subclass, a parametrized router,
    re-assigning the module already there (FSDP's and checkpointing's wrap walks) and a
    projection wrapper without a weight attribute: accepted, forward unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.nn.utils import parametrize
    layer = _shared_layer()
    x = torch.randn(5, 16)
    with torch.no_grad():
        y = layer(x)
        layer.experts = torch.compile(layer.experts, backend="eager")
        layer.shared_expert = checkpoint_wrapper(layer.shared_expert)
        parametrize.register_parametrization(layer.router, "weight", nn.Identity())
        layer.router = layer.router
        torch.testing.assert_close(layer(x), y)

    class Scaled(nn.Module):  # wraps a projection, exposes no `weight`
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, t):
            return 2 * self.base(t)
    layer = _shared_layer()
    layer.shared_expert.gate = Scaled(layer.shared_expert.gate)
    layer.shared_expert = type("MySharedExpert", (SharedExpert,), {})(16, 8, gated=True,
                                                                        dtype=torch.float32)
    layer(x)


def test_a_registration_elsewhere_does_not_recompile_the_layer():
    """The layer's cached walk is keyed on assignments to this package's modules only: modules
    built elsewhere (HF forwards slice ModuleLists on every call) neither redo it nor, under
    torch.compile, trigger a recompile."""
    torch._dynamo.reset()
    layer = _shared_layer(torch.bfloat16)  # (bf16: one graph, see the fullgraph test)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(x)
            nn.ModuleList([nn.Linear(4, 4)])[:1]
    layer(x)
    cache = layer.__dict__["_tree_cache"]
    nn.Linear(4, 4)
    layer(x)
    assert layer.__dict__["_tree_cache"] is cache


@pytest.mark.parametrize("how", ["to_meta", "overwrite_flag", "functional_call_first"])
def test_dtype_check_holds_no_tensors_and_sees_new_ones(how):
    """The cached walk names parameters and reads them live: parameters replaced without an
    assignment (the overwrite flag, .to('meta'), functional_call) are neither kept alive nor
    missed by the dtype check."""
    import weakref
    layer = _shared_layer()
    x = torch.randn(3, 16)
    if how == "functional_call_first":
        params = {k: v.clone() for k, v in layer.named_parameters()}
        torch.func.functional_call(layer, params, (x,))
    else:
        layer(x)
    old = weakref.ref(layer.router.weight)
    if how == "to_meta":
        layer.to("meta")
        assert old() is None  # (the walk did not keep it)
        return
    if how == "overwrite_flag":
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            layer.half()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        assert old() is None
        with torch.no_grad():  # the new fp16 parameters are the ones read (config.dtype follows)
            assert layer(x.half()).dtype == torch.float16
        return
    else:
        layer.shared_expert.half()
    with pytest.raises(TypeError, match=r"must share one dtype: .* is torch.float(16|32) but .* is "
                                        r"torch.float(16|32)"):
        layer(x)


def test_torch_func_grad_matches_autograd():
    """torch.func.grad over functional_call (parameters without storage: the path choice reads
    no data pointer on them) gives the gradients that backward does."""
    layer = _shared_layer()
    x = torch.randn(5, 16)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params)
    layer(x).sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_forward_mode_ad_matches_the_reverse_mode_jacobian():
    """Forward-mode AD (torch.func.jvp, a forward_ad dual level, also under torch.no_grad(),
    which leaves forward AD on) takes kernels with forward derivatives (the per-expert loop:
    torch._grouped_mm has none): the tangent equals the vector-Jacobian product's transpose,
    J v, taken in reverse mode."""
    import torch.autograd.forward_ad as fwAD
    layer = _shared_layer()
    x, v = torch.randn(5, 16), torch.randn(5, 16)
    jac = torch.autograd.functional.jacobian(layer, x)  # [5, 16, 5, 16], reverse mode
    want = torch.einsum("thsi,si->th", jac, v)
    _, tangent = torch.func.jvp(layer, (x,), (v,))
    torch.testing.assert_close(tangent, want)
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, v))).tangent
        torch.testing.assert_close(tangent, want)
    assert layer.experts._grouped(x.device, x.dtype)  # (outside forward AD: the grouped GEMM)


def test_deepcopy_of_a_layer_with_parametrized_submodules():
    """nn.utils.parametrize's deepcopy sets the replica's whole __dict__ through setattr, before
    the replica has module state: the layer's assignment checks let it through, and the copy
    computes what the original does."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w
    layer = _shared_layer()
    for sub, name in ((layer.router, "weight"), (layer.experts, "down_proj"),
                      (layer.shared_expert.up_proj, "weight")):
        parametrize.register_parametrization(sub, name, Double())
    x = torch.randn(5, 16)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
        twin.experts.parametrizations.down_proj.original.mul_(2)
        assert not torch.allclose(twin(x), layer(x))


def _bias_layer(dtype=torch.float32) -> MoELayer:
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8, dtype=dtype,
                    scoring="sigmoid", use_correction_bias=True, routed_scaling_factor=2.5)
    return MoELayer(cfg, backend="reference")


@pytest.mark.parametrize("cast", ["experts.down_proj", "shared_expert", "router.data", "double"])
def test_weights_of_mixed_or_unsupported_dtypes_raise(cast):
    layer = _shared_layer()
    if cast == "experts.down_proj":
        layer.experts.down_proj = nn.Parameter(layer.experts.down_proj.half())  # (accepted here)
    elif cast == "shared_expert":
        layer.shared_expert.half()
    elif cast == "router.data":
        layer.router.weight.data = layer.router.weight.data.bfloat16()
    else:
        layer.double()
        with pytest.raises(TypeError, match=r"weights are torch.float64; MoELayer computes in "
                                            r"float32, bfloat16, float16"):
            layer(torch.randn(3, 16, dtype=torch.float64))
        return
    with pytest.raises(TypeError, match=r"must share one dtype: .* but .*; cast the whole layer"):
        layer(torch.randn(3, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_layer_computes_in_its_new_dtype(dtype):
    """`.to(dtype)` / `.half()` convert the layer like any module (config.dtype follows); the
    result equals a layer built in that dtype from the same (cast) weights."""
    torch.manual_seed(0)
    layer = _shared_layer()
    built = _shared_layer(dtype)
    built.load_state_dict({k: v.to(dtype) for k, v in layer.state_dict().items()})
    (layer.half() if dtype == torch.float16 else layer.to(dtype))
    assert layer.config.dtype == dtype and layer.router.config.dtype == dtype
    x = torch.randn(6, 16, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(layer(x), built(x))


def test_an_assigned_correction_bias_is_kept_fp32():
    """load_state_dict(assign=True) of a bf16 state dict (a DeepSeek-V3 model cast by HF's
    `.to()`): the bias becomes fp32; a non-floating bias is refused."""
    cfg = MoEConfig(hidden_size=16, num_experts=8, top_k=2, moe_intermediate_size=8,
                    dtype=torch.float32, scoring="sigmoid", use_correction_bias=True,
                    router_logits_fp32=True)
    layer = MoELayer(cfg, backend="reference")
    layer.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()}, assign=True)
    assert layer.router.e_score_correction_bias.dtype == torch.float32
    assert layer.dtype == torch.bfloat16 and layer(torch.randn(3, 16).bfloat16()).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="e_score_correction_bias must be a floating tensor"):
        layer.router.e_score_correction_bias = torch.zeros(8, dtype=torch.int64)
    with torch.inference_mode():  # (a normal tensor converted there stays a normal tensor)
        layer.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()},
                              assign=True)
    assert not layer.router.e_score_correction_bias.is_inference()
    layer.load_state_dict(layer.state_dict())  # (in place: refused for an inference tensor)
    with torch.no_grad():
        layer.router.e_score_correction_bias.add_(1e-3)
        layer.router.e_score_correction_bias = torch.zeros(8, dtype=torch.bfloat16,
                                                           requires_grad=True)
    assert layer.router.e_score_correction_bias.grad_fn is None  # (as assigned: no_grad kept)


def test_a_cast_keeps_the_correction_bias_in_fp32():
    """DeepSeek-V3's e_score_correction_bias decides the expert choice: `.to(bfloat16)` of a
    layer already in bf16 must not round it (it stays fp32, from its fp32 values)."""
    torch.manual_seed(0)
    layer = _bias_layer(torch.bfloat16)
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(3.0 + 0.01 * torch.randn(4))
    bias = layer.router.e_score_correction_bias.clone()
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        ids, _ = layer.router(x)
        layer.to(torch.bfloat16)
        layer.half()
        assert layer.router.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(layer.router.e_score_correction_bias, bias)
        layer.to(torch.bfloat16)
        assert torch.equal(layer.router(x)[0], ids)


def test_autocast_accepts_inputs_of_the_autocast_dtype():
    """Under torch.autocast an fp32 layer after a bf16 op (and a bf16 layer after an fp32 one)
    takes the input, cast to its weights' dtype; the ops inside autocast as usual."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    layer = _shared_layer()
    x = torch.randn(5, 16)
    with torch.no_grad():
        ref = layer(lin(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(x)
            assert h.dtype == torch.bfloat16
            y = layer(h)
            y16 = _shared_layer(torch.bfloat16)(torch.randn(5, 16))  # fp32 input, bf16 layer
    assert y.shape == ref.shape and torch.isfinite(y16).all()
    assert rel_err(y.float(), ref) <= 3e-2
    with pytest.raises(TypeError, match="hidden_states must be torch.float32"):
        layer(h)  # outside autocast the dtype must match


def test_weights_set_by_assignment_decide_the_dtype():
    """load_state_dict(assign=True) with bf16 tensors (no conversion of the layer, so config.dtype
    stays): `dtype`, forward and load_expert_weights follow the weights."""
    layer = _shared_layer()
    layer.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()}, assign=True)
    assert layer.config.dtype == torch.float32 and layer.dtype == torch.bfloat16
    with torch.no_grad():
        assert layer(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer.load_expert_weights(layer.experts.gate_up_proj.detach().clone(),
                              layer.experts.down_proj.detach().clone())
    with pytest.raises(TypeError, match=r"gate_up_proj must be torch.bfloat16 \(the dtype of the "
                                        r"layer's weights\), got torch.float32"):
        layer.load_expert_weights(torch.randn(4, 16, 16), torch.randn(4, 16, 8))


def test_meta_init_then_reset_parameters():
    """The meta-device recipe (FSDP2): build on meta, to_empty, reset_parameters on every
    module that has one: every weight is drawn afresh (finite, the constructor's scale)."""
    cfg = MoEConfig(hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=32,
                    dtype=torch.float32, shared_expert_intermediate_size=8, scoring="sigmoid",
                    use_correction_bias=True)
    with torch.device("meta"):
        layer = MoELayer(cfg, backend="reference")
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.router.e_score_correction_bias.fill_(float("nan"))
    for m in layer.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert torch.equal(layer.router.e_score_correction_bias, torch.zeros(4))
    for w, fan_in in ((layer.router.weight, 64), (layer.experts.gate_up_proj, 64),
                      (layer.experts.down_proj, 32)):
        assert torch.isfinite(w).all() and abs(float(w.std()) * fan_in ** 0.5 - 1) < 0.2
    with torch.no_grad():
        assert torch.isfinite(layer(torch.randn(3, 64))).all()


@pytest.mark.parametrize("how", ["data", "register_parameter", "parameters_dict"])
def test_weights_replaced_without_assignment_keep_their_shape(how):
    """A router weight of 8 rows on a 4-expert layer would route to experts that do not exist
    (dropped without an error): replaced around the setattr check, forward refuses it."""
    layer = _shared_layer()
    layer(torch.randn(2, 16))  # (the cached walk exists before the replacement)
    bad = torch.randn(8, 16)
    if how == "data":
        layer.router.weight.data = bad
    elif how == "register_parameter":
        layer.router.register_parameter("weight", nn.Parameter(bad))
    else:
        layer.router._parameters["weight"] = nn.Parameter(bad)
    with pytest.raises(ValueError, match=r"weight router.weight is \(8, 16\) but the layer was "
                                         r"built for \(4, 16\)"):
        layer(torch.randn(3, 16))


def test_expert_gemv_reference_equals_experts_forward():
    """kernels/reference.expert_gemv (the GEMV kernel's semantics) == Experts in fp32."""
    torch.manual_seed(3)
    ex = Experts(4, 24, 8, dtype=torch.float32, use_grouped_mm=False)
    offsets = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)  # expert 1 empty
    x = torch.randn(10, 24)                                       # rows 8, 9 past the last expert
    act = R.expert_gemv(x, offsets, ex.gate_up_proj, swiglu=True)
    y = R.expert_gemv(act, offsets, ex.down_proj, swiglu=False)
    torch.testing.assert_close(y[:8], ex(x, offsets)[:8], rtol=1e-5, atol=1e-5)
    assert act.shape == (10, 8) and bool((y[8:] == 0).all())


def test_standalone_layer_trains_like_an_explicit_loop():
    """Experts and router of a standalone layer get the gradients of the same MoE written as a
    plain per-(token, pick) loop (autograd through both)."""
    torch.manual_seed(3)
    cfg = MoEConfig(hidden_size=32, num_experts=6, top_k=2, moe_intermediate_size=16,
                    dtype=torch.float32)
    layer = MoELayer(cfg)
    x, g = torch.randn(5, 32), torch.randn(5, 32)
    (layer(x) * g).sum().backward()
    got = [p.grad.clone() for p in (layer.router.weight, layer.experts.gate_up_proj,
                                    layer.experts.down_proj)]
    assert all(t is not None and t.abs().sum() > 0 for t in got)
    layer.zero_grad()
    ids, w = layer.router(x)
    wu, wd = layer.experts.gate_up_proj, layer.experts.down_proj
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(32)
        for j in range(cfg.top_k):
            gate, up = (wu[ids[t, j]] @ x[t]).split(16)
            acc = acc + w[t, j] * (wd[ids[t, j]] @ (F.silu(gate) * up))
        rows.append(acc)
    (torch.stack(rows) * g).sum().backward()
    want = [layer.router.weight.grad, wu.grad, wd.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_differentiable_kernels_pick_the_reference():
    from moe_runtime.kernels import differentiable_kernels, resolve_backend
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    with differentiable_kernels():
        assert resolve_backend("auto", cuda) == "reference"
        assert resolve_backend("reference", cuda) == "reference"
        with pytest.raises(ValueError, match="inference-only"):
            resolve_backend("cute", cuda)
    assert resolve_backend("auto", torch.device("cpu")) == "reference"


def test_layer_is_differentiable_only_when_autograd_records(monkeypatch):
    """MoELayer enters differentiable_kernels exactly when the forward needs gradients."""
    import contextlib

    import moe_runtime.layer as layer_mod
    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        yield

    monkeypatch.setattr(layer_mod, "differentiable_kernels", spy)
    layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                               dtype=torch.float32))
    x = torch.randn(3, 16)
    layer(x)
    assert entered == [True]  # parameters require grad by default
    with torch.no_grad():
        layer(x)
    with torch.inference_mode():
        layer(x)
    assert entered == [True]
    layer.requires_grad_(False)
    layer(x)
    assert entered == [True]
    layer(x.requires_grad_())
    assert entered == [True, True]


def test_router_refuses_bad_inputs_by_name():
    from moe_runtime.routing import Router
    cfg = MoEConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                    dtype=torch.bfloat16)
    router = Router(cfg, backend="reference")
    with pytest.raises(ValueError, match=r"\[T, 16\], got \(3, 8\)"):
        router(torch.randn(3, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be torch.bfloat16.*got torch.float32"):
        router(torch.randn(3, 16))
    with pytest.raises(TypeError, match="got torch.int64"):
        router(torch.ones(3, 16, dtype=torch.long))
    ids, w = router(torch.randn(3, 16, dtype=torch.bfloat16))
    assert ids.shape == w.shape == (3, 2)
    # fp32 router logits (DeepSeek-V3) take any float input, e.g. bf16 x with an fp32 weight
    fp32_logits = Router(MoEConfig(hidden_size=16, num_experts=4, top_k=2,
                                   moe_intermediate_size=8, dtype=torch.float32,
                                   router_logits_fp32=True), backend="reference")
    assert fp32_logits(torch.randn(3, 16, dtype=torch.bfloat16))[0].shape == (3, 2)


def test_inductor_training_step_at_zero_tokens():
    """torch.compile (inductor) of a bf16 layer in training: the gradients of a batch and of an
    empty one (T = 0: inductor's backward of torch._grouped_mm made an empty operand with stride
    0, which _grouped_mm rejected; the experts take the loop there) equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    cfg = MoEConfig(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16,
                    dtype=torch.bfloat16)
    layer = MoELayer(cfg, backend="reference")
    compiled = torch.compile(layer)
    for T in (6, 0):
        x = torch.randn(T, 32, dtype=torch.bfloat16)
        grads = []
        for fn in (compiled, layer):
            layer.zero_grad(set_to_none=False)
            xi = x.clone().requires_grad_(True)
            (fn(xi).float() ** 2).sum().backward()
            grads.append([xi.grad, layer.experts.gate_up_proj.grad.clone(), layer.router.weight.grad.clone()])
        for got, want in zip(*grads):  # (bf16: inductor fuses and rounds differently)
            assert got.shape == want.shape  # (T = 0: the weights' gradients are zero)
            if want.numel():
                assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())
