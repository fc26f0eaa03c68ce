"""Topologies over a torch.distributed process group: the shared base and the DP protocol.

`GroupTopology` binds a topology to a group (rank, world size, collective timeout, backend).
`DataParallelTopology` is the all-to-all protocol that `dp_nvlink` and `dp_p2p` share; their
reference backends are identical and only the (later) cute transports differ.

DP protocol (each rank owns its own batch; T may differ per rank, including T = 0):

    dispatch  1. sort this rank's (token, j) pairs by global expert id (= destination-rank-major,
                 expert-major within a destination, (t, j) order within an expert)
              2. all_to_all_single of the per-expert counts (int64 [E]): rank d receives
                 counts [W, E_local] (source rank x its local experts)
              3. all_to_all_single of the rows with split sizes (x.dtype)
              4. the receiver re-orders rows into expert-major order for its local experts,
                 padded per expert to `align` (reference.dispatch with k = 1 over the received
                 rows), so within an expert rows are ordered by (source rank, t, j)
    combine   1. gather expert_y rows back into received order, reverse all_to_all_single
              2. on the source rank: reference.combine with a slot map into the returned rows
                 (weighted sum over k in fp32, j = 0..k-1, cast to expert_y.dtype), which is
                 bit-identical to the `local` topology for row-wise experts.

Every collective is bounded by the group's timeout (or `timeout_s`); a rank that fails input
validation raises before its first collective, so its peers raise CollectiveError on timeout.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import all_to_all_single, group_rank_size
from ..kernels import reference
from .base import DispatchResult, Topology

TOPOLOGY_BACKENDS = ("reference", "cute", "auto")



_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}

class BackendNotImplementedError(NotImplementedError, ValueError):
    """The requested backend exists in the design but is not implemented for this topology yet."""


def resolve_group_backend(topology: str, backend: str) -> str:
    """Backend of a multi-rank topology: "reference" or "auto" -> "reference".

    Raises:
        ValueError: unknown backend name.
        BackendNotImplementedError (a ValueError): "cute", until its kernels exist.
    """
    if backend not in TOPOLOGY_BACKENDS:
        raise ValueError(f"backend must be one of {TOPOLOGY_BACKENDS}, got {backend!r}")
    if backend == "cute":
        raise BackendNotImplementedError(
            f"topology {topology!r}: backend 'cute' is not implemented yet; "
            "use backend='reference' (or 'auto', which resolves to 'reference' for now)")
    return "reference"


class GroupTopology(Topology):
    """A topology whose ranks are the members of a torch.distributed process group.

    Args:
        num_experts: E; rank r owns experts [r * E/W, (r + 1) * E/W).
        group: a ProcessGroup, or None for the default group (a world of one rank when
            torch.distributed is not initialized).
        align: per-expert segment alignment in rows (>= 1).
        backend: "reference", "auto" (-> "reference" for now) or "cute" (not implemented yet).
        timeout_s: bound on each collective call; None = the group's own timeout.

    Raises:
        ValueError: unknown backend; num_experts % world_size != 0; align < 1.
        BackendNotImplementedError: backend "cute".
        RuntimeError: a group is given but torch.distributed is not initialized.
    """

    def __init__(self, num_experts: int, *, group=None, align: int = 1, backend: str = "auto",
                 timeout_s: Optional[float] = None):
        self.backend = resolve_group_backend(self.name, backend)
        rank, world_size = group_rank_size(group)
        super().__init__(num_experts, rank=rank, world_size=world_size, align=align)
        self.group = group
        self.timeout_s = timeout_s

    def _step(self, what: str) -> str:
        return f"{self.name}.{what}"


class DataParallelTopology(GroupTopology):
    """Each rank routes its own batch; rows travel to the owners of their experts and back.

    dispatch(x [T, H], topk_ids int32 [T, k], topk_weights fp32 [T, k]) -> DispatchResult with
    expert_x [N_recv + E_local * (align - 1), H] (x.dtype) holding the rows every rank sent to
    this rank's experts, expert_offsets int32 [E_local + 1]. combine(expert_y [>= N, H]) ->
    y [T, H] in expert_y.dtype for this rank's own tokens. See the module docstring.
    Every rank must use the same H and x.dtype (and the same expert_y dtype in combine).

    Raises (besides validation): CollectiveError when a peer stalls or dies.
    """

    name = "dp"

    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult:
        T, k = topk_ids.shape
        W, E_local = self.world_size, self.num_local_experts
        flat = topk_ids.flatten().long()
        order = torch.sort(flat, stable=True).indices
        send_counts = torch.bincount(flat, minlength=self.num_experts)
        # (hidden, dtype) ride along with the counts: rows of another size or dtype would make
        # the row all-to-all abort the process inside gloo/NCCL instead of raising.
        meta = torch.tensor([x.shape[1], _DTYPE_CODES[x.dtype]], device=x.device)
        send = torch.cat([send_counts.view(W, E_local), meta.expand(W, 2)], 1).flatten()
        recv = torch.empty_like(send)
        all_to_all_single(recv, send, group=self.group,
                          step=self._step("dispatch counts"), timeout_s=self.timeout_s)
        recv = recv.view(W, E_local + 2)
        peers_meta = recv[:, E_local:]
        if bool((peers_meta != meta).any()):
            raise ValueError(
                f"{self.name} rank {self.rank}: every rank must dispatch rows of the same hidden "
                f"size and dtype; this rank has (H={x.shape[1]}, {x.dtype}), ranks sent "
                f"{[(int(h), _DTYPES[int(d)]) for h, d in peers_meta.tolist()]}")
        send_splits = send_counts.view(W, E_local).sum(1).tolist()
        recv_counts = recv[:, :E_local]
        recv_splits = recv_counts.sum(1).tolist()
        recv_rows = x.new_empty(sum(recv_splits), x.shape[1])
        all_to_all_single(recv_rows, x[order // k], output_split_sizes=recv_splits,
                          input_split_sizes=send_splits, group=self.group,
                          step=self._step("dispatch rows"), timeout_s=self.timeout_s)
        # Rows from each source arrive grouped by local expert: label them, then permute.
        local_ids = torch.repeat_interleave(
            torch.arange(E_local, device=x.device).repeat(W), recv_counts.flatten())
        expert_x, offsets, recv_slot = reference.dispatch(
            recv_rows, local_ids.to(torch.int32).view(-1, 1), expert_start=0,
            num_local_experts=E_local, align=self.align)
        token_slot = torch.empty(T * k, dtype=torch.int32, device=x.device)
        token_slot[order] = torch.arange(T * k, dtype=torch.int32, device=x.device)
        return DispatchResult(expert_x, offsets, {
            "recv_slot": recv_slot.view(-1).long(), "send_splits": send_splits,
            "recv_splits": recv_splits, "token_slot": token_slot.view(T, k),
            "topk_weights": topk_weights})

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        returned = expert_y.new_empty(sum(h["send_splits"]), expert_y.shape[1])
        all_to_all_single(returned, expert_y[h["recv_slot"]], output_split_sizes=h["send_splits"],
                          input_split_sizes=h["recv_splits"], group=self.group,
                          step=self._step("combine rows"), timeout_s=self.timeout_s)
        return reference.combine(returned, h["token_slot"], h["topk_weights"])
