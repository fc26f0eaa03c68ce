"""Model families and the HF checkpoint loader.

    spec, arch = read_spec(model_dir, dtype)          # config.json via transformers AutoConfig
    model = load_model(model_dir, parallel, ...)      # this rank's share of the safetensors

Registered families: Qwen3-MoE (`qwen3_moe`), Qwen2-MoE (`qwen2_moe`: Qwen1.5-MoE,
Qwen2-57B-A14B), OLMoE (`olmoe`), Mixtral (`mixtral`), GLM-4-MoE (`glm4_moe`: GLM-4.5 / 4.6 /
4.7), dots.llm1 (`dots1`) and DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3 / R1).
"""
from __future__ import annotations

from . import deepseek_v3, dots1, glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe
from .spec import Architecture, ModelSpec
from .transformer import MoECausalLM, Parallel, head_shard

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    qwen3_moe.ARCH, qwen2_moe.ARCH, olmoe.ARCH, mixtral.ARCH, glm4_moe.ARCH, dots1.ARCH,
    deepseek_v3.ARCH)}


def get_architecture(model_type: str) -> Architecture:
    """The registered family for an HF model_type.

    Raises:
        ValueError: unknown model_type (the message lists the known ones).
    """
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


from .loader import CheckpointError, load_model, read_spec  # noqa: E402

__all__ = ["ARCHITECTURES", "Architecture", "CheckpointError", "ModelSpec", "MoECausalLM",
           "Parallel", "get_architecture", "head_shard", "load_model", "read_spec"]
