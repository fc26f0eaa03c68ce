"""Topologies: how token rows move between token owners and expert owners.

`make_topology(name, num_experts, group=..., align=..., backend=...)` builds one by name;
`select.select_topology` says which name fits a cluster.
"""
from __future__ import annotations

from typing import Optional

from ..comm.groups import check_timeout_s
from .base import CallAbandoned, DispatchResult, Topology, validate_routing
from .distributed import (CUTE_TOPOLOGIES, BackendNotImplementedError, DataParallelTopology,
                          GroupTopology, PeerBufferTopology, auto_picks_cute,
                          fixed_capacity, resolve_group_backend)
from .dp_nvlink import DPNVLinkTopology
from .dp_p2p import DPP2PTopology
from .local import LocalTopology
from .select import ClusterInfo, ParallelConfig, Selection, select_topology
from .tp import TPTopology

TOPOLOGIES: dict[str, type[Topology]] = {
    "local": LocalTopology,
    "tp": TPTopology,
    "dp_nvlink": DPNVLinkTopology,
    "dp_p2p": DPP2PTopology,
}


def make_topology(name: str, num_experts: int, *, group=None, align: int = 1,
                  backend: str = "auto", timeout_s: Optional[float] = None,
                  max_tokens_per_rank: Optional[int] = None,
                  transport: Optional[str] = None) -> Topology:
    """Build the topology `name` for a layer of `num_experts` experts.

    Args:
        name: "local", "tp", "dp_nvlink" or "dp_p2p".
        group: ProcessGroup for the multi-rank topologies (None = default group); "local"
            accepts None or a group of one rank.
        align: per-expert segment alignment in rows.
        backend: "reference", "cute" or "auto" (local: see kernels.resolve_backend; the
            multi-rank topologies: see distributed.resolve_group_backend).
        timeout_s: per-collective bound in seconds for the multi-rank topologies (None = the
            group's timeout; else finite and >= 0.001, checked here; "local" ignores it; a
            gloo collective also gives up at the group's timeout, whichever is smaller); the
            cute backends turn it into each device-side wait's poll count
            (kernels.peer_sync.wait_bounds: ~1.5x timeout_s on the H200, grid barriers 2x).
        max_tokens_per_rank, transport: peer buffer sizing and transport of the cute backends
            of "tp" and "dp_nvlink" (distributed.PeerBufferTopology; None = its default,
            max_tokens_per_rank 1024). dp_nvlink's cute dispatch is the one-launch decode
            dispatch only with max_tokens_per_rank <= ep_dispatch.DECODE_MAX_TOKENS (128); with
            the default it always runs the 4-launch prefill dispatch.

    Raises:
        ValueError: unknown name (the message lists the known ones), bad backend, "cute"
            without CUDA or CuTeDSL (multi-rank topologies: here; "local": at its first call
            on a device, since a layer may move to CUDA after construction), experts not
            divisible by the world size, align outside [1, 1024], a
            multi-rank group for "local", max_tokens_per_rank / transport for a topology
            without peer buffers, timeout_s NaN, infinite or below 0.001 s (comm.groups.
            check_timeout_s) or, for backend "cute", above kernels.peer_sync.MAX_TIMEOUT_S.
        BackendNotImplementedError (a ValueError): backend "cute" for "dp_p2p".
        TypeError: num_experts or align not an int, group not a ProcessGroup, timeout_s not
            None or a number.
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; expected one of {sorted(TOPOLOGIES)}")
    peer_kw = {k: v for k, v in (("max_tokens_per_rank", max_tokens_per_rank),
                                 ("transport", transport)) if v is not None}
    if peer_kw and not issubclass(TOPOLOGIES[name], PeerBufferTopology):
        raise ValueError(f"{sorted(peer_kw)} apply to the peer buffers of the cute backends "
                         f"({', '.join(CUTE_TOPOLOGIES)}), not to topology {name!r}")
    if group is not None:
        import torch.distributed as dist
        # (new_group gives the ranks it leaves out a placeholder int: group_rank_size names it)
        placeholder = group is dist.GroupMember.NON_GROUP_MEMBER
        if not isinstance(group, dist.ProcessGroup) and not placeholder:
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(group).__name__}")
    if name == "local":
        check_timeout_s(timeout_s)  # ignored by "local", but a bad value is still an error
        if group is not None:
            import torch.distributed as dist
            if dist.get_world_size(group) != 1:
                raise ValueError(f"topology 'local' runs on 1 rank, got a group of "
                                 f"{dist.get_world_size(group)}")
        return LocalTopology(num_experts, align=align, backend=backend)
    return TOPOLOGIES[name](num_experts, group=group, align=align, backend=backend,
                            timeout_s=timeout_s, **peer_kw)


__all__ = [
    "TOPOLOGIES", "make_topology", "Topology", "DispatchResult", "CallAbandoned", "validate_routing",
    "LocalTopology", "TPTopology", "DPNVLinkTopology", "DPP2PTopology", "DataParallelTopology",
    "GroupTopology", "PeerBufferTopology", "BackendNotImplementedError", "resolve_group_backend",
    "auto_picks_cute", "CUTE_TOPOLOGIES", "fixed_capacity",
    "ClusterInfo", "ParallelConfig", "Selection", "select_topology",
]
