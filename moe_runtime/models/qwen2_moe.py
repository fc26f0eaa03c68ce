"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v biases (none on o_proj), RoPE,
softmax top-k routing (renormalized only with `norm_topk_prob`, off by default), one shared
expert of width `shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x)),
optional dense layers (`mlp_only_layers` / `decoder_sparse_step`, as Qwen3-MoE).

transformers 5.x `models/qwen2_moe`. Configs with sliding-window layers are refused: HF applies
the window to some layers only (`layer_types`), the engine to all or none.
"""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .qwen3_moe import dense_layers
from .spec import Architecture, ModelSpec, common_spec_fields


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers Qwen2MoeConfig (experts `num_experts`, k
    `num_experts_per_tok`, I `moe_intermediate_size`, q/k/v biases `qkv_bias`).

    Raises:
        ValueError: sliding-window layers (`layer_types`), or common_spec_fields' errors.
    """
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise ValueError("Qwen2-MoE with sliding-window layers (use_sliding_window) is not "
                         "supported: transformers windows only some layers (layer_types), the "
                         "engine all or none")
    shared = int(cfg.shared_expert_intermediate_size or 0)
    E = cfg.num_experts  # (0: every layer dense; the MoE config is then unused)
    moe = MoEConfig(hidden_size=cfg.hidden_size, num_experts=max(E, 1),
                    top_k=cfg.num_experts_per_tok if E > 0 else 1,
                    moe_intermediate_size=cfg.moe_intermediate_size,
                    scoring="softmax", norm_topk_prob=bool(cfg.norm_topk_prob),
                    shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                    dtype=dtype)
    fields = common_spec_fields(cfg, dtype)
    return ModelSpec(qk_norm=False, moe=moe, dense_layers=dense_layers(cfg),
                     dense_intermediate_size=cfg.intermediate_size,
                     **{**fields, "attention_bias": bool(cfg.qkv_bias), "o_proj_bias": False,
                        "sliding_window": None})


ARCH = Architecture(model_type="qwen2_moe", hf_class_name="Qwen2MoeForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config, shared_expert_name="shared_expert")
