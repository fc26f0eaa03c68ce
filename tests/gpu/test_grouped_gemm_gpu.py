"""Prefill grouped GEMMs through quack (kernels/grouped_gemm.py) against kernels/reference.py's
per-row expert product in float64, on the GPU."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from moe_runtime.experts import Experts  # noqa: E402
from moe_runtime.kernels import grouped_gemm as gg  # noqa: E402
from moe_runtime.kernels import reference  # noqa: E402

if torch.cuda.is_available() and not gg.quack_supported(0, torch.bfloat16):
    pytest.skip("needs quack-kernels on an sm_90/sm_100 GPU", allow_module_level=True)


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-300))


CASES = [  # (H, I, E, rows per expert)
    (2048, 768, 128, "random"),                   # Qwen3-30B-A3B widths, ~256 rows per expert
    (2048, 768, 16, [700] + [0] * 15),            # one expert receives every row
    (7168, 256, 32, [0, 0, 129, 0, 1, 0] + [3] * 26),  # empty experts, 1-row and odd segments
    (4096, 2048, 8, [1, 0, 0, 0, 0, 0, 0, 0]),    # a single row
    (576, 72, 8, [100, 0, 37, 5, 0, 0, 64, 1]),   # small odd widths (72 = 9 x 8)
]


@pytest.mark.parametrize("rows_hint", [None, 128, 1024])  # per expert; picks the tile (tile_config)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,I,E,counts", CASES)
def test_grouped_gemms_match_float64(H, I, E, counts, dtype, rows_hint):
    g = torch.Generator(device="cuda").manual_seed(H * 31 + I * 7 + E)
    if counts == "random":
        counts = torch.bincount(torch.randint(0, E, (2048 * 8,), generator=g, device="cuda"),
                                minlength=E).tolist()
    offsets = _offsets(counts)
    n_used = int(offsets[-1])
    N = n_used + 5  # rows past offsets[-1] exist and must not break anything
    x = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(dtype)
    hint = None if rows_hint is None else rows_hint * E
    act = gg.swiglu_grouped_gemm(x, offsets, w13, expected_rows=hint)
    assert act.shape == (N, I) and act.dtype == dtype
    ref_act = reference.expert_gemv(x.double(), offsets, w13.double(), swiglu=True)[:n_used]
    assert _rel_err(act[:n_used], ref_act) <= 1e-2
    y = gg.grouped_gemm(act, offsets, w2, expected_rows=hint)
    ref_y = reference.expert_gemv(act.double(), offsets, w2.double(), swiglu=False)[:n_used]
    assert y.shape == (N, H) and _rel_err(y[:n_used], ref_y) <= 1e-2


def test_every_used_row_written():
    """Outputs come from the caching allocator's NaN-poisoned block: every used row is overwritten."""
    E, H, I, counts = 8, 512, 256, [300, 0, 17, 1, 0, 90, 0, 200]
    offsets = _offsets(counts)
    n = int(offsets[-1])
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        poison = (torch.full((n, I), float("nan"), device="cuda", dtype=torch.bfloat16),
                  torch.full((n, H), float("nan"), device="cuda", dtype=torch.bfloat16))
        del poison
        act = gg.swiglu_grouped_gemm(x, offsets, w13)
        y = gg.grouped_gemm(act, offsets, w2)
        assert bool(torch.isfinite(act).all()) and bool(torch.isfinite(y).all())


def test_zero_rows_and_bad_inputs():
    E, H, I = 4, 256, 64
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16)
    offsets = _offsets([0] * E)
    act = gg.swiglu_grouped_gemm(torch.empty(0, H, device="cuda", dtype=torch.bfloat16), offsets, w13)
    assert act.shape == (0, I)
    assert gg.grouped_gemm(act, offsets, w2).shape == (0, H)
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="agree on K"):
        gg.grouped_gemm(x, offsets, w2)  # down_proj's K is I, not H
    with pytest.raises(TypeError, match="share a dtype"):
        gg.swiglu_grouped_gemm(x.half(), offsets, w13)
    with pytest.raises(ValueError, match="expert_offsets"):
        gg.swiglu_grouped_gemm(x, offsets[:-1], w13)
    with pytest.raises(ValueError, match="CUDA device"):
        gg.swiglu_grouped_gemm(x, offsets.cpu(), w13)


def test_cached_plans_launch_what_quack_gemm_act_computes(monkeypatch):
    """One launch plan per GEMM and tile serves every row count and every layer's weights of one
    shape (kernels/grouped_gemm.py, _PLANS): bit for bit quack's own gemm_act at row counts and
    weights other than the first call's. (Rows the plan left unwritten would hold stale memory,
    NaN poison or an earlier call's outputs on other inputs, never gemm_act's values.)"""
    from quack.gemm_interface import gemm_act
    monkeypatch.setattr(gg, "_PLANS", {})
    E, H, I = 16, 1024, 384
    g = torch.Generator(device="cuda").manual_seed(5)
    layers = [((torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16(),
               (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16())
              for _ in range(2)]
    index = torch.cuda.current_device()
    major = torch.cuda.get_device_capability()[0]
    random = torch.bincount(torch.randint(0, E, (3001,), generator=g, device="cuda"),
                            minlength=E).tolist()
    hints = (64, 128)  # rows per expert: the default tiles, and ONE_TILE_192 on sm_90
    for r in hints:
        cfg = {name: gg._config(index, gg.tile_config(r, name, major)) for name in ("gate_up", "down")}
        for counts in ([64] * E, random, [1] + [0] * (E - 1), [0] * (E - 1) + [129]):
            offsets = _offsets(counts)
            n = int(offsets[-1])
            for w13, w2 in layers:
                x = torch.randn(n + 3, H, device="cuda", generator=g).bfloat16()
                poison = [torch.full((n + 3, m), float("nan"), device="cuda", dtype=torch.bfloat16)
                          for m in (I, H)]  # (the caching allocator hands these blocks out next)
                del poison
                act = gg.swiglu_grouped_gemm(x, offsets, w13, expected_rows=r * E)
                _, want = gemm_act(x, w13.mT, activation="swiglu", cu_seqlens_m=offsets,
                                   tuned=False, store_preact=False, config=cfg["gate_up"],
                                   concat_layout=("B",))
                assert torch.equal(act[:n], want[:n])
                y = gg.grouped_gemm(act, offsets, w2, expected_rows=r * E)
                _, want = gemm_act(act, w2.mT, activation=None, cu_seqlens_m=offsets, tuned=False,
                                   store_preact=False, config=cfg["down"])
                assert torch.equal(y[:n], want[:n])
    tiles = {(name, gg.tile_config(r, name, major)) for r in hints for name in ("gate_up", "down")}
    assert len(gg._PLANS) == len(tiles) == (4 if major == 9 else 2)


def test_experts_take_the_quack_path_above_gemv_rows():
    """Experts.forward picks quack for prefill rows and matches the torch grouped path."""
    E, H, I = 16, 1024, 512
    fast = Experts(E, H, I, dtype=torch.bfloat16, device="cuda")
    ref = Experts(E, H, I, gate_up_proj=fast.gate_up_proj, down_proj=fast.down_proj, backend="reference")
    offsets = _offsets([64] * E)
    x = torch.randn(64 * E, H, device="cuda", dtype=torch.bfloat16)
    assert fast._quack(x.device, x.dtype) and not fast._gemv(x) and not ref._quack(x.device, x.dtype)
    assert fast.host_sync_free("cuda", torch.bfloat16)
    y, y_ref = fast(x, offsets), ref(x, offsets)
    assert _rel_err(y, y_ref.double()) <= 2e-2


def test_experts_warm_up_runs_every_tile_configuration(monkeypatch):
    """Experts.warm_up runs quack once per pair of tile configurations that tile_config picks
    here (so a first prefill of another size compiles nothing), on one row per expert."""
    E, H, I = 16, 1024, 512
    experts = Experts(E, H, I, dtype=torch.bfloat16, device="cuda")
    seen = []
    real = gg._config
    monkeypatch.setattr(gg, "_PLANS", {})  # (no plan from earlier tests: each config resolves)
    monkeypatch.setattr(gg, "_config", lambda index, tile: seen.append(tile) or real(index, tile))
    experts.warm_up()
    major = torch.cuda.get_device_capability()[0]
    want = [gg.tile_config(r, g, major) for r in gg.tile_probe_rows(major) for g in ("gate_up", "down")]
    assert seen == want and len(set(want)) == (3 if major == 9 else 2)
