"""Choose a topology from facts about the cluster and the model's parallel config.

    info = ClusterInfo.gather(group)                      # facts from every rank of the group
    name, reason, allreduce = select_topology(info, ParallelConfig.from_mode("dp", W))

Rules, in order:
  1 rank                                   -> local
  CPU only (no GPU arch)                   -> tp (TP attention) or dp_p2p (DP attention), the
                                              reference backend over gloo
  TP attention                             -> tp; its all-reduce is "nvls" when every rank is in
                                              one NVLink domain, multicast is supported and none
                                              of NVLS_VARS turns it off; "one-shot/two-shot" over
                                              NVLink peer buffers when NVLink but no NVLS; "nccl"
                                              when the ranks do not share an NVLink domain
  DP attention, one NVLink domain          -> dp_nvlink (one node, or e.g. GB200 NVL72: 72 GPUs
                                              on 18 nodes in one NVLink domain)
  DP attention, no shared NVLink domain    -> dp_p2p (NVSHMEM over IB; without IB NICs or
                                              NVSHMEM the reason says only the reference
                                              backend, an NCCL all-to-all, can serve it)
"""
from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Sequence

import torch

#: Variables that turn NVLS (multicast) off, with the values that do so.
NVLS_VARS = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
_FALSY = ("0", "false", "no", "off")
_TRUTHY = ("1", "true", "yes", "on")
_IB_SYSFS = "/sys/class/infiniband"


def nvls_disabled_by(env: dict[str, Optional[str]]) -> Optional[str]:
    """'NAME=value' of the first NVLS_VARS entry that turns NVLS off, or None.

    NCCL_NVLS_ENABLE off = 0/false/no/off; the other two off = 1/true/yes/on.
    """
    for name in NVLS_VARS:
        v = env.get(name)
        if v is None:
            continue
        off = _FALSY if name == "NCCL_NVLS_ENABLE" else _TRUTHY
        if v.strip().lower() in off:
            return f"{name}={v}"
    return None


def gpu_arch_name(major: int, minor: int) -> str:
    """CUDA compute capability -> arch string: (9, 0) -> "sm_90a", (10, 0) -> "sm_100a"."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


@dataclass
class ClusterInfo:
    """Facts about the ranks of one group (every field is a fact, nothing is a decision).

    Attributes:
        world_size: ranks W.
        num_nodes: distinct hosts.
        gpu_name: e.g. "NVIDIA H200" (rank 0's), None without a GPU.
        gpu_arch: "sm_90a", "sm_100a", ... (rank 0's), None without a GPU.
        nvlink_p2p: [W][W] bool, True where rank i reaches rank j's GPU over NVLink (the
            diagonal is True); across nodes True only inside one NVLink fabric (GB200 NVL72).
        multicast_supported: every GPU reports multicast (NVLS) support.
        nvls_env: NVLS_VARS as seen (None = unset); after gathering, a rank's values that turn
            NVLS off win over rank 0's.
        nics: InfiniBand/RoCE devices (/sys/class/infiniband); after gathering, the list of the
            host with the fewest, empty if any host has none.
        nvshmem_available: NVSHMEM usable on every rank.

    Raises:
        ValueError: world_size < 1, num_nodes outside [1, world_size], nvlink_p2p not [W][W].
    """

    world_size: int
    num_nodes: int
    gpu_name: Optional[str]
    gpu_arch: Optional[str]
    nvlink_p2p: Sequence[Sequence[bool]]
    multicast_supported: bool = False
    nvls_env: dict[str, Optional[str]] = field(default_factory=dict)
    nics: Sequence[str] = ()
    nvshmem_available: bool = False

    def __post_init__(self):
        W = self.world_size
        if W < 1 or not 1 <= self.num_nodes <= W:
            raise ValueError(f"need world_size >= 1 and 1 <= num_nodes <= world_size, got "
                             f"world_size={W}, num_nodes={self.num_nodes}")
        rows = [tuple(bool(v) for v in row) for row in self.nvlink_p2p]
        if len(rows) != W or any(len(r) != W for r in rows):
            raise ValueError(f"nvlink_p2p must be [{W}][{W}], got "
                             f"[{len(rows)}][{sorted({len(r) for r in rows})}]")
        self.nvlink_p2p = tuple(rows)
        self.nics = tuple(self.nics)
        self.nvls_env = {name: self.nvls_env.get(name) for name in NVLS_VARS}

    @property
    def one_nvlink_domain(self) -> bool:
        """Every pair of ranks is NVLink-connected."""
        return all(all(row) for row in self.nvlink_p2p)

    @classmethod
    def gather(cls, group=None) -> "ClusterInfo":
        """Facts of every rank of `group` (a collective: all must call); None: the default
        group when torch.distributed is initialized (as everywhere in torch.distributed), else
        this process alone.

        Raises:
            CollectiveError: a rank did not join within the group timeout.
        """
        facts = [_local_facts()]
        if group is not None or (torch.distributed.is_available()
                                 and torch.distributed.is_initialized()):
            from ..comm import all_gather_object
            facts = all_gather_object(facts[0], group=group, step="select.gather")
        return cls.from_facts(facts)

    @classmethod
    def from_facts(cls, facts: Sequence[dict[str, Any]]) -> "ClusterInfo":
        """Combine per-rank fact dicts (as `_local_facts` returns, in rank order)."""
        W = len(facts)

        def linked(a: dict, b: dict) -> bool:
            if a is b or (a["uuid"] is not None and a["uuid"] == b["uuid"]):
                return True
            if a["host"] == b["host"]:
                return b["uuid"] is not None and b["uuid"] in a["nvlink_peers"]
            return a["fabric"] is not None and a["fabric"] == b["fabric"]

        env = facts[0]["env"]
        for f in facts:
            if nvls_disabled_by(f["env"]):
                env = f["env"]
                break
        nics = min((f["nics"] for f in facts), key=len)
        return cls(world_size=W, num_nodes=len({f["host"] for f in facts}),
                   gpu_name=facts[0]["gpu_name"], gpu_arch=facts[0]["gpu_arch"],
                   nvlink_p2p=[[linked(a, b) for b in facts] for a in facts],
                   multicast_supported=all(f["multicast"] for f in facts), nvls_env=env,
                   nics=nics, nvshmem_available=all(f["nvshmem"] for f in facts))


def _local_facts() -> dict[str, Any]:
    """This process's facts (its current CUDA device, if any). Queries only; uses nothing."""
    facts = dict(host=socket.gethostname(), gpu_name=None, gpu_arch=None, uuid=None,
                 nvlink_peers=(), fabric=None, multicast=False,
                 env={name: os.environ.get(name) for name in NVLS_VARS},
                 nics=sorted(os.listdir(_IB_SYSFS)) if os.path.isdir(_IB_SYSFS) else [],
                 nvshmem=False)
    if not torch.cuda.is_available():
        return facts
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    uuid = _norm_uuid(props.uuid)
    peers, fabric = _nvml_links(uuid)
    if peers is None:  # no NVML: CUDA peer access among visible devices (may be PCIe)
        peers = tuple(_norm_uuid(torch.cuda.get_device_properties(d).uuid)
                      for d in range(torch.cuda.device_count())
                      if d != dev and torch.cuda.can_device_access_peer(dev, d))
    facts.update(gpu_name=props.name, gpu_arch=gpu_arch_name(props.major, props.minor),
                 uuid=uuid, nvlink_peers=peers, fabric=fabric, multicast=_multicast(dev),
                 nvshmem=_nvshmem_available())
    return facts


def _norm_uuid(u: Any) -> str:
    s = str(u)
    return s[4:] if s.startswith("GPU-") else s


def _nvml_links(uuid: str) -> tuple[Optional[tuple[str, ...]], Optional[str]]:
    """(NVLink peer UUIDs, "cluster:clique" fabric id or None) from NVML; (None, None) without it."""
    try:
        import pynvml as nv
        nv.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML is optional
        return None, None
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        ids = [_norm_uuid(nv.nvmlDeviceGetUUID(h)) for h in handles]
        if uuid not in ids:
            return None, None
        me = handles[ids.index(uuid)]
        peers = tuple(i for h, i in zip(handles, ids) if i != uuid and nv.nvmlDeviceGetP2PStatus(
            me, h, nv.NVML_P2P_CAPS_INDEX_NVLINK) == nv.NVML_P2P_STATUS_OK)
        fabric = None
        try:
            info = nv.nvmlDeviceGetGpuFabricInfo(me)
            if info.state == nv.NVML_GPU_FABRIC_STATE_COMPLETED and info.status == nv.NVML_SUCCESS:
                fabric = f"{bytes(info.clusterUuid).hex()}:{info.cliqueId}"
        except Exception:  # noqa: BLE001 - pre-Blackwell GPUs / old drivers have no fabric
            pass
        return peers, fabric
    except Exception:  # noqa: BLE001
        return None, None
    finally:
        nv.nvmlShutdown()


def _multicast(dev: int) -> bool:
    """The device attribute CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (queried, never used)."""
    try:
        from cuda.bindings import driver as cu
        err, val = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev)
        if err == cu.CUresult.CUDA_SUCCESS:
            return bool(val)
    except Exception:  # noqa: BLE001 - fall back to torch's query
        pass
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory
        # note: torch also answers False when TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        return bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, dev))
    except Exception:  # noqa: BLE001
        return False


def _nvshmem_available() -> bool:
    if importlib.util.find_spec("nvshmem") is not None:
        return True
    try:
        from torch.distributed._symmetric_memory import is_nvshmem_available
        return bool(is_nvshmem_available())
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class ParallelConfig:
    """How attention is parallelized; experts are always split over all tp * dp ranks.

    Attributes:
        tp: attention tensor-parallel size (tokens replicated across it).
        dp: attention data-parallel size (each group its own batch).
        ep: expert-parallel size; None = tp * dp (the only supported value).
    """

    tp: int = 1
    dp: int = 1
    ep: Optional[int] = None

    @classmethod
    def from_mode(cls, mode: Literal["tp", "dp"], world_size: int) -> "ParallelConfig":
        """All ranks tensor-parallel ("tp") or all data-parallel ("dp")."""
        if mode not in ("tp", "dp"):
            raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
        return cls(tp=world_size) if mode == "tp" else cls(dp=world_size)

    @property
    def attention(self) -> str:
        """"tp" when tokens are replicated on every rank (dp == 1), else "dp"."""
        return "tp" if self.dp == 1 else "dp"

    def check(self, world_size: int) -> None:
        """Raises ValueError unless tp * dp == ep == world_size."""
        ep = self.tp * self.dp if self.ep is None else self.ep
        if self.tp < 1 or self.dp < 1 or self.tp * self.dp != world_size or ep != world_size:
            raise ValueError(f"need tp * dp == ep == world_size ({world_size}), got tp={self.tp}, "
                             f"dp={self.dp}, ep={self.ep}")


class Selection(NamedTuple):
    """select_topology's answer: topology name, a one-line reason, and for tp the all-reduce
    ("nvls", "one-shot/two-shot", "nccl" or "gloo"; None for other topologies)."""

    name: str
    reason: str
    allreduce: Optional[str]


def _tp_allreduce(info: ClusterInfo) -> tuple[str, str]:
    if info.gpu_arch is None:
        return "gloo", "no GPU: the reference all-reduce runs over gloo"
    if not info.one_nvlink_domain:
        return "nccl", ("the ranks do not share one NVLink domain "
                        f"({info.num_nodes} nodes); consider DP attention (dp_p2p)")
    peer = "NVLink one-shot (small) / two-shot (large) over peer buffers"
    if not info.multicast_supported:
        return "one-shot/two-shot", f"the GPUs report no multicast support; {peer}"
    off = nvls_disabled_by(info.nvls_env)
    if off:
        return "one-shot/two-shot", f"NVLS turned off by {off}; {peer}"
    return "nvls", ("NVLink multicast supported and none of " + ", ".join(NVLS_VARS)
                    + " turns it off")


def select_topology(info: ClusterInfo, parallel: ParallelConfig) -> Selection:
    """Pick a topology name for `info` and `parallel` (rules: module docstring).

    Raises:
        ValueError: parallel does not match info.world_size.
    """
    parallel.check(info.world_size)
    W = info.world_size
    if W == 1:
        return Selection("local", "1 rank: every expert is local, no communication", None)
    gpus = f"{W} x {info.gpu_name or 'CPU'} on {info.num_nodes} node(s)"
    if parallel.attention == "tp":
        allreduce, why = _tp_allreduce(info)
        return Selection("tp", f"tensor-parallel attention ({gpus}): tp, tokens replicated; "
                               f"all-reduce {allreduce}: {why}", allreduce)
    hybrid = f" (tp={parallel.tp} replicas send duplicate rows)" if parallel.tp > 1 else ""
    if info.gpu_arch is None:
        return Selection("dp_p2p", f"data-parallel attention{hybrid} ({gpus}), CPU only: dp_p2p "
                         "with the reference backend, an all-to-all over gloo (the same protocol "
                         "as dp_nvlink; there is no NVLink or NVSHMEM on CPU)", None)
    if info.one_nvlink_domain:
        return Selection("dp_nvlink", f"data-parallel attention{hybrid} ({gpus}): every rank "
                         "is in one NVLink domain, so rows go straight to peers over NVLink",
                         None)
    missing = [m for m, ok in (("no InfiniBand NICs", bool(info.nics)),
                               ("NVSHMEM not available", info.nvshmem_available)) if not ok]
    if not missing:
        return Selection("dp_p2p", f"data-parallel attention{hybrid} ({gpus}) without one "
                         f"NVLink domain: dp_p2p, NVSHMEM over IB ({', '.join(info.nics)})", None)
    return Selection("dp_p2p", f"data-parallel attention{hybrid} ({gpus}) without one NVLink "
                     f"domain and {', '.join(missing)}: dp_p2p with the reference backend only "
                     "(NCCL all-to-all)", None)
