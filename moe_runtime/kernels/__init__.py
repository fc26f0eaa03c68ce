"""Kernels: CuTeDSL implementations (`cute`) and their torch references (`reference`).

`get_ops(backend)` returns a namespace with `route`, `dispatch` and `combine` of identical
signatures and semantics (see `reference.py`); `resolve_backend` turns "auto" into a choice.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
from typing import Callable

import torch

from . import reference

log = logging.getLogger("moe_runtime")

BACKENDS = ("reference", "cute")

# set while autograd must record the kernels' work (MoELayer.forward with gradients needed)
_DIFFERENTIABLE = contextvars.ContextVar("moe_runtime_differentiable", default=False)


def autograd_records() -> bool:
    """Whether autograd records the ops run now: grad mode on, outside torch.inference_mode()
    (inside it nothing is recorded, even under torch.enable_grad()). While torch.compile
    traces, grad mode alone (dynamo cannot trace torch.is_inference_mode_enabled)."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def forward_ad_active() -> bool:
    """Whether forward-mode AD is on (a `torch.autograd.forward_ad.dual_level`, or a
    `torch.func.jvp` / `jacfwd` transform, which opens one), whatever the grad mode: the ops
    run now need forward derivatives, which neither the CuTeDSL kernels nor
    torch._grouped_mm have. Not asked while torch.compile traces (False)."""
    return not torch.compiler.is_compiling() and torch.autograd.forward_ad._current_level >= 0


@contextlib.contextmanager
def differentiable_kernels():
    """Within this context `resolve_backend` picks the torch reference kernels, which autograd
    records: "auto" resolves to "reference", and an explicit "cute" raises ValueError (the
    CuTeDSL kernels have no backward). MoELayer enters it for forwards that need gradients.
    """
    token = _DIFFERENTIABLE.set(True)
    try:
        yield
    finally:
        _DIFFERENTIABLE.reset(token)


def traceable_cache(fn):
    """functools.lru_cache(fn) for pure functions of hashable arguments, except while
    torch.compile traces: then fn itself (dynamo traces through an lru_cache anyway, ignoring
    it, and warns at every such call)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return cached(*args, **kwargs)
    call.cache_clear = cached.cache_clear
    return call


_CUTLASS_IMPORTABLE = importlib.util.find_spec("cutlass") is not None  # (not traceable)


def cute_available() -> bool:
    """True when nvidia-cutlass-dsl can be imported (the kernels also need a CUDA device)."""
    return _CUTLASS_IMPORTABLE


@functools.lru_cache(maxsize=None)
def _log_once(msg: str) -> None:
    log.warning(msg)


def check_backend_name(backend: str) -> None:
    """ValueError unless backend is "reference", "cute" or "auto" (construction-time check; the
    device is checked per call by resolve_backend, as a layer may move to CUDA later)."""
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device,
                    unsupported: Callable[[], str | None] | None = None) -> str:
    """Pick the kernel backend: "reference", "cute", or "auto" (cute on CUDA when importable and
    the CuTeDSL kernels take the call's shapes).

    Inside `differentiable_kernels()` the answer is always "reference" ("cute" raises). While
    torch.compile traces (the callers: the router, the experts and the `local` topology; the
    multi-rank topologies pick their kernels themselves and are not traceable), grad mode
    decides: with it on, "auto" is "reference" ("cute" raises), as the CuTeDSL kernels have no
    backward (the reference kernels are sync-free torch ops that dynamo traces and
    differentiates); with it off (torch.no_grad() / torch.inference_mode()), the answer is the
    eager one, and `get_ops("cute")` gives the kernels as custom ops (compiled_ops.py).

    Args:
        unsupported: for "auto", asked only where cute would be picked: why the CuTeDSL kernels
            refuse this call's shapes (cute_ops.route_unsupported / rows_unsupported), or None.
            A reason makes "auto" pick "reference" (logged once); an explicit "cute" is left to
            the kernel's own ValueError.

    Raises:
        ValueError: unknown backend name, "cute" on a non-CUDA device / without CuTeDSL, or
            "cute" inside `differentiable_kernels()` or while torch.compile traces with grad
            mode on.
    """
    check_backend_name(backend)
    device = torch.device(device)
    compiling = torch.compiler.is_compiling()
    if compiling and torch.is_grad_enabled():
        if backend == "cute":
            raise ValueError(
                "backend 'cute' is inference-only (the CuTeDSL kernels have no backward) but "
                "torch.compile traces this forward with grad mode on (torch.enable_grad() "
                "inside torch.inference_mode() counts: dynamo cannot see inference mode): "
                "call it under torch.no_grad() / torch.inference_mode() alone, or build the "
                "layer with backend 'auto' (the torch kernels inside the compiled graph) to "
                "train")
        return "reference"
    if not compiling and _DIFFERENTIABLE.get():  # (dynamo refuses ContextVar.get; grad mode
        if backend == "cute":                   # is on wherever this context is entered)
            raise ValueError(
                "backend 'cute' is inference-only (the CuTeDSL kernels have no backward) but "
                "autograd is recording this forward: run it under torch.inference_mode() or "
                "torch.no_grad(), or build the layer with backend 'auto' or 'reference' to train")
        return "reference"
    if backend == "auto":
        if device.type == "cuda" and cute_available():
            reason = unsupported() if unsupported is not None else None
            if reason is None:
                return "cute"
            if not compiling:
                _log_once(f"moe_runtime: the CuTeDSL kernels do not take this layer ({reason}); "
                          "using the torch reference kernels for it")
            return "reference"
        if device.type == "cuda" and not compiling:
            _log_once("moe_runtime: nvidia-cutlass-dsl is not importable; using the torch "
                      "reference kernels on CUDA (pip install 'moe_runtime[gpu]')")
        return "reference"
    if backend == "cute" and (device.type != "cuda" or not cute_available()):
        raise ValueError(f"backend 'cute' needs a CUDA device and nvidia-cutlass-dsl; got "
                         f"device {device}, cutlass importable={cute_available()}")
    return backend


def get_ops(backend: str):
    """The module implementing route/dispatch/combine for a resolved backend name ("cute"
    while torch.compile traces: the kernels as custom ops, compiled_ops.py)."""
    if backend == "reference":
        return reference
    if torch.compiler.is_compiling():
        from . import compiled_ops
        return compiled_ops
    return cute_ops_module()


_CUTE_OPS = []  # [cute_ops] once imported (an import statement costs ~0.5 us a call)


def cute_ops_module():
    """kernels.cute_ops, imported on first use (it imports cutlass)."""
    if not _CUTE_OPS:
        from . import cute_ops
        _CUTE_OPS.append(cute_ops)
    return _CUTE_OPS[0]
