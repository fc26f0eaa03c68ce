"""Communication: process groups and bounded collectives (gloo on CPU, nccl on CUDA).

peer_buffers.py: the peer buffer tables of the multi-rank CuTeDSL kernels (torch symmetric memory
or CUDA IPC between ranks, or W virtual ranks on one GPU); virtual.py: the virtual-rank harness.
NVSHMEM (dp_p2p) buffers are not built yet.
"""
from .groups import (DEFAULT_TIMEOUT_S, CollectiveError, all_gather_object, all_reduce_sum,
                     all_to_all_single, default_backend, default_timeout_s, group_rank_size,
                     init_process_group, new_group, stream_capturing, wait_stream_bounded)

__all__ = [
    "DEFAULT_TIMEOUT_S", "CollectiveError", "all_gather_object", "all_reduce_sum",
    "all_to_all_single", "default_backend", "default_timeout_s", "group_rank_size",
    "init_process_group", "new_group", "stream_capturing", "wait_stream_bounded",
]
