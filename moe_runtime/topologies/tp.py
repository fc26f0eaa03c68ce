"""`tp` topology: every rank holds the same tokens; each rank computes only its own experts.

    dispatch  reference.dispatch restricted to this rank's experts (other pairs get slot -1)
    combine   local weighted sum over this rank's (t, j) pairs in fp32, then all_reduce(SUM) in
              fp32 over the group, then one cast to expert_y.dtype.

Reducing in fp32 means a bf16/fp16 result is rounded once, as in `local`; it differs from the
single-rank answer only by the fp32 summation order of the k terms (split across ranks).
Backends: "reference" (torch + torch.distributed all-reduce: gloo on CPU, nccl on CUDA). The
cute backend (NVLS multicast / NVLink one-shot, two-shot all-reduce) comes later.
"""
from __future__ import annotations

import torch

from ..comm import all_reduce_sum
from ..kernels import reference
from .base import DispatchResult
from .distributed import GroupTopology


class TPTopology(GroupTopology):
    """Tensor-parallel attention: tokens replicated on every rank of `group`.

    dispatch(x [T, H], topk_ids int32 [T, k], topk_weights fp32 [T, k]) -> DispatchResult with
    expert_x [T * k + E_local * (align - 1), H] (x.dtype), expert_offsets int32 [E_local + 1].
    combine(expert_y [>= N, H]) -> y [T, H] in expert_y.dtype, identical on every rank.
    Every rank must pass the same x, topk_ids and topk_weights (not checked: it would cost a
    collective). Constructor arguments and errors: see GroupTopology; combine raises
    CollectiveError when a peer stalls or dies.
    """

    name = "tp"

    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult:
        expert_x, offsets, slot = reference.dispatch(
            x, topk_ids, expert_start=self.expert_start,
            num_local_experts=self.num_local_experts, align=self.align)
        return DispatchResult(expert_x, offsets, {"token_slot": slot, "topk_weights": topk_weights})

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        partial = reference.combine(expert_y.float(), h["token_slot"], h["topk_weights"])
        all_reduce_sum(partial, group=self.group, step=self._step("combine all_reduce"),
                       timeout_s=self.timeout_s)
        return partial.to(expert_y.dtype)
