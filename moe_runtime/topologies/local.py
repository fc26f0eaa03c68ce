"""`local` topology (TP=1): one GPU holds every token and every expert."""
from __future__ import annotations

import torch

from ..kernels import check_backend_name, cute_ops_module, get_ops, resolve_backend
from .base import DispatchResult, Topology


class LocalTopology(Topology):
    """Dispatch = permute rows into expert-major order; combine = weighted gather-sum.

    Args:
        num_experts: E (all local).
        align: per-expert segment alignment in rows (for the grouped GEMM).
        backend: "reference" (torch), "cute" (CuTeDSL kernels, CUDA) or "auto".
    """

    name = "local"

    def __init__(self, num_experts: int, *, align: int = 1, backend: str = "auto"):
        super().__init__(num_experts, rank=0, world_size=1, align=align)
        check_backend_name(backend)
        self.backend = backend

    def resolved_backend(self, device, hidden: int, dtype: torch.dtype, top_k: int) -> str:
        """The kernels' backend on `device` for rows of `hidden` elements of `dtype` and `top_k`
        picks per token (kernels.resolve_backend): "auto" takes the reference where the
        CuTeDSL dispatch / combine refuse these shapes (cute_ops.rows_unsupported, e.g. a
        row that is not a multiple of 16 bytes)."""
        def unsupported():
            return cute_ops_module().rows_unsupported(hidden, dtype, self.num_local_experts, top_k)
        return resolve_backend(self.backend, device, unsupported)

    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult:
        ops = get_ops(self.resolved_backend(x.device, x.shape[1], x.dtype, topk_ids.shape[1]))
        expert_x, offsets, slot = ops.dispatch(
            x, topk_ids, expert_start=self.expert_start,
            num_local_experts=self.num_local_experts, align=self.align)
        return DispatchResult(expert_x, offsets, {"token_slot": slot, "topk_weights": topk_weights,
                                                  "ops": ops})

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        return h["ops"].combine(expert_y, h["token_slot"], h["topk_weights"])

    def compile_kernels(self, hidden: int, dtype: torch.dtype, top_k: int,
                        max_tokens: int | None, device) -> int:
        device = torch.device(device)
        if self.resolved_backend(device, hidden, dtype, top_k) != "cute":
            return 0
        from ..kernels import cute_ops
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return cute_ops.compile_kernels(dtype, hidden, self.num_local_experts, top_k, max_tokens,
                                        sms=sms)
