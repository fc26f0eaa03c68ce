"""Dispatch, prefill mode, launch 2 of 2: expert offsets, slots and row copies.

Specialization (constexpr): dtype, H hidden, E local experts, K top-k, WARPS per block, V
vectors per lane per segment. Dynamic: T tokens, N output rows.
One warp per (token, row segment), grid = ceil(T * NSEG / WARPS) (as large as the data needs):
the warp loads the token's segment ONCE (128-bit loads). Launched as a programmatic dependent
launch of launch 1 (dispatch_slots.py), it does so, and lanes j < K load the expert ids of
(t, j), while launch 1 still runs: x and ids were written before launch 1's predecessor
completed, which every block of launch 1 observed in its own wait before it let this launch
start. Then it waits for launch 1 (griddepcontrol.wait); lanes j < K load rank[t, j] while the
block's first warp loads the expert totals (the sum of the workspace's two sets, one of them
zero; each lane loads ceil(E / 32) consecutive experts) and scans them into the expert
offsets in shared memory (one shuffle scan of the lanes' sums); after one block barrier,
lane j < K forms slot = offset[e] + rank, the K slots are broadcast by shuffles, and the warp
stores the segment to each of its local slots. Segment 0's warp writes token_slot; block 0
also writes expert_offsets [E+1] and flips ws[0] for the next launch 1 (see
dispatch_slots.py). Every global store comes after the wait.
Measured on the H200 (benchmarks/local_dispatch_combine.py, T = 4096): every warp loading and
scanning the totals itself cost Qwen3-30B-A3B 4.4 µs (a grid-wide burst of loads of the same
few lines, all released by the same wait), and strong (L1-bypassing) loads of the totals or
a three-barrier block scan cost 5-6 µs; one warp per block with plain loads and one barrier
is what is left. The stores run at the DRAM rate of k scattered row writes: a kernel that only
stores rows to given slots took the same time within 1-3% (Qwen3-30B-A3B T = 16384, DeepSeek-V3
T = 4096), and TMA bulk stores (cp.async.bulk from shared memory) of its segments gained
0.5-1.7% there (not adopted). What the write pattern costs (H200, four runs, fraction of copy
bandwidth; a diagnostic kernel with the same bytes, warps visiting rows in a given order):
writing the k copies of each row to consecutive rows (no expert layout) reached 0.89-0.93 at
T = 16384 and for DeepSeek-V3 at T = 4096 where the same stores at the slots reached 0.85-0.87
(Mixtral T = 16384: 0.90-0.91 against 0.88-0.90); at T = 4096 both moved by run (Qwen3-30B-A3B /
Mixtral: consecutive 0.87-0.97 / 0.85-0.90). Visiting the output in slot order instead (a
gather) scatters the reads: 0.55-0.76; chunks of 256 tokens in slot order inside each chunk
0.82-0.89 (2% above the slots' order for DeepSeek-V3 only), larger chunks 0.59-0.88. L2 eviction
hints (createpolicy handles, `.L2::cache_hint`: x loads evict_last, row stores evict_first) on
this launch's own token order, with x rotated over buffers larger than the L2 so no replay finds
it there: Mixtral T = 16384 0.89 -> 0.93, DeepSeek-V3 T = 4096 / 16384 0.87 -> 0.88 / 0.89,
Qwen3-30B-A3B T = 16384 0.87 -> 0.88; mixed at T = 4096 (Mixtral 0.89 -> 0.87; Qwen3-30B-A3B
0.93 -> 0.88 in one run, 0.85 -> 0.87 in another). On this launch itself (three runs, two
interleaved rounds each, x rotated past the L2): row stores at evict_first 1.0-1.4% faster for
k = 8 (Qwen3-30B-A3B T = 4096 / 16384 0.906 / 0.853 -> 0.917 / 0.863, DeepSeek-V3 0.848 ->
0.859 at both), no gain for Mixtral; with x loads at evict_last too 1.5-2% (Mixtral T = 16384
0.897 -> 0.915, Qwen3-30B-A3B T = 4096 0.926). Not adopted, because the grouped GEMM that runs
next pays for it: its gate/up kernel after this launch (Qwen3-30B-A3B T = 4096, torch.profiler,
three interleaved rounds) took 418.6-420.7 us after plain stores, 422.1-422.6 after evict_first
stores (more than the 0.5 us the stores gained) and 428.6-437.3 with x at evict_last (x's
lines stay in the L2 at the highest priority); resetting x's lines to evict_normal after the
stores (applypriority) left 420.4-426.9 and a 1.3-1.8% gain here (Mixtral T = 16384 0.91):
about even for the layer. At T = 1024 and 16384 the GEMM did not move. Chunks of 256-2048
tokens in slot order inside each chunk with both hints reached 0.90-0.91 (DeepSeek-V3 T = 4096
/ 16384, Qwen3-30B-A3B T = 16384); that needs chunk-ordered slots and a visit order per
position, not built (and the hints' cost moves to the GEMM, as above).
Shared memory: E + 1 offsets.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from .device_counts import warp_exclusive_offsets, warp_padded_totals
from .device_rows import load_segment, num_segments, row_vectors, store_segment, vec_width, \
    warp_unit
from .dispatch_slots import COUNTS_AT


SM_THREADS = 2048  # resident threads per SM, compute capability 9.0 and 10.0 (CUDA C++
# Programming Guide, "Features and Technical Specifications"): at most 64K / 2048 = 32 registers
# per thread at full occupancy


def full_occupancy_blocks(warps: int, v: int, num_experts: int, element_bits: int) -> int:
    """Blocks per SM the copy launch asks ptxas to fit (nvvm.minctasm): all of them for 16-bit
    rows while the row fragment (4 * v registers) and the first warp's totals (one register per
    32 experts) leave room in 32 registers, else no bound (0). ptxas -v, v = 4: 32 registers
    and no spill up to E = 128 for 16-bit rows on sm_90a and sm_100a; fp32 rows spilled at
    E = 128 on sm_100a (the compile test runs ptxas); E = 256 spilled under the bound and takes
    40 registers without it, E = 384 48, E = 1024 64 (8 blocks per SM; not measured).
    Qwen3-30B-A3B at T = 4096 (2048 blocks of 4 warps) is one wave at 16 blocks per SM and two
    at 12: without the bound the offset scan took the kernel from 32 to 40 registers and cost
    3.5 µs (H200). DeepSeek-V3 (E = 256) runs many waves and measured the same at 40."""
    fits = element_bits == 16 and 4 * v + 2 * ((num_experts + 31) // 32) <= 24
    return SM_THREADS // (warps * 32) if fits else 0


@cute.kernel
def dispatch_copy_kernel(mX: cute.Tensor, mIds: cute.Tensor, mRank: cute.Tensor,
                         mWs: cute.Tensor, mOut: cute.Tensor, mOffsets: cute.Tensor,
                         mSlot: cute.Tensor, expert_start: Int32, align: Int32,
                         H: Constexpr[int], E: Constexpr[int], K: Constexpr[int],
                         WARPS: Constexpr[int], V: Constexpr[int]):
    VEC = vec_width(mX.element_type)
    NV = H // VEC
    bidx, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    t, seg = warp_unit(WARPS, num_segments(H, mX.element_type, V))
    smem = cutlass.memory.SmemAllocator()
    s_off = smem.allocate_tensor(Int32, cute.make_layout(E + 1), byte_alignment=16)
    frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), mX.element_type)
    e = Int32(-1)
    if t < mX.shape[0]:
        load_segment(row_vectors(mX[t, None], VEC), frag, lane, seg, V, NV)
        if lane < K:
            e = mIds[t, lane] - expert_start
    cute.arch.griddepcontrol_wait()  # launch 1 complete: ranks and totals are final
    local = t < mX.shape[0] and lane < K and e >= 0 and e < E
    rank = Int32(0)
    if local:
        rank = mRank[t, lane]
    if warp == 0:  # the block's offsets, from launch 1's totals
        pads = warp_padded_totals(mWs, COUNTS_AT, align, lane, E)
        warp_exclusive_offsets(pads, lane, s_off, E, mOffsets, bidx == 0)
        if bidx == 0 and lane == 0:  # the next launch 1 adds into the other set
            mWs[0] = 1 - mWs[0]
    cute.arch.sync_threads()
    if t < mX.shape[0]:
        slot = Int32(-1)
        if local:
            slot = s_off[e] + rank
        if lane < K and seg == 0:
            mSlot[t, lane] = slot
        for j in cutlass.range_constexpr(K):
            dst = cute.arch.shuffle_sync(slot, offset=j)
            if dst >= 0:
                store_segment(row_vectors(mOut[dst, None], VEC), frag, lane, seg, V, NV)


@cute.jit
def dispatch_copy(mX: cute.Tensor, mIds: cute.Tensor, mRank: cute.Tensor, mWs: cute.Tensor,
                  mOut: cute.Tensor, mOffsets: cute.Tensor, mSlot: cute.Tensor,
                  expert_start: Int32, align: Int32, stream, H: Constexpr[int], E: Constexpr[int],
                  K: Constexpr[int], WARPS: Constexpr[int], V: Constexpr[int]):
    """x [T,H] + ranks and totals from launch 1 -> out [N,H], offsets int32 [E+1], slot int32
    [T,K]; a programmatic dependent launch (use_pdl) of launch 1."""
    nseg = num_segments(H, mX.element_type, V)
    dispatch_copy_kernel(mX, mIds, mRank, mWs, mOut, mOffsets, mSlot, expert_start, align, H, E,
                         K, WARPS, V).launch(grid=(cute.ceil_div(mX.shape[0] * nseg, WARPS), 1, 1),
                                             block=(WARPS * 32, 1, 1), stream=stream, use_pdl=True,
                                             min_blocks_per_mp=full_occupancy_blocks(
                                                 WARPS, V, E, mX.element_type.width),
                                             preferred_smem_carveout=-1)  # (-1: CUDA's default)
