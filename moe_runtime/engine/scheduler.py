"""Request placement across ranks and the lockstep prefill/decode loop every rank runs."""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..layer import MoELayer
from .decode_graph import DecodeGraph, graphs_apply
from .sampler import SamplingParams, request_generators, sample


def assign_requests(prompt_lengths: Sequence[int], world_size: int, data_parallel: bool) -> list[list[int]]:
    """Which requests each rank runs.

    dp_* (data_parallel): each request goes to exactly one rank, longest first to the rank with
    the fewest prompt tokens so far (ties: lower rank). Otherwise (local, tp) every rank runs
    every request. Returns world_size lists of request indices, each in increasing order.
    """
    n = len(prompt_lengths)
    if not data_parallel:
        return [list(range(n)) for _ in range(world_size)]
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-prompt_lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += prompt_lengths[i]
    return [sorted(o) for o in out]


@dataclass
class RankOutput:
    """What one rank returns: generated ids per request (stop token included) and timings."""

    request_ids: list[int]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather(flags: Sequence[int], parallel, device: torch.device, step: str, *,
            any_topology: bool = False) -> list[list[int]]:
    """Under dp_* with several ranks (any multi-rank topology with any_topology): every rank's
    flags, in rank order (one all-reduce of a [W, len(flags)] table on `device`: nccl reduces
    only CUDA tensors; `step` names it in a CollectiveError), so that every rank takes the
    same branch and runs the same forward passes; otherwise [flags] (no device round trip)."""
    if parallel.world_size == 1 or not (any_topology or parallel.data_parallel):
        return [list(flags)]
    from ..comm import all_reduce_sum
    t = torch.zeros(parallel.world_size, len(flags), dtype=torch.int64)
    t[parallel.rank] = torch.tensor(list(flags), dtype=torch.int64)
    return all_reduce_sum(t.to(device), group=parallel.group, timeout_s=parallel.timeout_s,
                          step=f"scheduler: {step}").tolist()


def _from_rank0(tokens: torch.Tensor, parallel, device: torch.device) -> torch.Tensor:
    """Under tp with several ranks: every rank takes rank 0's sampled tokens (SUM all-reduce on
    `device` of rank 0's ids and zeros elsewhere), so replicated ranks never diverge.
    tokens: int64 [B] on the CPU; returns int64 [B] on the CPU."""
    if not parallel.tensor_parallel:
        return tokens
    from ..comm import all_reduce_sum
    t = tokens.to(device) if parallel.rank == 0 else torch.zeros_like(tokens, device=device)
    return all_reduce_sum(t, group=parallel.group, step="decode: tokens from rank 0",
                          timeout_s=parallel.timeout_s).cpu()


GRAPH_MIN_STEPS = 4  # decode steps from which capturing (~2 eager steps' time) pays off
# Tokens of the warm-up prompt (`warm_up`): long enough that every MoE layer takes its prefill
# path (routing, dispatch and experts of many rows: cute_ops' mode rules, the experts' grouped
# GEMM) in the prefill and its decode path in the decode step after it.
WARM_UP_TOKENS = 2048
# A prefill runs its prompts right-padded to the longest one ([B, L] positions through
# attention and the dense layers; the MoE layers take the real tokens only). One prefill takes
# another waiting prompt while the padded positions stay within PREFILL_PAD_RATIO x its real
# tokens or within PREFILL_PAD_FREE positions (small prefills batch whatever their lengths);
# the next prompt otherwise starts the next prefill. Without the bound, 1000 one-token prompts
# and one of 500 tokens made one prefill of 500500 positions for 1500 tokens (tiny preset,
# one CPU thread, 4 new tokens each: 30.9 s, now 1.8 s).
PREFILL_PAD_RATIO = 2
PREFILL_PAD_FREE = 4096


def pads_too_much(prompts: int, longest: int, tokens: int) -> bool:
    """Whether a prefill of `prompts` prompts, the longest `longest` tokens long, `tokens` in
    all, would pad too much (PREFILL_PAD_RATIO, PREFILL_PAD_FREE)."""
    return prompts * longest > max(PREFILL_PAD_FREE, PREFILL_PAD_RATIO * tokens)


def _decode_step(model, cache, batch: int, graphed: bool, capacity: int):
    """step(tokens, lengths, active, needed) runs one decode step (host tensors: int64 [B]
    each sequence's token and position, bool [B] the sequences still generating; needed: the
    cached positions the ranks' longest sequence needs) and returns its logits; replayed from
    a DecodeGraph (dp: MoE calls of `capacity` tokens) where `graphed` (and B >= 1), else an
    eager forward whose MoE layers see the active sequences."""
    dev = model.device
    if graphed and batch:
        graph = DecodeGraph(model, cache, batch, capacity)
        return lambda tokens, lengths, active, needed: graph(tokens, lengths, needed)
    zeros = torch.zeros(batch, dtype=torch.int64, device=dev)
    return lambda tokens, lengths, active, needed: model(
        tokens[:, None].to(dev), lengths[:, None].to(dev), active[:, None].to(dev), zeros, cache)


def run_requests(model, prompts: Sequence[Sequence[int]], request_ids: Sequence[int],
                 params: SamplingParams, stop_ids: Sequence[int], *,
                 max_batch_size: Optional[int] = None,
                 fail_at_step: Optional[int] = None,
                 on_step: Optional[Callable[[int], None]] = None,
                 cuda_graphs: bool = True) -> RankOutput:
    """Prefill and decode this rank's requests in lockstep with the other ranks, with
    continuous batching: at most `max_batch_size` sequences hold a slot of the KV cache; a
    request that finishes frees its slot, and the next waiting request is prefilled into it
    (one prefill forward for all requests placed at once; the others wait for that forward,
    then decode with it).

    Every forward pass is collective under a multi-rank topology: under dp_* the ranks agree
    before each one (a small all-reduce) on whether it is a prefill (some rank placed
    requests; the others run an empty one) or a decode step (some rank has a sequence
    generating), and stop together; under tp every rank holds every request and takes rank
    0's sampled tokens, so their decisions agree by construction. The ranks also agree, once,
    on CUDA graphs: all of them replay or none (under dp_* every MoE call of a replayed step
    then exchanges blocks sized for the largest rank's slots, a rank without requests keeps
    one idle slot, and the ranks move to a new cached-length bucket at the same steps).

    Args:
        model: a MoECausalLM (its `parallel` says tp / dp / local).
        prompts: token ids per request (each non-empty); may be empty on a dp rank.
        request_ids: global indices of these requests (seed the samplers).
        params: SamplingParams.
        stop_ids: token ids that finish a request.
        max_batch_size: slots of the KV cache (sequences decoded together); None: one per
            request. The cache holds max_batch_size x (longest prompt + max_new_tokens)
            positions. One prefill places at most `moe_tokens_per_call` prompt tokens and
            pads within `pads_too_much` (one request at least), in the order of `prompts`.
        fail_at_step: testing aid: raise RuntimeError at this decode step (fault tests).
        on_step: called with the number of forward passes done (prefills and decode steps):
            the rank's progress (RankWorker.progress).
        cuda_graphs: replay the decode steps from CUDA graphs where the model allows it on
            every rank (decode_graph.graphs_apply: CUDA, one rank or tp / dp_* over NCCL, MoE
            layers whose forward a capture can record) and there are GRAPH_MIN_STEPS of them
            or more; RankOutput.extra["cuda_graphs"] says whether it did (False when no
            decode step ran).

    Returns:
        RankOutput in the order of `prompts`; finish_reasons "stop" (a stop token) or
        "length" (max_new_tokens). prefill_s / decode_s: the wall time of the iterations
        that ran a prefill / a decode step (each with its agreement and sampling).

    Raises:
        ValueError: an empty prompt, or max_batch_size < 1. CollectiveError: a peer failed or
            stalled.
    """
    dev = model.device
    n = len(prompts)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
    slots = min(n, max_batch_size or n)
    steps = -(-n // max(slots, 1)) * (params.max_new_tokens - 1)  # (each request to its length)
    graphed = bool(cuda_graphs) and graphs_apply(model)
    # (a rank whose kernels cannot be captured, e.g. without CuTeDSL: no rank replays, since
    # recorded collectives must meet recorded ones)
    every = _gather([int(graphed), slots, steps], model.parallel, dev,
                    "CUDA graphs and decode slots", any_topology=True)
    graphed = all(e[0] for e in every) and max(e[2] for e in every) >= GRAPH_MIN_STEPS
    capacity = max(e[1] for e in every)  # (dp: the MoE calls' fixed capacity, the largest B)
    if graphed and model.parallel.data_parallel:
        slots = max(slots, 1)  # (a rank without requests replays with its peers)
    cache = model.new_cache(slots, max((len(p) for p in prompts), default=1)
                            + params.max_new_tokens, device=dev)
    gens = request_generators(params.seed, request_ids) if params.temperature > 0 else [None] * n
    stop = set(int(s) for s in stop_ids)
    out = RankOutput(list(request_ids), [[] for _ in range(n)], ["length"] * n,
                     prefill_tokens=sum(len(p) for p in prompts))
    owner = [-1] * slots  # the request in each slot (-1: free)
    tokens = torch.zeros(slots, dtype=torch.int64)  # what each slot feeds at its next step
    lengths = torch.zeros(slots, dtype=torch.int64)  # ... and at which position
    waiting = deque(range(n))
    forwards = 0

    def take(rows: list[int], logits: torch.Tensor) -> None:
        """Sample the next token of the requests in slots `rows` (logits [len(rows), V])."""
        picked = _from_rank0(sample(logits, params, [gens[owner[b]] for b in rows]),
                             model.parallel, dev)
        for b, t in zip(rows, picked.tolist()):
            r = owner[b]
            out.token_ids[r].append(t)
            tokens[b] = t
            if t in stop:
                out.finish_reasons[r], owner[b] = "stop", -1
            elif len(out.token_ids[r]) >= params.max_new_tokens:
                owner[b] = -1

    def counted() -> None:
        nonlocal forwards
        forwards += 1
        if on_step is not None:
            on_step(forwards)

    limit = moe_tokens_per_call(model)
    decode = _decode_step(model, cache, slots, graphed, capacity)
    _sync(dev)
    while True:
        t0 = time.perf_counter()
        placed, real, longest = [], 0, 0
        for b in range(slots):  # the next waiting requests, in free slots, within the MoE
            if not waiting:  # limit and the padding bound
                break
            size = len(prompts[waiting[0]])
            if placed and (real + size > limit or pads_too_much(
                    len(placed) + 1, max(longest, size), real + size)):
                break
            if owner[b] < 0:
                owner[b] = waiting.popleft()
                placed.append(b)
                real, longest = real + size, max(longest, size)
        generating = [b for b in range(slots) if owner[b] >= 0 and b not in placed]
        every = _gather([len(placed), len(generating), int(lengths.max()) + 1 if slots else 1],
                        model.parallel, dev, "requests to place or decode")
        any_placed, any_generating = (sum(e[i] for e in every) for i in (0, 1))
        if any_placed:
            logits = _prefill(model, cache, [prompts[owner[b]] for b in placed], placed)
            lengths[placed] = torch.tensor([len(prompts[owner[b]]) for b in placed],
                                           dtype=torch.int64)
            counted()
            take(placed, logits)
            _sync(dev)
            out.prefill_s += time.perf_counter() - t0
            continue
        if not any_generating:
            break
        if fail_at_step is not None and out.steps == fail_at_step:
            raise RuntimeError(f"injected fault at decode step {out.steps}")
        active = torch.tensor([o >= 0 for o in owner], dtype=torch.bool)
        logits = decode(tokens, lengths, active, max(e[2] for e in every))
        lengths += active.to(torch.int64)
        out.steps += 1
        counted()
        if len(generating) < slots:  # (every slot generating: the logits as they are)
            logits = logits[torch.tensor(generating, dtype=torch.int64, device=logits.device)]
        take(generating, logits)
        out.decode_s += time.perf_counter() - t0
    out.decode_tokens = sum(max(len(t) - 1, 0) for t in out.token_ids)
    out.extra["cuda_graphs"] = graphed and slots > 0 and out.steps > 0
    return out


def moe_tokens_per_call(model) -> float:
    """The most tokens one MoE call of this rank may take: the smallest
    `Topology.max_tokens_per_call` of the model's MoE topologies (a topology whose calls may
    run on peer buffers refuses a call above its max_tokens_per_rank; one settled on the
    reference backend takes any number), else unbounded. A prefill places requests within it
    (at least one)."""
    return min((layer.mlp.topology.max_tokens_per_call() for layer in model.layers
                if isinstance(layer.mlp, MoELayer)), default=math.inf)


def _prefill(model, cache, prompts: Sequence[Sequence[int]], rows: list[int]) -> torch.Tensor:
    """One prefill forward of `prompts` (right-padded) into the cache rows `rows`; fp32
    logits [len(rows), V] of each prompt's last position (none: the empty forward of a dp
    rank whose peers prefill)."""
    dev = model.device
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    L = int(lens.max()) if prompts else 1
    ids = torch.zeros(len(prompts), L, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(list(p), dtype=torch.int64)
    positions = torch.arange(L).expand(len(prompts), L).contiguous()
    valid = positions < lens[:, None]
    return model(ids.to(dev), positions.to(dev), valid.to(dev), (lens - 1).clamp(min=0).to(dev),
                 cache.at(rows), prefill=True)


def warm_up(model) -> float:
    """Pay the costs of a model's first forward passes before the first request: compiling the
    CuTeDSL and quack kernels of its MoE layers (a few tenths of a second each, once per
    process), CUDA, cuBLAS and attention start-up. Runs one prefill of WARM_UP_TOKENS dummy
    tokens (fewer where max_position_embeddings, or the tokens one call of its MoE topologies
    may take (`moe_tokens_per_call`), is smaller; once more with the larger number when the
    first call settled a topology on a backend without that limit) and one eager decode
    step, then compiles the other launch shapes of the MoE layers' kernels (MoELayer.warm_up:
    the dispatch / combine kernels of every token count, the expert GEMMs' tiles), so a batch
    of a new size compiles nothing on the local topology. Every rank of a multi-rank model
    must call it together (the forwards exchange tokens).

    Returns:
        The seconds it took.
    """
    t0 = time.perf_counter()
    done = 0
    while (tokens := max(1, int(min(WARM_UP_TOKENS, model.spec.max_position_embeddings - 2,
                                    moe_tokens_per_call(model))))) > done:
        # (again when the first call settled a topology on the reference backend, which lifts
        # its peer buffers' limit: the longer prefill compiles the routing kernel's prefill shape)
        run_requests(model, [[0] * tokens], [0], SamplingParams(max_new_tokens=2), stop_ids=(),
                     cuda_graphs=False)
        done = tokens
    limit = moe_tokens_per_call(model)
    for layer in model.layers:  # (every launch shape of the dispatch / combine kernels, the
        if isinstance(layer.mlp, MoELayer):  # expert GEMMs' tiles: compiles, no collective)
            layer.mlp.warm_up(None if math.isinf(limit) else int(limit))
    return time.perf_counter() - t0
