"""DeepSeek-V3 / R1: multi-head latent attention (MLA), dense SwiGLU MLPs in the first
`first_k_dense_replace` layers, then MoE blocks with fp32 router logits, sigmoid scores +
e_score_correction_bias, group-limited top-k, routed_scaling_factor and `n_shared_experts`
ungated shared experts.

MLA (transformers 5.x `models/deepseek_v3`, DeepseekV3Attention): q = q_b_proj(RMSNorm(
q_a_proj(x))) (or q_proj(x) without `q_lora_rank`), per head [qk_nope | qk_rope]; one latent
kv_a_proj_with_mqa(x) = [kv_lora | k_rope] shared by all heads, kv_b_proj(RMSNorm(kv_lora)) =
per head [k_nope | v]; RoPE (interleaved pairs when `rope_interleave`) on q_rope and k_rope;
softmax scale qk_head_dim^-0.5 times yarn's mscale^2; the two latent RMSNorms use eps 1e-6
whatever rms_norm_eps (as HF builds them). The engine caches the latent, [kv_lora | rotated
k_rope] per position and layer (512 + 64 values at DeepSeek-V3's sizes, where HF's per-head
keys and values take 128 * (192 + 128), ~70x), and absorbs kv_b_proj into the query and the
output (transformer.LatentAttention). The router weight and correction bias stay float32 in a
bf16 model (`_keep_in_fp32_modules_strict`); the checkpoints' multi-token-prediction layer
(index num_hidden_layers) is not part of the model.
"""
from __future__ import annotations

import math

import torch

from ..config import MoEConfig
from .spec import MLA, Architecture, ModelSpec, common_spec_fields


def sigmoid_moe_config(cfg, dtype: torch.dtype) -> MoEConfig:
    """MoEConfig of DeepSeek-V3-style routing (DeepSeek-V3, GLM-4-MoE configs: experts
    `n_routed_experts`, I `moe_intermediate_size`, `n_shared_experts` shared experts of width I)."""
    I = cfg.moe_intermediate_size
    return MoEConfig(hidden_size=cfg.hidden_size, num_experts=cfg.n_routed_experts,
                     top_k=cfg.num_experts_per_tok, moe_intermediate_size=I, scoring="sigmoid",
                     norm_topk_prob=bool(cfg.norm_topk_prob), n_group=cfg.n_group,
                     topk_group=cfg.topk_group,
                     routed_scaling_factor=float(cfg.routed_scaling_factor),
                     use_correction_bias=True, router_logits_fp32=True,
                     shared_expert_intermediate_size=I * (cfg.n_shared_experts or 0), dtype=dtype)


def softmax_scale(cfg, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale^2 for yarn RoPE with `mscale_all_dim` (HF yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        if factor > 1:
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers DeepseekV3Config (MLA sizes `q_lora_rank`, `kv_lora_rank`,
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`)."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    mla = MLA(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
              qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
              v_head_dim=cfg.v_head_dim, rope_interleave=bool(cfg.rope_interleave),
              softmax_scale=softmax_scale(cfg, qk))
    fields = common_spec_fields(cfg, dtype)
    fields.update(num_kv_heads=cfg.num_attention_heads, head_dim=qk)
    dense = tuple(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers)))
    return ModelSpec(qk_norm=False, moe=sigmoid_moe_config(cfg, dtype), dense_layers=dense,
                     dense_intermediate_size=cfg.intermediate_size,
                     rotary_dim=cfg.qk_rope_head_dim, mla=mla, **fields)


ARCH = Architecture(model_type="deepseek_v3", hf_class_name="DeepseekV3ForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config, shared_expert_name="shared_experts",
                    router_fp32=True)
