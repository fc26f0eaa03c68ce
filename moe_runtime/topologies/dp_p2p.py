"""`dp_p2p` topology: data-parallel attention across nodes without a shared NVLink domain.

The reference backend is the shared all-to-all protocol of `distributed.DataParallelTopology`
(torch.distributed: gloo on CPU, nccl on CUDA). The cute backend (later: backend "cute" raises
BackendNotImplementedError, "auto" is "reference") will run the same protocol over NVSHMEM
put-with-signal (InfiniBand between nodes, NVLink within one).
"""
from __future__ import annotations

from .distributed import DataParallelTopology


class DPP2PTopology(DataParallelTopology):
    """Each rank its own batch, ranks on several nodes linked by InfiniBand.

    Shapes, dtypes and errors: see DataParallelTopology and GroupTopology.
    """

    name = "dp_p2p"
