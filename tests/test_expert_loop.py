"""The per-expert GEMM loop as a torch op (moe_runtime/expert_loop.py): forward against the
eager loop, gradients against finite differences (float64), torch.library.opcheck, and the
tags that keep its host read out of inductor's CUDA graphs."""
import pytest
import torch

from moe_runtime.expert_loop import expert_loop_linear, loop_linear

# rows per expert: an empty expert, a single row, and 2 rows past offsets[-1] (padding)
COUNTS = [3, 0, 1, 4]


def inputs(dtype, N=10, K=6, M=5):
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0] + torch.tensor(COUNTS).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(N, K, generator=g, dtype=dtype)
    w = torch.randn(len(COUNTS), M, K, generator=g, dtype=dtype)
    return x, w, offsets


def test_forward_equals_the_loop_and_zeroes_rows_past_the_offsets():
    x, w, offsets = inputs(torch.float32)
    out = expert_loop_linear(x, w, offsets)
    assert torch.equal(out, loop_linear(x, w, offsets))
    for e, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        torch.testing.assert_close(out[lo:hi], x[lo:hi] @ w[e].T)
    assert not out[int(offsets[-1]):].any()


@pytest.mark.parametrize("need", ["both", "x", "w"])
def test_gradients_match_finite_differences(need):
    x, w, offsets = inputs(torch.float64)
    x.requires_grad_(need in ("both", "x"))
    w.requires_grad_(need in ("both", "w"))
    assert torch.autograd.gradcheck(lambda a, b: expert_loop_linear(a, b, offsets), (x, w))


def test_opcheck_and_cudagraph_unsafe_tags():
    x, w, offsets = inputs(torch.float32)
    torch.library.opcheck(expert_loop_linear, (x, w, offsets))
    torch.library.opcheck(expert_loop_linear, (x.requires_grad_(), w.requires_grad_(), offsets))
    for op in (torch.ops.moe_runtime.expert_loop_linear, torch.ops.moe_runtime.expert_loop_backward):
        assert torch.Tag.cudagraph_unsafe in op.default.tags


@pytest.mark.parametrize("N", [0, 3])
def test_no_rows_give_zero_gradients_not_none(N):
    """Every expert empty (T = 0, or only padding rows): the eager loop and the op both give x
    and w zero gradients (None made a data-parallel rank with no tokens skip its reduction)."""
    offsets = torch.zeros(5, dtype=torch.int32)
    x, w = torch.randn(N, 6, requires_grad=True), torch.randn(4, 5, 6, requires_grad=True)
    for fn in (loop_linear, expert_loop_linear):
        x.grad = w.grad = None
        out = fn(x, w, offsets)
        assert out.shape == (N, 5) and not out.any()
        out.sum().backward()
        assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(x.grad, torch.zeros_like(x))


def test_eager_loop_gradients_match_finite_differences_twice():
    """The eager loop (what autograd records outside torch.compile) to second order."""
    x, w, offsets = inputs(torch.float64)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: loop_linear(a, b, offsets), (x, w))


def test_eager_loop_backward_builds_one_weight_sized_gradient():
    """The backward of the eager loop makes grad_w in O(1) tensors of w's size, not one per
    expert (indexing w[e] made a zero-filled [E, M, K] gradient per expert: 2 s instead of
    40 ms for E = 128). Counted as ops whose output has w's shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.n += isinstance(out, torch.Tensor) and out.shape == w.shape
            return out

    E = 32
    offsets = torch.arange(0, 2 * E + 1, 2, dtype=torch.int32)
    x = torch.randn(2 * E + 3, 6, requires_grad=True)
    w = torch.randn(E, 5, 6, requires_grad=True)
    out = loop_linear(x, w, offsets)
    with Count():
        out.sum().backward()
    assert 1 <= Count.n <= 2
    ref = torch.stack([torch.ones(2, 5).T @ x[2 * e:2 * e + 2] for e in range(E)])
    torch.testing.assert_close(w.grad, ref)
