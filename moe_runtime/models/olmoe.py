"""OLMoE (OLMoE-1B-7B): GQA whose q / k RMSNorms span the whole projection (all heads at once,
before the split into heads), optional q/k/v clipping (`clip_qkv`), RoPE, softmax top-k routing
(renormalized only with `norm_topk_prob`, off by default), an MoE block in every layer with
experts of width `intermediate_size`.

transformers 5.x `models/olmoe`. Under `tp` the heads of one norm would sit on several ranks,
so OLMoE runs on one rank or with dp_* topologies (transformer.head_shard refuses tp).
"""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .spec import Architecture, ModelSpec, common_spec_fields


def spec_from_config(cfg, dtype: torch.dtype) -> ModelSpec:
    """ModelSpec of a transformers OlmoeConfig (experts `num_experts`, k `num_experts_per_tok`,
    I `intermediate_size`)."""
    moe = MoEConfig(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                    top_k=cfg.num_experts_per_tok, moe_intermediate_size=cfg.intermediate_size,
                    scoring="softmax", norm_topk_prob=bool(cfg.norm_topk_prob), dtype=dtype)
    clip = getattr(cfg, "clip_qkv", None)
    return ModelSpec(qk_norm=True, qk_norm_whole=True,
                     clip_qkv=float(clip) if clip is not None else None, moe=moe,
                     **common_spec_fields(cfg, dtype))


ARCH = Architecture(model_type="olmoe", hf_class_name="OlmoeForCausalLM",
                    moe_block_names=("mlp",), expert_proj_names=("gate_proj", "up_proj", "down_proj"),
                    spec_from_config=spec_from_config)
