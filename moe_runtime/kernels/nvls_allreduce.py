"""NVLS (NVLink SHARP multicast) two-shot all-reduce: multimem.ld_reduce / multimem.st on a
multicast address. COMPILED AND PTX-CHECKED ONLY: it must never run on the shared GPU machines
(multicast there can take the host's GPUs out of service).

Selection (`nvls_all_reduce` refuses otherwise): the device reports multicast support AND none of
NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set
(peer_buffers.nvls_allowed) AND the caller supplies multicast addresses (PeerBuffers never
creates any: that would need symmetric memory with multicast, a later multi-GPU issue).

Kernel (rank r of W, n 16-byte vectors, epoch e = 1, 2, ... per call):
  barrier  every CTA b: multimem.red.release.sys +1 on flag[b] (lands on all ranks), then
           acquire-wait until the local flag[b] >= (2e-1) * W  (inputs of all ranks written)
  reduce   vectors [r*n/W, (r+1)*n/W): multimem.ld_reduce (fp32 accumulate in the switch) from
           in_mc, multimem.st of the sum to out_mc (every rank's output)
  barrier  flag[b] >= 2e * W (every slice broadcast everywhere)
The waits are bounded like every other wait (a poll count -> error words; no timer read).
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Int32, Int64, Constexpr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as IRT, dsl_user_op

from ..comm.peer_buffers import nvls_allowed
from .peer_sync import THREADS, i32_at, wait_ge

PTX_EXPECTED = (r"multimem\.ld_reduce\.relaxed\.sys\.global\.add\.acc::f32\.v4\.bf16x2",
                r"multimem\.st\.relaxed\.sys\.global\.v4\.f32",
                r"multimem\.red\.release\.sys\.global\.add\.u32")


def _asm(res, operands, text, cons, loc, ip):
    return llvm.inline_asm(res, operands, text, cons, has_side_effects=True, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def mc_ld_reduce_bf16x8(addr: Int64, *, loc=None, ip=None):
    """8 bf16 at a multicast address, summed over the ranks by the switch (fp32 accumulate)."""
    st = _asm(llvm.StructType.get_literal([IRT.i32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
              "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {$0, $1, $2, $3}, [$4];",
              "=r,=r,=r,=r,l,~{memory}", loc, ip)
    return tuple(Int32(llvm.extractvalue(IRT.i32(), st, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mc_st_b32x4(addr: Int64, a, b, c, d, *, loc=None, ip=None):
    """16 bytes stored to a multicast address (every rank's copy)."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)]
    _asm(None, ops, "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};",
         "l,r,r,r,r,~{memory}", loc, ip)


@dsl_user_op
def mc_red_add_release(addr: Int64, v, *, loc=None, ip=None):
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
         "multimem.red.release.sys.global.add.u32 [$0], $1;", "l,r,~{memory}", loc, ip)


@cute.jit
def nvls_barrier(flag_mc: Int64, flag_local: Int64, target: Int32, tidx: Int32, bidx: Int32,
                 err: Int64, max_spins: Int32, phase: Int32):
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_sys()
        mc_red_add_release(flag_mc + Int64(bidx) * 4, Int32(1))
        wait_ge(i32_at(flag_local) + bidx, target, err, max_spins, phase, Int32(-1))
    cute.arch.sync_threads()


@cute.kernel
def nvls_allreduce_kernel(in_mc: Int64, out_mc: Int64, flag_mc: Int64, flag_local: Int64,
                          err: Int64, n_vec: Int32, epoch: Int32, rank: Int32, max_spins: Int32,
                          world: Constexpr[int]):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    nvls_barrier(flag_mc, flag_local, (2 * epoch - 1) * world, tidx, bidx, err, max_spins, Int32(7))
    per = (n_vec + (world - 1)) // world
    lo = rank * per
    mine = n_vec - lo
    mine = per if mine > per else mine
    for q in cutlass.range(bidx * THREADS + tidx, mine, nblk * THREADS):
        off = Int64(lo + q) * 16
        a, b, c, d = mc_ld_reduce_bf16x8(in_mc + off)
        mc_st_b32x4(out_mc + off, a, b, c, d)
    nvls_barrier(flag_mc, flag_local, 2 * epoch * world, tidx, bidx, err, max_spins,
                 Int32(9))


@cute.jit
def nvls_allreduce_entry(in_mc: Int64, out_mc: Int64, flag_mc: Int64, flag_local: Int64,
                         err: Int64, n_vec: Int32, epoch: Int32, rank: Int32, max_spins: Int32,
                         stream: cuda.CUstream, world: Constexpr[int],
                         num_ctas: Constexpr[int]):
    nvls_allreduce_kernel(in_mc, out_mc, flag_mc, flag_local, err, n_vec, epoch, rank,
                          max_spins, world).launch(
        grid=(num_ctas, 1, 1), block=(THREADS, 1, 1), stream=stream)


@functools.lru_cache(maxsize=None)
def compile_nvls_allreduce(world: int, num_ctas: int, arch: str | None = None):
    """Compile only (bf16). Plain ABI (no tensor arguments, so no TVM-FFI env stream)."""
    z = Int64(0)
    return cute.compile(nvls_allreduce_entry, z, z, z, z, z, Int32(1), Int32(1), Int32(0),
                        Int32(1), cuda.CUstream(0), world, num_ctas,
                        options="--keep-ptx" + (f" --gpu-arch {arch}" if arch else ""))


def nvls_all_reduce(*args, **kwargs):
    """Runtime entry: refuses unless NVLS is allowed (see the module docstring). Even then it is
    not wired: multicast buffers are a later multi-GPU issue, and nothing here creates them."""
    ok, why = nvls_allowed()
    if not ok:
        raise RuntimeError(f"NVLS all-reduce not allowed: {why}")
    raise NotImplementedError("NVLS all-reduce needs multicast peer buffers (not created here); "
                              "only the kernel is implemented (compile_nvls_allreduce)")
