"""Bounded, reusable grid barrier and "last block" detection (CuTeDSL device functions).

grid_barrier: one 32-bit word in device memory, zeroed once at allocation, never memset again.
Every block adds 1, block 0 adds 2^31 - (nblocks - 1), so bit 31 flips exactly when the last
block arrives and the low bits return to 0 (the scheme of CUDA cooperative groups'
grid.sync). Each block waits until bit 31 differs from the `old` value its own atomic returned,
so there is no ABA problem and no epoch to pass in: the word is its own generation counter.

The wait is bounded by `max_iters` polls (a strong load each, after a nanosleep back-off when
SLEEP_NS > 0; kernels/peer_sync.wait_bounds converts the multi-rank timeouts). No timer is read:
on the lent H200 (driver 580.159) a %globaltimer or %clock64 read in these wait loops made
one-launch multi-phase kernels fail with "illegal memory access" at valid addresses (the fused
decode combines of kernels/ep_combine.py and kernels/allreduce.py at 2/4/8 virtual ranks,
whatever the poll's scope, ordering, sleep or polling lanes; a core dump put it on the first
poll after the timer read); without any timer read the same kernels pass. %globaltimer bounds
also overshot 50 ms -> 3 s there (measured on the H200).

On timeout the block records `site` in the error words (mapped host memory, see
`moe_runtime.sync.host.ErrorFlags`) and returns ok = 0; callers skip the work that depended on
the barrier. After a timeout the barrier word is inconsistent: the host resets it together
with the error flags (`ErrorFlags.clear`).

No local kernel needs grid_barrier now (the decode dispatch derives its layout in every block,
kernels/dispatch_decode.py); it stays as the tested bounded primitive for one-launch multi-phase
kernels, exercised by `barrier_probe`. last_block_arrive is used by the routing kernel.

Requirements: all blocks co-resident (launch with cooperative=True, grid <= SMs x occupancy),
called from block-uniform control flow by every thread of every block, 1-D grids.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Int64, Uint32
from cutlass.experimental.primitives import nanosleep

from .ordered import atomic_add_acq_rel, atomic_add_release, fence_gpu, ld_acquire, mapped_i32, \
    st_relaxed

PHASE_BIT = 0x80000000


@cute.jit
def record_error(err_addr: Int64, site: Constexpr[int]):
    """Set error word `site` and bump the "any error" word 0 (system scope: the host reads them;
    the bump releases the site word, so a host that sees word 0 set also sees which site)."""
    if err_addr != Int64(0):
        errs = mapped_i32(err_addr)
        st_relaxed(errs + site, Int32(1), "sys")
        cute.arch.atomic_add(errs, Int32(1), sem="release", scope="sys")


@cute.jit
def arrive_and_wait(bar: cute.Pointer, leader, nblocks: Uint32, max_iters: Int32,
                    abort_addr: Int64, SLEEP_NS: Constexpr[int]):
    """One thread per block: arrive at the bit-31 barrier word `bar`, then wait for the flip.

    The leader block adds 2^31 - (nblocks - 1), every other block 1 (release); the thread then
    acquire-polls until bit 31 differs from the value its own atomic returned. It gives up after
    `max_iters` polls or, when `abort_addr` != 0, as soon as
    the int32 there is nonzero (an error already recorded elsewhere). SLEEP_NS > 0 backs off with
    nanosleep between polls. Shared by `grid_barrier` (whole grid) and the multi-rank kernels'
    per-rank barrier (kernels/peer_sync.rank_grid_barrier: the cpr CTAs of one rank).

    Returns:
        (timed_out Boolean, last value read Uint32).
    """
    inc = Uint32(1)
    if leader:
        inc = Uint32(PHASE_BIT) - (nblocks - Uint32(1))
    old = atomic_add_release(bar, inc)
    cur = ld_acquire(bar)
    polls = Int32(0)
    stop = False
    while ((old ^ cur) & Uint32(PHASE_BIT)) == Uint32(0) and not stop:
        if cutlass.const_expr(SLEEP_NS > 0):
            nanosleep(SLEEP_NS)
        cur = ld_acquire(bar)
        polls = polls + 1
        stop = polls >= max_iters
        if abort_addr != Int64(0):
            abort = cute.make_ptr(Int32, abort_addr, cute.AddressSpace.gmem, assumed_align=4)
            stop = stop | (cute.arch.load(abort, Int32, sem="relaxed", scope="gpu") != 0)
    return ((old ^ cur) & Uint32(PHASE_BIT)) == Uint32(0), cur


@cute.jit
def grid_barrier(bar: cute.Pointer, s_flag: cute.Pointer, err_addr: Int64, max_iters: Int32,
                 site: Constexpr[int]) -> Int32:
    """Block-wide call: wait until every block of the grid has arrived.

    Args:
        bar: the Uint32 barrier word (global memory).
        s_flag: one Int32 of shared memory, used to broadcast the outcome to the block.
        err_addr: address of the error words (0: do not record).
        max_iters: the spin bound (polls).
        site: error word index naming this barrier for the host's message.

    Returns:
        1 when the barrier completed, 0 when this block gave up (same value in all its threads).
    """
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        fence_gpu()
        timed_out, _ = arrive_and_wait(bar, bidx == 0, Uint32(nblk), max_iters, Int64(0), 0)
        fence_gpu()
        ok = Int32(1)
        if timed_out:
            ok = Int32(0)
            record_error(err_addr, site)
        cute.arch.store(s_flag, ok)
    cute.arch.sync_threads()
    return cute.arch.load(s_flag, Int32)


@cute.jit
def last_block_arrive(done: cute.Pointer, s_flag: cute.Pointer) -> Int32:
    """Block-wide call after a block's last global update: 1 in the block that arrives last.

    The arrival is an acq_rel atomic on a counter (zero at launch), so the last block observes
    every other block's earlier writes (threadFenceReduction pattern of the CUDA samples). The
    last block must reset `done` to 0 for the next launch. Never waits, so no bound is needed.
    """
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        nblk, _, _ = cute.arch.grid_dim()
        fence_gpu()
        old = atomic_add_acq_rel(done, Uint32(1))
        last = Int32(0)
        if old == Uint32(nblk) - Uint32(1):
            last = Int32(1)
        cute.arch.store(s_flag, last)
    cute.arch.sync_threads()
    return cute.arch.load(s_flag, Int32)


@cute.kernel
def barrier_probe_kernel(mWs: cute.Tensor, absent_block: Int32, rounds: Int32, err_addr: Int64,
                         max_iters: Int32, site: Constexpr[int]):
    """Test hook: `rounds` grid barriers in a row; block `absent_block` never arrives."""
    bidx, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
    bar = cute.recast_ptr(mWs.iterator, dtype=Uint32)
    if bidx != absent_block:
        for _ in cutlass.range(rounds):
            grid_barrier(bar, s_flag.iterator, err_addr, max_iters, site)


@cute.jit
def barrier_probe(mWs: cute.Tensor, absent_block: Int32, rounds: Int32, grid: Int32,
                  err_addr: Int64, max_iters: Int32, stream,
                  site: Constexpr[int]):
    """Launch `barrier_probe_kernel` cooperatively with `grid` blocks of 32 threads."""
    barrier_probe_kernel(mWs, absent_block, rounds, err_addr, max_iters, site).launch(
        grid=(grid, 1, 1), block=(32, 1, 1), cooperative=True, stream=stream)
