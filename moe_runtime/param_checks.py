"""Checks on tensors and submodules assigned to a MoE layer's modules after construction.

The layer's forward and its kernels size every launch from MoEConfig (E, H, I); a parameter
replaced by one of another shape would otherwise route to experts that do not exist, or drop
tokens, without an error. (Replacements that bypass assignment, `.data = ` or
register_parameter, are caught by the layer's forward: MoELayer._weights_dtype.)
"""
from __future__ import annotations

import torch
from torch import nn


structure_version = [0]  # bumped when a tensor or submodule of a MoE layer's modules is
# assigned (`note_assignment`), or the layer's tensors are converted (MoELayer._apply): the
# layer's cached walk of its tree (MoELayer._tree) is redone when it moved


def note_assignment(module: nn.Module, name: str, value) -> None:
    """Bump structure_version for an assignment to `module` of a tensor or a module, or of None
    where a tensor or module was (not for other attributes, e.g. Router.kept_logits)."""
    if isinstance(value, (torch.Tensor, nn.Module)) or (value is None and (
            name in module._parameters or name in module._buffers or name in module._modules)):
        structure_version[0] += 1


class CheckedModule(nn.Module):
    """An nn.Module whose tensors and submodules, once set, keep their shape when assigned
    again (`check_replacement`), and whose assignments bump structure_version (Router,
    Experts, SharedExpert)."""

    def __setattr__(self, name, value):
        check_replacement(self, name, value)
        note_assignment(self, name, value)
        super().__setattr__(name, value)


_WRAPPED = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrapped(module):
    """The module inside transparent wrappers that forward attribute access to it:
    torch.compile's OptimizedModule (`_orig_mod`), activation checkpointing's CheckpointWrapper
    (`_checkpoint_wrapped_module`), FSDP1 (`_fsdp_wrapped_module`)."""
    children = module.__dict__.get("_modules") if isinstance(module, nn.Module) else None
    if children:
        for attr in _WRAPPED:
            inner = children.get(attr)
            if inner is not None:
                return unwrapped(inner)
    return module


def check_replacement(module: nn.Module, name: str, value) -> None:
    """Raise before `module.name = value` replaces a tensor, or a submodule's `weight`, with
    one of another shape. The dtype may change (FSDP2's mixed precision sets bf16 copies of
    fp32 parameters; MoELayer's forward requires its weights to agree on one, and the Router
    keeps its correction bias fp32).

    Raises:
        ValueError: another shape.
        TypeError: a tensor / submodule where a submodule / tensor was.
    """
    params = module.__dict__.get("_parameters")
    if params is None:  # (no module state yet: copy.deepcopy of a parametrized module sets the
        return          # replica's whole __dict__ through setattr)
    old = params.get(name, module._buffers.get(name))
    if old is None and name in module._modules:
        current = module._modules[name]
        if current is None:
            return
        if not isinstance(value, nn.Module):
            raise TypeError(f"{type(module).__name__}.{name} is a submodule; got {type(value).__name__}")
        old, value = getattr(current, "weight", None), getattr(value, "weight", None)
        name = f"{name}.weight"
        if value is None:  # (a wrapper without a weight attribute: nothing to compare)
            return
    if not isinstance(old, torch.Tensor):
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} must be a tensor, got {type(value).__name__}")
    if value.shape != old.shape:
        raise ValueError(f"{type(module).__name__}.{name} must keep its shape {tuple(old.shape)} "
                         f"(the layer's config sizes every kernel), got {tuple(value.shape)}")


def check_layer_submodule(layer, name: str, value) -> None:
    """Raise before `layer.name = value` replaces a MoELayer's router, experts or shared expert
    with a module of another class or size than its config (E, H, I, local experts).

    Raises:
        TypeError: another class, unwrapped (`unwrapped`; e.g. an adapter wrapper: LoRA on the
            routed experts or the router is not supported).
        ValueError: another size.
    """
    from .experts import Experts, SharedExpert
    from .routing import Router
    if (name not in ("router", "experts", "shared_expert") or value is layer._modules.get(name)
            or (value is None and name == "shared_expert")):
        return  # (re-assigning the same module: e.g. FSDP's and checkpointing's wrap walks)
    c = layer.config
    cls, shape, expected = {
        "router": (Router, lambda m: m.weight.shape, (c.num_experts, c.hidden_size)),
        "experts": (Experts, lambda m: m.gate_up_proj.shape,
                    (layer.topology.num_local_experts, 2 * c.moe_intermediate_size, c.hidden_size)),
        "shared_expert": (SharedExpert, lambda m: m.gate_proj.weight.shape,
                          (c.shared_expert_intermediate_size, c.hidden_size))}[name]
    inner = unwrapped(value)
    if not isinstance(inner, cls):
        raise TypeError(f"MoELayer.{name} must be a {cls.__name__} (or torch.compile / "
                        f"checkpoint / FSDP wrapping one; the layer reads its weights directly: "
                        f"adapter wrappers such as PEFT's are not supported there), got "
                        f"{type(value).__module__}.{type(value).__name__}")
    if tuple(shape(inner)) != expected:
        raise ValueError(f"MoELayer.{name} must match the layer's config: weight {expected}, got "
                         f"{tuple(shape(value))}")
