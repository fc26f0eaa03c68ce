"""The topology contract: move tokens between token owners and expert owners.

    result = topo.dispatch(x[T,H], topk_ids[T,k] int32, topk_weights[T,k] fp32)
    y[T,H] = topo.combine(expert_y[N,H], result)

A topology never computes experts. `expert_x` rows are grouped by local expert, expert e's rows
start at `expert_offsets[e]` (a multiple of `align`) and there are `counts` of them; rows past
`expert_offsets[-1]` and padding rows hold unspecified values.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class DispatchResult:
    """What dispatch returns and combine consumes.

    Attributes:
        expert_x: [N, H] rows in expert-major order (N >= expert_offsets[-1]).
        expert_offsets: int32 [E_local + 1] on x's device; segment starts, last = rows used.
        handle: backend state combine needs (slot maps, routing of rows back to ranks, ...).
        expected_rows: host int, the rows this rank expects expert_offsets[-1] to be (padding
            included), known without a host sync; the experts choose their kernels from it
            (Experts.forward) and nothing may depend on it for correctness. None: N, every
            row may be used (exact on the host, or no better estimate). `tp` sets it: its
            expert_x has capacity rows for every (token, j) pair of which ~1/W are this rank's.
    """

    expert_x: torch.Tensor
    expert_offsets: torch.Tensor
    handle: dict[str, Any] = field(default_factory=dict)
    expected_rows: Optional[int] = None


class CallAbandoned(RuntimeError):
    """A peer rank raised between this call's dispatch and its combine and took its part in
    the combine without a result (Topology.abandon): the call has no result on any rank, and
    the ranks are still in step (the next call works)."""


# The largest per-expert row alignment: the dispatch buffer holds E_local * (align - 1) rows of
# padding (kernels.reference.dispatch_capacity); grouped GEMM M tiles are 64-256 rows.
MAX_ALIGN = 1024


class Topology(abc.ABC):
    """Base class: rank/world bookkeeping, the even expert split, input validation.

    Args:
        num_experts: E, experts of the whole layer.
        rank, world_size: this rank and the number of ranks.
        align: pad each local expert's row segment start to a multiple of this (1..MAX_ALIGN).

    Raises:
        TypeError: num_experts or align not an int.
        ValueError: num_experts < 1, num_experts % world_size != 0, or align outside
            [1, MAX_ALIGN].
    """

    name: str = "base"

    def __init__(self, num_experts: int, *, rank: int = 0, world_size: int = 1, align: int = 1):
        for name, v in (("num_experts", num_experts), ("align", align)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if num_experts % world_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by world_size ({world_size}): "
                "experts are split evenly across ranks")
        if not 1 <= align <= MAX_ALIGN:
            raise ValueError(f"align must be in [1, {MAX_ALIGN}], got {align} (every local expert's "
                             "rows are padded up to a multiple of it: align = a grouped GEMM's M "
                             "tile, at most 256 rows)")
        self.num_experts = num_experts
        self.rank = rank
        self.world_size = world_size
        self.align = align
        self.num_local_experts = num_experts // world_size
        self.expert_start = rank * self.num_local_experts

    # -- the contract -------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 *, check_values: bool = True, layer: int = 0) -> DispatchResult:
        """Validate, then move token rows to their experts (see the module docstring).

        check_values=False skips the host read of the ids (what MoELayer does: its router's ids
        are valid by construction); the caller then guarantees ids in [0, E), distinct per
        token: other ids give unspecified results (picks dropped, or an error from a later step).
        layer: which of the layers sharing this topology calls (`register_layer`; MoELayer
        passes its own): the multi-rank reference backends compare it across ranks, so ranks
        at different layers of one shared topology raise instead of exchanging rows.

        Raises:
            TypeError: wrong dtypes (x float32/bf16/fp16; topk_ids int32; topk_weights float32).
            ValueError: wrong shapes or devices; a `layer` that is not an int >= 0; with
                check_values, expert ids outside [0, E) or repeated within a token (the check
                reads the ids on the host).
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be an int >= 0 (Topology.register_layer), got {layer!r}")
        self._count_call(layer)
        validate_routing(x, topk_ids, topk_weights, self.num_experts, check_values=check_values)
        self._before_dispatch(x.device)
        try:
            return self._dispatch(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous())
        except (ValueError, TypeError):
            raise  # (checks that raise on every rank, or before any collective)
        except BaseException as e:  # e.g. a collective failed: the ranks' state may be unknown
            self._dispatch_failed(e)
            raise

    def combine(self, expert_y: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        """Weighted sum over k back in token order: y [T, H] in expert_y.dtype.

        Raises:
            ValueError: expert_y has fewer rows than dispatch produced, another hidden size or
                another device. TypeError: another dtype than expert_x.
        """
        if result.handle.get("abandoned"):
            raise RuntimeError(
                f"{self.name}: this dispatch result was abandoned ({result.handle['abandoned']}): "
                "its combine was already taken without a result on this rank (its peers were "
                "released, or its peer buffers marked broken); dispatch again")
        self._before_combine()
        ex = result.expert_x
        try:
            if not isinstance(expert_y, torch.Tensor):
                raise TypeError(f"expert_y must be a torch.Tensor, got {type(expert_y).__name__}")
            if expert_y.dim() != 2 or expert_y.shape[0] < ex.shape[0] or expert_y.shape[1] != ex.shape[1]:
                raise ValueError(f"expert_y must be [>= {ex.shape[0]}, {ex.shape[1]}] like "
                                 f"expert_x, got {tuple(expert_y.shape)}")
            if expert_y.device != ex.device:
                raise ValueError(f"expert_y must be on {ex.device}, got {expert_y.device}")
            if expert_y.dtype != ex.dtype:
                raise TypeError(f"expert_y must have expert_x's dtype {ex.dtype}, got {expert_y.dtype}")
        except (ValueError, TypeError) as e:  # (the peers are in this combine: release them)
            self.abandon(result, e)
            raise
        try:
            return self._combine(expert_y.contiguous(), result)
        except (ValueError, TypeError, CallAbandoned):
            raise  # (raised on every rank after an exchange)
        except BaseException as e:
            if result.handle.get("settled"):  # (its exchange started: the ranks' state is unknown)
                self._mark_out_of_step(e)
            else:  # e.g. an OOM before the exchange: the peers wait in it
                self.abandon(result, e)
            raise

    def abandon(self, result: DispatchResult, error: BaseException) -> None:
        """This rank will not combine `result` (`error` was raised after its dispatch, e.g. by
        the experts; MoELayer and combine's own checks call this): the multi-rank topologies
        take their part in that combine so that the peers raise CallAbandoned naming this rank
        instead of waiting (GroupTopology). Nothing for one rank, nor for a result whose
        combine exchange has started or that was abandoned already (`settled`)."""

    def _dispatch_failed(self, error: BaseException) -> None:
        """`_dispatch` raised `error` (not ValueError / TypeError): multi-rank topologies mark
        themselves out of step where the ranks' state is unknown (GroupTopology)."""

    def _mark_out_of_step(self, error: BaseException) -> None:
        """A collective failed (or was interrupted) on this rank: multi-rank topologies refuse
        further calls (GroupTopology)."""

    def _count_call(self, layer: int) -> None:
        """Before anything else in dispatch (multi-rank: GroupTopology numbers the calls and
        keeps the calling layer's id)."""

    def register_layer(self) -> int:
        """A new id for a layer that will call this topology (the last step of MoELayer's
        constructor): 0, 1, 2, ... in construction order, which must be the same on every rank
        (it is for swap_moe_layers, the engine and SPMD code that builds its layers in a fixed
        order; a rank that builds one more layer on a shared topology is out of step)."""
        n = self.__dict__.get("_layers", 0)
        self._layers = n + 1
        return n

    def compile_kernels(self, hidden: int, dtype: torch.dtype, top_k: int,
                        max_tokens: int | None, device) -> int:
        """Compile now the kernels that calls of 1..max_tokens tokens (None: any number) of
        `hidden`-wide `dtype` rows with `top_k` picks on `device` would compile on first use
        (a serving process's warm-up); returns how many. None here (0): LocalTopology and
        TPTopology on the cute backend have some (kernels/cute_ops.compile_kernels,
        kernels/allreduce.compile_tp_combines; dp_nvlink's peer kernels all compile at its
        first call, its mode being fixed by max_tokens_per_rank)."""
        return 0

    def max_tokens_per_call(self) -> float:
        """The most tokens one rank may pass to one dispatch: any number here (math.inf);
        PeerBufferTopology says its max_tokens_per_rank while a call may run on its peer
        buffers (a larger one raises ValueError there)."""
        return math.inf

    def records_collectives(self) -> bool:
        """Whether a CUDA graph capture can record this topology's calls with their
        collectives: no host read in them (checks that read peers' answers are skipped while
        capturing), every rank capturing and replaying the same calls. False here;
        GroupTopology says True on the reference backend over NCCL."""
        return False

    def _before_dispatch(self, device: torch.device) -> None:
        """After validation, before `_dispatch` (multi-rank: GroupTopology)."""

    def _before_combine(self) -> None:
        """After validation, before `_combine` (multi-rank: GroupTopology)."""

    @abc.abstractmethod
    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult: ...

    @abc.abstractmethod
    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor: ...

    def describe(self) -> str:
        return (f"{self.name}(rank {self.rank}/{self.world_size}, experts "
                f"[{self.expert_start}, {self.expert_start + self.num_local_experts}))")


def validate_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, *, check_values: bool = True) -> None:
    """Check the dispatch inputs at the Python boundary; raise with expected vs got.

    Raises:
        TypeError: a non-tensor, x not float32/bf16/fp16, topk_ids not int32, topk_weights not fp32.
        ValueError: shapes ([T, H], [T, k], [T, k], 1 <= k <= num_experts), mixed devices; with
            check_values, ids outside [0, num_experts) or repeated within a token (host read).
    """
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D [T, H] with H >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids must be torch.int32, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be torch.float32, got {topk_weights.dtype}")
    T = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, k], got shape {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be in [1, num_experts={num_experts}], got k={k}")
    if tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights must be [{T}, {k}] like topk_ids, got {tuple(topk_weights.shape)}")
    if topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError(f"x, topk_ids and topk_weights must share a device, got {x.device}, "
                         f"{topk_ids.device}, {topk_weights.device}")
    if check_values and T > 0:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
        if k > 1:
            s = torch.sort(topk_ids, dim=1).values
            dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
            if bool(dup.any()):
                t = int(dup.nonzero()[0, 0])
                raise ValueError(f"topk_ids must be distinct within a token; token {t} has "
                                 f"{topk_ids[t].tolist()}")
