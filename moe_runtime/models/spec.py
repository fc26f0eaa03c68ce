"""ModelSpec: the architecture-independent description of a MoE decoder, read from config.json.

An architecture module (`qwen3_moe.py`, `qwen2_moe.py`, `olmoe.py`, `mixtral.py`, `glm4_moe.py`,
`dots1.py`, `deepseek_v3.py`) turns an HF transformers config into a ModelSpec and names the checkpoint
tensors; `transformer.py` builds the network from the spec and `loader.py` fills it from
safetensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..config import MoEConfig


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek-V3; models/deepseek_v3.py).

    Attributes:
        q_lora_rank: rank of the query compression (None: a plain q_proj).
        kv_lora_rank: rank of the shared key/value latent.
        qk_nope_head_dim, qk_rope_head_dim: per-head query/key dims without and with RoPE.
        v_head_dim: per-head value dim.
        rope_interleave: RoPE on interleaved pairs (HF apply_rotary_pos_emb_interleave).
        softmax_scale: the attention scale (qk_head_dim^-0.5, times yarn's mscale^2).
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and rules of one MoE decoder-only model.

    Attributes:
        model_type: HF `model_type` ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "glm4_moe",
            "dots1", "deepseek_v3").
        vocab_size, hidden_size (H), num_layers: as in config.json.
        num_heads, num_kv_heads, head_dim: attention heads (GQA when num_kv_heads < num_heads).
        qk_norm: RMSNorm on q and k before RoPE (Qwen3, GLM-4-MoE's `use_qk_norm`: per head).
        qk_norm_whole: with qk_norm, the RMSNorm spans the whole q / k projection (all heads
            at once: OLMoE), so tp, which splits the heads, is refused (head_shard).
        clip_qkv: clamp q, k and v to [-clip_qkv, clip_qkv] after the norms (OLMoE), or None.
        attention_bias: q/k/v projections carry a bias.
        o_proj_bias: o_proj carries a bias (Llama-style configs: as attention_bias; GLM-4-MoE:
            never).
        rotary_dim: RoPE rotates the first rotary_dim dims of each head (GLM-4-MoE:
            head_dim * partial_rotary_factor; DeepSeek-V3: qk_rope_head_dim); 0 = all of
            head_dim.
        mla: multi-head latent attention (DeepSeek-V3) instead of GQA, or None. Then head_dim
            is the per-head query/key dim (qk_nope + qk_rope) and num_kv_heads = num_heads
            (heads split under tp as queries are); the KV cache holds the latent instead
            (MoECausalLM.new_cache).
        rms_norm_eps: epsilon of every RMSNorm.
        sliding_window: attend to at most this many previous positions (None = full causal).
        max_position_embeddings: the most positions the engine feeds a request (its prompt +
            max_new_tokens - 1: the last new token is sampled, not fed).
        moe: MoEConfig of every MoE layer (dtype = the model's dtype).
        dense_layers: indices of layers with a dense SwiGLU MLP instead of MoE (Qwen3
            `mlp_only_layers` / `decoder_sparse_step`, GLM-4-MoE `first_k_dense_replace`),
            width `dense_intermediate_size`.
        tie_word_embeddings: lm_head shares embed_tokens' weight.
        eos_token_ids: generation stops when one of these is sampled.
        hf_config: the transformers config object (RoPE parameters come from it).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    attention_bias: bool
    rms_norm_eps: float
    sliding_window: Optional[int]
    max_position_embeddings: int
    moe: MoEConfig
    o_proj_bias: bool = False
    qk_norm_whole: bool = False
    clip_qkv: Optional[float] = None
    rotary_dim: int = 0
    mla: Optional[MLA] = None
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        """Raises ValueError for sizes no model has (a damaged config.json: a 0 there failed
        later, e.g. as a prompt "exceeding" max_position_embeddings 0)."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {window!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.moe.dtype


def eos_ids(value) -> tuple[int, ...]:
    """config.eos_token_id (None, int or list) -> a tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_parameters(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim // 2], attention scaling) for the config's RoPE type.

    "default" RoPE is computed here (theta from `rope_parameters["rope_theta"]`, or the older
    `rope_theta` attribute); other types (yarn, linear, llama3, dynamic, ...) use transformers'
    ROPE_INIT_FUNCTIONS so scaled checkpoints keep their numerics ("dynamic" rescales only past
    max_position_embeddings, which the engine does not reach).

    Raises:
        ValueError: a rope_type transformers does not know, or "longrope" (HF switches its
            short / long factors by sequence length at run time; computed once here it would
            give other numerics silently).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    if rope_type == "longrope":
        raise ValueError("rope_type 'longrope' is not supported: transformers switches its short "
                         "and long factors by sequence length while it runs, which the engine "
                         "does not do")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv.float(), float(scaling)


@dataclass(frozen=True)
class Architecture:
    """One model family: how to read its config and how its checkpoint names MoE tensors.

    Attributes:
        model_type: HF `model_type` in config.json.
        hf_class_name: the transformers CausalLM class (make-checkpoint and numerics tests).
        moe_block_names: submodule names that hold the router (`gate`) and the experts in
            checkpoints, first = the one transformers' save_pretrained writes.
        expert_proj_names: per-expert (gate, up, down) projection names in checkpoints.
        spec_from_config: (HF config, dtype) -> ModelSpec.
        shared_expert_name: the MoE block's shared-expert MLP in checkpoints (its
            gate_proj / up_proj / down_proj), when the family has one.
        router_fp32: the router weight stays float32 in a bf16 / fp16 model, as HF keeps it
            (`_keep_in_fp32_modules_strict`; the correction bias always does).
    """

    model_type: str
    hf_class_name: str
    moe_block_names: tuple[str, ...]
    expert_proj_names: tuple[str, str, str]
    spec_from_config: Any = field(compare=False, repr=False)
    shared_expert_name: Optional[str] = None
    router_fp32: bool = False


def layer_types_window(cfg) -> Optional[int]:
    """The sliding window of a config that marks its windowed layers in `layer_types`
    (Qwen2-MoE, dots.llm1): `sliding_window` when every layer is "sliding_attention", None when
    none is.

    Raises:
        ValueError: only some layers are windowed (the engine windows all layers or none).
    """
    types = list(getattr(cfg, "layer_types", None) or ())
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None
    if all(sliding):
        return int(cfg.sliding_window)
    raise ValueError(f"{cfg.model_type}: sliding-window attention on some layers only "
                     f"({sum(sliding)} of {len(types)} in layer_types) is not supported: the "
                     "engine windows all layers or none")


def common_spec_fields(cfg, dtype: torch.dtype, sliding_window: Optional[int] = None) -> dict:
    """The ModelSpec fields every Llama-style HF config spells the same way, with
    `sliding_window`: a family's HF model reads the config's key its own way, or not at all
    (GLM-4-MoE, OLMoE, DeepSeek-V3 build full causal masks whatever config.json holds), so each
    family passes its window (none by default).

    Raises:
        ValueError: a `hidden_act` other than SiLU (the engine's MLPs and experts are SwiGLU)."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported: the engine's MLPs and experts "
                         "are SiLU-gated (SwiGLU)")
    heads = cfg.num_attention_heads
    return dict(
        model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        o_proj_bias=bool(getattr(cfg, "attention_bias", False)),
        rms_norm_eps=float(cfg.rms_norm_eps), sliding_window=sliding_window,
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        eos_token_ids=eos_ids(getattr(cfg, "eos_token_id", None)), hf_config=cfg)
