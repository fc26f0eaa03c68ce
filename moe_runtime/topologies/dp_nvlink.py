"""`dp_nvlink` topology: data-parallel attention inside one NVLink domain.

The reference backend is the shared all-to-all protocol of `distributed.DataParallelTopology`
(torch.distributed: gloo on CPU, nccl on CUDA). The cute backend (later) writes rows straight
into peers' receive buffers over NVLink with per-token release flags.
"""
from __future__ import annotations

from .distributed import DataParallelTopology


class DPNVLinkTopology(DataParallelTopology):
    """Each rank its own batch, one NVLink domain (a node, or a GB200 NVL72 rack).

    Shapes, dtypes and errors: see DataParallelTopology and GroupTopology.
    """

    name = "dp_nvlink"
