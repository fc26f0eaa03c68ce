"""Mixtral (8x7B, 8x22B): GQA, RoPE, no QK norm, softmax top-k routing always renormalized.

Checkpoints name the MoE block `block_sparse_moe` and the expert projections w1 (gate),
w3 (up), w2 (down); transformers >= 5 holds them in memory as `mlp.experts.gate_up_proj`."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .spec import Architecture, ModelSpec, common_spec_fields


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers MixtralConfig (experts: `num_local_experts`, I:
    `intermediate_size`; the window: `sliding_window`)."""
    moe = MoEConfig(hidden_size=cfg.hidden_size, num_experts=cfg.num_local_experts,
                    top_k=cfg.num_experts_per_tok, moe_intermediate_size=cfg.intermediate_size,
                    scoring="softmax", norm_topk_prob=True, dtype=dtype)
    return ModelSpec(qk_norm=False, moe=moe, **common_spec_fields(cfg, dtype, cfg.sliding_window))


ARCH = Architecture(model_type="mixtral", hf_class_name="MixtralForCausalLM",
                    moe_block_names=("block_sparse_moe", "mlp"), expert_proj_names=("w1", "w3", "w2"),
                    spec_from_config=spec_from_config)
