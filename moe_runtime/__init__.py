"""moe_runtime: a distributed Mixture-of-Experts expert-parallel runtime.

Public API:
    MoEConfig, MoELayer          the MoE block and its config
    swap_moe_layers(model, ...)  replace the MoE blocks of an HF transformers model in place
    Engine                       Ray-driven serving of a full MoE model (moe_runtime.engine)
"""
from .config import MoEConfig
from .layer import MoELayer

__all__ = ["MoEConfig", "MoELayer", "swap_moe_layers", "Engine"]
__version__ = "0.1.0"


def __getattr__(name):  # keep `import moe_runtime` light: transformers and Ray load on first use
    if name == "swap_moe_layers":
        from .hf_swap import swap_moe_layers
        return swap_moe_layers
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'moe_runtime' has no attribute {name!r}")
