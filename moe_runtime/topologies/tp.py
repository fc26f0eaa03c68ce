"""`tp` topology: every rank holds the same tokens; each rank computes only its own experts.

Backend "reference" (torch + torch.distributed all-reduce: gloo on CPU, nccl on CUDA):
    dispatch  reference.dispatch restricted to this rank's experts (other pairs get slot -1)
    combine   local weighted sum over this rank's (t, j) pairs in fp32, then all_reduce(SUM) in
              fp32 over the group, then one cast to expert_y.dtype.
Reducing in fp32 means a bf16/fp16 result is rounded once, as in `local`; it differs from the
single-rank answer only by the fp32 summation order of the k terms (split across ranks).

Backend "cute" (CUDA, bf16/fp16; PeerBufferTopology: buffers made by the first CUDA call, the
"auto" rule, errors):
    dispatch  kernels.cute_ops.dispatch with this rank's expert range (the local CuTeDSL
              dispatch: one launch for decode sizes, two for prefill sizes; no host sync)
    combine   kernels.allreduce.tp_combine_all_reduce, ONE launch: this rank's weighted
              partial sum, rounded to x.dtype, into its peer buffer, then the sum of all
              ranks' partials in fp32 in rank order, cast once: one-shot up to
              allreduce.ONESHOT_MAX_BYTES of partials per rank, two-shot above (T is the same
              on every rank, so every rank picks the same). Every rank compares its peers'
              sites (out of step: ValueError on every rank) and T (PeerDataError) with its
              own. Then the error words are read (one host sync per combine). No launch at
              T = 0.
Inside a CUDA graph capture (reference backend over NCCL: GroupTopology.records_collectives), the
combine skips the (T, H, k, dtype, site) check, which reads the peers' answers on the host,
and its all-reduce is recorded (comm.groups): the engine's decode graph captures a step that
it first ran eagerly, checks included, and bounds every replay (engine/decode_graph.py).
The cute result is bit-identical on every rank; it differs from the reference only by the
rounding of each rank's partial sum to x.dtype before the fp32 sum. NVLS (multicast) is never
used here.
"""
from __future__ import annotations

import torch

from ..comm import all_reduce_sum, stream_capturing
from ..kernels import get_ops, reference
from .base import DispatchResult
from .distributed import (_DTYPE_CODES, _DTYPES, HEADER_KINDS, PeerBufferTopology,
                          _header_text, _header_topologies, _unpaired)


class TPTopology(PeerBufferTopology):
    """Tensor-parallel attention: tokens replicated on every rank of `group`.

    dispatch(x [T, H], topk_ids int32 [T, k], topk_weights fp32 [T, k]) -> DispatchResult with
    expert_x [T * k + E_local * (align - 1), H] (x.dtype), expert_offsets int32 [E_local + 1],
    expected_rows ceil(T * k / W) + E_local * (align - 1): the rows this rank uses when routing
    is uniform (a rank owns E_local / E = 1 / W of the experts), where only expert_offsets[-1]
    on the device knows the real count (up to T * min(k, E_local) plus padding when routing is
    skewed). Experts chooses its kernels from it (e.g. the decode GEMV at T=16, k=8, W=4:
    32 expected rows, not 128); reading the real count would be a host sync.
    combine(expert_y [>= N, H]) -> y [T, H] in expert_y.dtype, identical on every rank.
    Every rank must pass the same x, topk_ids and topk_weights: the reference backend checks
    the token count and hidden size (a small all-reduce before the combine's; ValueError on
    every rank; not inside a CUDA graph capture, module docstring), the cute one the token
    count and the call's site in its kernel (module docstring).
    Constructor arguments and errors: see PeerBufferTopology and GroupTopology
    (max_tokens_per_rank bounds T, the replicated batch); combine raises CollectiveError
    (reference) or PeerTimeoutError / PeerDataError (cute) when a peer stalls or dies.
    """

    name = "tp"
    all_to_all = False  # the cute backend needs the all-reduce buffers only
    auto_fallback_over_limit = True  # every rank holds the same tokens: same path everywhere

    def compile_kernels(self, hidden: int, dtype: torch.dtype, top_k: int,
                        max_tokens: int | None, device) -> int:
        """On the cute backend (asked for, or "auto" settled on it by a first call; an unsettled
        "auto" compiles nothing, as that call decides): the local dispatch kernels of calls of
        1..max_tokens tokens (at most max_tokens_per_rank; cute_ops.compile_kernels, whose
        local combine kernels come along unused) and the combine all-reduce of each algorithm
        they pick (allreduce.compile_tp_combines). Returns how many."""
        device = torch.device(device)
        if self.backend != "cute" or device.type != "cuda":
            return 0
        from ..kernels import cute_ops
        from ..kernels.allreduce import compile_tp_combines
        limit = min(self.max_tokens_per_rank, self.max_tokens_per_rank if max_tokens is None
                    else max_tokens)
        n_local = 1 if self.peer_buffers is None else self.peer_buffers.n_local
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        with torch.cuda.device(device):  # (the all-reduce's grid follows the current device)
            return (cute_ops.compile_kernels(dtype, hidden, self.num_local_experts, top_k, limit,
                                             sms=sms)
                    + compile_tp_combines(hidden, top_k, self.world_size, n_local, dtype, limit))

    def _dispatch(self, x, topk_ids, topk_weights) -> DispatchResult:
        bufs = self._peer_buffers(x, topk_ids)
        ops = get_ops("reference" if bufs is None else "cute")
        expert_x, offsets, slot = ops.dispatch(
            x, topk_ids, expert_start=self.expert_start,
            num_local_experts=self.num_local_experts, align=self.align)
        T, k = topk_ids.shape
        expected = -(-T * k // self.world_size) + self.num_local_experts * (self.align - 1)
        return DispatchResult(expert_x, offsets, {"token_slot": slot, "topk_weights": topk_weights,
                                                  "peer_buffers": bufs, "site": self.site},
                              expected_rows=expected)

    def _combine(self, expert_y, result: DispatchResult) -> torch.Tensor:
        h = result.handle
        if h["peer_buffers"] is not None:
            h["peer_buffers"].check_usable()  # (a capture refused before the exchange is taken)
            h["settled"] = True
            from ..kernels.allreduce import tp_combine_all_reduce
            return self._site_checked(h["site"], lambda sites: tp_combine_all_reduce(
                h["peer_buffers"], [expert_y], h["token_slot"][None], h["topk_weights"],
                sites=sites, **self._kernel_bounds()))[0]
        partial = reference.combine(expert_y.float(), h["token_slot"], h["topk_weights"])
        h["settled"] = True
        if not stream_capturing():  # (a capture records the step its eager run checked)
            self._check_same_tokens(expert_y, h)
        all_reduce_sum(partial, group=self.group, step=self._step("combine all_reduce"),
                       timeout_s=self.timeout_s)
        return partial.to(expert_y.dtype)

    def _release_peers(self, result: DispatchResult) -> None:
        row = _combine_row("abandoned", result.expert_x, result.handle)
        every = self._send_header(row, result.expert_x.device, "combine shapes")
        other = _unpaired(row, every)
        if other is not None:  # (the peers raise out of step at this header: so does this rank,
            # at its next call, instead of waiting in a collective nobody joins)
            self._mark_apart(f"the ranks were out of step at {_header_text(every[self.rank])}: "
                             f"rank {other} was at {_header_text(every[other])}",
                             _header_topologies(every))

    def _check_same_tokens(self, expert_y: torch.Tensor, handle: dict) -> None:
        """Reference backend: every rank's (T, H, k, dtype) and the call's site (topology id,
        layer, dispatch number) through a fixed-size all-reduce (GroupTopology._exchange_header)
        before the [T, H] one, whose mismatched sizes would abort the process (gloo) or hang
        (NCCL), and whose partial sums from another call, layer, top-k or dtype would be added
        silently.

        Raises:
            ValueError: on every rank, naming each rank's (tokens, hidden, top_k, dtype), or its
                site (out of step: the topologies the sites reached then refuse calls)."""
        every = self._exchange_header(_combine_row("combine", expert_y, handle), expert_y.device,
                                      "combine shapes")
        per_rank = [tuple(e[1:5]) for e in every]
        if len(set(per_rank)) > 1:
            raise ValueError(f"tp rank {self.rank}: every rank must pass the same tokens with the "
                             "same top_k and dtype; (tokens, hidden, top_k, dtype) per rank "
                             f"{[(t, h, k, _DTYPES[d]) for t, h, k, d in per_rank]}")


def _combine_row(kind: str, rows: torch.Tensor, handle: dict) -> tuple[int, ...]:
    """The combine header (GroupTopology._send_header) of a tp call: kind, T, H (rows' width),
    top_k, rows' dtype code, then the dispatch's site (topology id, layer, dispatch number)."""
    T, k = handle["token_slot"].shape
    return (HEADER_KINDS[kind], T, rows.shape[1], k, _DTYPE_CODES[rows.dtype], *handle["site"])
