"""Peer buffer tables for the multi-rank CuTeDSL kernels (dp_nvlink all-to-all, tp all-reduce).

Every rank owns two byte heaps:
  * a **peer heap** that other ranks read and write over NVLink (receive rows, flags, signal
    pads, all-reduce inputs): symmetric, i.e. the same layout on every rank;
  * a **local heap** only its own kernels touch (slot maps, counters, expert-major output).
The kernels never see torch tensors for these: they get one int64 device table
`table[field, rank]` = address of `field` in `rank`'s heap (FIELDS below), so the same device
code runs across GPUs (peer addresses from symmetric memory or CUDA IPC) and on one GPU with W
**virtual ranks** (W heaps in one process, blocks of one launch split among ranks).

Modes (PeerBuffers.mode):
    "virtual"   PeerBuffers.virtual(spec, device): W ranks' heaps on one GPU, all local
                (n_local = W, rank0 = 0). Used by tests and benchmarks on one GPU.
    "symm_mem"  PeerBuffers.from_process_group(spec, group): the peer heap comes from
                torch symmetric memory (`symm_mem.empty` + `rendezvous`; handle.buffer_ptrs).
    "ipc"       same, peer heap exchanged as CUDA IPC handles over the group (all_gather_object),
                each peer's opened on this rank's own device (_open_ipc_handle).
                Real modes have n_local = 1, rank0 = the group rank.
    Real modes back the `cute` backends of the tp and dp_nvlink topologies
    (topologies/distributed.py, PeerBufferTopology; the topologies of one group share one
    PeerBuffers per spec, device and transport). tests/gpu/test_topologies_cute_gpu.py runs
    "ipc" with two processes on ONE GPU (CUDA IPC works between processes on one device);
    tests/gpu/test_multi_gpu.py runs "ipc" with one process per GPU (NVLink peers) and
    `benchmarks/multirank_virtual.py --real` "symm_mem" (both on 2 H200s).

Sizing: everything is sized from `PeerSpec.max_tokens_per_rank` (T_max); a call with more
tokens on any rank raises ValueError naming the limit before anything is launched
(`check_tokens`). Capacity per rank: staging S = T_max * min(k, E_local) rows per source,
expert-major output W * S + E_local * (align - 1) rows (every token of every rank may pick
this rank).

Flags never go stale: every flag is written with the call's epoch (1, 2, 3, ...) and waited on
with `>=`, so consecutive calls reuse buffers without a memset. Epochs never wrap: before a
counter would pass EPOCH_LIMIT, every rank restarts both counters together and zeroes the
epoch-carrying fields (EPOCH_FIELDS; `restart_epochs`, once per ~1e9 calls). A flag that a rare call
last wrote 2^31 epochs earlier would otherwise look current to a wrap-safe compare.

Errors: each rank has ERR_WORDS int32 error words, [phase, peer, expected, seen] first; device
waits that time out fill them and `check_errors` raises `PeerTimeoutError` naming rank and phase; an
index that would fall outside its buffer (topk_ids outside [0, E), token_slot past expert_y, a
corrupt count or row from a peer) is refused, recorded the same way, and raised as
`PeerDataError`; so is a peer whose call is at another site (`site_word`: the callers'
topology, layer and dispatch number, checked by every dispatch and all-reduce) or, in an
all-reduce, passed another T. After an error the buffers are in an unknown state: `reset()`
(a memset, host-synchronous) is needed.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .groups import all_gather_object

# ---- table fields: (name, peer-visible, element dtype); shapes come from PeerSpec.shapes() ----
F_RECV_X = 0        # [W, S, H] x.dtype        rows sent to this rank, per source region
F_RECV_META = 1     # [W, S, 2] int32          (local expert, source item t*k+j) per row
F_INBOX_CNT = 2     # [2?, W, E_local] int32   per-source counts of rows per local expert
F_INBOX_FLAG = 3    # [W] int32                epoch: counts from that source are written
F_CHUNK_FLAG = 4    # [W, S] int32             epoch per staging chunk of each source region
F_ACK = 5           # [W] int32                dest r started call e => done with e-1 inbox
F_RET_X = 6         # [T_max * k, H] x.dtype   combine: expert outputs coming back, item order
F_RET_FLAG = 7      # [W, S] int32             epoch per returned chunk, per dest rank
F_AR_IN = 8         # [T_max, H] x.dtype       all-reduce input (partial sums of this rank)
F_AR_MID = 9        # [T_max, H] x.dtype       two-shot: reduce-scattered slice of this rank
F_SIG = 10          # [MAX_CTAS, W] int32      cross-rank per-CTA barrier signal pad
F_SITE = 11         # [W, 3] int32             [s, 0]: site word of source s's dispatch (s
                    #                          pushes it); [r, 1:3] of rank r itself: its
                    #                          all-reduce's site word and T (peers pull them)
F_CNT = 12          # [E] int32      (local)   send counters per global expert, 0 between calls
F_STAGE = 13        # [T_max * k] int32        item -> slot, then staging index at its dest
F_INV = 14          # [W, S] int32             staging (dest, i) -> item t*k+j
F_NSEND = 15        # [W] int32                rows sent to each dest this call
F_POS = 16          # [W, S] int32             staging (src, i) -> expert-major row
F_NRECV = 17        # [W] int32                rows received from each source this call
F_XOUT = 18         # [XCAP, H] x.dtype        expert_x: rows in expert-major order
F_OFFS = 19         # [E_local + 1] int32      expert_offsets
F_BAR = 20          # [4] int32                rank-local grid barrier word (+ spare)
F_ERR = 21          # [8] int32                [phase, peer, expected, seen] of the first error,
                    #                          [4]: ERR_APART, [5:8] spare
NUM_HEAP_FIELDS = 22
# ---- argument rows: per-call values, not heap fields (table[f, r] for each local rank r) ----
F_ARG_X = 22        # address of rank r's token rows x [T_r, H]
F_ARG_IDS = 23      # address of rank r's topk_ids int32 [T_r, k]
F_ARG_T = 24        # T_r itself (a count, not an address)
F_ARG_W = 25        # address of rank r's topk_weights fp32 [T_r, k]
F_ARG_Y = 26        # address of rank r's output rows [T_r, H]
F_ARG_EY = 27       # address of rank r's expert_y [>= rows, H]
F_ARG_SLOT = 28     # address of rank r's token_slot int32 [T, k] (tp decode combine)
F_ARG_ROWS = 29     # rows of rank r's expert_y (tp decode combine: bound of token_slot)
F_ARG_SITE = 30     # rank r's site word of this call (`site_word`; compared with every peer's)
NUM_FIELDS = 31

FIELD_NAMES = ("recv_x", "recv_meta", "inbox_cnt", "inbox_flag", "chunk_flag", "ack", "ret_x",
               "ret_flag", "ar_in", "ar_mid", "sig", "site", "cnt", "stage", "inv", "nsend", "pos",
               "nrecv", "xout", "offs", "bar", "err")
PEER_FIELDS = frozenset(range(F_RECV_X, F_SITE + 1))
EPOCH_FIELDS = (F_INBOX_FLAG, F_CHUNK_FLAG, F_ACK, F_RET_FLAG, F_SIG)  # hold epochs, not data
EPOCH_LIMIT = 1 << 30  # epochs (dispatch and barrier) stay in [0, EPOCH_LIMIT]: int32 `>=` exact

MAX_CTAS_PER_RANK = 1024   # rows of the signal pad: the most CTAs per rank a barrier kernel may use
HEAP_ALIGN = 256

# Codes the kernels write into err[0]; names used in the exception. Codes below DATA_ERROR are
# bounded waits that timed out (PeerTimeoutError); from DATA_ERROR on, a value that would have
# indexed out of bounds was refused instead of used (PeerDataError; expected = the bound).
DATA_ERROR = 16
PHASES = {
    1: "dispatch: local grid barrier after counting",
    2: "dispatch: waiting for the destination's ack of the previous call",
    3: "dispatch: local grid barrier after publishing counts",
    4: "dispatch: waiting for the per-source row counts",
    5: "dispatch: waiting for rows (release flags) from the source",
    6: "combine: waiting for returned expert rows (release flags) from the expert owner",
    7: "all-reduce: cross-rank barrier before reading peers' inputs",
    8: "all-reduce: cross-rank barrier after the reduce-scatter",
    9: "all-reduce: cross-rank barrier before returning (peers done reading)",
    16: "dispatch/combine: topk_ids entry outside [0, num_experts)",
    17: "dispatch: more rows for one destination than the buffers hold (repeated expert ids "
        "in a token?)",
    18: "dispatch: a source announced more rows than the buffers hold",
    19: "dispatch: received row with an out-of-range local expert or position",
    20: "combine: returned row with an out-of-range token item",
    21: "tp combine: token_slot entry >= rows of expert_y",
    22: "out of step: a peer's call is at another site",
    23: "all-reduce: a peer passed another token count",
}
E_OUT_OF_STEP, E_OTHER_TOKENS = 22, 23  # (expected / seen: this rank's value / the peer's)

# Site words (F_ARG_SITE, F_SITE): every dispatch and all-reduce sends its caller's site to
# every peer, which compares it with its own (E_OUT_OF_STEP): ranks that paired calls of other
# layers, topologies or dispatch numbers (a rank went on after an error) raise instead of
# exchanging rows silently. One int32: topology id, layer and dispatch number, each modulo
# 2**bits (SITE_BITS, high to low bits), so a skip of 2**bits calls exactly goes unseen.
# Cost (benchmarks/multirank_virtual.py, H 7168, k 8, E 256, bf16, interleaved rounds against
# the kernels without it, best of each): W = 2 virtual ranks on one H200, decode dispatch
# T = 1 12.02 -> 12.27 us, dispatch + combine 18.67 -> 18.99, one-shot all-reduce 5.34 -> 5.59;
# on 2 H200s (--real, two machines' runs) decode dispatch T = 1 / 8 / 128 within the run-to-run
# spread (+0.1..0.5 us), one-shot all-reduce T = 1 17.3 -> 18.3 and 15.6 -> 16.3 us, T = 128
# +0.1..0.5 us. (Pushing the all-reduce's site into the peers' rows cost 3.7 us at T = 1 there:
# a remote store before the barrier's release; each rank keeps it in its own row instead.)
SITE_BITS = (12, 10, 9)
SITE_COLS = 3  # F_SITE columns: dispatch site, all-reduce site, all-reduce T
TOPOLOGY_SHIFT = SITE_BITS[1] + SITE_BITS[2]  # site word >> this = its topology id field
# Error words per rank (F_ERR): the first error's [phase, peer, expected, seen], then at
# ERR_APART the largest topology id field of the sites in the mismatches the rank saw (atomic
# max). Every rank of a call sees every peer's site, so all ranks out of step agree on it.
ERR_WORDS, ERR_APART = 8, 4


def site_word(topology: int, layer: int, call: int) -> int:
    """The int32 (>= 0) of a call's site (topology id, layer, dispatch number; SITE_BITS)."""
    word = 0
    for value, bits in zip((topology, layer, call), SITE_BITS):
        word = (word << bits) | (int(value) % (1 << bits))
    return word


def site_fields(word: int) -> tuple[int, int, int]:
    """(topology id, layer, dispatch number), each modulo 2**bits, of a site word."""
    out = []
    for bits in reversed(SITE_BITS):
        out.append(word & ((1 << bits) - 1))
        word >>= bits
    return tuple(reversed(out))


def check_sites(sites, n_local: int) -> list[int]:
    """Site words per local rank (None: 0 for each).

    Raises:
        ValueError: not n_local ints in [0, 2**31)."""
    sites = [0] * n_local if sites is None else list(sites)
    if len(sites) != n_local or any(isinstance(w, bool) or not isinstance(w, int)
                                    or not 0 <= w < 1 << 31 for w in sites):
        raise ValueError(f"sites must be {n_local} int(s) in [0, 2**31) (site_word), got {sites}")
    return sites


def describe_error(e: dict) -> str:
    """One line for an error record {rank, phase, phase_name, peer, expected, seen}."""
    if e["phase"] == E_OUT_OF_STEP:
        return (f"rank {e['rank']}: out of step with rank {e['peer']} (code {e['phase']}): this "
                "rank's call is at site (topology, layer, dispatch) "
                f"{site_fields(e['expected'])}, rank {e['peer']}'s at {site_fields(e['seen'])}")
    if e["phase"] == E_OTHER_TOKENS:
        return (f"rank {e['rank']}: {e['phase_name']} (code {e['phase']}): this rank passed "
                f"T={e['expected']}, rank {e['peer']} T={e['seen']}")
    if e["phase"] >= DATA_ERROR:
        return (f"rank {e['rank']}: {e['phase_name']} (code {e['phase']})"
                + (f", from rank {e['peer']}" if e["peer"] >= 0 else "")
                + f": saw {e['seen']}, allowed [0, {e['expected']})")
    return (f"rank {e['rank']}: timed out in {e['phase_name']!r} (phase {e['phase']})"
            + (f" waiting for rank {e['peer']}" if e["peer"] >= 0 else "")
            + f", expected epoch/flag >= {e['expected']}, saw {e['seen']}")


class PeerError(RuntimeError):
    """A multi-rank kernel recorded an error. `errors` holds one dict per failing rank:
    {rank, phase, phase_name, peer, expected, seen}."""

    summary = "device error"

    def __init__(self, what: str, errors: list[dict]):
        self.errors = errors
        super().__init__(f"{what}: {self.summary} on {len(errors)} rank(s); buffers must be "
                         "reset() before reuse:\n  " + "\n  ".join(map(describe_error, errors)))


class PeerTimeoutError(PeerError):
    """A bounded device-side wait gave up (peer = the rank waited for, -1 = own CTAs)."""

    summary = "device wait timed out"


class PeerDataError(PeerError):
    """A kernel refused a value that would have indexed out of bounds (bad input such as
    topk_ids outside [0, E), or a corrupt value from a peer); nothing was accessed with it.
    Also: a peer's call at another site (E_OUT_OF_STEP) or an all-reduce of another T
    (E_OTHER_TOKENS); that call's outputs are then wrong. Other ranks may report follow-on
    timeouts in the same exception."""

    summary = "value refused"


@dataclass(frozen=True)
class PeerSpec:
    """What the buffers are sized for. All ranks must use equal specs.

    Args:
        world_size: W ranks (virtual or real), >= 1.
        max_tokens_per_rank: T_max, the most tokens any rank passes in one call (>= 1).
        hidden: H; H * element bytes must be a multiple of 16.
        top_k: k.
        num_experts: E, divisible by W (rank r owns experts [r*E/W, (r+1)*E/W)).
        dtype: row dtype (torch.bfloat16 or torch.float16).
        align: per-expert row alignment of expert_x (>= 1).
        all_to_all: size the dp_nvlink all-to-all fields (receive/return rows, staging maps,
            expert_x). False (the tp topology): those fields get no rows, only the all-reduce
            fields are sized, and ep_dispatch refuses the buffers.
    """

    world_size: int
    max_tokens_per_rank: int
    hidden: int
    top_k: int
    num_experts: int
    dtype: torch.dtype = torch.bfloat16
    align: int = 1
    all_to_all: bool = True

    def __post_init__(self):
        sizes = ("world_size", "max_tokens_per_rank", "hidden", "top_k", "num_experts", "align")
        bad = [n for n in sizes if isinstance(getattr(self, n), bool)
               or not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be ints >= 1: {self}")
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by "
                             f"world_size={self.world_size}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} > num_experts={self.num_experts}")
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")
        if (self.hidden * self.elem_bytes) % 16:
            raise ValueError(f"hidden={self.hidden}: rows must be a multiple of 16 bytes")

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def stage_rows(self) -> int:
        """S: rows one source can send one destination in a call (distinct experts per token)."""
        return self.max_tokens_per_rank * min(self.top_k, self.num_local_experts)

    @property
    def xout_rows(self) -> int:
        """Rows of expert_x: every source's S rows plus the worst-case alignment padding."""
        return self.world_size * self.stage_rows + self.num_local_experts * (self.align - 1)

    def shapes(self) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        W, H, T, k = self.world_size, self.hidden, self.max_tokens_per_rank, self.top_k
        E, El, i32, dt = self.num_experts, self.num_local_experts, torch.int32, self.dtype
        # rows of the all-to-all fields (none when only the all-reduce is sized)
        S, items, xout = ((self.stage_rows, T * k, self.xout_rows) if self.all_to_all
                          else (0, 0, 0))
        return {
            F_RECV_X: ((W, S, H), dt), F_RECV_META: ((W, S, 2), i32), F_INBOX_CNT: ((W, El), i32),
            F_INBOX_FLAG: ((W,), i32), F_CHUNK_FLAG: ((W, S), i32), F_ACK: ((W,), i32),
            F_RET_X: ((items, H), dt), F_RET_FLAG: ((W, S), i32), F_AR_IN: ((T, H), dt),
            F_AR_MID: ((T, H), dt), F_SIG: ((MAX_CTAS_PER_RANK, W), i32),
            F_SITE: ((W, SITE_COLS), i32), F_CNT: ((E,), i32),
            F_STAGE: ((items,), i32), F_INV: ((W, S), i32), F_NSEND: ((W,), i32),
            F_POS: ((W, S), i32), F_NRECV: ((W,), i32), F_XOUT: ((xout, H), dt),
            F_OFFS: ((El + 1,), i32), F_BAR: ((4,), i32), F_ERR: ((ERR_WORDS,), i32),
        }


@dataclass
class HeapLayout:
    """Byte offsets of the fields inside the peer and the local heap (HEAP_ALIGN-aligned)."""

    offsets: dict[int, int]
    peer_bytes: int
    local_bytes: int
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(repr=False)

    @classmethod
    def of(cls, spec: PeerSpec) -> "HeapLayout":
        shapes = spec.shapes()
        offsets, size = {}, {True: 0, False: 0}
        for f in range(NUM_HEAP_FIELDS):
            shape, dt = shapes[f]
            peer = f in PEER_FIELDS
            offsets[f] = size[peer]
            nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            size[peer] += (nbytes + HEAP_ALIGN - 1) // HEAP_ALIGN * HEAP_ALIGN
        return cls(offsets, size[True], size[False], shapes)


def _on_device(device: torch.device):
    """`device` as the current CUDA device (NCCL collectives use it); nothing for other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class PeerSetupError(RuntimeError):
    """Making peer buffers failed on some rank(s); raised on every rank of the group together.
    `failed`: {rank: "ExceptionType: message"} of the failing ranks."""

    def __init__(self, what: str, failed: dict[int, str]):
        self.failed = failed
        super().__init__(f"peer buffers: {what} failed on rank(s) "
                         + "; ".join(f"{r}: {e}" for r, e in failed.items()))


def _on_every_rank(group, step: str, fn):
    """fn() on this rank, then a bounded gather of every rank's outcome (under the caller's
    `_on_device`). Returns (fn's value, None where it raised; {rank: "Type: message"} of the
    ranks where it raised, empty when it worked everywhere)."""
    value = error = None
    try:
        value = fn()
    except Exception as e:  # reported to every rank, which all raise together
        error = f"{type(e).__name__}: {e}"
    errors = all_gather_object(error, group=group, step=f"peer buffers: {step}")
    return value, {r: e for r, e in enumerate(errors) if e is not None}


def _open_ipc_handle(handle, device: torch.device) -> torch.Tensor:
    """A peer's heap from its `reduce_tensor` handle (fn, args), mapped on THIS rank's device.

    torch's rebuild_cuda_tensor opens the handle on its `storage_device` argument, which is
    the EXPORTER's device index (in the exporter's numbering). CUDA IPC maps memory into the
    CURRENT device's context (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess enables
    peer access from that device to the owner's), so opening under the owner's index would
    create a context on every peer GPU and enable peer access between the wrong devices: the
    argument is replaced by `device.index`. CPU heaps (tests) are rebuilt as they come.

    Raises:
        RuntimeError: torch's reduction of a CUDA tensor is not rebuild_cuda_tensor(...,
            storage_device, ...) (a torch change this code must follow).
    """
    import inspect

    from torch.multiprocessing import reductions
    fn, args = handle
    if device.type != "cuda":
        return fn(*args)
    params = (inspect.signature(fn).bind(*args) if fn is reductions.rebuild_cuda_tensor
              else None)
    if params is None or "storage_device" not in params.arguments:
        raise RuntimeError(f"peer buffers: torch's reduce_tensor of a CUDA tensor returned "
                           f"{getattr(fn, '__qualname__', fn)!r}, not rebuild_cuda_tensor with "
                           "a storage_device argument; the CUDA IPC mapping must be updated")
    params.arguments["storage_device"] = device.index
    return fn(*params.args, **params.kwargs)


def nvls_allowed(device: torch.device | int | None = None) -> tuple[bool, str]:
    """May NVLS (multicast, multimem.*) be used? Needs the device's multicast attribute and none
    of NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

    The variables are checked first, so with any of them set the device is never queried.
    Returns (allowed, one-line reason).
    """
    from ..topologies.select import nvls_disabled_by  # one reading of the variables (select.py)
    off = nvls_disabled_by(dict(os.environ))
    if off:
        return False, f"{off} is set"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from cuda.bindings import driver as cu
        dev = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        err, ok = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev)
        if int(err) != 0:
            return False, f"cuDeviceGetAttribute(MULTICAST_SUPPORTED) failed: {err}"
        return (bool(ok), "device reports multicast support" if ok else
                "device does not report multicast support")
    except Exception as ex:  # cuda-python missing or too old
        return False, f"cannot query multicast support: {ex}"


class PeerBuffers:
    """Heaps of the ranks this process drives, plus the int64 address table the kernels read.

    Attributes:
        spec: PeerSpec. layout: HeapLayout.
        mode: "virtual" | "symm_mem" | "ipc".
        rank0: first rank driven by this process; n_local: ranks driven (W virtual, 1 real).
        table: int64 [NUM_FIELDS, W] on the device; table[f, r] = address of heap field f of
            rank r (0 for local fields of ranks another process drives), then the per-call
            argument rows F_ARG_* (set_args).
        epoch: epoch of the last dispatch (0 = none yet); sig_epoch: last barrier epoch used.
    """

    def __init__(self, spec: PeerSpec, device: torch.device, mode: str, rank0: int,
                 peer_heaps: Sequence[torch.Tensor], local_heaps: Sequence[torch.Tensor],
                 peer_addrs: Sequence[int], keepalive=(), group=None):
        self.group = group
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare equal to tensors' devices
            device = torch.device("cuda", torch.cuda.current_device())
        self.spec, self.device, self.mode = spec, device, mode
        self.rank0, self.n_local = rank0, len(local_heaps)
        self.layout = HeapLayout.of(spec)
        self.peer_heaps, self.local_heaps = list(peer_heaps), list(local_heaps)
        self._keepalive = keepalive
        W = spec.world_size
        with torch.inference_mode(False):  # normal tensors: set_args writes them in any mode
            tab = torch.zeros(NUM_FIELDS, W, dtype=torch.int64)
            for f in range(NUM_HEAP_FIELDS):
                for r in range(W):
                    if f in PEER_FIELDS:
                        tab[f, r] = peer_addrs[r] + self.layout.offsets[f]
                    elif rank0 <= r < rank0 + self.n_local:
                        tab[f, r] = self.local_heaps[r - rank0].data_ptr() + self.layout.offsets[f]
            self._host_table = tab
            self.table = tab.to(self.device)
        self.epoch = 0
        self.sig_epoch = 0
        self.broken: str | None = None
        self._last_dispatch = None
        self.reset()

    def __deepcopy__(self, memo) -> "PeerBuffers":
        """The buffers themselves: a deep copy of a topology shares them, as topologies made
        on the same group do (a copy of the heaps kept the original's addresses in its table:
        its kernels wrote the original's heaps while it read its own)."""
        return self

    def __reduce__(self):
        """Refused (TypeError): a copy made by pickle would hold new heaps and the original's
        addresses, or addresses of another process."""
        raise TypeError("PeerBuffers cannot be pickled: their address table points at heaps "
                        "registered with the peer ranks (copy.deepcopy shares them; pickle a "
                        "model before its first call on peer buffers)")

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def virtual(cls, spec: PeerSpec, device="cuda") -> "PeerBuffers":
        """W virtual ranks on one device: every heap is a row of one allocation per kind."""
        lay = HeapLayout.of(spec)
        W = spec.world_size
        with torch.inference_mode(False):  # normal tensors: reset() zeroes them in any mode
            peer = torch.empty(W, lay.peer_bytes, dtype=torch.uint8, device=device)
            local = torch.empty(W, lay.local_bytes, dtype=torch.uint8, device=device)
        return cls(spec, device, "virtual", 0, list(peer), list(local),
                   [p.data_ptr() for p in peer], keepalive=(peer, local))

    @classmethod
    def from_process_group(cls, spec: PeerSpec, group=None, device=None,
                           transport: str = "auto") -> "PeerBuffers":
        """One rank per process over `group` (a collective: every rank of the group calls it).

        transport: "symm_mem" (torch symmetric memory rendezvous), "ipc" (CUDA IPC handles via
        all_gather_object) or "auto" (symm_mem; when it fails on any rank, every rank uses
        ipc). Every step that can fail on one rank (allocating both heaps; the rendezvous;
        exporting and opening IPC handles) is followed by a bounded gather of every rank's
        outcome, and the next step (a collective) runs only when it worked on every rank: so
        all ranks take the same path and a failure raises on every rank together. The
        allocation and the gathers run with `device` as the current CUDA device (NCCL object
        gathers use it).

        Raises:
            ValueError: group size != spec.world_size; an unknown transport.
            PeerSetupError: a step failed on some rank ("symm_mem", or "auto" once on ipc);
                raised on every rank, naming the failing ranks and their errors.
            CollectiveError: a peer did not join a gather within the group timeout.
        """
        import torch.distributed as dist
        if transport not in ("auto", "symm_mem", "ipc"):
            raise ValueError(f"transport must be 'auto', 'symm_mem' or 'ipc', got {transport!r}")
        group = group if group is not None else dist.group.WORLD
        rank, W = dist.get_rank(group), dist.get_world_size(group)
        if W != spec.world_size:
            raise ValueError(f"group has {W} ranks, spec.world_size={spec.world_size}")
        device = torch.device("cuda" if device is None else device)
        if device.type == "cuda" and device.index is None:  # by number: peers' handles open on it
            device = torch.device("cuda", torch.cuda.current_device())
        lay = HeapLayout.of(spec)

        def heaps(empty):  # (local heap, peer heap from `empty`; normal tensors, as in virtual)
            with torch.inference_mode(False):
                return (torch.empty(lay.local_bytes, dtype=torch.uint8, device=device),
                        empty(lay.peer_bytes, dtype=torch.uint8, device=device))

        with _on_device(device):
            if transport in ("symm_mem", "auto"):
                def symm_heaps():
                    import torch.distributed._symmetric_memory as symm_mem
                    return symm_mem, *heaps(symm_mem.empty)

                got, failed = _on_every_rank(group, "symm_mem heaps", symm_heaps)
                if not failed:  # the rendezvous, a collective, only once every rank has heaps
                    symm_mem, local, peer = got
                    hdl, failed = _on_every_rank(group, "symm_mem rendezvous",
                                                 lambda: symm_mem.rendezvous(peer, group))
                    if not failed:
                        return cls(spec, device, "symm_mem", rank, [peer], [local],
                                   list(hdl.buffer_ptrs), (peer, hdl), group=group)
                if transport == "symm_mem":
                    raise PeerSetupError("torch symmetric memory", failed)
                got = local = peer = hdl = None  # free the symm_mem heaps before the ipc ones
            from torch.multiprocessing.reductions import reduce_tensor

            def ipc_heaps():
                local, peer = heaps(torch.empty)
                return local, peer, reduce_tensor(peer)

            got, failed = _on_every_rank(group, "ipc heaps", ipc_heaps)
            if failed:  # no rank exchanges handles unless every rank has its heaps
                raise PeerSetupError("CUDA IPC heaps", failed)
            local, peer, handle = got
            handles = all_gather_object(handle, group=group, step="peer buffers: ipc handles")
            mapped, failed = _on_every_rank(group, "ipc open", lambda: [
                peer if r == rank else _open_ipc_handle(h, device) for r, h in enumerate(handles)])
            if failed:
                raise PeerSetupError("opening the peers' CUDA IPC handles", failed)
            return cls(spec, device, "ipc", rank, [peer], [local], [m.data_ptr() for m in mapped],
                       (peer, mapped), group=group)

    # ---- views -----------------------------------------------------------------------------
    def view(self, f: int, local_rank: int = 0) -> torch.Tensor:
        """Typed view of field f of local rank `local_rank` (0 <= local_rank < n_local)."""
        heap = (self.peer_heaps if f in PEER_FIELDS else self.local_heaps)[local_rank]
        shape, dt = self.layout.shapes[f]
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        off = self.layout.offsets[f]
        return heap[off:off + nbytes].view(dt).view(shape)

    def expert_x(self, local_rank: int = 0) -> torch.Tensor:
        """[xout_rows, H] expert-major rows of the last dispatch (valid until the next one)."""
        return self.view(F_XOUT, local_rank)

    def expert_offsets(self, local_rank: int = 0) -> torch.Tensor:
        """int32 [E_local + 1] offsets of the last dispatch (a view; clone to keep)."""
        return self.view(F_OFFS, local_rank)

    # ---- checks ------------------------------------------------------------------------------
    def check_tokens(self, tokens_per_rank: Sequence[int]) -> None:
        """Raise ValueError naming max_tokens_per_rank when a rank passes more tokens."""
        if len(tokens_per_rank) != self.n_local:
            raise ValueError(f"expected token counts for {self.n_local} local rank(s), got "
                             f"{len(tokens_per_rank)}")
        T = self.spec.max_tokens_per_rank
        for i, t in enumerate(tokens_per_rank):
            if t < 0 or t > T:
                raise ValueError(f"rank {self.rank0 + i} passes {t} tokens; the peer buffers were "
                                 f"sized for max_tokens_per_rank={T} (0 <= T <= {T})")

    def check_usable(self) -> None:
        """RuntimeError when the buffers broke (reset() them) or inside a CUDA graph capture
        (`refuse_capture`): every multi-rank call checks this first, before any state changes."""
        if self.broken:
            raise RuntimeError(f"peer buffers unusable after an error ({self.broken}); call reset()")
        self.refuse_capture()

    def next_epoch(self) -> int:
        """Epoch of the next dispatch/combine pair: 1, 2, ..., EPOCH_LIMIT, then (after
        restart_epochs) 1 again."""
        if self.epoch + 1 > EPOCH_LIMIT:
            self.restart_epochs()
        self.epoch += 1
        return self.epoch

    def take_sig_epochs(self, n: int) -> int:
        """Reserve n consecutive barrier epochs (all <= EPOCH_LIMIT); returns the first."""
        if self.sig_epoch + n > EPOCH_LIMIT:
            self.restart_epochs()
        self.sig_epoch += n
        return self.sig_epoch - n + 1

    def refuse_capture(self) -> None:
        """RuntimeError inside a CUDA graph capture: every call passes its barrier epoch as a
        launch argument, so a replay would reuse it and pass every wait at once (flags already
        at that epoch), reading rows before the peers wrote them."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the multi-rank cute kernels cannot be captured in a CUDA graph "
                               "(each call's barrier epoch is a launch argument a replay would "
                               "reuse): call them eagerly")

    def restart_epochs(self) -> None:
        """Both epoch counters back to 0 with EPOCH_FIELDS zeroed on every rank; data fields
        (e.g. all-reduce inputs already written) are kept. Every rank calls it at the same call
        (the counters advance identically everywhere). Host-synchronous, two bounded gathers:
        no rank zeroes before every rank's kernels are done, none writes a flag before every
        owner zeroed. A dispatch not combined yet cannot be combined after it (its epoch's
        flags are gone: ep_combine refuses its handle as stale)."""
        self._quiesce("epoch restart (kernels done)")
        for r in range(self.n_local):
            for f in EPOCH_FIELDS:
                self.view(f, r).zero_()
        self._quiesce("epoch restart (zeroed)")
        self.epoch = 0
        self.sig_epoch = 0
        self._last_dispatch = None

    def _quiesce(self, step: str) -> None:
        """Wait for this rank's device work, then for every rank to get here (bounded gather)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            with _on_device(self.device):
                all_gather_object(None, group=self.group, step=f"peer buffers: {step}")

    def errors(self, also: Sequence[torch.Tensor] = ()) -> tuple[list[dict], list[int]]:
        """Error records of the local ranks ({rank, phase, phase_name, peer, expected, seen,
        apart_topology}: see ERR_APART), and the values of the int32 scalar tensors `also`
        read in the same device-to-host copy (one host sync in all)."""
        words = [self.view(F_ERR, i) for i in range(self.n_local)]
        flat = torch.cat([w.reshape(-1) for w in words] + [t.reshape(1) for t in also]).tolist()
        n = ERR_WORDS * self.n_local
        out = []
        for i in range(self.n_local):
            rec = flat[ERR_WORDS * i:ERR_WORDS * (i + 1)]
            ph, peer, exp, seen = rec[:4]
            if ph:
                out.append({"rank": self.rank0 + i, "phase": ph,
                            "phase_name": PHASES.get(ph, "unknown phase"), "peer": peer,
                            "expected": exp, "seen": seen, "apart_topology": rec[ERR_APART]})
        return out, flat[n:]

    def check_errors(self, what: str, also: Sequence[torch.Tensor] = ()) -> list[int]:
        """Raise (and mark the buffers broken) if any local rank recorded an error:
        PeerDataError when a value was refused, else PeerTimeoutError. Returns the host values
        of the int32 scalar tensors `also`, read in the same copy as the error words."""
        errs, values = self.errors(also)
        if errs:
            self.broken = f"{what}: error on rank(s) {[e['rank'] for e in errs]}"
            data = any(e["phase"] >= DATA_ERROR for e in errs)
            raise (PeerDataError if data else PeerTimeoutError)(what, errs)
        return values

    def reset(self) -> None:
        """Zero every heap and restart epochs (host-synchronous; all ranks must reset together:
        a bounded collective; buffers shared by several topologies need ONE reset per rank).
        As restart_epochs: no rank zeroes before every rank's kernels are done (a late peer's
        kernel would write flags into a zeroed heap, which the next calls would take as
        fresh), none writes before every owner zeroed."""
        self._quiesce("reset (kernels done)")
        for h in self.peer_heaps + self.local_heaps:
            h.zero_()
        self._quiesce("reset")  # no peer may write into a heap before its owner zeroed it
        self.epoch = 0
        self.sig_epoch = 0
        self.broken = None
        self._last_dispatch = None

    def set_args(self, values: dict[int, Sequence[int]]) -> None:
        """Write per-call argument rows (F_ARG_*: one int64 per local rank) into the table.

        The kernels take ONLY the table as a tensor argument and reach every per-call array
        through these rows (the pattern the one-shot all-reduce proved on the H200). The
        device table is rewritten (one small host-to-device copy on the current stream,
        ordered after the kernels already queued there; from pageable memory, so the host
        waits for that stream) only when a value changed. Calls with the same tensors and
        sites copy nothing; a topology's calls copy every time (each carries a new dispatch
        number in its site word, and new activations), and read their error words after the
        launch, a host sync of their own."""
        new = self._host_table.clone()
        for f, vals in values.items():
            if f < NUM_HEAP_FIELDS or len(vals) != self.n_local:
                raise ValueError(f"set_args: field {f} needs {self.n_local} value(s)")
            new[f, self.rank0:self.rank0 + self.n_local] = torch.tensor(list(vals), dtype=torch.int64)
        if not torch.equal(new, self._host_table):
            self._host_table = new
            self.table.copy_(new)

    def launch(self, fn, *args) -> None:
        """Launch a compiled kernel on the table. With MOE_RUNTIME_SYNC_LAUNCH=1 the device is
        synchronized before and after (debug aid: rules out any ordering between the kernel
        and the torch work around it; costs a host sync per launch)."""
        sync = os.environ.get("MOE_RUNTIME_SYNC_LAUNCH") == "1" and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        fn(self.table, *args)
        if sync:
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        s = self.spec
        return (f"PeerBuffers({self.mode}, ranks {self.rank0}..{self.rank0 + self.n_local - 1} of "
                f"{s.world_size}, T_max={s.max_tokens_per_rank}, H={s.hidden}, k={s.top_k}, "
                f"E={s.num_experts}, peer heap {self.layout.peer_bytes / 2**20:.1f} MiB, local "
                f"heap {self.layout.local_bytes / 2**20:.1f} MiB per rank)")
