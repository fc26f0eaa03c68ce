"""The CuTeDSL kernels as torch custom ops (torch.library), so torch.compile keeps them.

dynamo cannot trace a CuTeDSL launch (a TVM-FFI call behind a host-side compile cache), so
while it traces an inference forward, `kernels.get_ops("cute")` returns this module: the
functions of cute_ops with the same signatures and results (route, dispatch, combine,
expert_gemv, linear_gemv, and quack's swiglu_grouped_gemm / grouped_gemm), each one op
`moe_runtime::<name>` (the two quack GEMMs share `moe_runtime::grouped_gemm`). The op's CUDA
kernel is the cute_ops call, run as it is inside the compiled code (inductor's CUDA graphs
included); its fake implementation derives the output shapes from the input shapes alone,
which these kernels allow: dispatch allocates `dispatch_capacity(T, k, E, align)` rows, never
a data-dependent count. So a compiled graph holds no break and no host sync for them.

The ops are defined with `torch.library.Library` (schema, a CUDA kernel, a fake kernel), not
`torch.library.custom_op`, for the host cost per call, which inductor's default mode pays on
every call (H200 host, µs per call of linear_gemv at T = 1 under inference_mode / no_grad,
bench_out diagnostic op_overhead.py, 2026-12-02, two runs: the cute_ops function 23.4 / 25.5
and 22.6 / 23.6, as a custom_op 34.6 / 48.3, as a Library op 23.7 / 30.2 and 28.1 / 23.6;
this host's timings move by several us between runs). They have no autograd formula:
`resolve_backend` picks them only while grad mode is off (torch.no_grad() /
torch.inference_mode()); compiled training takes the reference kernels. Where autograd would
record an op (grad mode on outside inference mode, an input that requires grad) it raises
RuntimeError, eagerly and while torch.compile traces, rather than drop the gradient.
Inputs that the kernels would refuse for their layout alone (not contiguous, or not 16-byte
aligned: a view the compiled graph passes) are copied first, as the torch ops would take them.
That includes expert weights viewed at an unaligned storage offset (dynamo cannot test the
offset, so the experts take the GEMV anyway): a copy of the weights on every call, slow but
right; weights as the layer allocates them, or as checkpoints load them, are aligned.

Measured (H200, one Qwen3-30B-A3B layer, bf16, fullgraph=True, inference_mode, us per call
over 8 inputs back to back, `benchmarks/moe_layer.py --compiled`, 2026-12-02; this host's
Python speed moves by up to 2x between runs): T = 1 with mode="reduce-overhead" 142.6 against
eager 198.7 and the layer's own CUDA graphs (`MoELayer.enable_cuda_graphs`) 91.1 (186.8 with
custom_op ops in an earlier run, against 194.0 for the reference kernels compiled); T = 4096
in the default mode 695.8 / 707.7 against eager 698.8 / 715.6 (two runs; one more gave 928.1
against 699.0, not repeated in three later runs), where compiled code took torch._grouped_mm
before quack's GEMMs became the op moe_runtime::grouped_gemm: 830.7 against eager 712.3.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import cute_ops
from .reference import dispatch_capacity

if "_LIB" in globals():  # importlib.reload: an op is defined once per process
    globals()["_LIB"]._destroy()
_LIB = torch.library.Library("moe_runtime", "FRAGMENT")  # (expert_loop.py defines ops there too)


def _refuse_autograd(name: str, args: tuple) -> None:
    """RuntimeError where autograd would record the op (the rule of kernels.autograd_records:
    grad mode on outside inference mode, an input that requires grad)."""
    if (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
        raise RuntimeError(f"moe_runtime::{name} has no backward: call it under "
                           "torch.no_grad() or torch.inference_mode()")


def _op(schema: str, fake: Callable) -> Callable:
    """Decorator: define moe_runtime::<schema> with the decorated function as its CUDA kernel
    and `fake` as its fake (shape-only) kernel, both refusing calls autograd would record
    (the fake one while torch.compile traces, where the CUDA one would run inside
    AOTAutograd's forward with grad mode off); returns the function unchanged."""
    name = schema.split("(", 1)[0]

    def define(fn: Callable) -> Callable:
        def kernel(*args):
            _refuse_autograd(name, args)
            return fn(*args)

        def fake_kernel(*args):
            _refuse_autograd(name, args)
            return fake(*args)
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, kernel, "CUDA")
        torch.library.register_fake(f"moe_runtime::{name}", fake_kernel, lib=_LIB)
        return fn
    return define


def _dense(t: Tensor) -> Tensor:
    """t, or a contiguous 16-byte aligned copy of it (what the kernels read)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------- route
def _route_fake(logits, correction_bias, top_k, scoring, norm_topk_prob, n_group, topk_group,
                routed_scaling_factor, with_counts):
    T, E = logits.shape
    return (logits.new_empty(T, top_k, dtype=torch.int32),
            logits.new_empty(T, top_k, dtype=torch.float32),
            logits.new_empty(E if with_counts else 0, dtype=torch.int32))


@_op("route(Tensor logits, Tensor? correction_bias, int top_k, str scoring, bool norm_topk_prob, "
     "int n_group, int topk_group, float routed_scaling_factor, bool with_counts) "
     "-> (Tensor, Tensor, Tensor)", _route_fake)
def _route(logits, correction_bias, top_k, scoring, norm_topk_prob, n_group, topk_group,
           routed_scaling_factor, with_counts):
    ids, weights, counts = cute_ops.route(
        _dense(logits), top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
        correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, with_counts=with_counts)
    return ids, weights, counts if with_counts else logits.new_empty(0, dtype=torch.int32)


def route(logits: Tensor, top_k: int, *, scoring: str = "softmax", norm_topk_prob: bool = True,
          correction_bias: Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, with_counts: bool = True):
    """cute_ops.route as the op moe_runtime::route (same arguments, results, errors)."""
    ids, weights, counts = torch.ops.moe_runtime.route(
        logits, correction_bias, top_k, scoring, norm_topk_prob, n_group, topk_group,
        float(routed_scaling_factor), with_counts)
    return ids, weights, counts if with_counts else None


# ------------------------------------------------------------------------------- dispatch
def _dispatch_fake(x, topk_ids, expert_start, num_local_experts, align):
    T, k = topk_ids.shape
    return (x.new_empty(dispatch_capacity(T, k, num_local_experts, align), x.shape[1]),
            x.new_empty(num_local_experts + 1, dtype=torch.int32),
            x.new_empty(T, k, dtype=torch.int32))


@_op("dispatch(Tensor x, Tensor topk_ids, int expert_start, int num_local_experts, int align) "
     "-> (Tensor, Tensor, Tensor)", _dispatch_fake)
def _dispatch(x, topk_ids, expert_start, num_local_experts, align):
    return cute_ops.dispatch(_dense(x), _dense(topk_ids), expert_start=expert_start,
                             num_local_experts=num_local_experts, align=align)


def dispatch(x: Tensor, topk_ids: Tensor, *, expert_start: int, num_local_experts: int,
             align: int = 1):
    """cute_ops.dispatch as the op moe_runtime::dispatch (same arguments, results, errors)."""
    return torch.ops.moe_runtime.dispatch(x, topk_ids, expert_start, num_local_experts, align)


# -------------------------------------------------------------------------------- combine
def _combine_fake(expert_y, token_slot, topk_weights):
    return expert_y.new_empty(token_slot.shape[0], expert_y.shape[1])


@_op("combine(Tensor expert_y, Tensor token_slot, Tensor topk_weights) -> Tensor", _combine_fake)
def _combine(expert_y, token_slot, topk_weights):
    return cute_ops.combine(_dense(expert_y), _dense(token_slot), _dense(topk_weights))


def combine(expert_y: Tensor, token_slot: Tensor, topk_weights: Tensor) -> Tensor:
    """cute_ops.combine as the op moe_runtime::combine (same arguments, result, errors)."""
    return torch.ops.moe_runtime.combine(expert_y, token_slot, topk_weights)


# ---------------------------------------------------------------------------- expert GEMV
def _expert_gemv_fake(x, expert_offsets, weight, swiglu):
    rows = weight.shape[1]
    return x.new_empty(x.shape[0], rows // 2 if swiglu else rows)


@_op("expert_gemv(Tensor x, Tensor expert_offsets, Tensor weight, bool swiglu) -> Tensor",
     _expert_gemv_fake)
def _expert_gemv(x, expert_offsets, weight, swiglu):
    return cute_ops.expert_gemv(_dense(x), _dense(expert_offsets), _dense(weight), swiglu=swiglu)


def expert_gemv(x: Tensor, expert_offsets: Tensor, weight: Tensor, *, swiglu: bool) -> Tensor:
    """cute_ops.expert_gemv as the op moe_runtime::expert_gemv (same arguments, result,
    errors)."""
    return torch.ops.moe_runtime.expert_gemv(x, expert_offsets, weight, swiglu)


def _linear_gemv_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


@_op("linear_gemv(Tensor x, Tensor weight) -> Tensor", _linear_gemv_fake)
def _linear_gemv(x, weight):
    return cute_ops.linear_gemv(_dense(x), _dense(weight))


def linear_gemv(x: Tensor, weight: Tensor) -> Tensor:
    """cute_ops.linear_gemv as the op moe_runtime::linear_gemv (same arguments, result,
    errors)."""
    return torch.ops.moe_runtime.linear_gemv(x, weight)


# ---------------------------------------------------------------- grouped GEMMs (quack's)
@_op("grouped_gemm(Tensor x, Tensor expert_offsets, Tensor weight, bool swiglu, "
     "SymInt? expected_rows) -> Tensor", lambda x, expert_offsets, weight, swiglu,
     expected_rows: _expert_gemv_fake(x, expert_offsets, weight, swiglu))
def _grouped_gemm(x, expert_offsets, weight, swiglu, expected_rows):
    run = cute_ops.swiglu_grouped_gemm if swiglu else cute_ops.grouped_gemm
    return run(_dense(x), _dense(expert_offsets), _dense(weight), expected_rows=expected_rows)


def swiglu_grouped_gemm(x: Tensor, expert_offsets: Tensor, gate_up_proj: Tensor, *,
                        expected_rows: int | None = None) -> Tensor:
    """cute_ops.swiglu_grouped_gemm as the op moe_runtime::grouped_gemm (same arguments,
    result, errors)."""
    return torch.ops.moe_runtime.grouped_gemm(x, expert_offsets, gate_up_proj, True,
                                              expected_rows)


def grouped_gemm(x: Tensor, expert_offsets: Tensor, weight: Tensor, *,
                 expected_rows: int | None = None) -> Tensor:
    """cute_ops.grouped_gemm as the op moe_runtime::grouped_gemm (same arguments, result,
    errors)."""
    return torch.ops.moe_runtime.grouped_gemm(x, expert_offsets, weight, False, expected_rows)
