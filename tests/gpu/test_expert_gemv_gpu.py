"""Decode expert GEMV (kernels/expert_gemv.py) against kernels/reference.py (float64) on the GPU."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from moe_runtime.experts import GEMV_MAX_ROWS, Experts  # noqa: E402
from moe_runtime.kernels import reference  # noqa: E402


def _ops():
    from moe_runtime.kernels import cute_ops
    return cute_ops


def _offsets(counts, align=1):
    padded = [(c + align - 1) // align * align for c in counts]
    return torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _reference(x, offsets, w, swiglu):
    """kernels/reference.py in float64, rows < offsets[-1]."""
    n_used = int(offsets[-1])
    return reference.expert_gemv(x.double(), offsets, w.double(), swiglu=swiglu)[:n_used]


CASES = [  # (H, I, E, counts per expert, align)
    (2048, 768, 128, [1 if e in (3, 17, 40, 64, 90, 100, 101, 127) else 0 for e in range(128)], 1),
    (2048, 768, 128, [8] + [0] * 127, 1),                       # one expert gets every row
    (7168, 2048, 16, [3, 0, 0, 5, 1] + [0] * 11, 1),            # DeepSeek-V3 widths, empty experts
    (4096, 1024, 8, [2, 0, 1, 0, 0, 0, 0, 3], 8),               # align padding rows inside segments
    (576, 72, 8, [1, 2, 0, 0, 0, 0, 0, 1], 1),                  # tail vectors (72 = 9 x 8)
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,I,E,counts,align", CASES)
def test_gemv_matches_float64(H, I, E, counts, align, dtype):
    ops = _ops()
    g = torch.Generator(device="cuda").manual_seed(hash((H, I, E, align)) % 2**31)
    offsets = _offsets(counts, align)
    n_used = int(offsets[-1])
    N = n_used + 3  # rows past offsets[-1] exist and must not break anything
    x = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(dtype)
    act = ops.expert_gemv(x, offsets, w13, swiglu=True)
    assert act.shape == (N, I) and act.dtype == dtype
    ref_act = _reference(x, offsets, w13, True)
    err = (act[:n_used].double() - ref_act).abs().max() / ref_act.abs().max()
    assert err <= 1e-2, f"gate_up+SwiGLU rel err {err:.3e}"
    y = ops.expert_gemv(act, offsets, w2, swiglu=False)
    ref_y = _reference(act, offsets, w2, False)
    err = (y[:n_used].double() - ref_y).abs().max() / ref_y.abs().max()
    assert y.shape == (N, H) and err <= 1e-2, f"down rel err {err:.3e}"


def test_gemv_writes_every_used_row():
    """Outputs start as NaN (the caching allocator hands back the poisoned block)."""
    ops = _ops()
    E, H, I = 4, 256, 64
    offsets = _offsets([2, 0, 3, 1])
    x = torch.randn(6, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.full((6, I), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed, then reused
        out = ops.expert_gemv(x, offsets, w, swiglu=True)
        assert not out.isnan().any()


def test_gemv_rejects_bad_input():
    ops = _ops()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    off = _offsets([4, 0])
    w = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        ops.expert_gemv(x, off, w.half(), swiglu=True)
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.expert_gemv(x, off[:2], w, swiglu=True)
    with pytest.raises(ValueError, match="x \\[N, 256\\]"):
        ops.expert_gemv(x[:, :128].contiguous(), off, w, swiglu=True)
    with pytest.raises(ValueError, match="even"):
        ops.expert_gemv(x, off, w[:, :127].contiguous(), swiglu=True)
    with pytest.raises(ValueError, match="contiguous"):
        ops.expert_gemv(x.t().contiguous().t(), off, w, swiglu=True)
    many = torch.zeros(ops.MAX_GRID_Y + 1, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grid.y"):
        ops.expert_gemv(many, _offsets([ops.MAX_GRID_Y + 1, 0]), w, swiglu=True)


@pytest.mark.parametrize("rows", [1, 8, GEMV_MAX_ROWS])
def test_experts_gemv_path_equals_grouped_path(rows):
    """Experts picks the GEMV for N <= GEMV_MAX_ROWS; it must agree with torch._grouped_mm."""
    torch.manual_seed(rows)
    E, H, I = 64, 2048, 768
    fast = Experts(E, H, I, dtype=torch.bfloat16, device="cuda")
    slow = Experts(E, H, I, gate_up_proj=fast.gate_up_proj, down_proj=fast.down_proj,
                   backend="reference")
    assert fast._gemv(torch.empty(rows, H, device="cuda", dtype=torch.bfloat16))
    few = Experts(8, H, I, gate_up_proj=fast.gate_up_proj[:8], down_proj=fast.down_proj[:8])
    assert few._gemv(torch.empty(12, H, device="cuda", dtype=torch.bfloat16))
    assert not few._gemv(torch.empty(13, H, device="cuda", dtype=torch.bfloat16))  # > 1.5 x E
    counts = torch.bincount(torch.randint(0, E, (rows,)), minlength=E).tolist()
    offsets = _offsets(counts)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    a, b = fast(x, offsets), slow(x, offsets)
    err = (a.double() - b.double()).abs().max() / b.double().abs().max()
    assert err <= 2e-2, f"rel err {err:.3e}"


@pytest.mark.parametrize("T", [0, 1, 7, 32, 64])
@pytest.mark.parametrize("E,H", [(128, 2048), (60, 2048), (8, 4096), (3, 136)])
def test_linear_gemv_matches_float64(T, E, H):
    """cute_ops.linear_gemv (the router's decode logits) against x @ W.T in float64; its output
    comes from a freed NaN block (poisoned before the call)."""
    ops = _ops()
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + E)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    torch.full((T, E), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed, then reused
    out = ops.linear_gemv(x, w)
    assert out.shape == (T, E) and out.dtype == torch.bfloat16
    if T:
        ref = x.double() @ w.double().T
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert not out.isnan().any() and err <= 1e-2, f"rel err {err:.3e}"


@pytest.mark.parametrize("T", [1, 32, 33])
def test_router_logits_take_the_gemv_for_decode_sizes(T):
    """Router.logits: the GEMV for T <= ROUTER_GEMV_MAX_TOKENS with a small router, F.linear
    otherwise (and always when autograd records); both within one bf16 rounding of F.linear."""
    from moe_runtime.config import MoEConfig
    from moe_runtime.routing import ROUTER_GEMV_MAX_TOKENS, Router
    cfg = MoEConfig(hidden_size=2048, num_experts=128, top_k=8, moe_intermediate_size=768,
                    dtype=torch.bfloat16)
    router = Router(cfg, backend="cute", device="cuda")
    x = torch.randn(T, 2048, device="cuda").to(torch.bfloat16)
    assert not router._gemv(x)  # gradients on and the weight requires grad: F.linear
    with torch.inference_mode():
        assert router._gemv(x) == (T <= ROUTER_GEMV_MAX_TOKENS)
        ref = torch.nn.functional.linear(x, router.weight).float()
        got = router.logits(x).float()
    assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()
