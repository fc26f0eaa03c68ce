"""Expert weights of one rank and the grouped GEMMs over expert-major rows; shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .expert_loop import expert_loop_linear, loop_linear
from .kernels import check_backend_name, cute_ops_module, forward_ad_active, get_ops, \
    resolve_backend
from .kernels.grouped_gemm import quack_supported, tile_probe_rows
from .param_checks import CheckedModule

# When Experts uses the CuTeDSL expert GEMV instead of the grouped GEMM on CUDA: each row re-reads
# its expert's weights, so it wins while rows are few and mostly on distinct experts. Measured by
# benchmarks/expert_gemv.py on the H200 (bf16): GEMV faster by 1.6-2.4x up to 64 rows on Qwen3
# (128 experts) and DeepSeek-V3 (256), 1.24x at 8 rows on Mixtral's 8 experts, 0.87x at 16.
# Rule: rows <= GEMV_MAX_ROWS and rows <= 1.5 x local experts, where rows are those the rank
# expects to use (DispatchResult.expected_rows: under `tp` ~1/W of expert_x's capacity rows).
# The rule is about speed only: the kernel finds each row's expert from the device offsets and
# the blocks of rows past expert_offsets[-1] return after one load (no shared memory; grid.y is
# expert_x's rows), so skewed routing (more real rows than expected) is slower, never wrong.
GEMV_MAX_ROWS = 64


_GROUPED_MM_PROBED: dict[tuple, bool] = {}


def grouped_mm_supported(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for this device and dtype (probed once on tiny inputs).

    On CUDA, torch's grouped GEMM needs sm_90+ and bf16; on CPU recent torch supports all float
    dtypes. The probe runs outside any CUDA-graph capture (first use of a layer). While
    torch.compile traces, an earlier eager probe's answer is used, else whether torch has
    `_grouped_mm` at all (a probe traced on fake tensors could not fail; the cache is a dict
    rather than functools.lru_cache, which dynamo traces through with a warning).
    """
    key = (device_type, device_index, dtype)
    if key not in _GROUPED_MM_PROBED:
        if torch.compiler.is_compiling():
            return hasattr(torch, "_grouped_mm")
        _GROUPED_MM_PROBED[key] = _probe_grouped_mm(device_type, device_index, dtype)
    return _GROUPED_MM_PROBED[key]


def _probe_grouped_mm(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm") or (device_type == "cuda" and not torch.cuda.is_available()):
        return False
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        a = torch.zeros(16, 16, dtype=dtype, device=dev)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=dev)
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32, device=dev))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_host_sync_free(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` with device offsets runs without a host sync on `device`.

    On CUDA only torch's CUTLASS fast path is sync-free: bf16 operands and output on compute
    capability 9.x or 10.x (GroupedBlas.cpp); every other case takes `_grouped_mm_fallback`, which
    copies the offsets to the host (`offs.cpu()`). Its other requirements, 16-byte aligned data
    pointers and row strides (H and I multiples of 8 for bf16), hold for contiguous expert rows;
    it needs NO per-expert row alignment (groups may hold any number of rows, 0 included).
    CPU: True (nothing to wait for).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16 or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def _fits_grouped_mm(w: torch.Tensor) -> bool:
    """torch._grouped_mm's layout for one weight: unit last stride, the other strides and (not
    while torch.compile traces, where dynamo cannot read it) the storage offset 16-byte aligned."""
    size = w.element_size()
    *outer, last = w.stride()
    if last != 1 or (0 if torch.compiler.is_compiling() else w.storage_offset()) * size % 16:
        return False
    for n in outer:
        if n * size % 16:
            return False
    return True


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, use_grouped: bool) -> torch.Tensor:
    """out[r] = x[r] @ w[e].T for the rows r of expert e.

    Args:
        x: [N, K] expert-major rows; expert e owns rows [offsets[e], offsets[e+1]).
        w: [E_local, M, K] (HF layout: out-features first).
        offsets: int32 [E_local + 1] on x's device.
        use_grouped: torch._grouped_mm with the device offsets (no host sync), else a loop over
            experts (reads the offsets on the host). Rows past offsets[-1] are unspecified
            with the grouped path and zero with the loop.

    Returns:
        [N, M] in x.dtype.
    """
    if use_grouped:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:])
    if torch.compiler.is_compiling():  # (one opaque op with a backward: expert_loop.py)
        return expert_loop_linear(x, w, offsets)
    return loop_linear(x, w, offsets)


class Experts(CheckedModule):
    """SwiGLU experts of one rank: y = down(silu(gate(x)) * up(x)) per expert.

    Parameters use HF transformers' fused layout so swapped models share storage:
        gate_up_proj: [E_local, 2*I, H] (gate rows first, then up rows)
        down_proj:    [E_local, H, I]

    Args:
        num_local_experts, hidden_size, intermediate_size: E_local, H, I.
        gate_up_proj, down_proj: existing tensors to wrap without copying (optional).
        use_grouped_mm: None = probe the device/dtype; False forces the per-expert loop; True
            skips the probe (the GEMV and quack paths still come first where they apply).
            Weights in a layout torch._grouped_mm rejects (strided views), and fp16 / fp32
            rows under torch.compile where neither the GEMV nor quack applies (the
            _grouped_mm lowering takes bf16 only), take the loop whatever it says; the GEMV
            and quack paths need contiguous weights. The loop reads the expert offsets on the
            host (a host sync on CUDA); compiled or exported, it is one op with a backward
            (expert_loop.py), so fullgraph=True, inductor training and torch.export take it
            and no row count recompiles.
        backend: kernel backend of the decode GEMV and the quack grouped GEMM ("auto": CuTeDSL
            on CUDA when importable; "reference": never, torch._grouped_mm instead).
    """

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype=torch.bfloat16, device=None, gate_up_proj=None, down_proj=None,
                 use_grouped_mm: bool | None = None, backend: str = "auto"):
        super().__init__()
        E, H, I = num_local_experts, hidden_size, intermediate_size
        if gate_up_proj is None:
            gate_up_proj = torch.randn(E, 2 * I, H, dtype=dtype, device=device) * H ** -0.5
        if down_proj is None:
            down_proj = torch.randn(E, H, I, dtype=dtype, device=device) * I ** -0.5
        if tuple(gate_up_proj.shape) != (E, 2 * I, H) or tuple(down_proj.shape) != (E, H, I):
            raise ValueError(f"expert weights must be gate_up_proj [{E}, {2 * I}, {H}] and down_proj "
                             f"[{E}, {H}, {I}], got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
        self.gate_up_proj = _as_parameter(gate_up_proj)
        self.down_proj = _as_parameter(down_proj)
        self.intermediate_size = I
        self.use_grouped_mm = use_grouped_mm
        check_backend_name(backend)
        self.backend = backend

    def extra_repr(self) -> str:
        E, _, H = self.gate_up_proj.shape
        return (f"num_local_experts={E}, hidden_size={H}, intermediate_size="
                f"{self.intermediate_size}, backend={self.backend}")

    def reset_parameters(self) -> None:
        """Draw the weights afresh, as the constructor does: N(0, 1/H) for gate_up_proj, N(0, 1/I)
        for down_proj (e.g. after `to_empty` on a layer built on the meta device)."""
        with torch.no_grad():
            self.gate_up_proj.normal_(std=self.gate_up_proj.shape[-1] ** -0.5)
            self.down_proj.normal_(std=self.intermediate_size ** -0.5)

    def _grouped(self, device: torch.device, dtype: torch.dtype, rows: int | None = None) -> bool:
        """Whether forward on `rows` rows takes torch._grouped_mm (else the per-expert loop):
        never for weights whose layout it rejects (`_weights_fit_grouped_mm`), nor under
        forward-mode AD (`forward_ad_active`: _grouped_mm has no forward derivative)."""
        if (self.use_grouped_mm is False or not self._weights_fit_grouped_mm()
                or forward_ad_active()):
            return False
        if torch.compiler.is_compiling() and (dtype != torch.bfloat16 or rows == 0):
            # torch.compile's _grouped_mm lowering accepts bf16 only; with no rows, inductor's
            # backward of torch._grouped_mm builds an empty operand with stride 0, which
            # _grouped_mm rejects
            return False
        if self.use_grouped_mm:
            return True
        return self._rows_16b_aligned(dtype) and grouped_mm_supported(device.type, device.index, dtype)

    def _weights_fit_grouped_mm(self) -> bool:
        """torch._grouped_mm's operand layout for both weights: unit stride in the last dim, the
        other strides and the storage offset 16-byte aligned (contiguous weights with 16-byte rows
        qualify; e.g. a view that takes every other input feature does not, and takes the loop).
        The CuTeDSL GEMV and quack need these too, and contiguity. Under torch.compile only the
        strides are checked (dynamo cannot trace storage_offset in a fullgraph)."""
        return _fits_grouped_mm(self.gate_up_proj) and _fits_grouped_mm(self.down_proj)

    def _weights_contiguous_aligned(self) -> bool:
        """Contiguous weights in `_weights_fit_grouped_mm`'s layout (the CuTeDSL GEMV and quack
        read them so; others take the next path). Each weight is read once (~2 us on the host
        instead of ~6 through the two tests)."""
        gu, dp = self.gate_up_proj, self.down_proj
        return (gu.is_contiguous() and dp.is_contiguous()
                and _fits_grouped_mm(gu) and _fits_grouped_mm(dp))

    def _rows_16b_aligned(self, dtype: torch.dtype) -> bool:
        """torch._grouped_mm needs 16-byte row strides: H and I multiples of 16 bytes."""
        step = 16 // dtype.itemsize
        return self.gate_up_proj.shape[-1] % step == 0 and self.intermediate_size % step == 0

    def _cute(self, device: torch.device) -> bool:
        """Whether the expert kernels on `device` may be CuTeDSL ones: CUDA, and `backend`
        resolves to "cute" there."""
        return device.type == "cuda" and resolve_backend(self.backend, device) == "cute"

    def _gemv(self, x: torch.Tensor, rows: int | None = None) -> bool:
        """Decode-sized rows on CUDA with CuTeDSL: the expert GEMV kernel (kernels/expert_gemv.py).

        rows: the rows of x expected to be used (default all, x.shape[0]); the GEMV_MAX_ROWS
        rule applies to them (it is about speed only, see GEMV_MAX_ROWS)."""
        if not (x.dtype in (torch.bfloat16, torch.float16) and self._cute(x.device)):
            return False  # (before any test of the row count: no size guard where no GEMV runs)
        rows = x.shape[0] if rows is None else rows
        E = self.gate_up_proj.shape[0]
        return (rows <= GEMV_MAX_ROWS and 2 * rows <= 3 * E
                and E <= cute_ops_module().MAX_EXPERTS  # (the GEMV's limit; cutlass importable)
                and self.use_grouped_mm is not False and self._rows_16b_aligned(x.dtype)
                and self._weights_contiguous_aligned())

    def _quack(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Prefill-sized rows on sm_90/sm_100 with quack: the varlen grouped GEMM with SwiGLU fused
        into the gate/up epilogue (kernels/grouped_gemm.py). Needs contiguous (K-major) weights
        and the "cute" backend (so under torch.compile only with grad mode off, as a custom op:
        `kernels.resolve_backend`; compiled training takes torch._grouped_mm)."""
        return (self.use_grouped_mm is not False
                and self._weights_contiguous_aligned() and self._rows_16b_aligned(dtype)
                and self._cute(device) and quack_supported(device.index, dtype))

    def forward(self, expert_x: torch.Tensor, expert_offsets: torch.Tensor,
                expected_rows: int | None = None) -> torch.Tensor:
        """expert_x [N, H] expert-major, expert_offsets int32 [E_local+1] -> [N, H].

        expected_rows: host int, the rows expected to be used, an estimate of
        expert_offsets[-1] (DispatchResult.expected_rows); None: N. It only picks the path:
        every path computes rows [0, expert_offsets[-1]) from the device offsets, whatever it is.

        Path, first that applies: the CuTeDSL expert GEMV (fused SwiGLU) for decode-sized
        expected rows on CUDA (`_gemv`, the GEMV_MAX_ROWS rule); quack's varlen grouped GEMM with
        fused SwiGLU on sm_90/sm_100 (`_quack`); torch._grouped_mm with the device offsets; a
        per-expert loop (`_grouped`). The first two are CuTeDSL kernels (custom ops while
        torch.compile traces an inference forward: kernels/compiled_ops.py).
        """
        if self._gemv(expert_x, expected_rows):
            ops = get_ops("cute")
            act = ops.expert_gemv(expert_x, expert_offsets, self.gate_up_proj, swiglu=True)
            return ops.expert_gemv(act, expert_offsets, self.down_proj, swiglu=False)
        if self._quack(expert_x.device, expert_x.dtype):
            ops = get_ops("cute")
            act = ops.swiglu_grouped_gemm(expert_x, expert_offsets, self.gate_up_proj,
                                          expected_rows=expected_rows)
            return ops.grouped_gemm(act, expert_offsets, self.down_proj,
                                    expected_rows=expected_rows)
        grouped = self._grouped(expert_x.device, expert_x.dtype, expert_x.shape[0])
        h = grouped_linear(expert_x, self.gate_up_proj, expert_offsets, use_grouped=grouped)
        gate, up = h.split(self.intermediate_size, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj, expert_offsets, use_grouped=grouped)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile, on the weights' device, the quack grouped GEMMs of every tile configuration
        forward may pick for prefill-sized rows (grouped_gemm.tile_probe_rows: it picks by the
        expected rows per expert), on one row per expert; a first prefill of another size then
        compiles nothing (~2 s each on the H200). Nothing where forward does not take quack."""
        w = self.gate_up_proj
        if w.device.type != "cuda" or not self._quack(w.device, w.dtype):
            return
        E = w.shape[0]
        x = torch.zeros(E, w.shape[2], dtype=w.dtype, device=w.device)
        offsets = torch.arange(E + 1, dtype=torch.int32, device=w.device)
        for r in tile_probe_rows(torch.cuda.get_device_capability(w.device)[0]):
            self.forward(x, offsets, expected_rows=max(int(r * E), GEMV_MAX_ROWS + 1))

    def host_sync_free(self, device, dtype: torch.dtype) -> bool:
        """Whether forward on `device` with `dtype` rows never waits for the host: the quack path,
        or the torch grouped path with device offsets (see `grouped_mm_host_sync_free`); the
        per-expert loop reads the offsets on the host."""
        device = torch.device(device)
        if device.type == "cpu":
            return True
        return self._quack(device, dtype) or (
            self._grouped(device, dtype) and grouped_mm_host_sync_free(device, dtype))


class SharedExpert(CheckedModule):
    """The always-on shared expert MLP (Qwen2-MoE, DeepSeek-V3), optionally sigmoid-gated.

    y = down(silu(gate_proj(x)) * up_proj(x)) [* sigmoid(x @ gate.T) when gated (Qwen2-MoE)].
    Submodule names follow HF: gate_proj, up_proj, down_proj (nn.Linear, no bias), and the
    optional `gate` of [1, H]. The projections stay nn.Linear (cuBLAS) at every T: the CuTeDSL
    GEMV (cute_ops.linear_gemv, one expert) for them was slower on the H200 (CUDA-graph replay,
    bf16, 2026-12-02, bench_out diagnostic shared_gemv.py): H 7168 / I 2048 (DeepSeek-V3) at
    T = 1 / 8 61.7 / 87.9 µs against 39.3 / 38.6, H 2048 / I 5632 40.2 / 74.1 against 31.3 /
    31.3 (one expert gives its grid too few blocks to stream a dense weight at full rate).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, gated: bool,
                 dtype=torch.bfloat16, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.gate = nn.Linear(hidden_size, 1, **kw) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y


def _as_parameter(t: torch.Tensor) -> nn.Parameter:
    """t itself when it is a Parameter (shared HF weights keep their requires_grad), else a
    Parameter on t's storage, trainable like the router's nn.Linear weight unless t is an
    inference tensor made under torch.inference_mode() (those cannot require grad outside it)."""
    if isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t, requires_grad=not t.is_inference() or torch.is_inference_mode_enabled())
