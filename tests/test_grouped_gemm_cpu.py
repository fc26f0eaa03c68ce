"""kernels/grouped_gemm.py on a CPU-only machine: input checks at the Python boundary (before
quack is imported) and the availability rule."""
import pytest
import torch

from moe_runtime.kernels import grouped_gemm as gg


def _args(E=4, H=64, I=32, N=10, dtype=torch.bfloat16):
    x = torch.randn(N, H, dtype=dtype)
    w13 = torch.randn(E, 2 * I, H, dtype=dtype)
    w2 = torch.randn(E, H, I, dtype=dtype)
    offsets = torch.tensor([0, 3, 3, 7, 10], dtype=torch.int32)
    return x, offsets, w13, w2


@pytest.mark.parametrize("mutate,err,match", [
    (lambda x, o, w: (x, o, w[:, :, :-8]), ValueError, "agree on K"),
    (lambda x, o, w: (x, o, w.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous"),
    (lambda x, o, w: (x.half(), o, w), TypeError, "share a dtype"),
    (lambda x, o, w: (x, o.long(), w), ValueError, "expert_offsets must be int32"),
    (lambda x, o, w: (x, o[:-1], w), ValueError, r"int32 \[5\]"),
    (lambda x, o, w: (x, o, w), ValueError, "one CUDA device"),
])
def test_bad_inputs_raise_before_any_launch(mutate, err, match):
    x, offsets, w13, _ = _args()
    with pytest.raises(err, match=match):
        gg.swiglu_grouped_gemm(*mutate(x, offsets, w13))


def test_down_projection_checks_its_own_k():
    x, offsets, _, w2 = _args()
    with pytest.raises(ValueError, match="agree on K"):
        gg.grouped_gemm(x, offsets, w2)  # down_proj's K is I = 32, rows have H = 64


def test_quack_is_not_supported_without_cuda_or_for_fp32():
    assert not gg.quack_supported(None, torch.float32)
    if not torch.cuda.is_available():
        assert not gg.quack_supported(None, torch.bfloat16)


@pytest.mark.parametrize("path,want", [
    ("/usr/lib/python3.12/site-packages/cutlass/__init__.py", True),
    ("/usr/lib/python3/dist-packages/cutlass/__init__.py", True),
    ("/venv/lib/python3.12/site-packages/nvidia_cutlass_dsl/python_packages/cutlass/__init__.py", True),
    ("/tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py", False),  # pip --target
    ("/opt/my-site-packages-copy/cutlass/__init__.py", False),  # a directory named otherwise
])
def test_quack_needs_cutlass_under_site_packages(path, want):
    assert gg.quack_keys_installed_code(path) is want


@pytest.mark.parametrize("origin,want", [
    ("/venv/lib/python3.12/site-packages/cutlass/__init__.py", True),
    ("/tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py", False),
    (None, False),  # cutlass not importable
])
def test_quack_supported_follows_the_cutlass_location(monkeypatch, caplog, origin, want):
    """On an sm_90 GPU with quack importable, the quack path depends on where cutlass lives;
    when it cannot run, the reason is logged once."""
    import importlib.util
    import types
    from moe_runtime import kernels

    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name == "cutlass":
            return None if origin is None else types.SimpleNamespace(origin=origin)
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(gg, "quack_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    gg.quack_supported.cache_clear()
    kernels._log_once.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="moe_runtime"):
            assert gg.quack_supported(0, torch.bfloat16) is want
            assert gg.quack_supported(1, torch.bfloat16) is want  # another cache key
        logged = [r for r in caplog.records if "cannot key" in r.getMessage()]
        assert len(logged) == (0 if want else 1)
    finally:
        gg.quack_supported.cache_clear()
        kernels._log_once.cache_clear()


@pytest.mark.parametrize("rows_per_expert,gemm,want", [
    (128, "gate_up", gg.ONE_TILE_192), (128, "down", gg.ONE_TILE_192),  # DeepSeek-V3, T=4096
    (97, "down", gg.ONE_TILE_192), (176, "gate_up", gg.ONE_TILE_192),   # the band's edges
    (96, "gate_up", gg.GATE_UP_TILE), (96, "down", gg.DOWN_TILE),
    (256, "gate_up", gg.GATE_UP_TILE), (256, "down", gg.DOWN_TILE),     # Qwen3-30B-A3B, T=4096
    (0.5, "gate_up", gg.GATE_UP_TILE), (4096, "down", gg.DOWN_TILE),
])
def test_tile_follows_rows_per_expert(rows_per_expert, gemm, want):
    assert gg.tile_config(rows_per_expert, gemm) == want
    assert gg.GATE_UP_TILE != gg.DOWN_TILE != gg.ONE_TILE_192  # the rule picks among distinct tiles


def test_one_tile_192_is_for_sm90_only():
    assert gg.tile_config(128, "gate_up", 9) == gg.ONE_TILE_192
    assert gg.tile_config(128, "gate_up", 10) == gg.GATE_UP_TILE
    assert gg.tile_config(128, "down", 10) == gg.DOWN_TILE


def test_tile_config_rejects_unknown_gemm():
    with pytest.raises(ValueError, match="gate_up"):
        gg.tile_config(128, "up")


def test_plans_resolve_once_per_metadata_and_serve_every_row_count(monkeypatch):
    """_run with quack's plan builder and launcher stubbed (no GPU here; the real ones against
    quack's gemm_act: tests/gpu/test_grouped_gemm_gpu.py): one plan per (SwiGLU or not, tile,
    weights' metadata), resolved with the arguments gemm_act passes (gate_up_proj as stored with
    the concat [gate; up] layout, down_proj as its (k, n) view), and every later call of any row
    count launched from it; no rows: zeros, nothing launched."""
    import sys
    import types
    calls = []

    class Mod:
        def __init__(self, args):
            self.args = args

        def gemm(self, A, B, D, C, **kw):
            calls.append(("resolve", self.args, A.shape[0], B, D, C, kw))
            return ("plan", len(calls))

    def run_gemm_epi_plan(plan, A, B, D, C, epi, cu_seqlens_m=None):
        calls.append(("launch", plan, A.shape[0], B, D, C, epi, cu_seqlens_m))

    library = types.SimpleNamespace(linear_act_mod=lambda act, **kw: Mod((act, kw)))
    host = types.SimpleNamespace(run_gemm_epi_plan=run_gemm_epi_plan)
    for name, mod in (("quack", types.ModuleType("quack")), ("quack.epilogue.library", library),
                      ("quack.gemm_runtime.host", host)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "quack.epilogue", types.SimpleNamespace(library=library))
    monkeypatch.setitem(sys.modules, "quack.gemm_runtime", types.SimpleNamespace(host=host))
    monkeypatch.setattr(gg, "_PLANS", {})
    monkeypatch.setattr(gg, "_major", lambda index: 9)
    monkeypatch.setattr(gg, "_config", lambda index, tile: types.SimpleNamespace(
        tile_m=tile[0], tile_n=tile[1], pingpong=tile[2], cluster_m=tile[3], cluster_n=tile[4],
        tile_k=None, max_swizzle_size=8))
    _, offsets, w13, w2 = _args()
    E, I, H = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    for n in (10, 3, 1000):  # (one tile: 64 expected rows per expert)
        act = gg._run(torch.randn(n, H, dtype=torch.bfloat16), offsets, w13, True, 64 * E)
        assert act.shape == (n, I) and act.dtype == torch.bfloat16
        y = gg._run(act, offsets, w2, False, 64 * E)
        assert y.shape == (n, H)
    resolves = [c for c in calls if c[0] == "resolve"]
    launches = [c for c in calls if c[0] == "launch"]
    assert [c[2] for c in resolves] == [10, 10] and [c[2] for c in launches] == [3, 3, 1000, 1000]
    gate_up, down = resolves
    assert gate_up[1] == ("swiglu", dict(gated=True, has_c=False, has_rowvec=False,
                                         has_colvec=False, sr=False, has_alpha=False))
    assert down[1][0] is None and not down[1][1]["gated"]
    assert gate_up[3] is w13 and gate_up[6]["concat_layout"] == ("B",) and not gate_up[6]["b_kn"]
    b = down[3]
    assert (b.data_ptr(), b.shape, b.stride()) == (w2.data_ptr(), w2.mT.shape, w2.mT.stride())
    assert down[6]["concat_layout"] is None and down[6]["b_kn"]
    for c in resolves:
        kw = c[6]
        assert c[4] is None and c[5] is None and kw["cu_seqlens_m"] is offsets
        assert kw["persistent"] and not kw["is_dynamic_persistent"]
        assert (kw["tile_M"], kw["tile_N"]) == gg.tile_config(64, "gate_up" if c is gate_up else "down")[:2]
        assert list(kw["epi_args"]) == ["mAuxOut"]
    assert [c[1] for c in launches] == [("plan", 1), ("plan", 2)] * 2  # the plans resolved first
    assert all(c[7] is offsets and list(c[6]) == ["mAuxOut"] for c in launches)
    gg._run(torch.randn(5, H, dtype=torch.bfloat16), offsets, w13, True, 128 * E)  # another tile
    assert calls[-1][0] == "resolve" and calls[-1][6]["tile_M"] == gg.ONE_TILE_192[0]
    n_calls = len(calls)
    empty = gg._run(torch.empty(0, H, dtype=torch.bfloat16), offsets, w13, True, None)
    assert empty.shape == (0, I) and len(calls) == n_calls
