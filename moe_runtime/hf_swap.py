"""Swap the MoE blocks of HF transformers (>= 5) models for `moe_runtime.MoELayer`, in place.

Supported blocks (transformers 5.x, `transformers/models/<family>/modeling_<family>.py`):

| family      | block class              | router                                   | shared expert                  |
|-------------|--------------------------|------------------------------------------|--------------------------------|
| Qwen3-MoE   | Qwen3MoeSparseMoeBlock   | softmax top-k, `norm_topk_prob` (config) | -                              |
| Qwen2-MoE   | Qwen2MoeSparseMoeBlock   | softmax top-k, `norm_topk_prob` (config) | `shared_expert` MLP, sigmoid `shared_expert_gate` |
| Mixtral     | MixtralSparseMoeBlock    | softmax top-k, always renormalized       | -                              |
| OLMoE       | OlmoeSparseMoeBlock      | softmax top-k, `norm_topk_prob` (config) | -                              |
| DeepSeek-V3 | DeepseekV3MoE            | fp32 logits, sigmoid + e_score_correction_bias, n_group/topk_group, routed_scaling_factor | `shared_experts` MLP (ungated) |

Also supported, because their MoE code (router, experts, shared MLP, block) is the same as a
family above, up to names (`tests/test_hf_swap.py` compares each one's output with HF's):
    * as DeepSeek-V3: DeepSeek-V3.2 (DeepseekV32MoE), GLM-4.5 / 4.6 / 4.7 (Glm4MoeMoE), GLM-4.5V
      (Glm4vMoeTextMoE), GLM-4-MoE-Lite (Glm4MoeLiteMoE), GLM-MoE-DSA (GlmMoeDsaMoE), Kimi-Linear
      (KimiLinearMoE), dots.llm1 (Dots1MoE), Solar-Open (SolarOpenMoE), Bailing-Hybrid
      (BailingHybridMoE);
    * as Qwen2-MoE: Qwen3-Next (Qwen3NextSparseMoeBlock), Qwen4-Exp (Qwen4ExpTextSparseMoeBlock),
      the Qwen3-Omni-MoE talker (Qwen3OmniMoeTalkerTextSparseMoeBlock), and Qwen3.5-MoE
      (Qwen3_5MoeSparseMoeBlock), whose router always renormalizes (no `norm_topk_prob`);
    * as Qwen3-MoE: Mellum (MellumSparseMoeBlock), the Qwen3-Omni-MoE thinker
      (Qwen3OmniMoeThinkerTextSparseMoeBlock), and Qwen3-VL-MoE (Qwen3VLMoeTextSparseMoeBlock),
      whose router always renormalizes;
    * as OLMoE: FlexOlmo (FlexOlmoSparseMoeBlock); as Mixtral: MiniMax-Text-01
      (MiniMaxSparseMoeBlock; MiniMax-M2's block differs and is refused).

Every family stores its routed experts in the fused v5 layout that `Experts` uses as is
(gate_up_proj [E, 2I, H] with the gate rows first, down_proj [E, H, I], SiLU, no bias), its router
weight as [E, H] and its shared expert as three bias-free nn.Linear, so NO tensor is copied for any
of these families: the replacement's parameters and buffers ARE the HF ones (same storage; under
a multi-rank topology the routed experts are a view of this rank's slice, which keeps the whole
[E, ...] HF storage alive: to hold only this rank's experts, load them so in the first place). The
MoELayer is built on the meta device first, so the swap allocates no weight memory at all.

All these blocks return one tensor [batch, seq, H] in transformers 5.x, which MoELayer also
returns.

Differences from the HF module, by design:
    * The routed weights are applied and summed in fp32 (`kernels.reference.combine`); HF Qwen2/3
      and OLMoE round the weights to the activation dtype first and accumulate per expert in the
      activation dtype. In fp32 the two agree to rounding; in bf16 they differ by bf16 rounding.
    * Mixtral's (and MiniMax's) `router_jitter_noise` (training only) is not applied; a block
      with a nonzero one warns (UserWarning, naming its family) at the swap.
    * The parameters are named as in MoELayer (`router.weight`, `shared_expert.gate.weight`,
      ...), but each replacement's state_dict uses the HF block's names (`gate.weight`,
      `shared_expert_gate.weight`, ...) and its load_state_dict takes them (state_dict hooks,
      `_hf_names`), so `save_pretrained` after the swap writes a checkpoint HF loads as is, and
      an HF state_dict loads into the swapped model (strict loading names missing keys as HF
      does; a tensor given under both names is an unexpected key). The renamed submodules are
      also reachable under the HF names (`MoELayer.module_aliases`), so every key is an
      attribute path and torch.distributed.checkpoint's get/set_model_state_dict work on the
      model itself. Not under DDP, FSDP2 or a torch.compile wrapper: those walk the parameters'
      own names, which stay MoELayer's (`router.weight`, where the state_dict says
      `gate.weight`); optimizer state dicts use those names too. Under a multi-rank topology
      a rank's state_dict holds only its own slice of the routed experts, so `save_pretrained`
      there does not give an HF checkpoint: the state_dict warns (UserWarning) when it is taken.
    * `output_router_logits=True`: HF records router logits with forward hooks on its router
      classes, which the swapped model no longer contains; each replacement therefore has a
      forward pre-hook that recomputes its router logits [T, E] (Router.logits, HF's dtype) and
      appends them to transformers' active output collector (a private transformers 5.x API;
      without it the hook is not installed). The hook sits on the MoELayer itself, outside its
      CUDA graphs (`enable_cuda_graphs`), so the logits come from the real rows on every call and
      the replays stay on. The cost is one extra router GEMM, only on calls that ask for them.
    * The submodules under the HF names are this package's modules with their own calls:
      `block.gate(x)` of a swapped block is the Router's, (topk_ids int32 [T, k], topk_weights
      fp32 [T, k]) for x [T, H], where HF's router returns (router_logits, weights, indices);
      `block.gate.logits(x)` gives the logits [T, E]. Hooks on the HF block or its submodules
      do not move to the replacement: the swap warns (UserWarning) naming where they were.
    * A shared expert of width 0 (DeepSeek-V3 `n_shared_experts=0`, Qwen2-MoE
      `shared_expert_intermediate_size=0`: HF keeps an empty MLP, and Qwen2-MoE its [1, H] gate,
      that add zeros) stays a zero-width `SharedExpert` holding those tensors (it adds zeros
      too; config.shared_expert_intermediate_size is 0), so the state_dict keeps HF's keys.
    * The replacement registers its submodules in the HF block's order (`gate` -> router,
      `experts`, shared expert), so `model.parameters()` keeps HF's order and an optimizer
      state_dict saved before the swap (index-based, e.g. HF Trainer's optimizer.pt) resumes.
    * Only plain HF blocks are swapped: every submodule must be a class of the family's
      modeling file, exactly torch.nn.Linear, or the activation. A block holding adapter or
      quantization wrappers (PEFT LoRA / ParamWrapper, bitsandbytes, ...) raises ValueError,
      since the swap takes the plain weights and would drop what the wrapper adds: apply PEFT
      after the swap (outside the routed experts) or merge it first (`merge_and_unload`).
      PEFT applied after the swap matches MoELayer's module names, not HF's: `target_modules`
      "gate" is then Qwen2-MoE's shared-expert gate (`shared_expert.gate`; HF's "gate" is the
      router, here `router`), and the adapter's keys use those names, so such an adapter loads
      into the swapped model, not into the plain HF one (merge it to get an HF checkpoint).
      Adapters inside a MoE layer (e.g. on the shared expert) must share its dtype: PEFT makes
      them fp32 by default (`autocast_adapter_dtype=False` keeps a bf16 model's bf16).
    * Exactly tied router scores pick the smaller expert id (the CuTeDSL router's rule, kept by
      the reference); torch.topk in HF may pick either, so a bf16 model can route a rare tied
      token differently.
    * A cast of the swapped model (`.to(torch.bfloat16)`) converts each MoELayer like any module
      (its config.dtype follows its weights); DeepSeek-V3's e_score_correction_bias stays fp32
      (HF keeps it so when it loads a checkpoint; a plain `.to()` of the HF model would round it).
      Its router weight follows the cast, as under HF's `.to()`; HF's from_pretrained(dtype=
      torch.bfloat16) keeps that fp32 too, so load DeepSeek-V3 in bf16 and swap it rather than
      casting after the swap (a rounded router weight moves some tokens to other experts).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

from .config import MoEConfig
from .experts import SharedExpert
from .kernels import traceable_cache
from .layer import MoELayer
from .param_checks import unwrapped

_MODELS = "transformers.models"
_LAYER_KWARGS = ("backend", "group", "align")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class _Family:
    """How to read one family's HF MoE block (attribute names in transformers 5.x).

    Attributes:
        name: human-readable family name.
        module, block: where the block class lives and its name (matched exactly, no subclasses).
        scoring: MoEConfig.scoring of its router.
        norm_topk_prob: fixed renormalization, or None to read `router.norm_topk_prob`.
        shared: attribute of the shared-expert MLP (gate_proj/up_proj/down_proj), or None.
        shared_gate: attribute of the shared expert's sigmoid gate nn.Linear(H, 1), or None.
        router_logits_fp32: whether HF computes the router linear in fp32.
    """

    name: str
    module: str
    block: str
    scoring: str = "softmax"
    norm_topk_prob: bool | None = None
    shared: str | None = None
    shared_gate: str | None = None
    router_logits_fp32: bool = False


def _modeling(model_dir: str) -> str:
    return f"{_MODELS}.{model_dir}.modeling_{model_dir}"


_QWEN3 = _Family("Qwen3-MoE", _modeling("qwen3_moe"), "Qwen3MoeSparseMoeBlock")
_QWEN2 = _Family("Qwen2-MoE", _modeling("qwen2_moe"), "Qwen2MoeSparseMoeBlock",
                 shared="shared_expert", shared_gate="shared_expert_gate")
_MIXTRAL = _Family("Mixtral", _modeling("mixtral"), "MixtralSparseMoeBlock", norm_topk_prob=True)
_OLMOE = _Family("OLMoE", _modeling("olmoe"), "OlmoeSparseMoeBlock")
_DSV3 = _Family("DeepSeek-V3", _modeling("deepseek_v3"), "DeepseekV3MoE", scoring="sigmoid",
                shared="shared_experts", router_logits_fp32=True)


def _like(base: _Family, name: str, model_dir: str, block: str, **over) -> _Family:
    """A family whose MoE code is `base`'s up to names (module docstring)."""
    return replace(base, name=name, module=_modeling(model_dir), block=block, **over)


FAMILIES = (
    _QWEN3, _QWEN2, _MIXTRAL, _OLMOE, _DSV3,
    _like(_DSV3, "DeepSeek-V3.2", "deepseek_v32", "DeepseekV32MoE"),
    _like(_DSV3, "GLM-4-MoE", "glm4_moe", "Glm4MoeMoE"),
    _like(_DSV3, "GLM-4V-MoE", "glm4v_moe", "Glm4vMoeTextMoE"),
    _like(_DSV3, "GLM-4-MoE-Lite", "glm4_moe_lite", "Glm4MoeLiteMoE"),
    _like(_DSV3, "GLM-MoE-DSA", "glm_moe_dsa", "GlmMoeDsaMoE"),
    _like(_DSV3, "Kimi-Linear", "kimi_linear", "KimiLinearMoE"),
    _like(_DSV3, "dots.llm1", "dots1", "Dots1MoE"),
    _like(_DSV3, "Solar-Open", "solar_open", "SolarOpenMoE"),
    _like(_DSV3, "Bailing-Hybrid", "bailing_hybrid", "BailingHybridMoE"),
    _like(_QWEN2, "Qwen3-Next", "qwen3_next", "Qwen3NextSparseMoeBlock"),
    _like(_QWEN2, "Qwen4-Exp", "qwen4_exp", "Qwen4ExpTextSparseMoeBlock"),
    _like(_QWEN2, "Qwen3.5-MoE", "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", norm_topk_prob=True),
    _like(_QWEN2, "Qwen3-Omni-MoE talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextSparseMoeBlock"),
    _like(_QWEN3, "Mellum", "mellum", "MellumSparseMoeBlock"),
    _like(_QWEN3, "Qwen3-Omni-MoE thinker", "qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock"),
    _like(_QWEN3, "Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
          norm_topk_prob=True),
    _like(_OLMOE, "FlexOlmo", "flex_olmo", "FlexOlmoSparseMoeBlock"),
    _like(_MIXTRAL, "MiniMax", "minimax", "MiniMaxSparseMoeBlock"),
)
_BY_CLASS = {(f.module, f.block): f for f in FAMILIES}


def supported_blocks() -> str:
    """The supported HF block classes, one 'Family (ClassName)' per entry, comma-separated."""
    return ", ".join(f"{f.name} ({f.block})" for f in FAMILIES)


def swap_moe_layers(model: nn.Module, topology="local", **kw) -> nn.Module:
    """Replace every supported HF MoE block of `model` with a MoELayer sharing its weights.

    Args:
        model: an HF transformers 5.x model (any head) or a single supported block. Blocks are
            found anywhere in the module tree and replaced where they are, so the model keeps its
            class, config, device and dtype. MoELayers already in the model are left alone.
        topology: a topology name ("local", "tp", "dp_nvlink", "dp_p2p"), built once per layer
            by MoELayer, or one Topology instance shared by all layers.
        **kw: `backend`, `group`, `align`, passed on to MoELayer.

    Returns:
        `model`, modified in place; when `model` itself is a supported block, the new MoELayer.
        Each replacement's forward maps hidden_states [..., H] (the experts' dtype) to [..., H].

    Warns:
        UserWarning: hooks on a replaced block or its submodules (forward / backward hooks
            other than transformers' output recording, an accelerate hook), which the new
            layer does not carry; a router_jitter_noise, which it does not apply.

    Raises:
        TypeError: a keyword other than backend/group/align.
        ValueError: the model holds an MoE block (a module with an `experts` or `router`
            child) of a class not in the module docstring's table (the message names it and
            lists the supported ones), a supported block that deviates from the supported
            form (activation other than SiLU, unfused or biased experts, pre-5.0 transformers
            layout, a submodule of another class such as a PEFT adapter wrapper), a block
            whose weights are on the meta device (not loaded yet), or no MoE block at all.
            Nothing is replaced when it raises. Errors of MoELayer / the topology pass through.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_moe_layers takes a loaded torch.nn.Module (e.g. "
                        f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__}")
    bad = sorted(set(kw) - set(_LAYER_KWARGS))
    if bad:
        raise TypeError(f"swap_moe_layers got unexpected keyword(s) {bad}; accepted: "
                        f"topology, {', '.join(_LAYER_KWARGS)}")
    found, unsupported = [], []
    _walk(model, "", found, unsupported)
    if unsupported:
        raise ValueError(f"unsupported MoE block(s): {', '.join(unsupported)}; supported: "
                         f"{supported_blocks()}")
    if not found and not _contains_moe_layer(model):
        raise ValueError(f"no MoE block found in {type(model).__name__}; supported: {supported_blocks()}")
    # Build (and validate) every replacement before the first one is installed.
    new = [(path, _build_layer(fam, block, topology, kw)) for path, fam, block in found]
    hooked = [f"{path}.{name}" if name else path or "<root>"
              for path, _, block in found for name, m in block.named_modules() if _user_hooks(m)]
    if hooked:
        warnings.warn(f"swap_moe_layers: hooks on the replaced HF modules are not carried over "
                      f"({', '.join(hooked[:4])}{', ...' if len(hooked) > 4 else ''}: forward / "
                      "backward hooks, or an accelerate hook); register them again on the "
                      "MoELayer (hidden_states [..., H] -> [..., H]) or its router / experts "
                      "after the swap", stacklevel=2)
    jittered = [(fam.name, block.jitter_noise) for _, fam, block in found
                if getattr(block, "jitter_noise", 0)]
    if jittered:
        names = ", ".join(sorted({name for name, _ in jittered}))
        warnings.warn(f"router_jitter_noise={jittered[0][1]} ({names}; applied by HF in training "
                      "only) is not applied by the swapped layers", stacklevel=2)
    for path, layer in new:
        if not path:
            return layer
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    return model


def _walk(module: nn.Module, path: str, found: list, unsupported: list) -> None:
    """Collect (path, family, block) of supported blocks and names of unsupported MoE blocks."""
    if isinstance(module, MoELayer):
        return
    cls = type(module)
    fam = _BY_CLASS.get((cls.__module__, cls.__name__))
    if fam is not None:
        found.append((path, fam, module))
        return
    # an MoE block has an `experts` child, or a `router` one (JetMoE's MLP: router, input_linear,
    # output_linear)
    if "experts" in module._modules or "router" in module._modules:
        unsupported.append(f"{path or '<root>'} ({cls.__module__}.{cls.__name__})")
        return
    for name, child in module.named_children():
        _walk(child, f"{path}.{name}" if path else name, found, unsupported)


def _user_hooks(module: nn.Module) -> bool:
    """Whether `module` has forward / backward (pre-)hooks other than transformers' own output
    recording (installed on a model's first forward; the swapped layers record router logits
    themselves), or an accelerate hook (`_hf_hook`: device placement, offloading)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values(),
             *module._backward_hooks.values(), *module._backward_pre_hooks.values())
    return hasattr(module, "_hf_hook") or any(
        not getattr(h, "__module__", "").startswith("transformers.") for h in hooks)


def _contains_moe_layer(model: nn.Module) -> bool:
    return any(isinstance(m, MoELayer) for m in model.modules())


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return isinstance(act, (SiLUActivation, nn.SiLU))


def _check_plain(fam: _Family, block: nn.Module) -> None:
    """ValueError unless every submodule of `block` is a class of the family's modeling file,
    exactly torch.nn.Linear (wrappers that subclass it add behavior the swap would drop) or an
    activation (transformers.activations, torch.nn's; `_config` then requires SiLU)."""
    activations = ("transformers.activations", "torch.nn.modules.activation")
    foreign = [f"{name} ({type(m).__module__}.{type(m).__name__})"
               for name, m in block.named_modules()
               if type(m).__module__ not in (fam.module, *activations) and type(m) is not nn.Linear]
    if foreign:
        raise ValueError(
            f"{fam.name} block {type(block).__name__}: submodule(s) {', '.join(foreign[:4])} are "
            "not the HF block's own classes (adapter or quantization wrappers, e.g. PEFT LoRA); "
            "the swap takes the plain weights and would drop what they add. Apply PEFT after "
            "swap_moe_layers (outside the routed experts) or merge it first (merge_and_unload)")


def _check_unclipped(where: str, what: str, module: nn.Module) -> None:
    """ValueError where HF clips the SwiGLU (a `limit` set from the config's per-layer
    swiglu_limits, Bailing-Hybrid since transformers 5.25): MoELayer computes it unclipped."""
    limit = getattr(module, "limit", None)
    if limit is not None:
        raise ValueError(f"{where}: its {what} clip the SwiGLU at {limit} (the config's "
                         "swiglu_limits); MoELayer does not clip, so the swap would change the "
                         "output")


def _config(fam: _Family, block: nn.Module) -> MoEConfig:
    """MoEConfig of one HF block, read from its modules (not from the model config)."""
    _check_plain(fam, block)
    router, experts = block.gate, block.experts
    where = f"{fam.name} block {type(block).__name__}"
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        raise ValueError(f"{where}: experts have no fused gate_up_proj; transformers >= 5 is needed")
    layout = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}
    odd = {k: getattr(experts, k) for k, v in layout.items() if getattr(experts, k, v) != v}
    if odd or not _is_silu(experts.act_fn):
        raise ValueError(f"{where}: experts must be SiLU-gated, fused [gate; up], untransposed and "
                         f"bias-free; got act_fn {type(experts.act_fn).__name__}"
                         + (f", {odd}" if odd else ""))
    _check_unclipped(where, "experts", experts)
    dtype = experts.gate_up_proj.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: its experts are {dtype}; MoELayer computes in float32, "
                         f"bfloat16 or float16: load the model in one of them (e.g. "
                         f"from_pretrained(..., dtype=torch.float32)) or cast it (model.float()) "
                         f"before the swap")
    E, H = router.weight.shape
    shared_size = 0  # also 0 for an empty HF shared MLP (DeepSeek-V3 n_shared_experts=0)
    if fam.shared is not None:
        mlp = getattr(block, fam.shared)
        if not _is_silu(mlp.act_fn) or any(getattr(mlp, n).bias is not None for n in _MLP_NAMES):
            raise ValueError(f"{where}: the shared expert must be a bias-free SiLU MLP")
        _check_unclipped(where, "shared expert", mlp)
        shared_size = mlp.gate_proj.out_features
    sigmoid = fam.scoring == "sigmoid"
    return MoEConfig(
        hidden_size=H, num_experts=E, top_k=router.top_k,
        moe_intermediate_size=experts.gate_up_proj.shape[1] // 2, scoring=fam.scoring,
        norm_topk_prob=bool(router.norm_topk_prob if fam.norm_topk_prob is None else fam.norm_topk_prob),
        n_group=router.num_group if sigmoid else 1, topk_group=router.topk_group if sigmoid else 1,
        routed_scaling_factor=float(router.routed_scaling_factor) if sigmoid else 1.0,
        use_correction_bias=getattr(router, "e_score_correction_bias", None) is not None,
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=fam.shared_gate is not None and shared_size > 0,
        router_logits_fp32=fam.router_logits_fp32, dtype=dtype)



def _build_layer(fam: _Family, block: nn.Module, topology, kw: dict) -> MoELayer:
    """A MoELayer whose parameters and buffers are the block's own tensors (no copies)."""
    meta = [n for n, t in (*block.named_parameters(), *block.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(
            f"{fam.name} block {type(block).__name__}: tensors {meta[:4]} are on the meta device "
            "(a model built under torch.device('meta') or with empty weights, or offloaded by "
            "accelerate's device_map to 'disk' / 'cpu' offload); the swap shares the block's "
            "weights, so they must be in memory: load or materialize them first "
            "(from_pretrained without offloading, or model.to_empty(device=...) and "
            "load_state_dict) and then call swap_moe_layers")
    cfg = _config(fam, block)
    layer = MoELayer(cfg, topology=topology, device="meta", **kw)
    layer.router.weight = block.gate.weight
    if cfg.use_correction_bias:
        layer.router.e_score_correction_bias = block.gate.e_score_correction_bias
    layer.load_expert_weights(block.experts.gate_up_proj, block.experts.down_proj)
    if fam.shared is not None:
        if layer.shared_expert is None:  # an empty HF MLP (width 0): kept for its keys
            with warnings.catch_warnings():  # (nn.Linear's init of zero-element tensors)
                warnings.filterwarnings("ignore", "Initializing zero-element tensors")
                layer.shared_expert = SharedExpert(cfg.hidden_size, 0, dtype=cfg.dtype,
                                                   gated=fam.shared_gate is not None, device="meta")
        mlp = getattr(block, fam.shared)
        for name in _MLP_NAMES:
            getattr(layer.shared_expert, name).weight = getattr(mlp, name).weight
        if layer.shared_expert.gate is not None:
            layer.shared_expert.gate.weight = getattr(block, fam.shared_gate).weight
    _order_like(layer, block)
    left = [n for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
    if left:  # every tensor must come from the HF block
        raise RuntimeError(f"{fam.name}: no HF tensor for {left}")
    layer.train(block.training)
    names = _hf_names(fam, cfg, layer)
    layer.register_state_dict_post_hook(_RenameKeys(names, warn_slice=True))
    loading = _LoadHFNames(names)
    layer.register_load_state_dict_pre_hook(loading)
    layer.register_load_state_dict_post_hook(_ReportHFNames(loading))
    layer.module_aliases = _module_aliases(names)
    if _output_collector() is not None:
        layer.register_forward_pre_hook(_keep_router_logits)
        layer.register_forward_hook(_append_router_logits, with_kwargs=True, always_call=True)
    return layer


def _hf_names(fam: _Family, cfg: MoEConfig, layer: MoELayer) -> dict[str, str]:
    """{MoELayer state_dict key: the HF block's key} for the keys whose names differ."""
    names = {"router.weight": "gate.weight"}
    if cfg.use_correction_bias:
        names["router.e_score_correction_bias"] = "gate.e_score_correction_bias"
    if layer.shared_expert is not None:
        for n in _MLP_NAMES:
            names[f"shared_expert.{n}.weight"] = f"{fam.shared}.{n}.weight"
        if layer.shared_expert.gate is not None:
            names["shared_expert.gate.weight"] = f"{fam.shared_gate}.weight"
    return {ours: hf for ours, hf in names.items() if ours != hf}


def _order_like(layer: MoELayer, block: nn.Module) -> None:
    """Reorder the layer's submodules as the HF block's children they replace (HF `gate` is the
    router, the shared expert gate lives in the shared expert), so parameters() and state_dict()
    list the tensors in HF's order."""
    ours = {"gate": "router", "experts": "experts", "shared_expert": "shared_expert",
            "shared_experts": "shared_expert"}
    order = [ours[n] for n in block._modules if n in ours and layer._modules.get(ours[n]) is not None]
    for name in dict.fromkeys(order + list(layer._modules)):
        layer._modules[name] = layer._modules.pop(name)


def _module_aliases(names: dict[str, str]) -> dict[str, str]:
    """{HF attribute: MoELayer submodule path} from `_hf_names`' key pairs (each without the
    trailing part the two keys share, e.g. router.weight / gate.weight -> gate: router), so
    every renamed state_dict key is also an attribute path (MoELayer.module_aliases)."""
    aliases = {}
    for ours, hf in names.items():
        o, h = ours.split("."), hf.split(".")
        while len(o) > 1 and len(h) > 1 and o[-1] == h[-1]:
            o.pop()
            h.pop()
        aliases[".".join(h)] = ".".join(o)
    return aliases


class _RenameKeys:
    """A state_dict post-hook / load_state_dict pre-hook (both get (module, state_dict, prefix,
    ...)) that renames the keys prefix + old to prefix + new for old -> new in `names`. A class,
    not a closure, so that swapped models pickle (torch.save(model)). With `warn_slice`, a layer
    of a multi-rank topology warns that its state_dict holds only its rank's experts."""

    def __init__(self, names: dict[str, str], warn_slice: bool = False):
        self.names = names
        self.warn_slice = warn_slice

    def __call__(self, module, state_dict, prefix, *args):
        # every key under prefix is taken out and put back, renamed where named, so the keys
        # keep their order (a state_dict post-hook sees this module's keys last)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix):]
            state_dict[prefix + self.names.get(rest, rest)] = state_dict.pop(key)
        topo = getattr(module, "topology", None)
        if self.warn_slice and topo is not None and topo.world_size > 1:
            r = module.local_expert_range
            warnings.warn(  # (the same text for every layer: shown once under the default filter)
                f"the state_dict of a '{topo.name}' MoELayer (rank {topo.rank} "
                f"of {topo.world_size}) holds only this rank's routed experts [{r.start}, "
                f"{r.stop}) of {topo.num_experts}; a checkpoint saved from it (save_pretrained) "
                f"lacks the other ranks' experts and does not load into the HF model. Save from "
                f"the model before the swap (or from a 'local' swap) for a full HF checkpoint",
                stacklevel=2)


class _LoadHFNames:
    """A load_state_dict pre-hook: the HF keys of `names` ({MoELayer key: HF key}) become the
    layer's own (a state_dict keyed by the layer's own names, e.g. by parameter names, loads
    too). A tensor under both names is ambiguous: the key under the layer's own name (not a
    key of its state_dict) is taken out, so it is not dropped silently, and its name kept for
    _ReportHFNames, which reports it as unexpected. A class, not a closure (pickling)."""

    def __init__(self, names: dict[str, str]):
        self.names = names
        self.ours = {hf: ours for ours, hf in names.items()}
        self.prefix, self.foreign = "", []

    def __call__(self, module, state_dict, prefix, *args):
        self.prefix = prefix
        self.foreign = [prefix + o for o, hf in self.names.items()
                        if prefix + o in state_dict and prefix + hf in state_dict]
        for key in self.foreign:
            del state_dict[key]
        _RenameKeys(self.ours)(module, state_dict, prefix)


class _ReportHFNames:
    """The load_state_dict post-hook of _LoadHFNames: missing keys under the HF names the
    layer's state_dict uses, the keys it took out as unexpected (strict loading raises)."""

    def __init__(self, loading: _LoadHFNames):
        self.loading = loading

    def __call__(self, module, incompatible):
        p, names = self.loading.prefix, self.loading.names
        missing = incompatible.missing_keys
        missing[:] = [p + names[k[len(p):]] if k.startswith(p) and k[len(p):] in names else k
                      for k in missing]
        incompatible.unexpected_keys.extend(self.loading.foreign)
        self.loading.foreign = []


@traceable_cache
def _output_collector():
    """transformers' context variable of the outputs being recorded, or None where it is absent."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _collected() -> dict | None:
    """transformers' outputs being recorded now, when they include "router_logits"."""
    collector = _output_collector()
    collected = None if collector is None else collector.get()
    return collected if collected is not None and "router_logits" in collected else None


def _keep_router_logits(layer: MoELayer, args: tuple) -> None:
    """Forward pre-hook of the layer: while the model records "router_logits", its router keeps
    the logits it computes in this call (Router.kept_logits; MoELayer.forward clears it when the
    call runs CUDA graphs: a capture computes the padded static rows, a replay runs no Python).
    Decided on every call (assigned only when it changes)."""
    router = unwrapped(layer.router)
    if _collected() is not None:
        router.kept_logits = []
    elif router.kept_logits is not None:
        router.kept_logits = None


def _append_router_logits(layer: MoELayer, args: tuple, kwargs: dict, output) -> None:
    """Forward hook of the layer (also after a forward that raised: it clears what the router
    kept): append its router logits [T, E] where the model records "router_logits": those its
    router computed in this call (no second router GEMM, and autograd saves the same tensors
    whether or not they are recorded, as activation checkpointing's recomputation requires),
    or, when the layer ran CUDA graphs, recomputed from the call's real rows (no autograd then:
    graphs run only without it). Both hooks sit on the layer, not its router: hooks on a
    submodule disable the replays."""
    router = unwrapped(layer.router)
    kept = router.kept_logits
    if kept is not None:
        router.kept_logits = None
    collected = _collected()
    if collected is not None and output is not None:
        if kept:
            logits = kept[-1]
        else:
            x = args[0] if args else kwargs["hidden_states"]
            logits = router.logits(x.reshape(-1, x.shape[-1]))
        collected["router_logits"].append(logits)
