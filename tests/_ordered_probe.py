"""A kernel that calls every moe_runtime.sync.ordered primitive at .gpu and .sys scope, compiled
by tests/test_kernels_compile.py to check the PTX each one emits (imports cutlass: load it only
in a process that has set CUTE_DSL_KEEP)."""
import cutlass.cute as cute
from cutlass import Int32, Uint32

from moe_runtime.sync import ordered


@cute.kernel
def ordered_probe_kernel(mFlags: cute.Tensor):
    p = mFlags.iterator
    u = cute.recast_ptr(p, dtype=Uint32)
    for scope in ("gpu", "sys"):
        v = ordered.ld_acquire(u, scope) + ordered.ld_relaxed(u + 1, scope)
        ordered.st_release(p + 2, Int32(v), scope)
        ordered.st_relaxed(p + 3, Int32(v), scope)
        ordered.atomic_add_release(u + 4, Uint32(1), scope)
        ordered.atomic_add_acq_rel(u + 5, Uint32(1), scope)
    ordered.fence_gpu()
    ordered.fence_sys()


@cute.jit
def ordered_probe(mFlags: cute.Tensor):
    ordered_probe_kernel(mFlags).launch(grid=(1, 1, 1), block=(32, 1, 1))
