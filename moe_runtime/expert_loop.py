"""The per-expert GEMM loop as a torch op with a backward, for torch.compile.

`expert_loop_linear(x, w, offsets)`: out[r] = x[r] @ w[e].T for the rows r of expert e, one
F.linear per expert over its row slice, the slice bounds read from the device offsets on the
host; rows past offsets[-1] are zero. It is what the experts run where torch._grouped_mm does
not (fp32 / fp16 rows, and torch.compile's _grouped_mm lowering takes bf16 only).

Eagerly, autograd records the loop itself. Traced by torch.compile, the loop's host-read
bounds would be unbacked sizes: inductor could not generate the backward of their slices
(torch 2.13, fullgraph=True: "expected [u9, u10] to have been codegen-ed"), and with graph
breaks dynamo recompiled the code after the read for every new row count. As the op
`moe_runtime::expert_loop_linear` (fake kernel: [N, M] from the shapes) the compiled graph
holds one opaque call whose backward is two more loops: grad_x = the same op on grad and the
transposed weights, grad_w[e] = grad[rows of e].T @ x[rows of e] (`moe_runtime::
expert_loop_weight_grad`). No double backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def loop_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """out [N, M] in x.dtype from x [N, K], w [E, M, K] and int32 offsets [E + 1] (read on the
    host): out[r] = x[r] @ w[e].T for offsets[e] <= r < offsets[e + 1], zero past offsets[E]."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = F.linear(x[lo:hi], w[e])
    return out


@torch.library.custom_op("moe_runtime::expert_loop_linear", mutates_args=())
def expert_loop_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """loop_linear as a torch op with a backward (see the module docstring)."""
    return loop_linear(x, w, offsets)


@expert_loop_linear.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("moe_runtime::expert_loop_weight_grad", mutates_args=())
def expert_loop_weight_grad(grad: Tensor, x: Tensor, offsets: Tensor, num_experts: int) -> Tensor:
    """[E, M, K] in x.dtype: grad[rows of e].T @ x[rows of e] (zero for an expert with no rows)."""
    out = torch.zeros(num_experts, grad.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = grad[lo:hi].transpose(0, 1) @ x[lo:hi]
    return out


@expert_loop_weight_grad.register_fake
def _(grad, x, offsets, num_experts):
    return x.new_empty(num_experts, grad.shape[1], x.shape[1])


def _save(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = expert_loop_linear(grad, w.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        grad_w = expert_loop_weight_grad(grad, x, offsets, w.shape[0]).to(w.dtype)
    return grad_x, grad_w, None


expert_loop_linear.register_autograd(_backward, setup_context=_save)
