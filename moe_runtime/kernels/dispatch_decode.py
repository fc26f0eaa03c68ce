"""Dispatch, decode mode: ONE launch, no grid barrier, no global atomics, no memset.

Specialization (constexpr): dtype (from the tensors), H hidden, E local experts, K top-k,
WARPS per block, V 16-byte vectors per lane per row segment, MAX_ITEMS (cap on T * K).
Dynamic: T tokens (T * K <= MAX_ITEMS, checked by the host), N output rows.

Every block computes the whole layout itself from the T * K expert ids (a few KiB at decode
sizes), so blocks never wait for each other:
  1. ranks: warp w owns the items [w * ch * 32, (w + 1) * ch * 32) of the flattened [T, K]
     ids (ch = ceil(T * K / threads) chunks of 32 items; the ids are loaded up front). Chunk by
     chunk, the lanes with the same expert are found with one ballot per bit of the expert id
     (peers = AND over bits of the ballot or its complement, as the lane's bit is 1 or 0);
     an item's rank inside the warp is its lanes-below count plus the warp's running count of
     that expert, kept in shared memory (hist[w, e]; only the group's lowest lane updates it).
     (`match.any.sync` finds the same groups but cost ~0.1 µs per distinct expert in a chunk
     on the H200.)
  2. offsets: hist[:, e] becomes its exclusive prefix over warps (the base of warp w inside
     expert e) and the count of e; a block scan of the counts, each rounded up to `align`,
     gives the expert offsets (block 0 writes expert_offsets).
  3. slot(t, j) = offset[e] + base[w, e] + rank: the rank of (t, j) among the picks of its
     expert in token-major order, so the layout is deterministic and equals reference.dispatch.
  4. copy: one warp per (token, row segment) unit, grid-stride; the warp loads the token's
     segment once (128-bit loads; its first unit is loaded before step 1, overlapping the
     ids' latency) and stores it to each of the token's local slots; the unit with segment 0
     writes the token's row of token_slot.
Measured against another layout (H200, graph replay): blocks that count the ids with
shared-memory atomics (totals, and the picks of tokens before their own) and place only the
tokens they copy were 0.1-0.4 us faster for Qwen3-30B-A3B at T = 32-256 but 0.15-0.25 us slower
at T <= 8 and for DeepSeek-V3 at T = 64 and 256, so the ranking stays.
Where a block's time goes (clock() at the phase boundaries in thread 0, H200 cycles,
Qwen3-30B-A3B T = 1 / 128): ids 380 / 650, ranking 140 / 960, offsets 500 / 620, slots 70 / 300,
copies 550 / 1100. A ranking that ballots every chunk first and lets only each group's lowest
lane touch hist (the peers take its count by a shuffle) was slower: 200 / 1310 cycles. The
padding division runs only for align > 1 (device_counts.round_up; at align = 1 it cost 100-230
cycles of the offsets step: the decode dispatch 0.04-0.2 us faster at T = 32..256 for the three
benchmark shapes). Computing the slots in the copy loop from a packed (warp, expert, rank) per
item, without step 3's pass and barrier, was mixed in two same-run A/Bs: T = 256 0.13-0.40 us
faster (Qwen3, DeepSeek-V3), Qwen3 T = 1 / 8 0.06-0.19 us and DeepSeek-V3 T = 128 0.08-0.14 us
slower; not adopted. Step 2 done by every warp for its own bases (ceil(E / 32) experts per lane,
one warp scan, no block barrier) measured slower for E >= 128 (DeepSeek-V3 T = 32 / 128: 2.41 /
5.77 -> 3.69 / 7.08 us: each warp reads all of hist) and within the run-to-run spread (~0.1 us)
for E = 8..64 (two interleaved runs per form, k = 2..8, T = 1..256); not adopted. Loading 2 or 4
of a warp's copy units (instead of 1) before step 1, so that the copies of wide rows only store,
gained nothing where warps copy several units (DeepSeek-V3 T = 128 / 256: 5.64-5.67 / 9.58-9.61
us with 1, 5.64 / 9.74-9.77 with 2, 5.76-5.78 / 9.56-9.61 with 4: the stores, at ~4 us of bytes,
are what is left) and cost 0.05-0.4 us elsewhere (three interleaved rounds, graph replay).
A kernel for T * K <= 32 in which every warp derives the whole layout alone, one item per lane
(ballot ranks, the warp's counts in shared memory, one warp scan; no block barrier, no block
scan), gained at most 0.1 us and lost up to 0.09 (H200, graph replay, best of three
interleaved rounds, T * K <= 32: Qwen3-30B-A3B T = 1 / 2 / 4 1.50 / 1.56 / 1.59 against 1.44 / 1.49 / 1.50
us, DeepSeek-V3 1.43 / 1.48 / 1.49 against 1.49 / 1.48 / 1.53, Mixtral T = 1 / 2 / 16 1.30 /
1.27 / 1.41 against 1.32 / 1.37 / 1.50): at these sizes the launch and the dependent loads
of ids, x and the stores are the time, not the ranking; not adopted.
Launched as a programmatic dependent launch (PDL): after the router kernel (route_topk.py lets
its dependents start at once) its blocks are resident early and wait for the previous launch
(griddepcontrol.wait) before any global access: x may be the output of any earlier kernel,
which is complete only then. Once the offsets are written it lets its own dependents start
(the expert GEMV's blocks become resident during the copies).
Shared memory: hist int32 [WARPS, E], slot int32 [MAX_ITEMS], (E + 1) offsets.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Uint32

from .device_counts import block_exclusive_scan, round_up
from .device_rows import load_segment, num_segments, row_vectors, store_segment, vec_width


@cute.kernel
def dispatch_decode_kernel(mX: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor,
                           mOffsets: cute.Tensor, mSlot: cute.Tensor, expert_start: Int32,
                           align: Int32, H: Constexpr[int], E: Constexpr[int], K: Constexpr[int],
                           WARPS: Constexpr[int], V: Constexpr[int], MAX_ITEMS: Constexpr[int]):
    THREADS = WARPS * 32
    MAXC = MAX_ITEMS // THREADS  # chunks of 32 items per warp at the cap
    PER_T = (E + THREADS - 1) // THREADS  # experts per thread in step 2
    BITS = max(1, (E - 1).bit_length())  # bits of a local expert id
    VEC = vec_width(mX.element_type)
    NV = H // VEC
    NSEG = num_segments(H, mX.element_type, V)

    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    T = mX.shape[0]
    n = T * K
    ch = (n + THREADS - 1) // THREADS

    smem = cutlass.memory.SmemAllocator()
    s_hist = smem.allocate_tensor(Int32, cute.make_layout((WARPS, E), stride=(E, 1)),
                                  byte_alignment=16)
    s_slot = smem.allocate_tensor(Int32, cute.make_layout(MAX_ITEMS), byte_alignment=16)
    s_off = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    s_warp = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)

    cute.arch.griddepcontrol_wait()  # PDL: the previous launch (the router) is complete
    # first copy unit of this warp: its row segment does not depend on the ids, load it now
    u0 = bidx * WARPS + warp
    n_units = T * NSEG
    uc = cutlass.min(u0, n_units - 1)
    t0 = uc // NSEG
    frag = cute.make_rmem_tensor(cute.make_layout((VEC, V)), mX.element_type)
    load_segment(row_vectors(mX[t0, None], VEC), frag, lane, uc - t0 * NSEG, V, NV)

    # the warp's ids, all loads issued before any use (in range, no branch; chunks past ch
    # re-read chunk 0's line); ev[c] = local expert of item (warp * ch + c) * 32 + lane, or -1
    # (not local / past the end)
    ev = []
    for c in cutlass.range_constexpr(MAXC):
        item = (warp * ch + c) * 32 + lane
        i = cutlass.min(item if c < ch else warp * ch * 32 + lane, n - 1)
        e = mIds[i // K, i % K] - expert_start
        ev.append(e if item < n and e >= 0 and e < E else Int32(-1))
    for i in cutlass.range_constexpr((E + 31) // 32):
        if cutlass.const_expr(E % 32 == 0 or i < E // 32):
            s_hist[warp, lane + i * 32] = 0
        else:
            if lane + i * 32 < E:
                s_hist[warp, lane + i * 32] = 0
    cute.arch.sync_warp()

    # 1. rank of each item inside its warp (token-major), s_slot[item] = rank or -1
    for c in cutlass.range_constexpr(MAXC):
        if c < ch:
            e = ev[c]
            peers = Uint32(cute.arch.vote_ballot_sync(e >= 0))
            for b in cutlass.range_constexpr(BITS):
                bit = (e >> b) & 1
                # lanes whose bit b equals mine: the ballot, or its complement when mine is 0
                peers = peers & (Uint32(cute.arch.vote_ballot_sync(bit == 1))
                                 ^ (Uint32(bit) - Uint32(1)))
            below = Int32(cute.arch.popc(peers & cute.arch.lanemask_lt()))
            item = (warp * ch + c) * 32 + lane
            seen = Int32(0)
            if e >= 0:
                seen = s_hist[warp, e]
            if item < n:
                s_slot[item] = seen + below if e >= 0 else Int32(-1)
            cute.arch.sync_warp()
            if e >= 0 and below == 0:
                s_hist[warp, e] = seen + Int32(cute.arch.popc(peers))
            cute.arch.sync_warp()
    cute.arch.sync_threads()

    # 2. per expert (thread tidx owns experts [tidx * PER_T, +PER_T)): warp bases and the
    # padded count, then the block scan of the padded counts -> offsets
    pads = []
    part = Int32(0)
    for i in cutlass.range_constexpr(PER_T):
        e = tidx * PER_T + i
        run = Int32(0)
        if e < E:
            hs = []
            for w in cutlass.range_constexpr(WARPS):
                hs.append(s_hist[w, e])
            for w in cutlass.range_constexpr(WARPS):
                s_hist[w, e] = run
                run = run + hs[w]
        pad = round_up(run, align)
        pads.append(pad)
        part = part + pad
    excl, total = block_exclusive_scan(part, s_warp, WARPS)
    for i in cutlass.range_constexpr(PER_T):
        e = tidx * PER_T + i
        if e < E:
            s_off[e] = excl
            if bidx == 0:
                mOffsets[e] = excl
        excl = excl + pads[i]
    if bidx == 0 and tidx == 0:
        mOffsets[E] = total
    cute.arch.sync_threads()
    # the expert GEMV after this launch (PDL) may become resident while the rows are copied
    # (it waits for this grid before any global access)
    cute.arch.griddepcontrol_launch_dependents()

    # 3. slots
    for c in cutlass.range_constexpr(MAXC):
        if c < ch:
            e = ev[c]
            if e >= 0:
                item = (warp * ch + c) * 32 + lane
                s_slot[item] = s_off[e] + s_hist[warp, e] + s_slot[item]
    cute.arch.sync_threads()

    # 4. copies
    for u in cutlass.range(u0, n_units, nblk * WARPS):
        t = u // NSEG
        seg = u - t * NSEG
        if u != u0:
            load_segment(row_vectors(mX[t, None], VEC), frag, lane, seg, V, NV)
        dsts = []
        for j in cutlass.range_constexpr(K):
            dsts.append(s_slot[t * K + j])
        for j in cutlass.range_constexpr(K):
            if dsts[j] >= 0:
                store_segment(row_vectors(mOut[dsts[j], None], VEC), frag, lane, seg, V, NV)
        if seg == 0 and lane < K:
            mSlot[t, lane] = s_slot[t * K + lane]


@cute.jit
def dispatch_decode(mX: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor, mOffsets: cute.Tensor,
                    mSlot: cute.Tensor, expert_start: Int32, align: Int32, max_grid: Int32, stream,
                    H: Constexpr[int], E: Constexpr[int], K: Constexpr[int],
                    WARPS: Constexpr[int], V: Constexpr[int], MAX_ITEMS: Constexpr[int]):
    """x [T,H], ids int32 [T,K] (T >= 1, T*K <= MAX_ITEMS) -> out [N,H], offsets int32 [E+1],
    slot int32 [T,K]; grid = min(ceil(T * segments / WARPS), max_grid)."""
    units = mX.shape[0] * num_segments(H, mX.element_type, V)
    grid = cutlass.min(cute.ceil_div(units, WARPS), max_grid)
    dispatch_decode_kernel(mX, mIds, mOut, mOffsets, mSlot, expert_start, align, H, E, K, WARPS,
                           V, MAX_ITEMS).launch(grid=(grid, 1, 1), block=(WARPS * 32, 1, 1),
                                                stream=stream, use_pdl=True)
