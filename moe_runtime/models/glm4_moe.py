"""GLM-4-MoE (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): GQA with q/k/v biases (none on o_proj),
RoPE on the first half of each head (`partial_rotary_factor`), optional per-head QK RMSNorm,
dense SwiGLU MLPs in the first `first_k_dense_replace` layers, then MoE blocks routed as
DeepSeek-V3 (fp32 logits, sigmoid + e_score_correction_bias, group-limited top-k,
routed_scaling_factor) with `n_shared_experts` ungated shared experts.

transformers 5.x `models/glm4_moe`; its router weight and correction bias stay float32 in a
bf16 model (`_keep_in_fp32_modules_strict`). The checkpoints' multi-token-prediction layers
(layer index num_hidden_layers) are not part of the model: the loader names them in its
unused-tensor warning."""
from __future__ import annotations

import torch

from .deepseek_v3 import sigmoid_moe_config
from .spec import Architecture, ModelSpec, common_spec_fields


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers Glm4MoeConfig (the MoE as DeepSeek-V3's:
    deepseek_v3.sigmoid_moe_config; dense layers' width `intermediate_size`)."""
    fields = common_spec_fields(cfg, dtype)
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    dense = tuple(range(min(cfg.first_k_dense_replace, cfg.num_hidden_layers)))
    return ModelSpec(qk_norm=bool(cfg.use_qk_norm), moe=sigmoid_moe_config(cfg, dtype),
                     dense_layers=dense, dense_intermediate_size=cfg.intermediate_size,
                     rotary_dim=int(fields["head_dim"] * factor),
                     **{**fields, "o_proj_bias": False})


ARCH = Architecture(model_type="glm4_moe", hf_class_name="Glm4MoeForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config, shared_expert_name="shared_experts",
                    router_fp32=True)
