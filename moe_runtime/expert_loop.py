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
holds one opaque call whose backward is one more loop (`moe_runtime::expert_loop_backward`:
grad_x[r] = grad[r] @ w[e], grad_w[e] = grad[rows of e].T @ x[rows of e], one host read). No
double backward. Both ops are tagged cudagraph_unsafe: mode="reduce-overhead" leaves a graph
holding them out of its CUDA graphs (a replay would reuse the captured row bounds).
inductor's on-disk caches key a compiled training graph without the op's autograd formula
(torch 2.13): after an upgrade that changes it, empty the cache (TORCHINDUCTOR_CACHE_DIR) or a
cached graph may call a backward op that no longer exists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def loop_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """out [N, M] in x.dtype from x [N, K], w [E, M, K] and int32 offsets [E + 1] (read on the
    host): out[r] = x[r] @ w[e].T for offsets[e] <= r < offsets[e + 1], zero past offsets[E].
    With no rows at all, out still depends on w (autograd gives it a zero gradient, as for
    torch._grouped_mm, not None: a data-parallel rank with no tokens reduces zeros)."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = F.linear(x[lo:hi], w[e])
    if bounds[-1] == 0 and w.shape[0]:
        out[:0] = F.linear(x[:0], w[0])
    return out


# cudagraph_unsafe: the host read of the offsets must not be captured in inductor's CUDA graphs
# (mode="reduce-overhead" then runs the graph that holds it without them)
_TAGS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("moe_runtime::expert_loop_linear", mutates_args=(), tags=_TAGS)
def expert_loop_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """loop_linear as a torch op with a backward (see the module docstring)."""
    return loop_linear(x, w, offsets)


@expert_loop_linear.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("moe_runtime::expert_loop_backward", mutates_args=(), tags=_TAGS)
def expert_loop_backward(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool,
                         need_w: bool) -> tuple[Tensor, Tensor]:
    """The gradients of expert_loop_linear with one host read of the offsets: grad_x [N, K]
    (grad[r] @ w[e], zero past offsets[E]) and grad_w [E, M, K] in w.dtype
    (grad[rows of e].T @ x[rows of e], zero for an expert with no rows); an empty tensor for
    one not needed."""
    E, N = w.shape[0], x.shape[0]
    grad_x = grad.new_zeros(N if need_x else 0, x.shape[1])
    grad_w = w.new_zeros(w.shape if need_w else (0,))
    bounds = offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            if need_x:
                grad_x[lo:hi] = grad[lo:hi] @ w[e]
            if need_w:
                grad_w[e] = grad[lo:hi].transpose(0, 1) @ x[lo:hi]
    return grad_x, grad_w


@expert_loop_backward.register_fake
def _(grad, x, w, offsets, need_x, need_w):
    return (grad.new_empty(x.shape[0] if need_x else 0, x.shape[1]),
            w.new_empty(w.shape if need_w else (0,)))


def _save(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = expert_loop_backward(grad, x, w, offsets, need_x, need_w)
    return grad_x if need_x else None, grad_w if need_w else None, None


expert_loop_linear.register_autograd(_backward, setup_context=_save)
