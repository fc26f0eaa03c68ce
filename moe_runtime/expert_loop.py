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
    host, offsets[0] = 0): out[r] = x[r] @ w[e].T for offsets[e] <= r < offsets[e + 1], zero
    past offsets[E].
    With no rows at all, out still depends on w (autograd gives it a zero gradient, as for
    torch._grouped_mm, not None: a data-parallel rank with no tokens reduces zeros).

    Recorded by autograd, the experts' weights come from one `unbind` and the output is one
    `cat`: the backward builds grad_w once ([E, M, K]) and hands out views of the output's
    gradient. (Indexing w[e] and writing out[lo:hi] in place cost, per expert, a zero-filled
    [E, M, K] gradient and a copy of the [N, M] one: 2.2 s instead of 40 ms for a backward
    with E = 128 on CPU.)"""
    bounds = offsets.tolist()
    ws = w.unbind(0)
    pieces = [F.linear(x[lo:hi], we) for we, lo, hi in zip(ws, bounds, bounds[1:]) if hi > lo]
    if not pieces and ws:
        pieces.append(F.linear(x[:0], ws[0]))
    pieces.append(x.new_zeros(x.shape[0] - bounds[-1], w.shape[1]))
    return torch.cat(pieces).to(x.dtype)


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
