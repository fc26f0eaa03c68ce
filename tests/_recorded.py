"""Replace the compiled multi-rank kernels by recorders: CPU tests run the host code of the cute
calls (validation, peer buffer tables, epochs, launch arguments) up to the launch."""
from __future__ import annotations

from typing import Any, Callable


def record_launches(patch: Callable[[Any, str, Any], None]) -> list[tuple[str, tuple, tuple]]:
    """Patch compile_dispatch / compile_combine / compile_allreduce with recorders through
    `patch(module, name, value)` (monkeypatch.setattr; plain setattr in a throwaway process).

    Returns the list each launch appends (kernel name, compile key, launch args) to."""
    from moe_runtime.kernels import allreduce, ep_combine, ep_dispatch
    calls: list[tuple[str, tuple, tuple]] = []

    def recorder(name):
        def compile_(*key, **kw):
            return lambda *args: calls.append((name, key, args))
        return compile_

    patch(ep_dispatch, "compile_dispatch", recorder("dispatch"))
    patch(ep_combine, "compile_combine", recorder("combine"))
    patch(allreduce, "compile_allreduce", recorder("allreduce"))
    return calls
