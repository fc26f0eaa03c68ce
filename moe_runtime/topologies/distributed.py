"""Topologies over a torch.distributed process group: the shared bases and the DP protocol.

`GroupTopology` binds a topology to a group (rank, world size, collective timeout, backend).
`DataParallelTopology` is the all-to-all protocol that `dp_nvlink` and `dp_p2p` share as their
reference backend. `PeerBufferTopology` adds the cute backend of `tp` and `dp_nvlink`: the
peer buffers, created on the first CUDA call, and the "auto" rule.

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
                 (weighted sum over k in fp32, j = 0..k-1, cast to expert_y.dtype): the local
                 topology's arithmetic, so results equal it up to the experts' own rounding,
                 which may depend on how many rows a GEMM gets (CPU fp32 blocking: ~1e-6).
Fixed-capacity protocol (inside `fixed_capacity(topologies, tokens)`, which the engine's decode
graphs enter): every rank sends every peer a block of C = tokens * min(k, E_local) rows, each
carrying its local expert id (-1 unused), in one equal-split all-to-all; combine returns them:
more bytes at decode sizes, but no split size read on the host, so a CUDA graph capture records
the calls. It exchanges no site or shape (the caller keeps the ranks in step); combine's blocks
end with a status row, read on the host outside a capture (CallAbandoned, as above).

Every collective is bounded by the group's timeout (or `timeout_s`); a rank that fails input
validation raises before its first collective, so its peers raise CollectiveError on timeout.
Ranks out of step (one rank went on after an error, so its calls pair with other layers' or
calls' on its peers) are caught where a header is exchanged. Every call has a site: the
topology's id on its group (0, 1, ... in construction order per group), the calling layer's id
on the topology (Topology.register_layer, in construction order; one topology may serve many
layers) and the topology's dispatch number. The dp counts exchange and tp's combine check carry
the site, and so do the cute backends' kernels (a dp dispatch sends its site word to every
peer with its counts, a tp all-reduce lets every peer read it; each rank compares the peers'
words with its own: peer_buffers.site_word). A mismatch raises ValueError on every rank
instead of exchanging rows of another layer. The ranks
stay apart: every topology of the group up to the highest id in the failing exchange then
refuses calls, on every rank alike; build new topologies and layers. Every rank must build its
topologies and layers in the same order (SPMD code, swap_moe_layers and the engine do; a copy,
by copy.deepcopy or pickle, takes a new id as it is made; a rank that built one topology more
than its peers stays apart on that group). A default group destroyed and initialized again is
another group: topologies built before refuse calls. Ranks that meet in different collectives
(e.g. one at a topology's first-call check, another in a dp counts exchange) time out instead
(CollectiveError). Not caught: under dp, a combine or a dispatch made by one rank only
(combining one result twice is allowed when every rank does it, so there is no local sign: its
row exchange meets the peers' next collective and gloo / NCCL abort the process on the size
mismatch); a cute tp call with T = 0 (it launches nothing: the next call with tokens compares
the sites).
A rank that raised between a dispatch and its combine (e.g. in the experts, or in combine's
checks) takes its part in that combine without a result (`abandon`; MoELayer does it, and
also dispatches no tokens and abandons for a forward that raised before its dispatch): a
header of kind "abandoned" (tp) or a status row per peer (dp), so its peers raise
RuntimeError naming it and every rank stays in step (a retry works). On the cute backends it
marks the peer buffers broken instead (the peers' kernels time out; every rank then calls
peer_buffers.reset()). A collective that failed or was interrupted leaves the ranks' state
unknown: that topology then refuses further calls (RuntimeError, no collective).

Backends (`resolve_group_backend`): every topology here has "reference" (the torch.distributed
protocol above for dp, an all-reduce for tp). `tp` and `dp_nvlink` also have "cute"
(`PeerBufferTopology`): the multi-rank CuTeDSL kernels (kernels/allreduce.py,
kernels/ep_dispatch.py, kernels/ep_combine.py) over peer buffers (comm/peer_buffers.py) that the
first CUDA call creates. `dp_p2p` (NVSHMEM) has no cute backend yet: "cute" raises
BackendNotImplementedError there.

"auto" for tp / dp_nvlink stays unresolved at construction (even on a rank without CUDA or
CuTeDSL, so that every rank joins the same first-call collective) and is "reference" unless the
cute backend is safe, decided ONCE, at the first call with CUDA tensors, from facts every rank
reports (a collective: `auto_picks_cute`): at least 2 ranks, CuTeDSL importable on every rank,
buffers possible for the call (bf16/fp16, rows a multiple of 16 bytes, timeout_s within the
kernels' limit), one host, every rank on its own GPU, and every rank's process seeing every other
rank's GPU with CUDA peer access (so e.g. Ray actors that each see one GPU stay on "reference"),
and then the peer buffers made on every rank (a failure anywhere settles every rank on
"reference", the reason naming the failing ranks). Before it is settled, calls with
CPU tensors take the reference path and settle nothing; once settled on cute, "auto" behaves
as "cute" (CPU tensors raise ValueError), except above max_tokens_per_rank: there `tp` (every
rank holds the same tokens, so all ranks take the same path) runs that call on the reference
path, while `dp_nvlink` raises (its ranks differ in T, so they could not agree on a per-call
fallback without another collective).

Peer buffers are shared: every MoE layer builds its own topology, and all topologies of one
process group with the same PeerSpec, device and transport use ONE PeerBuffers (`_SHARED`, a
weak registry: the buffers live while a topology holds them). Layers run one after another and
the epoch protocol allows back-to-back calls from different topologies, but a dispatch result
must be combined before the next dispatch on the same buffers (as MoELayer does); combining an
older one raises ValueError (the stale-handle check of ep_combine). A device error breaks the
buffers for every topology sharing them; `peer_buffers.reset()` (a collective, once per rank)
repairs them for all.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import socket
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import kernels
from ..comm import (all_gather_object, all_reduce_sum, all_to_all_single, group_rank_size,
                    stream_capturing)
from ..comm.groups import CollectiveError, check_timeout_s
from ..kernels import reference
from .base import CallAbandoned, DispatchResult, Topology

log = logging.getLogger("moe_runtime")

TOPOLOGY_BACKENDS = ("reference", "cute", "auto")
CUTE_TOPOLOGIES = ("tp", "dp_nvlink")      # the multi-rank topologies with a cute backend
TRANSPORTS = ("auto", "symm_mem", "ipc")   # PeerBuffers.from_process_group(transport=...)
_TRANSPORT_NAMES = ("-",) + TRANSPORTS  # (the topology check's codes; "-": no peer buffers)
#: Peer buffer sizing default: tokens one rank passes in one call (tp: the replicated batch).
DEFAULT_MAX_TOKENS_PER_RANK = 1024
#: Device type of the tensors the cute backends take ("cpu" only in the CPU tests that run the
#: host code with the compiled kernels replaced by recorders).
CUTE_DEVICE_TYPE = "cuda"

#: The PeerBuffers of the live topologies, keyed by (group, PeerSpec, device, transport).
_SHARED: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}


class BackendNotImplementedError(NotImplementedError, ValueError):
    """The requested backend exists in the design but is not implemented for this topology yet."""


def resolve_group_backend(topology: str, backend: str) -> str:
    """Construction-time backend of a multi-rank topology (rules: module docstring).

    Returns:
        "reference"; "cute" (tp / dp_nvlink, CUDA present and CuTeDSL importable); or "auto"
        for tp / dp_nvlink whatever this rank has: the first CUDA call settles it for every
        rank together (PeerBufferTopology), so a rank without CuTeDSL still joins that call's
        collective and reports it.

    Raises:
        ValueError: unknown backend name; "cute" without a CUDA device or without CuTeDSL.
        BackendNotImplementedError (a ValueError): "cute" for a topology without a cute
            backend (dp_p2p).
    """
    if backend not in TOPOLOGY_BACKENDS:
        raise ValueError(f"backend must be one of {TOPOLOGY_BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    if topology not in CUTE_TOPOLOGIES:
        if backend == "cute":
            raise BackendNotImplementedError(
                f"topology {topology!r}: backend 'cute' is not implemented yet (cute backends: "
                f"{', '.join(CUTE_TOPOLOGIES)}); use backend='reference' (or 'auto', which "
                "resolves to 'reference' here)")
        return "reference"
    if backend == "cute" and not (torch.cuda.is_available() and kernels.cute_available()):
        raise ValueError(
            f"topology {topology!r}: backend 'cute' needs a CUDA device and nvidia-cutlass-dsl; "
            f"got CUDA available={torch.cuda.is_available()}, cutlass importable="
            f"{kernels.cute_available()}; use backend='reference' or 'auto'")
    return backend


@functools.lru_cache(maxsize=None)
def _warn_alone(name: str) -> None:
    """Once per topology name: a multi-rank topology built before init_process_group runs as
    a world of one rank (every expert here); say so instead of silently doing that."""
    log.warning("moe_runtime: %s topology built while torch.distributed is not initialized: it "
                "is a world of one rank holding every expert (call init_process_group first "
                "for multi-rank runs)", name)


class GroupTopology(Topology):
    """A topology whose ranks are the members of a torch.distributed process group.

    Args:
        num_experts: E; rank r owns experts [r * E/W, (r + 1) * E/W).
        group: a ProcessGroup, or None for the default group (a world of one rank when
            torch.distributed is not initialized).
        align: per-expert segment alignment in rows (>= 1).
        backend: "reference", "cute" or "auto" (resolve_group_backend; `backend` holds the
            result, "auto" until a PeerBufferTopology's first CUDA call settles it).
        timeout_s: bound on each collective call in seconds (>= 0.001: comm.groups.
            check_timeout_s); None = the group's own timeout. A gloo collective also gives up
            at the group's timeout, so a larger timeout_s does not extend it there. The cute backend turns it into
            each device-side wait's poll count (kernels.peer_sync.wait_bounds: ~1.5x timeout_s
            on the H200; None = the kernels' default, 10 s).

    Raises:
        ValueError: unknown backend; "cute" without CUDA or CuTeDSL; num_experts % world_size
            != 0; align outside [1, 1024]; timeout_s below 0.001 s, NaN or infinite
            (TypeError: not a number).
        BackendNotImplementedError: backend "cute" for a topology without one (dp_p2p).
        RuntimeError: a group is given but torch.distributed is not initialized.
    """

    def __init__(self, num_experts: int, *, group=None, align: int = 1, backend: str = "auto",
                 timeout_s: Optional[float] = None):
        self.backend = resolve_group_backend(self.name, backend)
        self.timeout_s = check_timeout_s(timeout_s)
        rank, world_size = group_rank_size(group)
        if group is None and not (dist.is_available() and dist.is_initialized()):
            _warn_alone(self.name)  # (world_size is then 1)
        super().__init__(num_experts, rank=rank, world_size=world_size, align=align)
        self.group = group
        self._take_topology_id()

    def _take_topology_id(self) -> None:
        """This topology's id on its group (`_next_topology_id`), and the group it was taken
        on (a default group re-initialized later is another group: `_check_in_step`)."""
        key = _group_key(self.group) if self.world_size > 1 else None
        self.topology_id = _next_topology_id(self.group) if key is not None else 0
        self._id_group = weakref.ref(key) if key is not None else None

    def __setstate__(self, state: dict) -> None:
        """A copy (copy.deepcopy, pickle) takes a new id, in the order copies are made: with
        its original's it would pair with it silently when ranks ran the two in other orders."""
        self.__dict__.update(state)
        self._take_topology_id()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_id_group", None)  # (a weak reference: taken again by __setstate__)
        return state

    def _step(self, what: str) -> str:
        return f"{self.name}.{what}"

    def abandon(self, result: DispatchResult, error: BaseException) -> None:
        """Take this rank's part in the combine of `result` without a result (see the module
        docstring): the peers raise RuntimeError naming this rank, and every rank stays in
        step. On the cute backend, mark the peer buffers broken instead (its peers' kernels
        time out; every rank then calls peer_buffers.reset()), also inside a capture (the cute
        calls refuse one, on every rank). Otherwise inside a CUDA graph capture (which failed)
        nothing can be exchanged: this topology refuses further calls, and the peers' replays
        time out. If the release fails too, this topology refuses further calls
        (`_mark_out_of_step`)."""
        if self.world_size == 1 or result.handle.get("settled"):
            return
        result.handle["settled"] = True
        result.handle["abandoned"] = f"{type(error).__name__}: {error}"
        bufs = result.handle.get("peer_buffers")
        if bufs is not None:
            bufs.broken = bufs.broken or (f"rank {self.rank} left dispatch #{self.calls} without "
                                          f"its combine ({type(error).__name__}: {error})")
            return
        if stream_capturing():  # (a capture failed: nothing was exchanged, nor can be now)
            self._mark_out_of_step(error)
            return
        try:
            self._release_peers(result)
        except BaseException as e:  # (the peers still wait: this rank must not go on)
            self._mark_out_of_step(e)

    def _release_peers(self, result: DispatchResult) -> None:
        """The reference protocol's part of a combine that has no result (tp, dp)."""
        raise NotImplementedError

    def _dispatch_failed(self, error: BaseException) -> None:
        """Mark out of step when the failed dispatch had started exchanging (a collective
        failed or was interrupted, or an error after the dp counts exchange, e.g. an OOM: the
        peers wait in this call's row exchange or combine). Before any exchange the dispatch
        numbers catch a rank that goes on (tp's dispatch has none)."""
        if isinstance(error, (CollectiveError, KeyboardInterrupt, SystemExit)) or \
                self.__dict__.get("_exchanged"):
            self._mark_out_of_step(error)

    def _mark_out_of_step(self, error: BaseException) -> None:
        """The ranks' state is unknown after `error` on this rank (a failed or interrupted
        collective, or an error once an exchange had started): later calls raise RuntimeError
        without a collective (their peers time out). Not for the cute backend's device errors
        (PeerError: its buffers break until every rank calls peer_buffers.reset())."""
        from ..comm.peer_buffers import PeerError
        if isinstance(error, PeerError):
            return
        if self.world_size > 1 and not self.__dict__.get("_out_of_step"):
            self._out_of_step = (f"{type(error).__name__} in or after dispatch #{self.calls} on "
                                 f"this rank: {error}")

    def records_collectives(self) -> bool:
        """The reference backend over NCCL ("auto" settled on it: it stays unsettled until the
        first CUDA call). A CUDA graph capture records its collectives (comm.groups) and the
        checks that read the peers' answers on the host are skipped while capturing (tp's
        token check; the eager run before each capture made it) or absent (dp calls inside
        `fixed_capacity`, the only dp calls a capture may record). The cute backends read their
        kernels' error words after every call, so they do not."""
        return (self.world_size > 1 and self.backend == "reference"
                and dist.get_backend(self.group) == "nccl")

    def _check_in_step(self) -> None:
        why = self.__dict__.get("_out_of_step")
        key = _group_key(self.group) if self.world_size > 1 else None
        built_on = self.__dict__.get("_id_group")
        if not why and key is None and built_on is not None:
            why = "torch.distributed was shut down (destroy_process_group) since it was built"
        if (not why and self.world_size == 1 and self.group is None
                and _group_key(None) is not None and dist.get_world_size() > 1):
            why = (f"it was built before init_process_group, as a world of one rank; the default "
                   f"group now has {dist.get_world_size()} ranks")
        if not why and key is not None and built_on is not None and built_on() is not key:
            why = ("it was built on a default process group that has been destroyed and "
                   "initialized again since")
        if not why and key is not None:  # (topologies the ranks' apart calls reached)
            upto, why = _GROUPS_APART.get(key, (0, None))
            why = why if self.topology_id < upto else None
        if why:
            raise RuntimeError(f"{self.name} rank {self.rank}: this topology refuses calls, its "
                               f"ranks being out of step: {why}. {_REBUILD}")

    @property
    def calls(self) -> int:
        """Dispatch calls so far, those that failed validation included (each rank numbers its
        own: a rank that skipped or repeated a call is out of step)."""
        return self.__dict__.get("_calls", 0)

    def _count_call(self, layer: int) -> None:
        self._calls = self.calls + 1
        self._layer = layer

    @property
    def site(self) -> tuple[int, int, int]:
        """(topology_id, layer, dispatch number) of the latest dispatch: what the reference
        backends compare across ranks (module docstring)."""
        return (self.topology_id, self.__dict__.get("_layer", 0), self.calls)

    def _out_of_step_error(self, mine: str, theirs: str, ids: Sequence[int]) -> ValueError:
        """The ValueError that every rank raises when the ranks are at different calls (`ids`:
        the topology ids of the sites every rank saw, `_mark_apart`)."""
        why = f"the ranks are out of step: {mine}, {theirs}"
        self._mark_apart(why, ids)
        return ValueError(f"{self.name} rank {self.rank}: {why}; every rank must make the same "
                          f"calls in the same order. {_REBUILD}")

    def _mark_apart(self, why: str, ids: Sequence[int]) -> None:
        """The ranks paired calls of different sites (`site`), whose topology ids are `ids`
        (max(ids) is the same on every rank: each saw every rank's site): the order of calls on
        this group has diverged, so the topologies with an id up to max(ids) refuse further
        calls on every rank alike; topologies with larger ids (built later) work."""
        self._out_of_step = why
        key = _group_key(self.group)
        if key is not None:
            upto = max(_GROUPS_APART.get(key, (0, None))[0], max(ids) + 1)
            _GROUPS_APART[key] = (upto, f"{why} (topologies up to #{upto - 1} of this group)")

    def _before_dispatch(self, device: torch.device) -> None:
        """The first call checks that every rank built the same topology (`_check_same_topology`,
        a collective)."""
        self._check_in_step()
        self._exchanged = False  # (dp: set once its counts exchange starts)
        if not self.__dict__.get("_agreed"):
            self._check_same_topology(device)
            self._agreed = True

    def _before_combine(self) -> None:
        self._check_in_step()

    def _send_header(self, row: Sequence[int], device: torch.device, step: str) -> list[list[int]]:
        """Every rank's `row` (HEADER_WIDTH ints: kind (HEADER_KINDS), then per kind, see
        `_header_text`) through a fixed-size all-reduce (one size for every such check, so
        checks out of step meet each other, not a collective of another size)."""
        mine = torch.zeros(self.world_size, HEADER_WIDTH, dtype=torch.int64)
        mine[self.rank] = torch.tensor(list(row))
        return all_reduce_sum(mine.to(device), group=self.group, timeout_s=self.timeout_s,
                              step=self._step(step)).tolist()

    def _exchange_header(self, row: Sequence[int], device: torch.device, step: str) -> list[list[int]]:
        """`_send_header`, checked.

        Raises:
            CallAbandoned (a RuntimeError): on every rank but the one, when a rank left this
                call's dispatch without its combine (`abandon`).
            ValueError: on every rank, when another rank is at a check of another kind or a
                combine of another site (`site`; every topology built on the group so far then
                refuses calls).
        """
        every = self._send_header(row, device, step)
        other = _unpaired(row, every)  # (first: every rank then marks itself out of step)
        if other is not None:
            raise self._out_of_step_error(f"this rank is at {_header_text(every[self.rank])}",
                                          f"rank {other} at {_header_text(every[other])}",
                                          _header_topologies(every))
        gone = next((r for r, e in enumerate(every) if e[0] == HEADER_KINDS["abandoned"]
                     and row[0] == HEADER_KINDS["combine"]), None)
        if gone is not None:
            raise CallAbandoned(f"{self.name} rank {self.rank}: rank {gone} left "
                               f"{_site_text(*row[SITE:])} without its combine (it raised; see "
                               "its error): this call has no result")
        return every

    def _check_same_topology(self, device: torch.device) -> None:
        """Every rank's (topology, num_experts, backend, transport) through `_exchange_header`:
        ranks that split the experts differently would exchange rows of the wrong sizes (which
        aborts gloo / NCCL) or sum partial results of another split, and ranks of other backends
        or transports would wait in different collectives until the group's timeout.

        Raises:
            ValueError: on every rank, naming each rank's four values.
        """
        row = (HEADER_KINDS["topology"], _TOPOLOGY_CODES.get(self.name, len(_TOPOLOGY_CODES)),
               self.num_experts, TOPOLOGY_BACKENDS.index(self.backend),
               _TRANSPORT_NAMES.index("-" if self.backend == "reference"  # (no peer buffers)
                                      else self.__dict__.get("transport", "-")))
        every = self._exchange_header(row + (0,) * (HEADER_WIDTH - len(row)), device,
                                      "topology check")
        if any(r != every[self.rank] for r in every):
            raise ValueError(f"{self.name} rank {self.rank}: every rank must build the same "
                             "topology; (topology, num_experts, backend, transport) per rank: "
                             f"{[_topology_values(e) for e in every]}")


HEADER_KINDS = {"topology": 1, "combine": 2, "abandoned": 3}  # _send_header's first column
HEADER_WIDTH = 8  # kind, 4 values of the kind, then the call's site (`_header_text`)
SITE = HEADER_WIDTH - 3  # first column of the site: topology id, layer, dispatch number

#: per process group, the multi-rank topologies built on it so far (their ids: GroupTopology)
_GROUP_TOPOLOGIES: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


#: process groups whose ranks went out of step (GroupTopology._mark_apart): (topologies built
#: on the group by then, why)
_GROUPS_APART: "weakref.WeakKeyDictionary[Any, tuple[int, str]]" = weakref.WeakKeyDictionary()


def _group_key(group):
    """The ProcessGroup that `group` names (None: the default one), or None without one."""
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return group


def _next_topology_id(group) -> int:
    """The id of a new topology on `group` (None: the default group): 0, 1, 2, ... in
    construction order per group, which is the same on every rank when every rank builds its
    topologies (and layers) in the same order, as SPMD code, swap_moe_layers and the engine do."""
    key = _group_key(group)
    if key is None:
        return 0
    n = _GROUP_TOPOLOGIES.get(key, 0)
    _GROUP_TOPOLOGIES[key] = n + 1
    return n


def _site_text(topology: int, layer: int, call: int) -> str:
    return f"dispatch #{call} of layer {layer} of topology #{topology}"


_REBUILD = ("Build new topologies and layers, in the same order on every rank, to go on (on a "
            "new process group if the ranks built different numbers of topologies on this one)")


def _header_topologies(every: Sequence[Sequence[int]]) -> list[int]:
    """The topology ids in the combine / abandoned headers of `every` (0 for other kinds)."""
    pairs = (HEADER_KINDS["combine"], HEADER_KINDS["abandoned"])
    return [e[SITE] if e[0] in pairs else 0 for e in every]
_TOPOLOGY_CODES = {"tp": 0, "dp_nvlink": 1, "dp_p2p": 2}


def _topology_name(code: int) -> str:
    names = {c: n for n, c in _TOPOLOGY_CODES.items()}
    return names.get(code, f"another topology (code {code})")


def _header_text(row: Sequence[int]) -> str:
    """A header row in words: [topology, code, num_experts, backend, transport, 0...] or
    [combine / abandoned, T, H, top_k, dtype code, topology id, layer, dispatch number]."""
    kind, a, b, c, d = row[:SITE]
    if kind == HEADER_KINDS["topology"]:
        return "the first call's topology check ({}, {} experts, backend {}, transport {})".format(
            *_topology_values(row))
    if kind in (HEADER_KINDS["combine"], HEADER_KINDS["abandoned"]):
        what = "combine" if kind == HEADER_KINDS["combine"] else "abandoned combine"
        return (f"the {what} of {_site_text(*row[SITE:])} (T={a}, H={b}, k={c}, "
                f"{_DTYPES[d] if 0 <= d < len(_DTYPES) else d})")
    return f"an unknown check {list(row)}"


def _topology_values(row: Sequence[int]) -> tuple:
    """(topology, num_experts, backend, transport) of a topology check's header row."""
    pick = lambda names, i: names[i] if 0 <= i < len(names) else i  # noqa: E731
    return (_topology_name(row[1]), row[2], pick(TOPOLOGY_BACKENDS, row[3]),
            pick(_TRANSPORT_NAMES, row[4]))


def _unpaired(row: Sequence[int], every: Sequence[Sequence[int]]) -> Optional[int]:
    """The first rank whose header cannot pair with `row` (another check, or a combine /
    abandoned header of another site), or None."""
    pairs = (HEADER_KINDS["combine"], HEADER_KINDS["abandoned"])
    for r, e in enumerate(every):
        if row[0] in pairs:
            if e[0] not in pairs or list(e[SITE:]) != list(row[SITE:]):
                return r
        elif e[0] != row[0]:
            return r
    return None


def _id_column(hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    """(first column, row width) of a fixed-capacity dispatch row of `hidden` elements of
    `dtype` followed by one int32 expert id: the id starts at the first 4-byte boundary past
    the row, so a view of columns [first column:] as int32 is legal."""
    per_id = max(1, 4 // dtype.itemsize)
    col = -(-hidden // per_id) * per_id
    return col, col + per_id


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
        if self.__dict__.get("fixed_tokens") is not None:
            return self._dispatch_fixed(x, topk_ids, topk_weights, self.fixed_tokens)
        T, k = topk_ids.shape
        W, E_local = self.world_size, self.num_local_experts
        flat = topk_ids.flatten().long()
        order = torch.sort(flat, stable=True).indices
        send_counts = torch.bincount(flat, minlength=self.num_experts)
        # (hidden, dtype) ride along with the counts: rows of another size or dtype would make
        # the row all-to-all abort the process inside gloo/NCCL instead of raising; so does
        # the dispatch number: a peer at another call (out of step) would send its rows to
        # another layer's experts.
        site = self.site
        meta = torch.tensor([x.shape[1], _DTYPE_CODES[x.dtype], *site], device=x.device)
        send = torch.cat([send_counts.view(W, E_local), meta.expand(W, 5)], 1).flatten()
        recv = torch.empty_like(send)
        self._exchanged = True
        all_to_all_single(recv, send, group=self.group,
                          step=self._step("dispatch counts"), timeout_s=self.timeout_s)
        recv = recv.view(W, E_local + 5)
        peers_meta = recv[:, E_local:].tolist()  # (one host read for both checks)
        if any(tuple(m[2:]) != site for m in peers_meta):
            raise self._out_of_step_error(
                f"this rank is at the {_site_text(*site)}",
                f"the ranks at {[_site_text(*m[2:]) for m in peers_meta]}",
                [m[2] for m in peers_meta])
        mine = [x.shape[1], _DTYPE_CODES[x.dtype]]
        if any([h, d] != mine for h, d, *_ in peers_meta):
            raise ValueError(
                f"{self.name} rank {self.rank}: every rank must dispatch rows of the same hidden "
                f"size and dtype; this rank has (H={x.shape[1]}, {x.dtype}), ranks sent "
                f"{[(h, _DTYPES[d]) for h, d, *_ in peers_meta]}")
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
        # combine's all-to-all sends each source rank its rows and then one status row: the
        # positions, computed here where the splits are on the host already (one copy)
        send_n, back_n = [n + 1 for n in recv_splits], [n + 1 for n in send_splits]
        starts = torch.tensor([0] + send_n[:-1]).cumsum(0)
        row_pos = torch.cat([torch.arange(n) + s for n, s in zip(recv_splits, starts.tolist())])
        back_status = torch.tensor(back_n).cumsum(0) - 1
        dest = torch.bucketize(torch.arange(T * k), torch.tensor(send_splits).cumsum(0), right=True)
        pos = torch.cat([row_pos, starts + torch.tensor(recv_splits), back_status, dest]).to(x.device)
        row_pos, send_status, back_status, dest = pos.split([len(row_pos), W, W, T * k])
        token_slot = torch.empty(T * k, dtype=torch.long, device=x.device)
        token_slot[order] = torch.arange(T * k, device=x.device) + dest  # (past the status rows)
        return DispatchResult(expert_x, offsets, {
            "recv_slot": recv_slot.view(-1).long(), "send_splits": send_splits,
            "recv_splits": recv_splits, "token_slot": token_slot.view(T, k).to(torch.int32),
            "topk_weights": topk_weights, "site": site, "row_pos": row_pos,
            "send_status": send_status, "back_status": back_status})

    def _dispatch_fixed(self, x, topk_ids, topk_weights, tokens: int) -> DispatchResult:
        """The fixed-capacity protocol (`fixed_capacity`): every rank sends every peer a block
        of C = tokens * min(k, E_local) rows, whatever its routing, in one all-to-all of equal
        splits; each row carries its local expert id (-1: an unused row) as an int32 in extra
        columns past H (`_id_column`), so rows and ids travel together. Combine returns the
        blocks the same way. No size is read on the host, so a CUDA graph capture can record
        the call. Nothing is compared across ranks before the rows are exchanged (no site or
        shape exchange: the caller keeps the ranks in step); combine's blocks end with a status
        row (`_combine_fixed`). Within a block, rows are in (t, j) order."""
        T, k = topk_ids.shape
        if T > tokens:
            raise ValueError(f"{self.name} rank {self.rank}: {T} tokens in a call of at most "
                             f"{tokens} (fixed_capacity)")
        W, E_local, dev, H = self.world_size, self.num_local_experts, x.device, x.shape[1]
        C = tokens * min(k, E_local)
        flat = topk_ids.flatten().long()
        dest = flat // E_local
        seen = torch.zeros(T * k, W, dtype=torch.long, device=dev).scatter_(1, dest[:, None], 1)
        pos = seen.cumsum(0).gather(1, dest[:, None]).squeeze(1) - 1  # (t, j) order per peer
        # (a pair past C, possible only with an id repeated within a token, is dropped)
        kept = pos < C
        at = torch.where(kept, dest * C + pos, W * C)  # row W * C: dropped pairs
        token_slot = torch.where(kept, dest * (C + 1) + pos, -1)  # (combine: C + 1 per block)
        col, width = _id_column(H, x.dtype)
        send = x.new_zeros(W * C + 1, width)
        ids = send[:, col:].view(torch.int32)
        ids.fill_(-1)
        send[at, :H] = x[torch.arange(T * k, device=dev) // k]
        ids[at, 0] = (flat % E_local).to(torch.int32)
        recv = torch.empty_like(send[:-1])
        self._exchanged = True
        all_to_all_single(recv, send[:-1], group=self.group,
                          step=self._step("dispatch rows and expert ids (fixed capacity)"),
                          timeout_s=self.timeout_s)
        expert_x, offsets, recv_slot = reference.dispatch(
            recv[:, :H], recv[:, col:].view(torch.int32)[:, :1], expert_start=0,
            num_local_experts=E_local, align=self.align)
        return DispatchResult(expert_x, offsets, {
            "fixed": C, "site": self.site, "recv_slot": recv_slot.view(-1).long(),
            "token_slot": token_slot.view(T, k).to(torch.int32), "topk_weights": topk_weights},
            expected_rows=tokens * k + E_local * (self.align - 1))

    def _combine_fixed(self, expert_y, h: dict, release: bool = False) -> torch.Tensor:
        """The fixed-capacity combine (`_dispatch_fixed`): each peer's block of C rows back,
        then one status row (0, or 1 with `release`: this rank abandons the call and sends
        zeros). Outside a CUDA graph capture the W statuses are read on the host (CallAbandoned
        naming the ranks that abandoned); a capture records no such check."""
        W, C, H = self.world_size, h["fixed"], expert_y.shape[1]
        slot = h["recv_slot"]
        send = expert_y.new_zeros(W, C + 1, H)
        if release:
            send[:, C] = 1.0
        else:
            rows = expert_y[slot.clamp(min=0)]
            send[:, :C] = torch.where((slot >= 0)[:, None], rows, torch.zeros_like(rows)).view(W, C, H)
        returned = torch.empty_like(send)
        h["settled"] = True
        all_to_all_single(returned.view(-1, H), send.view(-1, H), group=self.group,
                          step=self._step("combine rows (fixed capacity)"),
                          timeout_s=self.timeout_s)
        if not stream_capturing():
            gone = [r for r, v in enumerate(returned[:, C, 0].tolist()) if v != 0]
            if gone and not release:
                raise CallAbandoned(f"{self.name} rank {self.rank}: rank(s) {gone} left "
                                    f"{_site_text(*h['site'])} without its combine (they raised; "
                                    "see their errors): this call has no result")
        return reference.combine(returned.view(-1, H), h["token_slot"], h["topk_weights"])

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        if h.get("fixed"):
            return self._combine_fixed(expert_y, h)
        send = expert_y.new_empty(sum(h["recv_splits"]) + self.world_size, expert_y.shape[1])
        send[h["row_pos"]] = expert_y[h["recv_slot"]]
        returned, gone = self._return_rows(send, h, status=0)
        if gone:
            raise CallAbandoned(f"{self.name} rank {self.rank}: rank(s) {gone} left "
                                f"{_site_text(*h['site'])} without its combine (they raised; "
                                "see their errors): this call has no result")
        return reference.combine(returned, h["token_slot"], h["topk_weights"])

    def _release_peers(self, result: DispatchResult) -> None:
        ex, h = result.expert_x, result.handle
        if h.get("fixed"):
            self._combine_fixed(ex, h, release=True)
            return
        self._return_rows(ex.new_zeros(sum(h["recv_splits"]) + self.world_size, ex.shape[1]), h,
                          status=1)

    def _return_rows(self, send: torch.Tensor, h: dict, status: int) -> tuple[torch.Tensor, list[int]]:
        """The combine's all-to-all: `send` holds, per source rank, the rows it sent and one
        status row (written here: 0 rows, 1 this rank has no result, `abandon`). Returns (the
        rows this rank gets back, each peer's part followed by its status row: token_slot
        indexes them; the ranks whose status was 1), a host read of W values."""
        send[h["send_status"]] = float(status)
        back = [n + 1 for n in h["send_splits"]]
        returned = send.new_empty(sum(back), send.shape[1])
        h["settled"] = True  # (an error before here releases the peers: Topology.combine)
        all_to_all_single(returned, send, output_split_sizes=back,
                          input_split_sizes=[n + 1 for n in h["recv_splits"]], group=self.group,
                          step=self._step("combine rows"), timeout_s=self.timeout_s)
        statuses = returned[h["back_status"], 0].tolist()
        return returned, [r for r, v in enumerate(statuses) if v != 0]


@contextlib.contextmanager
def fixed_capacity(topologies: Sequence[Topology], tokens: int):
    """Inside: the data-parallel topologies among `topologies` run their calls that take the
    reference protocol (backend "reference", or "auto" where it takes that path) with the
    fixed-capacity protocol (DataParallelTopology._dispatch_fixed:
    blocks of tokens * min(k, E_local) rows to every peer, no split size read on the host;
    combine reads its status rows only outside a capture),
    each call of at most `tokens` tokens (ValueError above), so that a CUDA graph capture can
    record them (the engine's decode step under dp_*, engine/decode_graph.py). Every rank must
    enter it with the same `tokens` around the same calls (the ranks' sites are not compared
    inside it); the other topologies, and the cute backend's calls, are left alone. Nested, the
    inner `tokens` applies inside the inner block and the outer one again after it.

    Raises:
        ValueError: tokens not an int >= 1.
        TypeError: an element of `topologies` that is not a Topology.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    topologies = list(topologies)  # (an iterator is walked once)
    bad = [t for t in topologies if not isinstance(t, Topology)]
    if bad:
        raise TypeError(f"fixed_capacity takes topologies, got {bad[0]!r}")
    dp = [t for t in topologies if isinstance(t, DataParallelTopology)]
    outer = [t.__dict__.get("fixed_tokens") for t in dp]  # (nested: restored on the way out)
    for t in dp:
        t.fixed_tokens = tokens
    try:
        yield
    finally:
        for t, before in zip(dp, outer):
            t.fixed_tokens = before


# ------------------------------------------------------------------------- the cute backends
def rank_peer_facts(device: torch.device) -> dict[str, Any]:
    """This process's CUDA facts for `auto_picks_cute` (queries only): host, the GPU's UUID,
    the UUIDs of the GPUs visible here that `device` has CUDA peer access to."""
    idx = torch.device(device).index
    uuid = lambda d: str(torch.cuda.get_device_properties(d).uuid)  # noqa: E731
    return {"host": socket.gethostname(), "gpu": uuid(idx),
            "peers": [uuid(d) for d in range(torch.cuda.device_count())
                      if d != idx and torch.cuda.can_device_access_peer(idx, d)]}


def auto_picks_cute(facts: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """The "auto" rule (module docstring) over every rank's facts, in rank order: each a dict
    of rank_peer_facts plus "cute" (CuTeDSL importable there) and "unsupported" (why this rank
    cannot size peer buffers for the call, or None). Returns (cute?, one-line reason); every
    rank computes the same answer."""
    W = len(facts)
    if W < 2:
        return False, "one rank: nothing to exchange over peer buffers"
    for r, f in enumerate(facts):
        if not f["cute"]:
            return False, f"rank {r}: nvidia-cutlass-dsl is not importable"
        if f["unsupported"]:
            return False, f"rank {r}: no peer buffers for this call ({f['unsupported']})"
    hosts = sorted({f["host"] for f in facts})
    if len(hosts) > 1:
        return False, f"the ranks are on {len(hosts)} hosts {hosts}; peer buffers need one host"
    gpus = [f["gpu"] for f in facts]
    if len(set(gpus)) < W:
        return False, (f"{W} ranks share {len(set(gpus))} GPU(s); auto wants every rank on its "
                       "own GPU")
    for r, f in enumerate(facts):
        missing = [q for q, g in enumerate(gpus) if q != r and g not in f["peers"]]
        if missing:
            return False, (f"rank {r} has no CUDA peer access to the GPUs of ranks {missing} "
                           "(not visible in its process, or no P2P)")
    return True, f"{W} ranks on {W} GPUs of one host with CUDA peer access"


class PeerBufferTopology(GroupTopology):
    """A GroupTopology with a `cute` backend: multi-rank CuTeDSL kernels over peer buffers
    (comm/peer_buffers.py). The shared base of `tp` and `dp_nvlink`.

    Args (besides GroupTopology's):
        max_tokens_per_rank: the most tokens one rank passes to one dispatch (tp: the
            replicated batch); sizes the peer buffers (PeerSpec: dp_nvlink holds about
            W * max_tokens_per_rank * min(k, E_local) rows of H per rank twice, tp two
            [max_tokens_per_rank, H] buffers). Default DEFAULT_MAX_TOKENS_PER_RANK (1024).
            It also fixes dp_nvlink's dispatch mode: the one-launch decode dispatch only when
            max_tokens_per_rank <= ep_dispatch.DECODE_MAX_TOKENS (128), else the 4-launch
            prefill dispatch on every call (so the default always uses prefill).
        transport: how each rank maps its peers' buffers: "auto" (torch symmetric memory, else
            CUDA IPC), "symm_mem" or "ipc" (PeerBuffers.from_process_group).

    The first call with CUDA tensors (backend "cute", or "auto" not yet settled) is a
    collective: every rank reports the call's shape (H, dtype, k, the constructor's sizes and
    transport and the backend asked for; they must agree, else ValueError on every rank),
    whether the call can have peer buffers (if not, backend "cute" raises on every rank, naming
    the first such rank) and, for "auto", its peer facts; "auto" settles on "reference" when
    auto_picks_cute says no. Otherwise the ranks reuse the buffers an earlier topology of the
    same group, PeerSpec, device and transport made (when every rank still holds them: the
    module docstring says how they are shared), or every rank allocates new ones and exchanges
    their addresses (PeerBuffers.from_process_group; a world of one rank: PeerBuffers.virtual).
    When that fails on any rank (PeerSetupError, raised on every rank together), "cute" raises
    it on every rank and "auto" settles every rank on "reference" (logged as a warning); else
    "auto" settles on "cute". The reason "auto" settled is kept in `backend_reason`.
    EVERY RANK MUST MAKE THE SAME CALLS, in the same order: each dispatch and combine is a
    collective whose kernels wait for every peer; and a dispatch must be combined before the
    next dispatch of any topology sharing the buffers.

    Every later call checks, before anything is launched: the same H, dtype and k as the first
    call and T <= max_tokens_per_rank (ValueError naming the limit), x on the buffers' device,
    buffers not broken by an earlier device error. A check that fails on one rank only raises
    there; the peers' kernels then time out (PeerTimeoutError). On the device, every dp
    dispatch and tp combine compares the ranks' sites (module docstring): ranks out of step
    raise ValueError on every rank, as on the reference backends; their buffers break, and the
    new topologies that the advice asks for make new ones (tp also compares T: PeerDataError).

    Device errors surface as raised by the kernels: PeerTimeoutError (a bounded wait gave up:
    names the rank, the phase and the peer) and PeerDataError (a value refused on the device,
    e.g. topk_ids outside [0, E) with check_values=False). After either, the buffers are
    unusable, for every topology sharing them, until every rank calls `peer_buffers.reset()`
    once (a collective).

    Attributes:
        peer_buffers: the PeerBuffers (None until the first cute call; shared, see above).
        backend_reason: why "auto" settled as it did (None before, or without "auto").

    Raises (construction): TypeError / ValueError for max_tokens_per_rank not an int >= 1 or
    an unknown transport; ValueError for backend "cute" with timeout_s above the kernels'
    limit (kernels.peer_sync.MAX_TIMEOUT_S); besides GroupTopology's.
    """

    all_to_all = True  # PeerSpec.all_to_all of this topology's buffers (tp: all-reduce only)
    # "auto" runs calls over max_tokens_per_rank on the reference path (tp: same T on every rank)
    auto_fallback_over_limit = False

    def __init__(self, num_experts: int, *, group=None, align: int = 1, backend: str = "auto",
                 timeout_s: Optional[float] = None,
                 max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
                 transport: str = "auto"):
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int):
            raise TypeError(f"max_tokens_per_rank must be an int, got "
                            f"{type(max_tokens_per_rank).__name__} {max_tokens_per_rank!r}")
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        super().__init__(num_experts, group=group, align=align, backend=backend,
                         timeout_s=timeout_s)
        if self.backend == "cute" and (why := self._kernel_timeout_refused()):
            raise ValueError(f"{self.name}, backend 'cute': {why}")
        self.max_tokens_per_rank = max_tokens_per_rank
        self.transport = transport
        self.peer_buffers = None
        self.backend_reason: Optional[str] = None
        self._asked_auto = self.backend == "auto"

    def max_tokens_per_call(self) -> float:
        """max_tokens_per_rank while a call may run on the peer buffers: backend "cute", or
        "auto" not (yet) settled on "reference" where calls above the limit do not fall back to
        it (auto_fallback_over_limit, tp's); else any number (math.inf)."""
        if self.backend == "reference" or (self._asked_auto and self.auto_fallback_over_limit):
            return math.inf
        return self.max_tokens_per_rank

    def _peer_buffers(self, x: torch.Tensor, topk_ids: torch.Tensor):
        """The PeerBuffers for this call, or None for the reference path (see the class
        docstring); creates them on the first cute call. Raises before anything is launched."""
        if self.backend == "reference":
            return None
        if x.device.type != CUTE_DEVICE_TYPE:
            if self.backend == "cute":
                raise ValueError(f"{self.name} rank {self.rank}: backend 'cute' needs "
                                 f"{CUTE_DEVICE_TYPE} tensors, got x on {x.device}")
            return None  # auto, not settled yet: CPU tensors take the reference path
        if self.peer_buffers is None:
            self._create_peer_buffers(x, topk_ids)
            if self.peer_buffers is None:  # auto settled on the reference
                return None
        if (self._asked_auto and self.auto_fallback_over_limit
                and x.shape[0] > self.max_tokens_per_rank):
            return None
        bufs, s = self.peer_buffers, self.peer_buffers.spec
        got = (x.shape[1], x.dtype, topk_ids.shape[1])
        if got != (s.hidden, s.dtype, s.top_k) or x.device != bufs.device:
            raise ValueError(
                f"{self.name} rank {self.rank}: the peer buffers were made for hidden={s.hidden}, "
                f"dtype={s.dtype}, top_k={s.top_k} on {bufs.device} by the first call; this call "
                f"has hidden={got[0]}, dtype={got[1]}, top_k={got[2]} on {x.device} (build "
                "another topology for another shape)")
        bufs.check_usable()
        bufs.check_tokens([x.shape[0]])
        return bufs

    def _create_peer_buffers(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        from ..comm.peer_buffers import PeerBuffers, PeerSetupError, PeerSpec, _on_device
        call = dict(world_size=self.world_size, max_tokens_per_rank=self.max_tokens_per_rank,
                    hidden=x.shape[1], top_k=topk_ids.shape[1], num_experts=self.num_experts,
                    dtype=x.dtype, align=self.align, all_to_all=self.all_to_all)
        try:
            spec, error = PeerSpec(**call), None
        except (TypeError, ValueError) as e:
            spec, error = None, e
        if spec is not None and kernels.cute_available():  # (the kernels' limits: top_k <= 32)
            from ..kernels import cute_ops
            why = cute_ops.rows_unsupported(x.shape[1], x.dtype, self.num_local_experts,
                                            topk_ids.shape[1])
            if why:
                spec, error = None, ValueError(why)
        key = (self.group, spec, x.device, self.transport)
        shared = None if spec is None else _SHARED.get(key)  # (held: the registry is weak)
        if shared is not None and shared.broken:  # (e.g. ranks out of step: new topologies)
            shared = None
        mine = {"call": call, "transport": self.transport, "backend": self.backend,
                "shared": shared is not None, "unsupported": error and str(error),
                "error_type": error and type(error).__name__}
        if self.backend == "auto":
            mine.update(rank_peer_facts(x.device), cute=kernels.cute_available())
            if mine["cute"] and not error:
                mine["unsupported"] = self._kernel_timeout_refused()
        with _on_device(x.device):  # NCCL object gathers use the current device
            facts = all_gather_object(mine, group=self.group, step=self._step("peer buffer setup"))
        failed = [(r, f) for r, f in enumerate(facts) if f["unsupported"]]
        if failed and self.backend == "cute":  # every rank raises, naming the first such rank
            r, f = failed[0]
            raise (TypeError if f["error_type"] == "TypeError" else ValueError)(
                f"{self.name} rank {r}, backend 'cute': {f['unsupported']}")
        calls = [dict(f["call"], transport=f["transport"], backend=f["backend"]) for f in facts]
        differ = [k for k in calls[0] if any(c[k] != calls[0][k] for c in calls)]
        if differ:
            raise ValueError(
                f"{self.name} rank {self.rank}: every rank must make the same calls; the first "
                "CUDA call differs across ranks in " + "; ".join(
                    f"{k}: " + ", ".join(f"rank {r} {c[k]}" for r, c in enumerate(calls))
                    for k in differ))
        if self.backend == "auto":
            ok, reason = auto_picks_cute(facts)
            if not ok:
                self._settle("reference", reason)
                return
        if all(f["shared"] for f in facts):  # made by an earlier topology on every rank: reuse
            bufs = shared
        else:
            try:
                bufs = _SHARED[key] = (
                    PeerBuffers.virtual(spec, x.device) if self.world_size == 1 else
                    PeerBuffers.from_process_group(spec, self.group, device=x.device,
                                                   transport=self.transport))
            except PeerSetupError as e:  # raised on every rank together
                if self.backend == "cute":
                    raise
                self._settle("reference", f"making the peer buffers failed: {e}", logging.WARNING)
                return
        self.peer_buffers = bufs
        if self.backend == "auto":
            self._settle("cute", reason)

    def _site_checked(self, site: tuple[int, int, int], call: Callable[[list[int]], Any]) -> Any:
        """call(sites), a kernel call of the call at `site` that sends this rank's site word
        (`sites`: [peer_buffers.site_word(*site)]) to its peers. A peer at another site
        (PeerDataError, E_OUT_OF_STEP) raises the reference backends' ValueError instead,
        and the topologies up to the highest id of the sites the call paired refuse further
        calls (`_out_of_step_error`; every rank saw every peer's site, so all agree on that
        id: peer_buffers.ERR_APART). The peer's site is read from its word, so its numbers
        are modulo peer_buffers.SITE_BITS."""
        from ..comm.peer_buffers import E_OUT_OF_STEP, PeerDataError, site_fields, site_word
        try:
            return call([site_word(*site)])
        except PeerDataError as e:
            apart = [r for r in e.errors if r["phase"] == E_OUT_OF_STEP]
            if not apart:
                raise
            peer, theirs = apart[0]["peer"], site_fields(apart[0]["seen"])
            upto = self._topology_id_of(max(r["apart_topology"] for r in apart))
            raise self._out_of_step_error(f"this rank is at the {_site_text(*site)}",
                                          f"rank {peer} at the {_site_text(*theirs)}",
                                          [upto]) from e

    def _topology_id_of(self, field: int) -> int:
        """The topology id whose site word field (its id modulo 2**SITE_BITS[0]) is `field`:
        the newest topology built on this group with that field (the same on every rank when
        every rank built the same topologies)."""
        from ..comm.peer_buffers import SITE_BITS
        key = _group_key(self.group)
        built = _GROUP_TOPOLOGIES.get(key, 0) if key is not None else 0
        newest = max(self.topology_id, built - 1)
        return newest - (newest - field) % (1 << SITE_BITS[0])

    def _settle(self, backend: str, reason: str, level: int = logging.INFO) -> None:
        """Settle "auto" on `backend` (every rank does, at the same call); log the reason."""
        self.backend, self.backend_reason = backend, reason
        log.log(level, "%s rank %d: backend auto -> %s: %s", self.name, self.rank, backend, reason)

    def _kernel_timeout_refused(self) -> Optional[str]:
        """Why the cute kernels refuse timeout_s (above kernels.peer_sync.MAX_TIMEOUT_S), else
        None. Reads the limit from the kernels (CuTeDSL) only when timeout_s is set."""
        if self.timeout_s is None:
            return None
        from ..kernels.peer_sync import MAX_TIMEOUT_S
        if self.timeout_s > MAX_TIMEOUT_S:
            return (f"timeout_s={self.timeout_s} is above the cute kernels' limit "
                    f"(kernels.peer_sync.MAX_TIMEOUT_S={MAX_TIMEOUT_S})")
        return None

    def _kernel_bounds(self) -> dict[str, float]:
        """timeout_s for the kernels' device waits (none given: the kernels' default)."""
        return {} if self.timeout_s is None else {"timeout_s": self.timeout_s}
