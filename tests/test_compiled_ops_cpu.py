"""The CuTeDSL kernels as torch custom ops (kernels/compiled_ops.py), checked on the CPU with
fake CUDA tensors: what torch.compile / torch.export trace for a CUDA layer, and the ops' fake
implementations against the reference kernels' output shapes. (The real kernels against
them run on the GPU: tests/gpu/test_moe_layer_gpu.py.)"""
import warnings
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("cutlass")  # (compiled_ops imports the CuTeDSL kernels; the test extra has it)

from moe_runtime import MoEConfig, MoELayer  # noqa: E402
from moe_runtime.kernels import compiled_ops, reference as R  # noqa: E402

OURS = {f"moe_runtime.{n}.default" for n in ("route", "dispatch", "combine", "expert_gemv",
                                             "linear_gemv")}
CONFIGS = {
    "softmax": dict(),
    "sigmoid_groups_bias_shared": dict(scoring="sigmoid", n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, use_correction_bias=True,
                                       shared_expert_intermediate_size=64),
}


def traced_ops(family: str, T: int) -> Counter:
    """The call targets of torch.export's graph of a bf16 CUDA layer (fake tensors) on T rows,
    grad mode off, with how often each is called. (Grad mode on is not traceable here: autograd on a fake CUDA tensor aborts
    a CPU-only torch; kernels.resolve_backend's answer is checked in test_layer.py and the
    compiled training step on the GPU.)"""
    cfg = MoEConfig(hidden_size=256, num_experts=16, top_k=4, moe_intermediate_size=128,
                    dtype=torch.bfloat16, **CONFIGS[family])
    meta = MoELayer(cfg, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = meta.to_empty(device="cuda")
        x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ep = torch.export.export(layer, (x,), strict=True)
    # (dynamo warns where it traces through a functools.lru_cache: kernels.traceable_cache)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("T", [1, 4])
def test_compiled_inference_traces_the_cutedsl_kernels(family, T):
    """Grad mode off: the router GEMV, the routing epilogue, dispatch, both expert GEMVs and
    combine are the custom ops, and no reference kernel is traced (its sort / one-hot /
    index_add); the shared expert stays torch ops."""
    ops = set(traced_ops(family, T))
    assert OURS <= ops, sorted(ops)
    assert not {o for o in ops if any(w in o for w in ("sort", "topk", "index_add", "scatter"))}
    assert ("aten.linear.default" in ops) == ("shared" in family)


def test_compiled_prefill_traces_the_quack_grouped_gemms(monkeypatch):
    """Prefill-sized rows (T * k = 256, past the expert GEMV's rule) where quack runs (stubbed
    here: no quack or GPU on the CPU): both expert GEMMs are the custom op
    moe_runtime::grouped_gemm (gate/up with SwiGLU, then down), not torch._grouped_mm. (Where
    quack does not run, the experts take torch._grouped_mm, which a CPU-only torch cannot trace
    on fake CUDA tensors; the GPU test covers it.)"""
    from moe_runtime import experts
    monkeypatch.setattr(experts, "quack_supported", lambda index, dtype: True)
    ops = traced_ops("softmax", 64)
    assert ops["moe_runtime.grouped_gemm.default"] == 2, sorted(ops)
    assert not {o for o in ops if "grouped_mm" in o or "expert_gemv" in o}, sorted(ops)


@pytest.mark.parametrize("T,align", [(0, 1), (1, 1), (7, 1), (7, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_shapes_match_the_reference(T, align, dtype):
    """Every op's fake output (shape, dtype) equals the reference kernels' real output on the
    same inputs: the shapes a compiled graph plans with are the ones the kernels return."""
    H, E, k, M = 64, 8, 2, 48
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    bias = torch.rand(E, generator=g)
    weight = torch.randn(E, M, H, generator=g).to(dtype)
    ids, w, counts = R.route(logits, k, scoring="sigmoid", correction_bias=bias, n_group=2,
                             topk_group=1)
    ex, offsets, slot = R.dispatch(x, ids, expert_start=0, num_local_experts=E, align=align)
    y = R.combine(ex, slot, w)
    want = {"route": (ids, w, counts), "dispatch": (ex, offsets, slot), "combine": (y,),
            "expert_gemv": (torch.empty(ex.shape[0], M // 2, dtype=dtype),),
            "linear_gemv": (torch.empty(T, M, dtype=dtype),),
            "swiglu_grouped_gemm": (torch.empty(ex.shape[0], M // 2, dtype=dtype),),
            "grouped_gemm": (torch.empty(ex.shape[0], M, dtype=dtype),)}
    with FakeTensorMode() as mode:
        f = {n: mode.from_tensor(t) for n, t in dict(
            x=x, logits=logits, bias=bias, weight=weight, ids=ids, w=w, ex=ex,
            offsets=offsets, slot=slot).items()}
        got = {
            "route": compiled_ops.route(f["logits"], k, scoring="sigmoid", correction_bias=f["bias"],
                                        n_group=2, topk_group=1),
            "dispatch": compiled_ops.dispatch(f["x"], f["ids"], expert_start=0,
                                              num_local_experts=E, align=align),
            "combine": (compiled_ops.combine(f["ex"], f["slot"], f["w"]),),
            "expert_gemv": (compiled_ops.expert_gemv(f["ex"], f["offsets"], f["weight"],
                                                     swiglu=True),),
            "linear_gemv": (compiled_ops.linear_gemv(f["x"], f["weight"][0]),),
            "swiglu_grouped_gemm": (compiled_ops.swiglu_grouped_gemm(
                f["ex"], f["offsets"], f["weight"], expected_rows=T * k),),
            "grouped_gemm": (compiled_ops.grouped_gemm(f["ex"], f["offsets"], f["weight"]),)}
    for name, outs in want.items():
        shapes = [(tuple(t.shape), t.dtype) for t in got[name]]
        assert shapes == [(tuple(t.shape), t.dtype) for t in outs], name
    with FakeTensorMode() as mode:
        out = compiled_ops.route(mode.from_tensor(logits), k, with_counts=False)
    assert out[2] is None and tuple(out[0].shape) == (T, k)


def test_ops_refuse_what_autograd_would_record_and_survive_a_reload():
    """Where autograd would record an op (grad mode on outside inference mode, an input that
    requires grad) its fake kernel raises, so torch.compile fails at trace time instead of
    dropping the gradient; no_grad / inference_mode (+ enable_grad) calls run. The ops are
    marked PT2-compliant, and reloading the module redefines them. (Meta tensors: autograd on
    a fake CUDA tensor aborts a CPU-only torch.)"""
    import importlib
    x = torch.randn(3, 64, device="meta", dtype=torch.bfloat16)
    w = torch.randn(16, 64, device="meta", dtype=torch.bfloat16).requires_grad_()
    with pytest.raises(RuntimeError, match="linear_gemv has no backward"):
        compiled_ops.linear_gemv(x, w)
    with pytest.raises(RuntimeError, match="linear_gemv has no backward"):
        torch.compile(compiled_ops.linear_gemv, backend="aot_eager", fullgraph=True)(x, w)
    with torch.no_grad():
        assert compiled_ops.linear_gemv(x, w).shape == (3, 16)
    with torch.inference_mode(), torch.enable_grad():
        assert compiled_ops.linear_gemv(x, w).shape == (3, 16)
    importlib.reload(compiled_ops)
    for name in ("route", "dispatch", "combine", "expert_gemv", "linear_gemv", "grouped_gemm"):
        assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.moe_runtime, name).default.tags
    assert compiled_ops.linear_gemv(x, w.detach()).shape == (3, 16)
