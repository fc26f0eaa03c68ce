"""dots.llm1 (rednote-hilab dots.llm1.base / .inst): GQA with per-head QK RMSNorm and full RoPE
(Qwen3's attention), dense SwiGLU MLPs in the first `first_k_dense_replace` layers, then MoE
blocks routed as DeepSeek-V3 (fp32 logits, sigmoid + e_score_correction_bias, group-limited
top-k, routed_scaling_factor) with `n_shared_experts` ungated shared experts.

transformers 5.x `models/dots1` (its MoE code is DeepSeek-V3's up to names, see hf_swap); the
router weight and correction bias stay float32 in a bf16 model (`_keep_in_fp32_modules_strict`).
Windowed layers come from `layer_types` (spec.layer_types_window: all or none).
"""
from __future__ import annotations

import torch

from .deepseek_v3 import sigmoid_moe_config
from .spec import Architecture, ModelSpec, common_spec_fields, layer_types_window


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers Dots1Config (the MoE as DeepSeek-V3's:
    deepseek_v3.sigmoid_moe_config; dense layers' width `intermediate_size`).

    Raises:
        ValueError: sliding windows on some layers only, or common_spec_fields' errors.
    """
    dense = tuple(range(min(cfg.first_k_dense_replace, cfg.num_hidden_layers)))
    return ModelSpec(qk_norm=True, moe=sigmoid_moe_config(cfg, dtype), dense_layers=dense,
                     dense_intermediate_size=cfg.intermediate_size,
                     **common_spec_fields(cfg, dtype, layer_types_window(cfg)))


ARCH = Architecture(model_type="dots1", hf_class_name="Dots1ForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config, shared_expert_name="shared_experts",
                    router_fp32=True)
