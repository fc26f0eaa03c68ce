"""CuTeDSL route / dispatch / combine (kernels/cute_ops.py) against the torch reference on a GPU.

Every output the kernels allocate is poisoned first (torch.empty is patched to fill NaN for
floats and -7 for integers), so a row or slot the kernel forgets to write shows up.
Dispatch: rows bit-exact through token_slot, expert_offsets exact, every slot of an expert
used exactly once (prefill: the order inside an expert may differ from the reference; decode:
token_slot equals the reference's, the layout is deterministic). Combine: rel err
<= 1e-2 (16-bit) against float64. Route: ids identical, weights within fp32 rounding.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from moe_runtime.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                       reason="nvidia-cutlass-dsl is not installed"),
]

DEV = "cuda"
MODES = ("decode", "prefill")
_real_empty = torch.empty


@pytest.fixture
def ops(monkeypatch):
    """cute_ops with torch.empty poisoned (NaN / -7) for the duration of a test."""
    from moe_runtime.kernels import cute_ops

    def poisoned(*size, dtype=None, device=None, **kw):
        t = _real_empty(*size, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)
    torch.manual_seed(0)  # fresh random data per test, reproducible on this machine
    yield cute_ops
    torch.cuda.synchronize()
    cute_ops.check_errors()


def rand_ids(T, E, k, gen=None):
    """Distinct expert ids per token, int32 [T, k]."""
    return torch.rand(T, E, device=DEV, generator=gen).topk(k, dim=1).indices.to(torch.int32)


def check_dispatch(x, ids, out, *, expert_start, num_local_experts, align=1, exact_slots=False):
    ex, off, slot = out
    rx, roff, rslot = reference.dispatch(x, ids, expert_start=expert_start,
                                         num_local_experts=num_local_experts, align=align)
    T, k = ids.shape
    assert ex.shape == rx.shape and ex.dtype == x.dtype
    assert off.dtype == torch.int32 and slot.dtype == torch.int32 and slot.shape == (T, k)
    assert torch.equal(off, roff), f"offsets {off.tolist()} != {roff.tolist()}"
    if exact_slots:
        assert torch.equal(slot, rslot), "decode layout differs from the token-major reference"
    assert torch.equal(slot < 0, rslot < 0), "local/non-local picks differ"
    local = slot >= 0
    s = slot[local].long()
    e = ids[local].long() - expert_start
    assert bool(((s >= off[e]) & (s < off[e] + (roff[e + 1] - roff[e]))).all()), "slot outside expert"
    # every slot of an expert used exactly once: same multiset as the reference's slots
    assert torch.equal(torch.sort(s).values, torch.sort(rslot[local].long()).values)
    t = torch.arange(T, device=DEV).unsqueeze(1).expand(T, k)[local]
    assert torch.equal(ex[s].view(torch.int16 if x.element_size() == 2 else torch.int32),
                       x[t].view(torch.int16 if x.element_size() == 2 else torch.int32))


def check_combine(y, expert_y, slot, w, tol):
    T = slot.shape[0]
    assert y.shape == (T, expert_y.shape[1]) and y.dtype == expert_y.dtype
    valid = slot >= 0
    rows = expert_y[slot.clamp(min=0).long()].double()
    ref = (torch.where(valid, w.double(), 0.0).unsqueeze(-1)
           * torch.where(valid.unsqueeze(-1), rows, 0.0)).sum(1)
    err = (y.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30) if T else 0.0
    assert torch.isfinite(y).all() and err <= tol, f"rel err {err:.3e} > {tol}"


# ----------------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,H,E,k", [
    (torch.bfloat16, 2048, 128, 8), (torch.bfloat16, 7168, 256, 8), (torch.float16, 4096, 8, 2),
    (torch.float32, 2880, 64, 6), (torch.bfloat16, 576, 384, 8), (torch.bfloat16, 128, 8, 1)])
@pytest.mark.parametrize("T", [1, 7, 100, 1000])
def test_dispatch_matches_reference(ops, mode, dtype, H, E, k, T):
    x = torch.randn(T, H, device=DEV).to(dtype)
    ids = rand_ids(T, E, k)
    if mode == "decode" and T * k > ops.DISPATCH_DECODE_MAX_ITEMS:
        with pytest.raises(ValueError, match="use mode='prefill'"):
            ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=mode)
        return
    out = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=mode)
    check_dispatch(x, ids, out, expert_start=0, num_local_experts=E, exact_slots=mode == "decode")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["one_expert", "empty_experts", "rank_filter", "align16",
                                  "align128_filter", "no_local", "negative_ids"])
def test_dispatch_edge_cases(ops, mode, case):
    T, H, E, k = 300, 2048, 64, 4
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    start, n_local, align = 0, E, 1
    ids = rand_ids(T, E, k)
    if case == "one_expert":
        ids = torch.full((T, 1), 5, device=DEV, dtype=torch.int32)
    elif case == "empty_experts":  # only experts 3, 17, 40, 41 get tokens
        ids = torch.tensor([3, 17, 40, 41], device=DEV, dtype=torch.int32).repeat(T, 1)
    elif case == "rank_filter":
        start, n_local = 16, 16
    elif case == "align16":
        align = 16
    elif case == "align128_filter":
        start, n_local, align = 48, 16, 128
    elif case == "no_local":
        start, n_local = 64, 8
    elif case == "negative_ids":  # masked picks (-1) and ids below expert_start are not local
        start, n_local = 8, 32
        ids[torch.rand(T, k, device=DEV) < 0.3] = -1
    out = ops.dispatch_in_mode(x, ids, expert_start=start, num_local_experts=n_local, align=align,
                               mode=mode)
    assert out[0].shape[0] == reference.dispatch_capacity(T, ids.shape[1], n_local, align)
    check_dispatch(x, ids, out, expert_start=start, num_local_experts=n_local, align=align,
                   exact_slots=mode == "decode")


@pytest.mark.parametrize("case", ["T1_k1", "odd_hidden", "one_vector_rows", "max_experts_align",
                                  "small_block_max_experts", "small_block_cap",
                                  "mid_block_cap_one_expert", "cap", "cap_one_expert",
                                  "one_block_per_sm_loops", "one_local_expert_align"])
def test_dispatch_decode_edge_cases(ops, case):
    """The barrier-free decode kernel at its edges: one pick, rows of partial segments or a
    single 16-byte vector, E = 1024 (the largest shared-memory layout) with padding, exactly
    the item cap of each block shape (cute_compile.DISPATCH_DECODE_SHAPES: all warps own full
    chunks), a cap on one expert (ranks up to cap - 1)."""
    T, H, E, k, dtype, start, n_local, align = {
        "T1_k1": (1, 2048, 128, 1, torch.bfloat16, 0, 128, 1),
        "small_block_max_experts": (3, 512, 1280, 8, torch.bfloat16, 256, 1024, 4),
        "small_block_cap": (8, 2048, 128, 8, torch.bfloat16, 0, 128, 1),   # 64 items: 2 warps
        "mid_block_cap_one_expert": (256, 1024, 8, 2, torch.bfloat16, 0, 8, 1),  # 512 items
        "odd_hidden": (37, 2888, 64, 6, torch.bfloat16, 0, 64, 1),   # 361 vectors: 12 segments
        "one_vector_rows": (300, 4, 16, 3, torch.float32, 0, 16, 8),
        "max_experts_align": (200, 1024, 1280, 8, torch.bfloat16, 256, 1024, 4),
        "cap": (256, 1024, 128, 8, torch.float16, 0, 128, 1),
        "cap_one_expert": (2048, 256, 64, 1, torch.bfloat16, 0, 64, 16),
        # one block per SM (cute_ops.dispatch_decode_grid), each warp copying ~7 units of 29
        # segments (the last partial), 128 of 256 experts local, padded
        "one_block_per_sm_loops": (256, 7176, 256, 8, torch.bfloat16, 64, 128, 4),
        # a single local expert of 64, 8 warps (800 items), padded
        "one_local_expert_align": (200, 1024, 64, 4, torch.bfloat16, 5, 1, 8),
    }[case]
    assert T * k <= ops.DISPATCH_DECODE_MAX_ITEMS
    x = torch.randn(T, H, device=DEV).to(dtype)
    ids = rand_ids(T, E, k)
    if case == "cap_one_expert":
        ids.fill_(9)
    if case == "mid_block_cap_one_expert":  # every token's first pick on expert 5
        ids[:, 0], ids[:, 1] = 5, ids[:, 1] % 5
    out = ops.dispatch_in_mode(x, ids, expert_start=start, num_local_experts=n_local, align=align,
                               mode="decode")
    check_dispatch(x, ids, out, expert_start=start, num_local_experts=n_local, align=align,
                   exact_slots=True)


DECODE_CAPS = (64, 128, 256, 512, 1024, 2048)  # cute_compile.DISPATCH_DECODE_SHAPES' caps


@pytest.mark.parametrize("items", sorted(set(DECODE_CAPS) | {c + 1 for c in DECODE_CAPS[:-1]}))
def test_dispatch_decode_every_block_shape(ops, items):
    """Each decode block shape (cute_compile.DISPATCH_DECODE_SHAPES) at exactly its item cap
    (k = 8) and one item past the cap of the shape below it (k = 1: one lane of a new chunk)."""
    from moe_runtime.kernels.cute_compile import DISPATCH_DECODE_SHAPES
    assert DECODE_CAPS == tuple(cap for _, cap in DISPATCH_DECODE_SHAPES)
    k = 8 if items % 8 == 0 else 1
    T, H, E = items // k, 640, 64
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    ids = rand_ids(T, E, k)
    out = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode="decode")
    check_dispatch(x, ids, out, expert_start=0, num_local_experts=E, exact_slots=True)


def test_dispatch_decode_item_cap(ops):
    """Above the cap, decode is refused and the automatic choice is prefill."""
    cap, k, H = ops.DISPATCH_DECODE_MAX_ITEMS, 8, 256
    assert ops.select_dispatch_mode(cap // k, k, H, torch.bfloat16) == "decode"
    assert ops.select_dispatch_mode(cap // k + 1, k, H, torch.bfloat16) == "prefill"
    x = torch.randn(cap // k + 1, H, device=DEV).to(torch.bfloat16)
    ids = rand_ids(cap // k + 1, 64, k)
    with pytest.raises(ValueError, match="at most"):
        ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=64, mode="decode")
    check_dispatch(x, ids, ops.dispatch(x, ids, expert_start=0, num_local_experts=64),
                   expert_start=0, num_local_experts=64)


@pytest.mark.parametrize("mode", MODES)
def test_dispatch_zero_tokens(ops, mode):
    x = _real_empty(0, 4096, device=DEV, dtype=torch.bfloat16)
    ids = _real_empty(0, 8, device=DEV, dtype=torch.int32)
    ex, off, slot = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=32, align=8,
                                         mode=mode)
    assert ex.shape == (32 * 7, 4096) and slot.shape == (0, 8)
    assert torch.equal(off, torch.zeros(33, device=DEV, dtype=torch.int32))


def test_dispatch_auto_mode_and_decode_1000_calls(ops):
    """1000 back-to-back decode launches with varying T (1..256, up to the item cap): no state
    carries between launches; offsets and the slots of every call are checked on the device
    (no sync): slots against the token-major rank computed by torch."""
    H, E, k = 1024, 128, 8
    assert ops.select_dispatch_mode(1, k, H, torch.bfloat16) == "decode"
    assert ops.select_dispatch_mode(16384, k, 7168, torch.bfloat16) == "prefill"
    x_all = torch.randn(256, H, device=DEV).to(torch.bfloat16)
    bad = torch.zeros((), device=DEV, dtype=torch.int64)
    kept = []
    for i in range(1000):
        T = 1 + (i * 37) % 256
        ids = rand_ids(T, E, k)
        out = ops.dispatch_in_mode(x_all[:T], ids, expert_start=0, num_local_experts=E,
                                   mode="decode")
        flat = ids.flatten().long()
        counts = torch.bincount(flat, minlength=E)
        ref_off = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        same = flat.unsqueeze(0) == flat.unsqueeze(1)  # [n, n]: rank = same expert, earlier item
        rank = torch.tril(same, diagonal=-1).sum(1)
        bad += (out[1] != ref_off).sum() + (out[2].flatten() != ref_off[flat] + rank).sum()
        if i % 97 == 0:
            kept.append((T, ids, out))
    ops.check_errors()
    assert bad.item() == 0
    for T, ids, out in kept:
        check_dispatch(x_all[:T], ids, out, expert_start=0, num_local_experts=E, exact_slots=True)


def test_dispatch_prefill_300_calls(ops):
    """300 prefill dispatches back to back, nothing launched between them (each copy launch
    is followed at once by the next slots launch), T = 1..3000, alignments 1 and 16, 40 local
    experts of 64 (expert_start 16: some picks not local): the expert totals' two workspace
    sets (each slots launch clears the set the previous dispatch used; the copy launch adds
    both) carry nothing between launches. Every call checked afterwards as
    test_dispatch_matches_reference."""
    H, E, start, n_local = 256, 64, 16, 40
    x_all = torch.randn(3000, H, device=DEV).to(torch.bfloat16)
    calls = [(1 + (i * 389) % 3000, (1, 16)[i % 2]) for i in range(300)]
    ids_all = [rand_ids(T, E, 6) for T, _ in calls]
    torch.cuda.synchronize()
    outs = [ops.dispatch_in_mode(x_all[:T], ids, expert_start=start, num_local_experts=n_local,
                                 align=align, mode="prefill")
            for (T, align), ids in zip(calls, ids_all)]
    ops.check_errors()
    for (T, align), ids, out in zip(calls, ids_all, outs):
        check_dispatch(x_all[:T], ids, out, expert_start=start, num_local_experts=n_local,
                       align=align)


def test_two_prefill_dispatches_in_one_cuda_graph(ops):
    """Two prefill dispatches of the same experts in one graph (one workspace, two parity
    flips per replay), replayed with new ids each time."""
    H, E, k = 512, 40, 4
    x = torch.randn(700, H, device=DEV).to(torch.bfloat16)
    ids = [rand_ids(700, E, k), rand_ids(300, E, k)]
    for i in ids:  # eager first: compiles, creates the workspace
        ops.dispatch_in_mode(x[:i.shape[0]], i, expert_start=0, num_local_experts=E, mode="prefill")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in ids:
            ops.dispatch_in_mode(x[:i.shape[0]], i, expert_start=0, num_local_experts=E,
                                 mode="prefill")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs = [ops.dispatch_in_mode(x[:i.shape[0]], i, expert_start=0, num_local_experts=E,
                                         align=8, mode="prefill") for i in ids]
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        for i in ids:
            i.copy_(rand_ids(i.shape[0], E, k))
        g.replay()
        torch.cuda.synchronize()
        for i, o in zip(ids, outs):
            check_dispatch(x[:i.shape[0]], i, o, expert_start=0, num_local_experts=E, align=8)


def test_dispatch_and_combine_in_a_cuda_graph(ops):
    """No host sync inside: both modes capture, and replays see new ids and rows."""
    T, H, E, k = 64, 2048, 64, 6
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    ids = rand_ids(T, E, k)
    w = torch.rand(T, k, device=DEV)
    for mode in MODES:  # eager first: compiles, creates the per-stream workspaces
        ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=mode)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for mode in MODES:
            ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=mode)
            ops.combine_in_mode(x, torch.zeros_like(ids), w, mode=mode)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs = [ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E, mode=m)
                    for m in MODES]
            ys = [ops.combine_in_mode(o[0], o[2], w, mode=m) for o, m in zip(outs, MODES)]
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        x.copy_(torch.randn(T, H, device=DEV).to(torch.bfloat16))
        ids.copy_(rand_ids(T, E, k))
        g.replay()
        torch.cuda.synchronize()
        for o, y in zip(outs, ys):
            check_dispatch(x, ids, o, expert_start=0, num_local_experts=E)
            check_combine(y, o[0], o[2], w, 1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_programmatic_dependent_launch_chains_match_synchronized_runs(ops, mode):
    """Programmatic dependent launches give back to back, bit for bit, what they give with a
    device sync after every launch: no kernel reads its input before the kernel writing it is
    done. The chain is MoELayer's decode chain, logits GEMV (cute_ops.linear_gemv, the router's
    at T <= 32: it lets its dependents start once its loads are issued) -> route (resident
    during the GEMV; lets the decode dispatch start early) -> dispatch (prefill: the slots
    launch lets the copy start early) -> GEMV -> GEMV -> combine (each resident before its
    predecessor ends), plus a dispatch of a GEMV's output straight after that GEMV and a
    combine of that dispatch's rows straight after it. Each round's x is the previous round's
    combine output, and its logits are computed from x."""
    T, H, I, E, k, rounds = 8, 512, 256, 16, 4, 30
    g = torch.Generator(device=DEV).manual_seed(11)
    w_router = (torch.randn(E, H, device=DEV, generator=g) * H ** -0.5).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV, generator=g) * I ** -0.5).to(torch.bfloat16)
    x0 = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)

    def chain(sync):
        step = torch.cuda.synchronize if sync else (lambda: None)
        x, outs = x0, []
        for i in range(rounds):
            logits = ops.linear_gemv(x, w_router)
            step()
            ids, w, _ = ops.route(logits, k)
            step()
            ex, off, slot = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=E,
                                                 mode=mode)
            step()
            act = ops.expert_gemv(ex, off, w13, swiglu=True)
            step()
            ey = ops.expert_gemv(act, off, w2, swiglu=False)
            step()
            again, _, again_slot = ops.dispatch_in_mode(ey[:T], ids, expert_start=0,
                                                        num_local_experts=E, mode=mode)
            step()
            back = ops.combine(again, again_slot, w)
            step()
            x = ops.combine(ey, slot, w)
            step()
            outs += [x, again, back]
        return outs

    want = chain(sync=True)
    assert all(bool(torch.isfinite(o).all()) for o in want)
    for _ in range(3):
        got = chain(sync=False)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_grid_barrier_timeout_raises_naming_the_step(ops):
    from moe_runtime.sync import DeviceSyncError

    dev = torch.device(DEV)
    ops.launch_barrier_probe(dev, grid=8, absent_block=-1, rounds=200, max_polls=1 << 22)
    ops.check_errors()  # all blocks arrive: 200 barriers, no error
    ops.launch_barrier_probe(dev, grid=8, absent_block=3, rounds=1, max_polls=20000)
    with pytest.raises(DeviceSyncError, match="grid barrier probe timed out"):
        ops.check_errors()
    ops.check_errors()  # cleared
    x = torch.randn(5, 256, device=DEV).to(torch.bfloat16)
    ids = rand_ids(5, 16, 2)
    out = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=16, mode="decode")
    check_dispatch(x, ids, out, expert_start=0, num_local_experts=16)


def test_grid_barrier_word_is_reused_across_launches_without_a_memset(ops):
    """One barrier word for 1000 launches of 1..132 blocks and 1..4 barriers each (odd counts
    leave bit 31 set for the next launch): no timeout, and the word ends with its low bits zero
    and bit 31 equal to the parity of all the barriers passed."""
    dev = torch.device(DEV)
    ws = torch.zeros(4, dtype=torch.int32, device=DEV)
    total = 0
    for i in range(1000):
        grid, rounds = 1 + (i * 37) % 132, 1 + i % 4
        ops.launch_barrier_probe(dev, grid=grid, absent_block=-1, rounds=rounds,
                                 max_polls=1 << 22, ws=ws)
        total += rounds
    ops.check_errors()
    word = int(ws[0]) & 0xFFFFFFFF
    assert word & 0x7FFFFFFF == 0 and word >> 31 == total % 2, (hex(word), total)


def test_workspaces_made_under_inference_mode_are_cleared_outside_it(ops):
    """A workspace first asked for under torch.inference_mode() (a new stream's prefill
    dispatch) is a normal tensor: a device error raised outside inference mode zeroes it
    (ErrorFlags.clear) and surfaces as DeviceSyncError, not an inference-tensor RuntimeError."""
    from moe_runtime.sync import DeviceSyncError

    dev = torch.device(DEV)
    x = torch.randn(300, 256, device=DEV).to(torch.bfloat16)
    ids = rand_ids(300, 16, 2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(s):
        ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=16, mode="prefill")
    torch.cuda.synchronize()
    ops.launch_barrier_probe(dev, grid=8, absent_block=3, rounds=1, max_polls=20000)
    with pytest.raises(DeviceSyncError, match="grid barrier probe timed out"):
        ops.check_errors()
    out = ops.dispatch_in_mode(x, ids, expert_start=0, num_local_experts=16, mode="prefill")
    check_dispatch(x, ids, out, expert_start=0, num_local_experts=16)


def test_boundary_validation(ops):
    x = torch.randn(4, 256, device=DEV).to(torch.bfloat16)
    ids = rand_ids(4, 8, 2)
    kw = dict(expert_start=0, num_local_experts=8)
    with pytest.raises(TypeError, match="topk_ids dtype"):
        ops.dispatch(x, ids.long(), **kw)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # odd hidden: the policy
        ops.dispatch(torch.randn(4, 255, device=DEV).to(torch.bfloat16), ids, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        ops.dispatch(torch.randn(4, 512, device=DEV).to(torch.bfloat16)[:, :256], ids, **kw)
    flat = torch.randn(4 * 256 + 1, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.dispatch(flat[1:].view(4, 256), ids, **kw)
    with pytest.raises(ValueError, match="rows"):
        ops.dispatch(x, ids[:3], **kw)
    with pytest.raises(ValueError, match="CUDA"):
        ops.dispatch(x.cpu(), ids.cpu(), **kw)
    with pytest.raises(TypeError, match="topk_weights dtype"):
        ops.combine(x, ids, torch.rand(4, 2, device=DEV).double())
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        ops.combine(torch.randn(8, 7, device=DEV).half(), ids, torch.rand(4, 2, device=DEV))


# ------------------------------------------------------------------------------------ combine
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,H,k", [(torch.bfloat16, 2048, 8), (torch.bfloat16, 7168, 8),
                                       (torch.float16, 4096, 2), (torch.float32, 2880, 6),
                                       (torch.bfloat16, 576, 1)])
@pytest.mark.parametrize("T", [0, 1, 33, 2000])
def test_combine_matches_float64(ops, mode, dtype, H, k, T):
    N = T * k + 5
    expert_y = torch.randn(N, H, device=DEV).to(dtype)
    slot = torch.randperm(N, device=DEV)[: T * k].view(T, k).to(torch.int32)
    slot[torch.rand(T, k, device=DEV) < 0.2] = -1  # non-local picks (rank filter)
    w = torch.rand(T, k, device=DEV)
    y = ops.combine_in_mode(expert_y, slot, w, mode=mode)
    check_combine(y, expert_y, slot, w, 1e-2 if dtype != torch.float32 else 1e-5)
    if T:
        ref = reference.combine(expert_y, slot, w)
        assert (y.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()


def test_combine_decode_both_block_shapes(ops, monkeypatch):
    """Decode combine at the last T of its one-warp blocks and the first T of its four-warp
    blocks (cute_compile.combine_shape): the launch takes that shape and matches float64."""
    from moe_runtime.kernels import cute_compile as cc
    H, k = 2048, 8  # bf16: 8 segments of 512 bytes per row
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    last = cc.COMBINE_NARROW_UNITS_PER_SM * sms // 8
    launched = []
    compiled = cc.combine_fn
    monkeypatch.setattr(cc, "combine_fn",
                        lambda *a, **kw: launched.append(a[3]) or compiled(*a, **kw))
    for T, warps in ((last, 1), (last + 1, cc.COMBINE_WARPS["decode"])):
        expert_y = torch.randn(T * k, H, device=DEV).to(torch.bfloat16)
        slot = torch.randperm(T * k, device=DEV).view(T, k).to(torch.int32)
        w = torch.rand(T, k, device=DEV)
        check_combine(ops.combine_in_mode(expert_y, slot, w, mode="decode"), expert_y, slot, w,
                      1e-2)
        assert launched[-1] == warps, (T, launched)


def test_combine_ignores_nan_rows_of_unused_slots(ops):
    """-1 picks must not read anything: a NaN row 0 (e.g. padding) cannot leak into y."""
    expert_y = torch.randn(16, 1024, device=DEV).to(torch.bfloat16)
    expert_y[0] = float("nan")
    slot = torch.tensor([[-1, 3], [5, -1]], device=DEV, dtype=torch.int32)
    w = torch.rand(2, 2, device=DEV)
    for mode in MODES:
        check_combine(ops.combine_in_mode(expert_y, slot, w, mode=mode), expert_y, slot, w, 1e-2)
    no_rows = _real_empty(0, 1024, device=DEV, dtype=torch.bfloat16)
    y = ops.combine(no_rows, torch.full((3, 2), -1, device=DEV, dtype=torch.int32), w[:1].expand(3, 2).contiguous())
    assert torch.equal(y, torch.zeros(3, 1024, device=DEV, dtype=torch.bfloat16))


# -------------------------------------------------------------------------------------- route
ROUTERS = [
    dict(E=8, k=2, scoring="softmax"),                                        # Mixtral
    dict(E=128, k=8, scoring="softmax"),                                      # Qwen3-MoE
    dict(E=64, k=6, scoring="softmax", norm_topk_prob=False),                 # Qwen2-MoE
    dict(E=256, k=8, scoring="sigmoid", n_group=8, topk_group=4, bias=True,
         routed_scaling_factor=2.5),                                          # DeepSeek-V3
    dict(E=384, k=8, scoring="sigmoid", bias=True),
    dict(E=64, k=1, scoring="sigmoid", n_group=4, topk_group=1, bias=True),
]


@pytest.mark.parametrize("cfg", ROUTERS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [0, 1, 300, 777, 5000])  # both launch shapes (ROUTE_DECODE_MAX_TOKENS)
@pytest.mark.parametrize("with_counts", [True, False])
def test_route_matches_reference(ops, cfg, dtype, T, with_counts):
    cfg = dict(cfg)
    E, k = cfg.pop("E"), cfg.pop("k")
    if cfg.pop("bias", False):
        cfg["correction_bias"] = torch.randn(E, device=DEV) * 0.1
    logits = torch.randn(T, E, device=DEV).to(dtype)
    ids, w, counts = ops.route(logits, k, with_counts=with_counts, **cfg)
    rids, rw, rcounts = reference.route(logits, k, with_counts=with_counts, **cfg)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    if with_counts:
        assert counts.dtype == torch.int32 and torch.equal(counts, rcounts)
    else:
        assert counts is None and rcounts is None
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", ROUTERS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_route_nan_logits_match_reference(ops, cfg):
    """A token with a NaN logit: NaN weights, ids as the reference's (a row of NaN: k distinct ids)."""
    cfg = dict(cfg)
    E, k = cfg.pop("E"), cfg.pop("k")
    if cfg.pop("bias", False):
        cfg["correction_bias"] = torch.randn(E, device=DEV) * 0.1
    logits = torch.randn(40, E, device=DEV)
    logits[3, E // 2] = logits[7, :] = logits[11, 0] = float("nan")
    for T in (40, 1):  # (T = 1: the NaN row alone)
        lg = logits[:T] if T > 1 else logits[7:8]
        ids, w, counts = ops.route(lg, k, **cfg)
        rids, rw, rcounts = reference.route(lg, k, **cfg)
        assert torch.equal(ids, rids) and torch.equal(counts, rcounts)
        assert torch.equal(torch.isnan(w), torch.isnan(rw))
        torch.testing.assert_close(w.nan_to_num(), rw.nan_to_num(), rtol=1e-5, atol=1e-6)
    assert torch.isnan(w).all()


@pytest.mark.parametrize("cfg", ROUTERS[3:] + [
    dict(E=16, k=8, scoring="sigmoid", n_group=4, topk_group=1, bias=True)],  # (4 kept < k)
    ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_route_with_fewer_finite_choices_than_k_matches_reference(ops, cfg):
    """A -inf correction bias on all but a few experts (experts switched off), or kept groups
    holding fewer than k experts: the finite choices first, then -inf ones in id order, k
    distinct ids, as the reference."""
    cfg = dict(cfg)
    E, k = cfg.pop("E"), cfg.pop("k")
    cfg.pop("bias")
    bias = torch.full((E,), float("-inf"), device=DEV)
    bias[torch.randperm(E, device=DEV)[: max(k // 2, 1) if E > 16 else E]] = 0.0
    logits = torch.randn(300, E, device=DEV)
    ids, w, counts = ops.route(logits, k, correction_bias=bias, **cfg)
    rids, rw, rcounts = reference.route(logits, k, correction_bias=bias, **cfg)
    assert torch.equal(ids, rids) and torch.equal(counts, rcounts)
    assert all(len(set(row)) == k for row in ids.tolist())
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


def test_route_ties_go_to_the_smaller_id(ops):
    """Integer logits with many exact ties: order and membership follow the stable rule."""
    logits = torch.randint(-2, 3, (2048, 64), device=DEV).float()
    for kw in (dict(scoring="softmax"), dict(scoring="sigmoid", n_group=8, topk_group=3)):
        ids, w, counts = ops.route(logits, 6, **kw)
        rids, rw, rcounts = reference.route(logits, 6, **kw)
        assert torch.equal(ids, rids) and torch.equal(counts, rcounts)
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
