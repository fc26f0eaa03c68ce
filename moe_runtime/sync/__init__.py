"""Device-side synchronization for the CuTeDSL kernels.

ordered.py       memory-ordered loads/stores, atomics and fences (@cute.jit helpers)
grid_barrier.py  bounded, reusable grid barrier; last-block detection; a barrier test probe
host.py          error words in mapped host memory (-> DeviceSyncError), per-stream workspaces

Import the device modules only where nvidia-cutlass-dsl is available; host.py needs torch (and
cuda-python when the error words are first allocated).
"""
from .host import DeviceSyncError, check_errors, raise_pending

__all__ = ["DeviceSyncError", "check_errors", "raise_pending"]
