"""MoEConfig: the shape and routing rules of one Mixture-of-Experts layer."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEConfig:
    """Static description of one MoE layer.

    Attributes:
        hidden_size: H, the model width.
        num_experts: E, routed experts in the whole layer (all ranks together).
        top_k: k, experts per token, 1 <= k <= E.
        moe_intermediate_size: I, the SwiGLU width of one routed expert.
        scoring: "softmax" (Mixtral, Qwen2/3-MoE, OLMoE) or "sigmoid" (DeepSeek-V3).
        norm_topk_prob: renormalize the k selected weights to sum to 1.
        n_group, topk_group: group-limited top-k (DeepSeek-V3, sigmoid scoring only): experts
            are split into n_group groups, each group scored by the sum of its top-2 scores,
            and only the best topk_group groups are eligible, which must hold >= top_k experts.
            n_group=1 disables it.
        routed_scaling_factor: multiplies the final routed weights (DeepSeek-V3: 2.5).
        use_correction_bias: add `e_score_correction_bias` [E] to the scores for the
            choice of experts only (weights use the unbiased scores), as DeepSeek-V3 (sigmoid
            scoring only).
        shared_expert_intermediate_size: width of the always-on shared expert MLP
            (0 = none). DeepSeek-V3 uses n_shared_experts * moe_intermediate_size.
        shared_expert_gate: Qwen2-MoE's sigmoid gate on the shared expert output.
        router_logits_fp32: compute the router linear in fp32 (DeepSeek-V3's HF router does);
            otherwise in the activation dtype (Mixtral, Qwen2/3-MoE, OLMoE).
        dtype: parameter and activation dtype: torch.float32, torch.bfloat16 or torch.float16,
            or its name ("float32", "bfloat16", "float16", as in HF configs' torch_dtype).

    Raises:
        TypeError: a size that is not an int, a flag that is not a bool.
        ValueError: on inconsistent sizes (k > E, E % n_group != 0, k > topk_group * E / n_group,
            ...) or softmax scoring with n_group > 1 or a correction bias.
    """

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: Scoring = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_logits_fp32: bool = False
    dtype: torch.dtype = field(default=torch.bfloat16)

    def __post_init__(self):
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", _DTYPES[self.dtype])
        for name in ("hidden_size", "num_experts", "top_k", "moe_intermediate_size", "n_group",
                     "topk_group", "shared_expert_intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, int(v))  # (a numpy integer: the int it holds)
        for name in ("norm_topk_prob", "use_correction_bias", "shared_expert_gate",
                     "router_logits_fp32"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
        for name in ("hidden_size", "num_experts", "top_k", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be >= 0 (0 = none), got "
                             f"{self.shared_expert_intermediate_size}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(
                self.routed_scaling_factor, numbers.Real):
            raise TypeError(f"routed_scaling_factor must be a number, got "
                            f"{type(self.routed_scaling_factor).__name__} {self.routed_scaling_factor!r}")
        # (a numpy scalar: the float it holds)
        object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got "
                             f"{self.routed_scaling_factor}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.scoring == "softmax" and (self.n_group > 1 or self.use_correction_bias):
            raise ValueError(f"scoring='softmax' takes no group-limited top-k or correction bias (got "
                             f"n_group={self.n_group}, use_correction_bias={self.use_correction_bias}): "
                             "those are DeepSeek-V3's sigmoid routing")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= topk_group ({self.topk_group}) * experts per group "
                f"(num_experts {self.num_experts} // n_group {self.n_group}): the group-limited "
                "top-k could not pick top_k distinct experts")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
