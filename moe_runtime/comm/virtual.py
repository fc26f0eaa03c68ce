"""Virtual ranks: W ranks' worth of the multi-rank kernels on ONE GPU, in one process.

`VirtualRanks` owns PeerBuffers.virtual (W heaps on one device, one int64 address table) and
calls the same functions a real rank calls (kernels/ep_dispatch, ep_combine, allreduce) with
n_local = W: each launch carries every rank's CTAs (blocks split among ranks), and the device
code is the code NVLink peers run, only the addresses in the table differ. One GPU's HBM stands
in for NVLink: a functional proxy, not a link-speed measurement.

Also here: the oracles the tests and the benchmark share, built on kernels/reference.py
(reference.dispatch applied per destination rank; reference.combine over all ranks' rows).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import reference
from . import peer_buffers as pb


class VirtualRanks:
    """W virtual ranks on `device`. Arguments: see peer_buffers.PeerSpec."""

    def __init__(self, world_size: int, max_tokens_per_rank: int, hidden: int, top_k: int,
                 num_experts: int, *, dtype=torch.bfloat16, align: int = 1, device="cuda"):
        self.spec = pb.PeerSpec(world_size, max_tokens_per_rank, hidden, top_k, num_experts,
                                dtype, align)
        self.bufs = pb.PeerBuffers.virtual(self.spec, device)
        self.W = world_size

    def dispatch(self, xs: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor], **kw):
        """xs[r] [T_r, H], topk_ids[r] int32 [T_r, k] -> EPDispatchHandle (see ep_dispatch)."""
        from ..kernels.ep_dispatch import ep_dispatch
        return ep_dispatch(self.bufs, torch.cat(list(xs)), torch.cat(list(topk_ids)),
                           [x.shape[0] for x in xs], **kw)

    def combine(self, handle, expert_ys: Sequence[torch.Tensor],
                topk_weights: Sequence[torch.Tensor], **kw) -> list[torch.Tensor]:
        """expert_ys[r] [>= xout_rows, H]; topk_weights[r] fp32 [T_r, k] -> y_r [T_r, H]."""
        from ..kernels.ep_combine import ep_combine
        y = ep_combine(self.bufs, handle, list(expert_ys), torch.cat(list(topk_weights)), **kw)
        return list(torch.split(y, handle.tokens))

    def all_reduce(self, x: torch.Tensor, **kw) -> torch.Tensor:
        """x [W, T, H] -> [W, T, H], every row the sum over ranks."""
        from ..kernels.allreduce import all_reduce
        return all_reduce(self.bufs, x, **kw)

    def tp_combine_all_reduce(self, expert_ys, token_slot, topk_weights, **kw) -> torch.Tensor:
        from ..kernels.allreduce import tp_combine_all_reduce
        return tp_combine_all_reduce(self.bufs, expert_ys, token_slot, topk_weights, **kw)


# ------------------------------------------------------------------------------------ oracles
def kernel_token_slots(bufs: pb.PeerBuffers, handle) -> list[torch.Tensor]:
    """Per destination rank r, int64 [sum T, k]: the expert_x row of r holding item (t, j) of
    the concatenated tokens, or -1 when r does not own that expert. Read back from the
    dispatch's pos/meta tables (host sync); the kernels' analogue of reference's token_slot."""
    s, out = bufs.spec, []
    W, k = s.world_size, s.top_k
    starts = [0] + list(torch.tensor(handle.tokens).cumsum(0).tolist())
    for r in range(bufs.n_local):
        slot = torch.full((starts[-1] * k,), -1, dtype=torch.int64)
        nrecv = bufs.view(pb.F_NRECV, r).cpu().tolist()
        pos = bufs.view(pb.F_POS, r).cpu()
        item = bufs.view(pb.F_RECV_META, r)[..., 1].cpu().long()
        for src in range(W):
            n = nrecv[src]
            if n:
                slot[starts[src] * k + item[src, :n]] = pos[src, :n].long()
        out.append(slot.view(-1, k))
    return out


def reference_dispatch_per_rank(x: torch.Tensor, topk_ids: torch.Tensor, spec: pb.PeerSpec):
    """reference.dispatch of ALL tokens (concatenated over source ranks) for each destination
    rank's experts: list of (expert_x, expert_offsets, token_slot)."""
    El = spec.num_local_experts
    return [reference.dispatch(x, topk_ids, expert_start=r * El, num_local_experts=El,
                               align=spec.align) for r in range(spec.world_size)]


def expert_scale(num_experts: int, device) -> torch.Tensor:
    """The test expert: row * c_e with c_e = 1 + (e % 7) / 8 (exact in bf16)."""
    return 1.0 + (torch.arange(num_experts, device=device) % 7).float() / 8


def apply_test_experts(expert_x: torch.Tensor, offsets: torch.Tensor, expert_start: int,
                       scale: torch.Tensor) -> torch.Tensor:
    """expert_y = expert_x * c_e per expert segment (rows outside segments copied unchanged)."""
    y = expert_x.clone()
    o = offsets.tolist()
    for le in range(len(o) - 1):
        y[o[le]:o[le + 1]] = (expert_x[o[le]:o[le + 1]].float() * scale[expert_start + le]).to(y.dtype)
    return y


def reference_dp_combine(per_rank, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         spec: pb.PeerSpec, scale: torch.Tensor) -> torch.Tensor:
    """reference.combine over the rows of every destination (the test experts applied):
    y [sum T, H] for all source tokens, fp32 sum over j in order, one cast."""
    El = spec.num_local_experts
    eys, base, slots = [], 0, torch.full_like(topk_ids, -1)
    owner = topk_ids.long() // El
    for r, (ex, offs, slot) in enumerate(per_rank):
        eys.append(apply_test_experts(ex, offs, r * El, scale))
        mine = owner == r
        slots[mine] = slot[mine] + base
        base += ex.shape[0]
    return reference.combine(torch.cat(eys), slots, topk_weights)
