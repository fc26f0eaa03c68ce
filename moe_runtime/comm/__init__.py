"""Communication: process groups and bounded collectives (gloo on CPU, nccl on CUDA).

Peer buffers (CUDA IPC / symmetric memory / NVSHMEM) for the cute backends come later.
"""
from .groups import (DEFAULT_TIMEOUT_S, CollectiveError, all_gather_object, all_reduce_sum,
                     all_to_all_single, default_backend, default_timeout_s, group_rank_size,
                     init_process_group, new_group)

__all__ = [
    "DEFAULT_TIMEOUT_S", "CollectiveError", "all_gather_object", "all_reduce_sum",
    "all_to_all_single", "default_backend", "default_timeout_s", "group_rank_size",
    "init_process_group", "new_group",
]
