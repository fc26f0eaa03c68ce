"""Device helpers shared by the dispatch and combine kernels: 128-bit row segments.

Row segments: a row of `hidden` elements is viewed as nv = hidden / VEC vectors of 16 bytes
(VEC = 16 / element bytes: 8 for bf16/fp16, 4 for fp32). A warp moves a row in segments of
32 * V vectors: lane l handles vectors seg * 32 * V + i * 32 + l for i < V, so each
instruction of the warp touches 512 contiguous bytes. Loads are never inside a branch: in
the last, partial segment the lanes past nv re-load vector nv - 1 (in bounds, discarded) and
only the stores are predicated. A load under a branch made the compiler convert its result
inside the branch, i.e. wait for it there, which serialized the k gathers of combine (measured
on the H200: 1.8 TB/s instead of 3.4). Callers issue all loads of a segment before its
stores (the compiler does not move loads across stores that might alias).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

VEC_BYTES = 16


def vec_width(dtype) -> int:
    """Elements per 16-byte vector for a cutlass numeric type."""
    return VEC_BYTES * 8 // dtype.width


def num_segments(hidden: int, dtype, v: int) -> int:
    """Segments of 32 * v vectors in a row of `hidden` elements."""
    nv = hidden // vec_width(dtype)
    return (nv + 32 * v - 1) // (32 * v)


def row_vectors(row: cute.Tensor, vec: int) -> cute.Tensor:
    """[hidden] row -> ((vec), (hidden / vec)) vector view."""
    return cute.zipped_divide(row, (vec,))


@cute.jit
def load_segment(src: cute.Tensor, frag: cute.Tensor, lane: Int32, seg: Int32,
                 V: Constexpr[int], nv: Constexpr[int]):
    """frag[:, i] = src vector min(seg * 32 * V + i * 32 + lane, nv - 1) for i < V."""
    for i in cutlass.range_constexpr(V):
        c = seg * (32 * V) + i * 32 + lane
        if cutlass.const_expr(nv % (32 * V) != 0):
            c = cutlass.min(c, nv - 1)
        frag[None, i].store(src[None, c].load())


@cute.jit
def store_segment(dst: cute.Tensor, frag: cute.Tensor, lane: Int32, seg: Int32,
                  V: Constexpr[int], nv: Constexpr[int]):
    """dst vector (seg * 32 * V + i * 32 + lane) = frag[:, i] for i < V, vectors >= nv skipped."""
    for i in cutlass.range_constexpr(V):
        c = seg * (32 * V) + i * 32 + lane
        if cutlass.const_expr(nv % (32 * V) == 0):
            dst[None, c].store(frag[None, i].load())
        else:
            if c < nv:
                dst[None, c].store(frag[None, i].load())


@cute.jit
def warp_unit(warps: Constexpr[int], nseg: Constexpr[int]):
    """(token, segment) of this warp when one warp handles one (token, segment) unit."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    unit = bidx * warps + tidx // 32
    t = unit // nseg
    return t, unit - t * nseg
