"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head QK RMSNorm, GQA, RoPE, softmax top-k
routing with optional renormalization, optional dense layers (`mlp_only_layers`)."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .spec import Architecture, ModelSpec, common_spec_fields


def dense_layers(cfg) -> tuple[int, ...]:
    """The layers with a dense MLP in a Qwen2/Qwen3-MoE config: those in `mlp_only_layers`,
    and all but every `decoder_sparse_step`-th (all of them without experts)."""
    E, L = cfg.num_experts, cfg.num_hidden_layers
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(i for i in range(L) if i in only or not (E > 0 and (i + 1) % step == 0))


def softmax_moe_config(cfg, dtype: torch.dtype, **shared_expert) -> MoEConfig:
    """The MoEConfig of a Qwen2/Qwen3-MoE config: softmax top-k over `num_experts`, k
    `num_experts_per_tok`, I `moe_intermediate_size`, renormalized with `norm_topk_prob`;
    `shared_expert`: MoEConfig's shared-expert fields. With num_experts 0 every layer is dense
    and the config (1 expert, k 1) is unused."""
    E = cfg.num_experts
    return MoEConfig(hidden_size=cfg.hidden_size, num_experts=max(E, 1),
                     top_k=cfg.num_experts_per_tok if E > 0 else 1,
                     moe_intermediate_size=cfg.moe_intermediate_size, scoring="softmax",
                     norm_topk_prob=bool(cfg.norm_topk_prob), dtype=dtype, **shared_expert)


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers Qwen3MoeConfig (the MoE: `softmax_moe_config`; the window:
    `sliding_window`, which the config sets to None unless `use_sliding_window`)."""
    return ModelSpec(qk_norm=True, moe=softmax_moe_config(cfg, dtype), dense_layers=dense_layers(cfg),
                     dense_intermediate_size=cfg.intermediate_size,
                     **common_spec_fields(cfg, dtype, cfg.sliding_window))


ARCH = Architecture(model_type="qwen3_moe", hf_class_name="Qwen3MoeForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config)
