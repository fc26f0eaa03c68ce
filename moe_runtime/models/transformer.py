"""The decoder network shared by every MoE family: RMSNorm, RoPE, GQA attention with a KV cache
(optionally tensor-parallel, Megatron style), and MoE blocks through `moe_runtime.MoELayer`.

Parallel modes (one process per rank, see `Parallel`):
    local      world size 1; everything on the one rank.
    tp         every rank holds the same tokens; attention heads are split (column-parallel
               q/k/v, row-parallel o followed by an all-reduce); MoE tokens are replicated and
               the `tp` topology sums the experts' outputs across ranks; embeddings, norms,
               router and dense MLPs are replicated.
    dp_nvlink / dp_p2p
               each rank runs its own requests (data-parallel attention, full replicated
               attention weights); experts are partitioned (EP) and the topology moves token
               rows between ranks. Every rank must call forward the same number of times (a rank
               without requests passes a batch of 0 rows) because MoE layers are collectives.

Parameter names mirror HF transformers (`model.` prefix dropped) except inside MoE layers,
which use MoELayer's own names (`mlp.router.weight`, `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); `loader.py` maps them to checkpoint tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.groups import group_rank_size
from ..layer import MoELayer
from .spec import ModelSpec, rope_parameters

TOPOLOGY_NAMES = ("local", "tp", "dp_nvlink", "dp_p2p")


@dataclass(frozen=True)
class Parallel:
    """How one rank takes part in the model.

    Attributes:
        topology: "local", "tp", "dp_nvlink" or "dp_p2p".
        rank, world_size: this rank in the process group.
        group: the torch.distributed ProcessGroup (None = default group; unused for local).
        backend: kernel/topology backend ("auto", "reference", "cute").
        timeout_s: bound on each collective (None = the group's timeout).
    """

    topology: str = "local"
    rank: int = 0
    world_size: int = 1
    group: Any = None
    backend: str = "auto"
    timeout_s: Optional[float] = None

    def __post_init__(self):
        if self.topology not in TOPOLOGY_NAMES:
            raise ValueError(f"topology must be one of {TOPOLOGY_NAMES}, got {self.topology!r}")
        if self.topology == "local" and self.world_size != 1:
            raise ValueError(f"topology 'local' runs on 1 rank, got world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def data_parallel(self) -> bool:
        """Each rank owns its own requests (dp_* topologies)."""
        return self.topology.startswith("dp_")

    @property
    def tensor_parallel(self) -> bool:
        """Attention heads are split across ranks (tp with more than one rank)."""
        return self.topology == "tp" and self.world_size > 1


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: q heads [q_start, q_start + q_heads), kv heads
    [kv_start, kv_start + kv_heads)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_shard(spec: ModelSpec, parallel: Parallel) -> HeadShard:
    """Split attention heads for tensor parallelism (all heads when not tp).

    q heads are split evenly. kv heads are split evenly when num_kv_heads % W == 0; when
    W % num_kv_heads == 0 each rank holds the one kv head its q heads use (kv heads replicated
    across W / num_kv_heads ranks, as vLLM does).

    Raises:
        ValueError: num_heads % W != 0, neither kv rule applies, or a q/k norm over all heads
            (spec.qk_norm_whole).
    """
    Hq, Hkv = spec.num_heads, spec.num_kv_heads
    if not parallel.tensor_parallel:
        return HeadShard(0, Hq, 0, Hkv)
    W, r = parallel.world_size, parallel.rank
    if spec.qk_norm and spec.qk_norm_whole:
        raise ValueError(f"tp: {spec.model_type}'s q/k RMSNorm spans all heads, which tp would "
                         "split across ranks; run it with dp_nvlink, dp_p2p or one rank")
    if Hq % W:
        raise ValueError(f"tp: num_attention_heads ({Hq}) must be divisible by the world size ({W})")
    q_heads = Hq // W
    if Hkv % W == 0:
        return HeadShard(r * q_heads, q_heads, r * (Hkv // W), Hkv // W)
    if W % Hkv == 0:
        return HeadShard(r * q_heads, q_heads, r // (W // Hkv), 1)
    raise ValueError(f"tp: num_key_value_heads ({Hkv}) and the world size ({W}) must divide one another")


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32, as HF's RMSNorm.

    weight: [n]; forward(x [..., n]) -> [..., n] in x.dtype (times weight's dtype)."""

    def __init__(self, n: int, eps: float, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [B, heads, L, D] (all of them, or
    GLM-4-MoE's partial rotary: the rest pass through), as HF transformers' apply_rotary_pos_emb."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :R], x[..., R:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [..., R], output de-interleaved
    (rotated evens, then rotated odds), as HF's apply_rotary_pos_emb_interleave (DeepSeek-V3);
    cos/sin [..., R] hold each pair's angle in their first half."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


DECODE_POSITIONS = 2  # query positions (per sequence) up to which attention is two bmm, not SDPA


def _kv_len(mask: Optional[torch.Tensor], L: int) -> int:
    """The cached positions attention reads: the mask's S, or L for the causal mask (None)."""
    return mask.shape[-1] if mask is not None else L


def _sdpa(q, keys, values, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """SDPA with a bool mask [B, 1, L, S], or causal over L == S positions when mask is None
    (is_causal: the mask is not materialized, and the flash kernels apply)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                          is_causal=mask is None, scale=scale)


def _attend(module: nn.Module, q, k, v, positions, mask, cache, scale: float) -> torch.Tensor:
    """Write k, v into the cache and attend over the cached prefix (S = mask.shape[-1]).
    q [B, heads, L, Dk], k [B, kv_heads, L, Dk], v [B, kv_heads, L, Dv], mask bool [B, 1, L, S]
    or None (causal over a fresh prefill, S = L) -> [B, heads, L, Dv]. Decode steps (at most
    DECODE_POSITIONS query positions) run `_grouped_attention`: on the H200 torch's SDPA
    (cuDNN) took 90 / 694 µs for one sequence at S = 4096 / 32768 (32 query, 4 kv heads of
    128, bf16) against 27 / 87 µs for the two bmm with bf16 scores, as it splits the work by
    query tiles (bench_out diagnostic attn_decode.py; at 4 positions of 16 sequences SDPA was
    faster, 108 / 159 µs). The scores are fp32 (bf16 ones lose accuracy): from an fp32 copy
    of the keys per call, the graphed decode step of benchmarks/engine_step.py's Qwen3 model
    took 1.75 / 2.90 ms for one sequence at S = 4096 / 32768 and 5.32 / 9.69 ms for 16 at
    S = 4096 / 16384; from the bf16 keys with fp32 bmm output (`_fp32_scores`, two
    interleaved rounds, 2026-11-30) 1.61-1.68 / 2.08-2.15 and 3.74 / 5.10-5.20 ms (the MLA
    model's 16 at S = 16384: 6.82-6.92 -> 4.82-4.92 ms). Prefill runs SDPA over the kv heads
    repeated per query head."""
    keys, values = cache.write(module.layer_idx, positions, k, v, _kv_len(mask, q.shape[2]))
    rep = q.shape[1] // keys.shape[1]
    if q.shape[2] <= DECODE_POSITIONS:
        return _grouped_attention(q, keys, values, mask, scale)
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    return _sdpa(q, keys, values, mask, scale)


SCORES_PER_CHUNK = 1 << 26  # `_grouped_attention`'s scores per query chunk (64 Mi: ~0.6 GiB transient)


def _fp32_scores(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether q @ keys^T can run on the 16-bit tensors with fp32 accumulation and fp32 output
    (torch.bmm's out_dtype, CUDA, torch >= 2.8): the fp32 copy of the keys it saves is read
    and written every decode step (B16 x 16384 cached positions of 4 kv heads of 128: 1.1 GB
    of traffic per layer against the 0.27 GB the keys are)."""
    return (q.is_cuda and q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.bmm, "dtype"))


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with the query heads of each kv head folded into its query rows (GQA, and
    MLA's one latent head), so the keys and values are never repeated per query head: two bmm
    over B * kv_heads; scores and softmax in fp32 (bf16 scores were 6-23x less accurate than
    SDPA's), the probabilities in the values' dtype for the second bmm, as HF's eager
    attention. 16-bit queries and keys on CUDA go into the first bmm as they are, with fp32
    output (`_fp32_scores`), instead of as an fp32 copy of the keys. q [B, heads, L, Dk], keys
    [B, kv_heads, S, Dk], values [B, kv_heads, S, Dv], mask bool [B, 1, L, S] (True = attend;
    every row attends somewhere) or None (causal, L = S) -> [B, heads, L, Dv]. The scores are materialized, so the query positions go in chunks
    of about SCORES_PER_CHUNK scores (one position at least; a long MLA prefill would
    otherwise hold B * heads * L * S of them, e.g. 128 heads at L = S = 8192: 8.6 G)."""
    B, h, L, Dk = q.shape
    kv, S = keys.shape[1], keys.shape[2]
    if mask is None:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()[None, None]
    keys_t = keys.reshape(B * kv, S, Dk).transpose(1, 2)
    direct = _fp32_scores(q, keys)
    if not direct:
        keys_t = keys_t.float()
    values = values.reshape(B * kv, S, -1)
    chunk = max(1, SCORES_PER_CHUNK // max(1, B * h * S))
    outs = []
    for i in range(0, L, chunk):
        n = min(chunk, L - i)
        rows = q[:, :, i:i + n].reshape(B * kv, h // kv * n, Dk)  # row r * n + l: head kv_i * rep + r
        if direct:
            scores = torch.bmm(rows, keys_t, out_dtype=torch.float32).mul_(scale)
        else:
            scores = torch.bmm(rows.float() * scale, keys_t)
        scores = scores.view(B, kv, h // kv, n, S)
        scores = scores.masked_fill(~mask[:, :, None, i:i + n], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(values.dtype)
        outs.append(torch.bmm(p.view(B * kv, h // kv * n, S), values).view(B, h, n, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _project_out(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """o_proj of out [B, L, heads * Dv] -> [B, L, H] (row-parallel: all-reduce under tp, its
    bias added once after it)."""
    out = F.linear(out, module.o_proj.weight)
    if module.parallel.tensor_parallel:
        from ..comm import all_reduce_sum
        all_reduce_sum(out, group=module.parallel.group, timeout_s=module.parallel.timeout_s,
                       step=f"layer {module.layer_idx} attention o_proj all_reduce")
    if module.o_proj.bias is not None:
        out = out + module.o_proj.bias
    return out


class DenseMLP(nn.Module):
    """SwiGLU MLP of the dense (non-MoE) layers: down(silu(gate(x)) * up(x)), replicated."""

    def __init__(self, hidden: int, intermediate: int, dtype=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention over this rank's head shard, with optional QK RMSNorm (per head,
    or over the whole projection) and q/k/v clipping.

    Parameters (HF names and layouts, rows/cols of this rank's heads only):
        q_proj.weight [q_heads*D, H], k_proj/v_proj.weight [kv_heads*D, H],
        o_proj.weight [H, q_heads*D] (row-parallel; its bias, when spec.o_proj_bias, is added
        once, after the all-reduce), q_norm/k_norm.weight [D] when spec.qk_norm
        ([q_heads*D] / [kv_heads*D] with spec.qk_norm_whole).
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, shard: HeadShard, parallel: Parallel):
        super().__init__()
        D, H, b, dt = spec.head_dim, spec.hidden_size, spec.attention_bias, spec.dtype
        self.layer_idx, self.shard, self.parallel, self.head_dim = layer_idx, shard, parallel, D
        self.q_proj = nn.Linear(H, shard.q_heads * D, bias=b, dtype=dt)
        self.k_proj = nn.Linear(H, shard.kv_heads * D, bias=b, dtype=dt)
        self.v_proj = nn.Linear(H, shard.kv_heads * D, bias=b, dtype=dt)
        self.o_proj = nn.Linear(shard.q_heads * D, H, bias=spec.o_proj_bias, dtype=dt)
        whole = spec.qk_norm_whole
        self.q_norm = RMSNorm(shard.q_heads * D if whole else D, spec.rms_norm_eps, dt) if spec.qk_norm else None
        self.k_norm = RMSNorm(shard.kv_heads * D if whole else D, spec.rms_norm_eps, dt) if spec.qk_norm else None
        self.qk_norm_whole, self.clip_qkv = whole, spec.clip_qkv
        self.scaling = D ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """x [B, L, H] -> [B, L, H]; cos/sin [B, 1, L, R] (R: the rotary dims of a head); mask
        bool [B, 1, L, S] (True = attend) over the S cached positions after this step's keys
        are written."""
        B, L, _ = x.shape
        D = self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.view(B, L, -1, D), k.view(B, L, -1, D)
        v = v.view(B, L, -1, D).transpose(1, 2)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = _attend(self, q, k, v, positions, mask, cache, self.scaling)
        return _project_out(self, out.transpose(1, 2).reshape(B, L, -1))


# Query positions from which MLA expands its keys and values (prefill). H200, DeepSeek-V3's
# dense + MoE layers in bf16 (bench_out diagnostic mla_expand.py), absorbed / expanded ms per
# prefill: B = 1, L = 128 7.5 / 9.0; L = 256 8.2 / 8.1; L = 1024 14.9 / 11.6; B = 8, L = 256
# 18.2 / 15.2; L = 4096 92 / 31 (benchmarks/engine_step.py).
MLA_EXPAND_ROWS = 256
LATENT_NORM_EPS = 1e-6  # HF builds MLA's latent RMSNorms with its default eps, not rms_norm_eps


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3; models/deepseek_v3.py) over this rank's heads.

    Parameters (HF names; per-head rows / columns of this rank's heads only; Dk = qk_nope +
    qk_rope, Dv = v_head_dim, h = this rank's heads):
        q_a_proj.weight [q_lora, H], q_a_layernorm.weight [q_lora], q_b_proj.weight [h*Dk,
        q_lora] (or q_proj.weight [h*Dk, H] without q_lora_rank), kv_a_proj_with_mqa.weight
        [kv_lora + qk_rope, H], kv_a_layernorm.weight [kv_lora], kv_b_proj.weight
        [h*(qk_nope + Dv), kv_lora], o_proj.weight [H, h*Dv]; q_a_proj, kv_a_proj_with_mqa and
        o_proj carry a bias with spec.attention_bias. The latent projections are replicated.
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, shard: HeadShard, parallel: Parallel):
        super().__init__()
        m, H, b, dt, h = spec.mla, spec.hidden_size, spec.attention_bias, spec.dtype, shard.q_heads
        self.layer_idx, self.shard, self.parallel, self.mla = layer_idx, shard, parallel, m
        Dk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(H, m.q_lora_rank, bias=b, dtype=dt)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dt)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * Dk, bias=False, dtype=dt)
        else:
            self.q_proj = nn.Linear(H, h * Dk, bias=False, dtype=dt)
        self.kv_a_proj_with_mqa = nn.Linear(H, m.kv_lora_rank + m.qk_rope_head_dim, bias=b, dtype=dt)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dt)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim),
                                   bias=False, dtype=dt)
        self.o_proj = nn.Linear(h * m.v_head_dim, H, bias=b, dtype=dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """As Attention.forward; cos/sin [B, 1, L, qk_rope]; `cache` holds the latent
        (MoECausalLM.new_cache: one head of [kv_lora | rotated k_rope], values its first
        kv_lora dims). Below MLA_EXPAND_ROWS query positions (decode) kv_b_proj is absorbed
        (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1.2): scores q_nope . (W_UK c) =
        (q_nope W_UK) . c, and the output W_UV (P c), so keys and values are never expanded
        per head (`_grouped_attention` over the one latent head). A prefill expands the cached
        latents into per-head keys [k_nope | k_rope] and values, as HF does, for SDPA: per
        score it multiplies qk_head_dim + v_head_dim values instead of 2 kv_lora + qk_rope."""
        m = self.mla
        B, L, _ = x.shape
        nope, rope, C = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank
             else self.q_proj(x)).view(B, L, -1, nope + rope).transpose(1, 2)
        q_pass, q_rot = q.split((nope, rope), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((C, rope), dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, L, C)
        turn = apply_rope_interleaved if m.rope_interleave else apply_rope
        q_rot, k_rot = turn(q_rot, cos, sin), turn(k_rot.view(B, 1, L, rope), cos, sin)
        w = self.kv_b_proj.weight.view(q.shape[1], nope + m.v_head_dim, C)  # this rank's heads
        keys, values = cache.write(self.layer_idx, positions, torch.cat((latent, k_rot), dim=-1),
                                   None, _kv_len(mask, L))  # [B, 1, S, C + rope], [B, 1, S, C] (a view)
        if L >= MLA_EXPAND_ROWS:
            h, S = q.shape[1], keys.shape[2]
            k_nope = torch.einsum("bsc,hdc->bhsd", values[:, 0], w[:, :nope])
            k = torch.cat((k_nope, keys[:, :, :, C:].expand(B, h, S, rope)), dim=-1)
            v = torch.einsum("bsc,hvc->bhsv", values[:, 0], w[:, nope:])
            out = _sdpa(torch.cat((q_pass, q_rot), dim=-1), k, v, mask, m.softmax_scale)
            return _project_out(self, out.transpose(1, 2).reshape(B, L, -1))
        q_latent = torch.einsum("bhld,hdc->bhlc", q_pass, w[:, :nope])
        ctx = _grouped_attention(torch.cat((q_latent, q_rot), dim=-1), keys, values, mask,
                                 m.softmax_scale)  # [B, heads, L, C]
        out = torch.einsum("bhlc,hvc->blhv", ctx, w[:, nope:])
        return _project_out(self, out.reshape(B, L, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); the MoE block sees only the
    valid tokens (prompt padding and finished sequences are left out)."""

    def __init__(self, spec: ModelSpec, layer_idx: int, shard: HeadShard, parallel: Parallel):
        super().__init__()
        eps, dt = spec.rms_norm_eps, spec.dtype
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, dt)
        self.self_attn = (LatentAttention if spec.mla is not None else Attention)(
            spec, layer_idx, shard, parallel)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, dt)
        if layer_idx in spec.dense_layers:
            self.mlp = DenseMLP(spec.hidden_size, spec.dense_intermediate_size, dt)
        else:
            from ..topologies import make_topology
            # (one rank: every multi-rank topology is `local`, without its "not initialized" warning)
            topo = make_topology(parallel.topology if parallel.world_size > 1 else "local",
                                 spec.moe.num_experts,
                                 group=parallel.group if parallel.world_size > 1 else None,
                                 backend=parallel.backend,
                                 **({"timeout_s": parallel.timeout_s} if parallel.world_size > 1 else {}))
            self.mlp = MoELayer(spec.moe, topology=topo, backend=parallel.backend)

    def forward(self, x, cos, sin, positions, mask, rows, cache):
        """rows: int64 [n], the valid tokens' indices into the flattened [B * L] (found once per
        forward: a boolean index here would wait for the device in every layer), or None: all
        of them."""
        B = x.shape[0]
        if B:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, cache)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoELayer):
            H = h.shape[-1]
            if rows is None:
                return x + self.mlp(h.reshape(-1, H)).view_as(h)
            y = torch.zeros_like(h)
            y.view(-1, H).index_copy_(0, rows, self.mlp(h.reshape(-1, H).index_select(0, rows)))
        else:
            y = self.mlp(h)
        return x + y


class MoECausalLM(nn.Module):
    """A MoE decoder-only LM on one rank.

    Args:
        spec: the ModelSpec.
        parallel: this rank's Parallel.

    Build it under `torch.device("meta")` and fill it with `loader.load_weights` (which calls
    `load_state_dict(..., assign=True)`), then `.to(device)` if needed and `init_buffers()`.

    Raises:
        ValueError: parallel.world_size > 1 but its process group (parallel.group, None = the
            default group) does not hold this process as rank `parallel.rank` of
            `world_size` ranks, e.g. torch.distributed not initialized: the attention heads
            would be split while the MoE layers and collectives ran as a world of one rank.
        RuntimeError: a group is given but torch.distributed is not initialized.
    """

    def __init__(self, spec: ModelSpec, parallel: Parallel):
        if parallel.world_size > 1:
            got = group_rank_size(parallel.group)
            if got != (parallel.rank, parallel.world_size):
                raise ValueError(
                    f"Parallel({parallel.topology!r}, rank={parallel.rank}, world_size="
                    f"{parallel.world_size}) but the process group has this process as rank "
                    f"{got[0]} of {got[1]}" + ("" if parallel.group is not None or got[1] > 1
                                              else " (torch.distributed is not initialized)")
                    + ": call torch.distributed.init_process_group first (or pass "
                    "Parallel.group); for one process use Parallel() (topology 'local')")
        super().__init__()
        self.spec, self.parallel = spec, parallel
        self.shard = head_shard(spec, parallel)
        dt = spec.dtype
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dt)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.shard, parallel)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dt)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(
            spec.hidden_size, spec.vocab_size, bias=False, dtype=dt)
        self.inv_freq: Optional[torch.Tensor] = None
        self.rope_scaling = 1.0
        for p in self.parameters():
            p.requires_grad_(False)

    def new_cache(self, batch: int, max_len: int, device=None):
        """An empty engine.kv_cache.KVCache for `batch` sequences of up to max_len positions,
        laid out as this rank's attention reads it: keys and values [head_dim] per kv head; for
        MLA one latent head of [kv_lora + qk_rope] whose first kv_lora dims are the values
        (LatentAttention); in the dtype of the embeddings (the activations': spec.dtype unless
        the model was cast since)."""
        from ..engine.kv_cache import KVCache
        s, m = self.spec, self.spec.mla
        dt = self.embed_tokens.weight.dtype
        if m is not None:
            return KVCache(s.num_layers, batch, 1, max_len, m.kv_lora_rank + m.qk_rope_head_dim,
                           dtype=dt, device=device, values_in_keys=m.kv_lora_rank)
        return KVCache(s.num_layers, batch, self.shard.kv_heads, max_len, s.head_dim,
                       dtype=dt, device=device)

    def init_buffers(self) -> None:
        """Compute the RoPE frequencies on the parameters' device (after loading)."""
        inv, self.rope_scaling = rope_parameters(self.spec.hf_config,
                                                 self.spec.rotary_dim or self.spec.head_dim)
        self.inv_freq = inv.to(self.embed_tokens.weight.device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _mask(self, positions: torch.Tensor, S: int) -> torch.Tensor:
        keys = torch.arange(S, device=positions.device)
        p = positions[:, None, :, None]
        mask = keys <= p
        if self.spec.sliding_window:
            mask &= keys > p - self.spec.sliding_window
        return mask

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                valid: Optional[torch.Tensor], last_index: torch.Tensor, cache,
                kv_len: Optional[int] = None, prefill: bool = False) -> torch.Tensor:
        """One prefill or decode step for a batch of sequences.

        Args:
            input_ids: int64 [B, L] (right-padded prompts in prefill; L = 1 in decode).
            positions: int64 [B, L], position of each token in its sequence (its KV slot).
            valid: bool [B, L], tokens that count (not padding, not a finished sequence); only
                these go through the MoE blocks. None: all of them.
            last_index: int64 [B], which of the L positions gives each sequence's logits.
            cache: an `engine.kv_cache.KVCache` with this rank's kv heads and room for
                positions.max() + 1 positions.
            kv_len: the cached positions attention reads, > positions.max() and <= the
                cache's max_len (the mask hides those past each token's position; not checked
                against the positions, which stay on the device); None: positions.max() + 1,
                checked against max_len (ValueError).
            prefill: every row's positions are 0..L-1 and nothing is cached before them (a
                fresh prefill, as scheduler.run_requests makes it): without a sliding window
                the mask is then the causal one, which SDPA applies without materializing it.

        Returns:
            fp32 logits [B, vocab_size]. B may be 0 (a dp rank without requests still runs
            the MoE collectives).

        With `kv_len` and valid None the forward never waits for the device (the MoE layers'
        own forwards permitting: MoELayer.graph_capturable), so a CUDA graph can capture it
        (engine.decode_graph); otherwise it reads positions.max() and the valid rows once.
        """
        B = input_ids.shape[0]
        x = self.embed_tokens(input_ids)
        cos = sin = mask = None
        if B:
            cos, sin = self._rope(positions, x.dtype)
            if not (prefill and not self.spec.sliding_window):
                mask = self._mask(positions, kv_len if kv_len is not None
                                  else int(positions.max()) + 1)
        rows = None if valid is None else valid.flatten().nonzero().flatten()
        for layer in self.layers:
            x = layer(x, cos, sin, positions, mask, rows, cache)
        h = self.norm(x[torch.arange(B, device=x.device), last_index])
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()
