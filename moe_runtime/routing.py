"""Routers: router linear + top-k epilogue (softmax or DeepSeek-V3 sigmoid/group-limited).

The epilogue semantics live in `kernels.reference.route`; on CUDA with CuTeDSL the fused
routing kernel (`kernels.cute_ops.route`) computes the same ids and weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .kernels import autograd_records, cute_ops_module, forward_ad_active, get_ops, resolve_backend
from .param_checks import CheckedModule


# When Router.logits uses the CuTeDSL GEMV (cute_ops.linear_gemv) instead of F.linear: at most
# this many tokens and a router of at most this many weights (E * H). H200, bf16, graph-replayed
# (the router table of benchmarks/expert_gemv.py): Qwen3-30B-A3B's router (128 x 2048) took
# 3.0-3.4 us instead of 4.7-5.2 at T = 1..32 (4.3 vs 5.2 at 64); Mixtral's (8 x 4096) 5.6-5.8
# either way; DeepSeek-V3's (256 x 7168; its logits are fp32 anyway) was slower with the GEMV
# (10.6 vs 6.3 us).
ROUTER_GEMV_MAX_TOKENS = 32
ROUTER_GEMV_MAX_WEIGHTS = 1 << 18


class Router(CheckedModule):
    """Router linear (`weight` [E, H]) and top-k selection.

    Args:
        config: the layer's MoEConfig.
        backend: kernel backend for the epilogue ("auto", "reference", "cute").

    Buffers/parameters:
        weight: [E, H] in config.dtype, as HF `gate.weight` (or fp32 with
            config.router_logits_fp32 when assigned so, as HF keeps GLM-4-MoE's and
            DeepSeek-V3's).
        e_score_correction_bias: fp32 [E] when config.use_correction_bias (DeepSeek-V3).

    kept_logits: None, or a list to which forward appends the logits [T, E] it computes
    (swap_moe_layers sets it while transformers records router logits).
    """

    kept_logits: list | None = None

    def __init__(self, config: MoEConfig, *, backend: str = "auto", device=None):
        super().__init__()
        self.config = config
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                               dtype=config.dtype, device=device))
        if config.use_correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.empty(config.num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        self.reset_parameters()

    def extra_repr(self) -> str:
        c = self.config
        groups = f", n_group={c.n_group}, topk_group={c.topk_group}" if c.n_group > 1 else ""
        return (f"num_experts={c.num_experts}, hidden_size={c.hidden_size}, top_k={c.top_k}, "
                f"scoring={c.scoring}{groups}, backend={self.backend}")

    def reset_parameters(self) -> None:
        """weight ~ N(0, 1/H), e_score_correction_bias = 0, as the constructor draws them (e.g.
        after `to_empty` on a layer built on the meta device)."""
        with torch.no_grad():
            self.weight.normal_(std=self.weight.shape[1] ** -0.5)
            if self.e_score_correction_bias is not None:
                self.e_score_correction_bias.zero_()

    def __setattr__(self, name, value):
        if name == "kept_logits":  # (a plain attribute set on every call: skip Module's checks)
            object.__setattr__(self, name, value)
            return
        if name == "e_score_correction_bias" and isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                raise TypeError(f"Router.e_score_correction_bias must be a floating tensor, got "
                                f"{value.dtype}")
            # (e.g. load_state_dict(assign=True) of a bf16 state dict); a normal tensor stays
            # one when assigned under torch.inference_mode() (later in-place updates, e.g.
            # DeepSeek-V3's bias update or load_state_dict, happen outside it)
            with torch.inference_mode(False), torch.no_grad():  # (the first enables grad mode)
                value = value.float()
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        """A conversion of the module (.to(dtype), .half(), .cuda()) converts the weight; the
        correction bias keeps fp32 (HF keeps it so: it decides the expert choice, and bf16 would
        round it) and only follows the device, converted from its fp32 values. An assigned bias
        is kept fp32 too (`__setattr__`). (The weight follows the cast, as under HF's own
        `.to()`; a buffer is never part of an FSDP group's uniform parameter dtype.)"""
        bias = self._buffers.get("e_score_correction_bias")
        out = super()._apply(fn, recurse)
        new = self._buffers.get("e_score_correction_bias")
        if bias is not None and new is not None and new.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(device=new.device, dtype=torch.float32)
        return out

    def resolved_backend(self, device, logits_dtype: torch.dtype) -> str:
        """The epilogue's backend on `device` for logits of `logits_dtype` (kernels.
        resolve_backend): "auto" takes the reference where the CuTeDSL router refuses this
        configuration (cute_ops.route_unsupported, e.g. more than 1024 experts)."""
        c = self.config

        def unsupported():
            return cute_ops_module().route_unsupported(
                c.num_experts, c.top_k, logits_dtype, scoring=c.scoring, n_group=c.n_group,
                topk_group=c.topk_group)
        return resolve_backend(self.backend, device, unsupported)

    def logits_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype of `logits` for input of `x_dtype`."""
        return torch.float32 if self.config.router_logits_fp32 else x_dtype

    def logits(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """Router logits [T, E]: fp32 when config.router_logits_fp32, else x.dtype (fp32
        accumulation). Decode-sized x with a small router on CUDA takes the CuTeDSL GEMV
        (`_gemv`), otherwise F.linear. backend: `resolved_backend(x.device, x.dtype)` when the
        caller has it (forward), else resolved here."""
        w = self.weight
        if self.config.router_logits_fp32:
            return F.linear(x.float(), w.float())
        if self._gemv(x, w, backend):
            return get_ops("cute").linear_gemv(x, w)
        return F.linear(x, w)

    def _gemv(self, x: torch.Tensor, w: torch.Tensor | None = None,
              backend: str | None = None) -> bool:
        """Speed rule (ROUTER_GEMV_MAX_TOKENS, ROUTER_GEMV_MAX_WEIGHTS) and the GEMV's needs:
        contiguous, 16-byte aligned 16-bit rows of 16-byte multiples and weight on one CUDA
        device with the cute backend, nothing for autograd to record, no forward-mode AD
        (anything else takes F.linear, which accepts it). While torch.compile traces, the
        layout is not tested (dynamo cannot trace data_ptr()): the custom op copies what the
        GEMV cannot read."""
        w = self.weight if w is None else w
        return (x.is_cuda and x.dim() == 2 and x.shape[0] <= ROUTER_GEMV_MAX_TOKENS
                and w.numel() <= ROUTER_GEMV_MAX_WEIGHTS and x.dtype == w.dtype
                and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 8 == 0
                and x.device == w.device
                and (torch.compiler.is_compiling()
                     or (x.is_contiguous() and w.is_contiguous()
                         and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0))
                and not (autograd_records() and (x.requires_grad or w.requires_grad))
                and not forward_ad_active()
                and (backend if backend is not None
                     else self.resolved_backend(x.device, x.dtype)) == "cute")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids int32 [T, k], topk_weights fp32 [T, k]).

        Raises:
            ValueError: x not 2-D with H = the router weight's width, or on another device.
            TypeError: x not floating point, or (unless config.router_logits_fp32, which
                computes the logits in fp32 from any float x) not in the router weight's dtype.
        """
        w = self.weight
        if x.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"router input must be [T, {w.shape[1]}], got {tuple(x.shape)}")
        if not x.is_floating_point() or (x.dtype != w.dtype and not self.config.router_logits_fp32):
            raise TypeError(f"router input must be {w.dtype} (the router weight's dtype), got "
                            f"{x.dtype}")
        if x.device != w.device:
            raise ValueError(f"router input is on {x.device}, the router weight on {w.device}")
        c = self.config
        backend = self.resolved_backend(x.device, self.logits_dtype(x.dtype))
        ops = get_ops(backend)
        logits = self.logits(x, backend)
        if self.kept_logits is not None:  # (swap_moe_layers' router-logits recording)
            self.kept_logits.append(logits)
        ids, weights, _ = ops.route(
            logits, c.top_k, scoring=c.scoring, norm_topk_prob=c.norm_topk_prob,
            correction_bias=self.e_score_correction_bias, n_group=c.n_group,
            topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
            with_counts=False)
        return ids, weights
