"""`dp_nvlink` topology: data-parallel attention inside one NVLink domain.

Backend "reference": the shared all-to-all protocol of `distributed.DataParallelTopology`
(torch.distributed: gloo on CPU, nccl on CUDA).

Backend "cute" (CUDA, bf16/fp16; PeerBufferTopology: buffers made by the first CUDA call, the
"auto" rule, errors): kernels/ep_dispatch.py and kernels/ep_combine.py over this rank's
PeerBuffers. Rows go straight into the receivers' buffers (NVLink stores) with release flags;
the receiver compacts them into expert-major order; combine sends expert outputs back and the
source sums over k in fp32 (j = 0..k-1, one cast, the order of reference.combine).
    dispatch  decode mode (max_tokens_per_rank <= ep_dispatch.DECODE_MAX_TOKENS = 128): one
              cooperative launch, per-token flags; else prefill mode: four launches, per-chunk
              flags. The mode comes from the buffers' size, not from T, because every rank must
              use the same one and a rank does not know its peers' T: with the default
              max_tokens_per_rank (1024) every call runs the prefill dispatch; pass
              max_tokens_per_rank <= 128 for the decode one. Each receiver compares every
              source's site with its own (ranks out of step: ValueError on every rank). Then
              the error words and expert_offsets[-1] are read in one device-to-host copy (one
              host sync).
    combine   send back + weighted sum: one cooperative launch after a decode dispatch, two
              launches after a prefill one; then the error words (one host sync).
Every rank launches on every call, T = 0 included (its peers wait for its counts).

Differences from the reference backend's DispatchResult: expert_x and expert_offsets are views
of the peer buffers, valid until the next dispatch; expert_x holds expert_offsets[-1] rows (read
on the host together with the dispatch's error words, so the experts see decode-sized inputs at
decode, not the buffers' capacity); within an expert, rows are ordered by source rank, then in
an order set by device atomics (not deterministic). Combine only the newest dispatch of the
buffers, which every dp_nvlink topology of the group with the same shapes shares (an older
result raises ValueError).
"""
from __future__ import annotations

import torch

from .base import DispatchResult
from .distributed import DataParallelTopology, PeerBufferTopology


class DPNVLinkTopology(PeerBufferTopology, DataParallelTopology):
    """Each rank its own batch, one NVLink domain (a node, or a GB200 NVL72 rack).

    Shapes, dtypes and errors: see DataParallelTopology, PeerBufferTopology and GroupTopology
    (max_tokens_per_rank bounds each rank's own T), and the module docstring for the cute
    backend's expert_x.
    """

    name = "dp_nvlink"

    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult:
        bufs = self._peer_buffers(x, topk_ids)
        if bufs is None:
            return super()._dispatch(x, topk_ids, topk_weights)
        from ..kernels.ep_dispatch import ep_dispatch
        h = self._site_checked(self.site, lambda sites: ep_dispatch(
            bufs, x, topk_ids, sites=sites, **self._kernel_bounds()))
        return DispatchResult(h.expert_x[0][:h.rows_used[0]], h.expert_offsets[0],
                              {"ep": h, "peer_buffers": bufs, "topk_weights": topk_weights})

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        if "ep" not in h:
            return super()._combine(expert_y, result)
        from ..kernels.ep_combine import ep_combine
        h["peer_buffers"].check_usable()  # (a capture refused before the exchange is taken)
        h["settled"] = True
        return ep_combine(h["peer_buffers"], h["ep"], expert_y, h["topk_weights"],
                          **self._kernel_bounds())
