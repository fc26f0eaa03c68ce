"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v biases (none on o_proj), RoPE,
softmax top-k routing (renormalized only with `norm_topk_prob`, off by default), one shared
expert of width `shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x)),
optional dense layers (`mlp_only_layers` / `decoder_sparse_step`, as Qwen3-MoE).

transformers 5.x `models/qwen2_moe`. Its windowed layers come from `layer_types`
(spec.layer_types_window: all or none; `use_sliding_window` usually windows some, refused).
"""
from __future__ import annotations

import torch

from .qwen3_moe import dense_layers, softmax_moe_config
from .spec import Architecture, ModelSpec, common_spec_fields, layer_types_window


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers Qwen2MoeConfig (experts `num_experts`, k
    `num_experts_per_tok`, I `moe_intermediate_size`, q/k/v biases `qkv_bias`).

    Raises:
        ValueError: sliding windows on some layers only, or common_spec_fields' errors.
    """
    shared = int(cfg.shared_expert_intermediate_size or 0)
    moe = softmax_moe_config(cfg, dtype, shared_expert_intermediate_size=shared,
                             shared_expert_gate=shared > 0)
    fields = common_spec_fields(cfg, dtype, layer_types_window(cfg))
    return ModelSpec(qk_norm=False, moe=moe, dense_layers=dense_layers(cfg),
                     dense_intermediate_size=cfg.intermediate_size,
                     **{**fields, "attention_bias": bool(cfg.qkv_bias), "o_proj_bias": False})


ARCH = Architecture(model_type="qwen2_moe", hf_class_name="Qwen2MoeForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config, shared_expert_name="shared_expert")
