"""Torch references of every kernel, with the semantics the CuTeDSL kernels must match.

These functions are the single source of truth for what routing, dispatch and combine compute.
They run on any device (CPU in CI) and are used by the `reference` backends of the topologies.

Conventions (the field's usual names):
    T tokens, H hidden, E experts (E_local on this rank), k = top-k.
    topk_ids    int32 [T, k]   global expert ids, distinct within a token
    topk_weights fp32 [T, k]
    token_slot  int32 [T, k]   row of `expert_x` that holds (t, j), or -1 when expert
                               topk_ids[t, j] is not local to this rank
    expert_offsets int32 [E_local + 1]: expert e's rows are
                               expert_x[expert_offsets[e] : expert_offsets[e] + counts[e]],
                               and expert_offsets[e] is a multiple of `align`.
"""
from __future__ import annotations

import torch


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk_prob: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    with_counts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Router epilogue: scores -> top-k ids, weights and per-expert counts.

    Args:
        logits: [T, E] router logits (any float dtype; computed in fp32).
        top_k: k.
        scoring: "softmax" (Mixtral, Qwen2/3-MoE, OLMoE: softmax over all E, then top-k) or
            "sigmoid" (DeepSeek-V3: sigmoid scores; the choice uses score + correction_bias,
            restricted to the best `topk_group` of `n_group` groups, a group scored by the sum
            of its two best biased scores; experts of the other groups get -inf, as in HF
            transformers 5.x DeepseekV3TopkRouter / DeepseekV3MoE.route_tokens_to_experts).
        norm_topk_prob: divide the k weights by their sum (sigmoid: sum + 1e-20).
        routed_scaling_factor: multiplies the final weights.
        with_counts: also count the tokens per expert (else counts is None).

    Returns:
        topk_ids int32 [T, k] in descending score order (ties: smaller expert id first),
        topk_weights fp32 [T, k], counts int32 [E] (tokens routed to each expert) or None.
        A token with a NaN logit gets k NaN weights (its output is NaN, as HF's is: there
        torch.topk takes NaN as the largest score); for the choice a NaN counts as the lowest
        finite fp32 value (above the -inf of masked groups).
    """
    scores_in = logits.float()
    T, E = scores_in.shape
    nan_rows = torch.isnan(scores_in).any(-1, keepdim=True)
    if scoring == "softmax":
        scores = torch.softmax(scores_in, dim=-1)
        choice = _nan_to_lowest(scores)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(scores_in)
        choice = _nan_to_lowest(scores if correction_bias is None
                                 else scores + correction_bias.float())
        if n_group > 1:
            grouped = choice.view(T, n_group, E // n_group)
            group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
            group_idx = _topk_ids(group_scores, topk_group)
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            keep = group_mask.bool().unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
            choice = choice.masked_fill(~keep, float("-inf"))
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    ids = _topk_ids(choice, top_k)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if scoring == "sigmoid" else denom)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    weights = weights.masked_fill(nan_rows, float("nan"))
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32) if with_counts else None
    return ids.to(torch.int32), weights.float(), counts


def _nan_to_lowest(values: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(torch.isnan(values), torch.finfo(torch.float32).min)


def _topk_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, descending, ties to the smaller index."""
    # A stable sort on the negated values keeps equal values in index order.
    return torch.sort(-values, dim=-1, stable=True).indices[:, :k]


def dispatch_capacity(num_tokens: int, top_k: int, num_local_experts: int, align: int = 1) -> int:
    """Rows of `expert_x` a dispatch allocates: T*k plus the worst-case per-expert padding."""
    return num_tokens * top_k + num_local_experts * (align - 1)


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_start: int,
    num_local_experts: int,
    align: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute token rows into expert-major order for the experts [expert_start, +E_local).

    Args:
        x: [T, H] token rows.
        topk_ids: int32 [T, k] global expert ids.
        expert_start: first global expert id owned here.
        num_local_experts: E_local.
        align: pad every expert's segment start to a multiple of this many rows.

    Returns:
        expert_x [dispatch_capacity(T, k, E_local, align), H] (x.dtype; rows past
        expert_offsets[-1] and padding rows are zero here, unspecified in kernels),
        expert_offsets int32 [E_local + 1], token_slot int32 [T, k] (-1 = not local).
        Within an expert the reference orders rows by (t, j); kernels may use any order, so
        tests compare through `token_slot`.
    """
    T, k = topk_ids.shape
    H = x.shape[1]
    dev = x.device
    E = num_local_experts
    local = topk_ids.long() - expert_start
    is_local = (local >= 0) & (local < E)
    flat_e = torch.where(is_local, local, torch.full_like(local, E)).flatten()  # E: not local
    # every size below comes from the shapes only (no host read of the data: torch.export and
    # torch.compile(fullgraph=True) trace it with a dynamic T)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).index_add_(
        0, flat_e, torch.ones_like(flat_e))
    padded = (counts[:E] + align - 1) // align * align
    offsets = torch.zeros(E + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    order = torch.sort(flat_e, stable=True).indices  # (t, j) order within each expert
    sorted_e = flat_e[order]
    rank_in_expert = torch.arange(T * k, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    slot = torch.empty(T * k, dtype=torch.long, device=dev)
    slot[order] = torch.where(sorted_e < E, offsets[sorted_e] + rank_in_expert, -1)
    rows = dispatch_capacity(T, k, E, align)
    if T * k == 0:  # (static: no token row to gather, only padding rows)
        expert_x = x.new_zeros(rows, H)
    else:  # a gather of the token rows: each row's source token, -1 for padding / unused
        src = torch.full((rows + 1,), -1, dtype=torch.long, device=dev)
        src.scatter_(0, torch.where(slot >= 0, slot, rows), torch.arange(T * k, device=dev) // k)
        src = src[:rows]
        expert_x = torch.where((src >= 0).unsqueeze(1), x[src.clamp(min=0)],
                               torch.zeros((), dtype=x.dtype, device=dev))
    return expert_x, offsets.to(torch.int32), slot.view(T, k).to(torch.int32)


def combine(expert_y: torch.Tensor, token_slot: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted gather-sum back into token order: y[t] = sum_j w[t,j] * expert_y[slot[t,j]].

    Args:
        expert_y: [N, H] expert outputs in expert-major order.
        token_slot: int32 [T, k] rows of expert_y; -1 entries contribute nothing.
        topk_weights: fp32 [T, k].

    Returns:
        y [T, H] in expert_y.dtype; the sum is accumulated in fp32 in order j = 0..k-1.
    """
    T, k = token_slot.shape
    y = torch.zeros(T, expert_y.shape[1], dtype=torch.float32, device=expert_y.device)
    if T and expert_y.shape[0] == 0:  # every pick is -1: nothing to gather (adding the zero
        return (y + expert_y.float().sum(0)).to(expert_y.dtype)  # sum keeps autograd's graph)
    for j in range(k):
        s = token_slot[:, j].long()
        valid = s >= 0
        rows = expert_y[s.clamp(min=0)].float()
        w = torch.where(valid, topk_weights[:, j].float(), torch.zeros_like(topk_weights[:, j]))
        y += w.unsqueeze(1) * torch.where(valid.unsqueeze(1), rows, torch.zeros_like(rows))
    return y.to(expert_y.dtype)


def expert_gemv(x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor, *,
                swiglu: bool) -> torch.Tensor:
    """Per-row expert matrix-vector product over expert-major rows (kernels/expert_gemv.py).

    Args:
        x: [N, K]; row r belongs to expert e with expert_offsets[e] <= r < expert_offsets[e+1].
        expert_offsets: int32 [E + 1].
        weight: [E, M, K] (HF layout, out-features first).
        swiglu: weight rows are [gate; up]: out = silu(W_gate x) * (W_up x), [N, M/2];
            otherwise out = W x, [N, M].

    Returns:
        out in x.dtype, computed in fp32 (float64 for float64 inputs) and rounded once; rows
        >= expert_offsets[E] are zero here and unspecified in the kernel.
    """
    E, M, K = weight.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape[0], M // 2 if swiglu else M, dtype=x.dtype, device=x.device)
    bounds = expert_offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            h = x[lo:hi].to(acc) @ weight[e].to(acc).T
            if swiglu:
                gate, up = h.chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate) * up
            out[lo:hi] = h.to(x.dtype)
    return out
