"""CPU: peer buffer tables (layout, limits, epochs, error words) and the host side of the
multi-rank cute calls up to the launch (the compiled kernels replaced by recorders)."""
import pytest
import torch

from moe_runtime.comm import peer_buffers as pb

SPEC = dict(world_size=4, max_tokens_per_rank=16, hidden=256, top_k=4, num_experts=16)


def bufs(**kw):
    return pb.PeerBuffers.virtual(pb.PeerSpec(**{**SPEC, **kw}), device="cpu")


def test_spec_validation():
    with pytest.raises(ValueError, match="divisible"):
        pb.PeerSpec(**{**SPEC, "num_experts": 10})
    with pytest.raises(ValueError, match="16 bytes"):
        pb.PeerSpec(**{**SPEC, "hidden": 4})
    with pytest.raises(TypeError):
        pb.PeerSpec(**SPEC, dtype=torch.float32)
    for field, bad in (("hidden", 0), ("hidden", -8), ("max_tokens_per_rank", 2.5),
                       ("num_experts", 0), ("top_k", True)):
        with pytest.raises(ValueError, match=f"{field} must be ints >= 1"):
            pb.PeerSpec(**{**SPEC, field: bad})
    s = pb.PeerSpec(**SPEC, align=8)
    assert s.stage_rows == 16 * 4 and s.xout_rows == 4 * 64 + 4 * 7
    with pytest.raises(ValueError, match="transport must be"):  # (a typo fell back to ipc)
        pb.PeerBuffers.from_process_group(s, transport="symm-mem")


def test_layout_fields_disjoint_aligned_and_table_addresses():
    b = bufs()
    lay = b.layout
    for peer in (True, False):
        spans = sorted((lay.offsets[f], lay.offsets[f] + b.view(f).numel() * b.view(f).element_size())
                       for f in range(pb.NUM_HEAP_FIELDS) if (f in pb.PEER_FIELDS) == peer)
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:])), "fields overlap"
        assert all(s % pb.HEAP_ALIGN == 0 for s, _ in spans)
    assert b.table.shape == (pb.NUM_FIELDS, 4) and b.table.dtype == torch.int64
    for r in range(4):
        for f in (pb.F_RECV_X, pb.F_XOUT, pb.F_ERR):
            assert b.table[f, r].item() == b.view(f, r).data_ptr()
    assert b.view(pb.F_XOUT, 2).shape == (b.spec.xout_rows, 256)


def test_token_limit_names_the_limit():
    b = bufs()
    with pytest.raises(ValueError, match="max_tokens_per_rank=16"):
        b.check_tokens([1, 17, 0, 0])
    with pytest.raises(ValueError, match="4 local rank"):
        b.check_tokens([1])


def test_epochs_grow_then_restart_with_flags_zeroed_and_data_kept():
    """Epochs never wrap (a wrap-safe >= would take a flag written 2^31 epochs earlier for a
    current one): past EPOCH_LIMIT both counters restart at 1 and every epoch field is zeroed,
    while data fields (an all-reduce input already written) are kept."""
    b = bufs()
    assert [b.next_epoch() for _ in range(3)] == [1, 2, 3]
    assert b.take_sig_epochs(3) == 1 and b.take_sig_epochs(2) == 4
    b.epoch, b.sig_epoch = pb.EPOCH_LIMIT - 1, pb.EPOCH_LIMIT - 3
    for r in range(b.n_local):
        for f in pb.EPOCH_FIELDS:
            b.view(f, r).fill_(pb.EPOCH_LIMIT - 1)
        b.view(pb.F_AR_IN, r).fill_(7)
    assert b.next_epoch() == pb.EPOCH_LIMIT  # the limit itself is still used
    assert b.take_sig_epochs(3) == pb.EPOCH_LIMIT - 2
    assert all(b.view(f, r).eq(pb.EPOCH_LIMIT - 1).all() for f in pb.EPOCH_FIELDS
               for r in range(b.n_local)), "zeroed before the limit"
    assert b.next_epoch() == 1 and b.sig_epoch == 0
    assert all(b.view(f, r).eq(0).all() for f in pb.EPOCH_FIELDS for r in range(b.n_local))
    assert all(b.view(pb.F_AR_IN, r).eq(7).all() for r in range(b.n_local)), "data zeroed"
    assert b.take_sig_epochs(2) == 1
    b.sig_epoch = pb.EPOCH_LIMIT - 1
    assert b.take_sig_epochs(2) == 1 and b.epoch == 0  # a barrier restart restarts both


def test_buffers_made_under_inference_mode_are_written_outside_it():
    """Peer buffers built by a first forward under torch.inference_mode() are normal tensors:
    a later call under no_grad (or a reset) writes their table and heaps."""
    with torch.inference_mode():
        b = bufs()
    assert not b.table.is_inference() and not b.local_heaps[0].is_inference()
    b.set_args({pb.F_ARG_T: [3, 1, 4, 1]})
    assert b.table[pb.F_ARG_T].tolist() == [3, 1, 4, 1]
    b.view(pb.F_AR_IN, 0).fill_(5)
    b.reset()
    assert all(h.eq(0).all() for h in b.peer_heaps + b.local_heaps)


def test_error_words_raise_naming_rank_phase_peer_then_reset():
    b = bufs()
    b.check_errors("nothing")  # no error: no exception
    b.view(pb.F_ERR, 2)[:4].copy_(torch.tensor([4, 3, 7, 6], dtype=torch.int32))
    with pytest.raises(pb.PeerTimeoutError) as ei:
        b.check_errors("ep_dispatch")
    msg = str(ei.value)
    assert "rank 2" in msg and "waiting for rank 3" in msg and pb.PHASES[4] in msg
    assert ei.value.errors[0]["peer"] == 3
    with pytest.raises(RuntimeError, match="reset"):
        b.check_usable()
    b.reset()
    b.check_usable()
    assert not b.view(pb.F_ERR, 2).any()


def test_refused_values_raise_data_error_naming_rank_code_and_bound():
    b = bufs()
    b.view(pb.F_ERR, 1)[:4].copy_(torch.tensor([16, -1, 16, 99], dtype=torch.int32))
    b.view(pb.F_ERR, 3)[:4].copy_(torch.tensor([4, 1, 7, 6], dtype=torch.int32))  # follow-on wait
    with pytest.raises(pb.PeerDataError) as ei:
        b.check_errors("ep_dispatch")
    msg = str(ei.value)
    assert "rank 1: " + pb.PHASES[16] in msg and "saw 99, allowed [0, 16)" in msg, msg
    assert "rank 3: timed out" in msg and isinstance(ei.value, pb.PeerError)
    assert all(c >= pb.DATA_ERROR for c in range(16, 22) if c in pb.PHASES)


def test_site_words_round_trip_and_out_of_step_errors_name_both_sites():
    for site in [(0, 0, 0), (3, 5, 17), (4095, 1023, 511)]:
        w = pb.site_word(*site)
        assert 0 <= w < 1 << 31 and pb.site_fields(w) == site
    assert pb.site_fields(pb.site_word(4096 + 2, 1024 + 1, 512 + 9)) == (2, 1, 9)  # modulo
    assert len({pb.site_word(t, l, c) for t in range(3) for l in range(3) for c in range(3)}) == 27
    assert pb.check_sites(None, 2) == [0, 0] and pb.check_sites([5], 1) == [5]
    for bad in ([1], [1, -1], [1, 1 << 31], [1, True], [1, 2.0]):
        with pytest.raises(ValueError, match="sites must be 2 int"):
            pb.check_sites(bad, 2)
    b = bufs()
    mine, theirs = pb.site_word(1, 0, 2), pb.site_word(2, 1, 2)
    b.view(pb.F_ERR, 0)[:5].copy_(torch.tensor([pb.E_OUT_OF_STEP, 1, mine, theirs, 2],
                                               dtype=torch.int32))
    b.view(pb.F_ERR, 2)[:4].copy_(torch.tensor([pb.E_OTHER_TOKENS, 3, 5, 6], dtype=torch.int32))
    with pytest.raises(pb.PeerDataError) as ei:
        b.check_errors("tp_combine_all_reduce")
    msg = str(ei.value)
    assert ("rank 0: out of step with rank 1 (code 22): this rank's call is at site (topology, "
            "layer, dispatch) (1, 0, 2), rank 1's at (2, 1, 2)") in msg, msg
    assert f"rank 2: {pb.PHASES[23]} (code 23): this rank passed T=5, rank 3 T=6" in msg, msg
    assert [e["apart_topology"] for e in ei.value.errors] == [2, 0]
    assert pb.site_word(4095, 0, 0) >> pb.TOPOLOGY_SHIFT == 4095


def test_wait_bounds_validate():
    pytest.importorskip("cutlass")
    from moe_runtime.kernels.peer_sync import MAX_SPINS, wait_bounds
    assert wait_bounds(1.0, None) == 4 * 10**6  # polls of POLL_NS = 250 ns
    assert wait_bounds(3600.0, None) == MAX_SPINS  # 2x (grid barriers) stays in int32
    for bad in (dict(timeout_s=0, max_spins=None), dict(timeout_s=float("nan"), max_spins=None),
                dict(timeout_s=1.0, max_spins=0), dict(timeout_s=1.0, max_spins=MAX_SPINS + 1)):
        with pytest.raises(ValueError):
            wait_bounds(**bad)


def test_nvls_off_variables_win(monkeypatch):
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                     ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        for v, _ in (("NCCL_NVLS_ENABLE", 0), ("NVSHMEM_DISABLE_NVLS", 0),
                     ("TORCH_SYMM_MEM_DISABLE_MULTICAST", 0)):
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv(var, val)
        ok, why = pb.nvls_allowed()
        assert not ok and var in why


def test_combine_needs_only_the_rows_the_dispatch_used(recorded):
    """ep_dispatch reads each rank's expert_offsets[-1] with its error words (rows_used); the
    combine then accepts expert_y of that many rows (what dp_nvlink's experts compute) and
    refuses fewer before launching."""
    from moe_runtime.kernels.ep_combine import ep_combine
    from moe_runtime.kernels.ep_dispatch import ep_dispatch
    b = bufs()
    tokens = [3, 0, 16, 1]
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, 16, (20, 4), dtype=torch.int32)
    used = [5, 0, 12, 7]
    for r, n in enumerate(used):  # what the (recorded, not run) kernels would have written
        b.expert_offsets(r)[-1] = n
    h = ep_dispatch(b, x, ids, tokens, mode="prefill")
    assert h.rows_used == used
    w = torch.rand(20, 4)
    eys = [torch.zeros(n, 256, dtype=torch.bfloat16) for n in used]
    n = len(recorded)
    short = eys[:2] + [eys[2][:11]] + eys[3:]
    with pytest.raises(ValueError, match=r"expert_y\[2\] must be contiguous .*\[>= 12, 256\]"):
        ep_combine(b, h, short, w)
    assert len(recorded) == n
    assert ep_combine(b, h, eys, w).shape == (20, 256)
    assert ep_dispatch(b, x, ids, tokens, mode="prefill", check=False).rows_used is None


# ------------------------------------------------------------- host path up to the launch
def test_host_paths_pass_the_compiled_signatures(recorded):
    """The kernels take the table and scalars only; every per-call array reaches them through
    the table's F_ARG_* rows, which must hold each local rank's row addresses."""
    from moe_runtime.kernels import allreduce
    from moe_runtime.kernels.allreduce import all_reduce, tp_combine_all_reduce
    from moe_runtime.kernels.ep_combine import ep_combine
    from moe_runtime.kernels.ep_dispatch import PREFILL_PHASES, ep_dispatch
    b = bufs()
    tokens = [3, 0, 16, 1]
    x = torch.randn(sum(tokens), 256, dtype=torch.bfloat16)
    ids = torch.randint(0, 16, (sum(tokens), 4), dtype=torch.int32)
    h = ep_dispatch(b, x, ids, tokens, mode="prefill")
    assert [c[1][0] for c in recorded] == list(PREFILL_PHASES)
    _, key, args = recorded[-1]
    assert args[0] is b.table and args[1:] == (1, b.spec.stage_rows, 0, -1, 4 * 10**7)
    assert key[-1] == "bfloat16" and key[6] == 4 * 132 // 4  # cpr for split launches
    tab = b.table
    starts = [0, 3, 3, 19]
    assert tab[pb.F_ARG_T].tolist() == tokens
    assert tab[pb.F_ARG_X].tolist() == [x.data_ptr() + s0 * 256 * 2 for s0 in starts]
    assert tab[pb.F_ARG_IDS].tolist() == [ids.data_ptr() + s0 * 4 * 4 for s0 in starts]
    w = torch.rand(20, 4)
    y = ep_combine(b, h, h.expert_x, w)
    assert y.shape == (20, 256) and recorded[-1][0] == "combine"
    assert tab[pb.F_ARG_EY].tolist() == [e.data_ptr() for e in h.expert_x]
    assert tab[pb.F_ARG_W].tolist() == [w.data_ptr() + s0 * 4 * 4 for s0 in starts]
    assert tab[pb.F_ARG_Y].tolist() == [y.data_ptr() + s0 * 256 * 2 for s0 in starts]
    with pytest.raises(ValueError, match="combined already"):  # (its flags are set: no wait)
        ep_combine(b, h, h.expert_x, w)
    h2 = ep_dispatch(b, x, ids, tokens, mode="decode")
    with pytest.raises(ValueError, match="stale"):
        ep_combine(b, h, h.expert_x, w)
    b.restart_epochs()  # (a dispatch's epoch flags are gone: its combine cannot wait on them)
    with pytest.raises(ValueError, match="restarted their epochs"):
        ep_combine(b, h2, h2.expert_x, w)
    n = len(recorded)
    with pytest.raises(ValueError, match="max_tokens_per_rank=16"):
        ep_dispatch(b, torch.zeros(20, 256, dtype=torch.bfloat16),
                    torch.zeros(20, 4, dtype=torch.int32), [17, 1, 1, 1])
    assert len(recorded) == n, "launched despite the token limit"
    out = all_reduce(b, torch.randn(4, 5, 256, dtype=torch.bfloat16), algo="twoshot")
    assert out.shape == (4, 5, 256) and recorded[-1][0] == "allreduce"
    assert recorded[-1][1][0] == 2 and recorded[-1][2][1:3] == (5, 1)  # TWOSHOT, T, 1st epoch
    assert tab[pb.F_ARG_Y].tolist() == [o.data_ptr() for o in out]
    eys = [torch.zeros(8, 256, dtype=torch.bfloat16) for _ in range(4)]
    slot = torch.full((4, 2, 4), -1, dtype=torch.int32)
    w2 = torch.rand(2, 4)
    tp_combine_all_reduce(b, eys, slot, w2)
    assert recorded[-1][1][0] == allreduce.COMBINE | allreduce.ONESHOT  # one launch
    assert tab[pb.F_ARG_SLOT].tolist() == [t.data_ptr() for t in slot]
    assert tab[pb.F_ARG_ROWS].tolist() == [8] * 4  # the kernel refuses slots >= 8
    assert tab[pb.F_ARG_W].tolist() == [w2.data_ptr()] * 4
    assert torch.equal(b.table, b._host_table)


def test_allreduce_only_buffers_have_no_all_to_all_rows(recorded):
    """PeerSpec(all_to_all=False) (the tp topology) sizes the all-reduce fields only, and
    ep_dispatch refuses such buffers before launching."""
    from moe_runtime.kernels.ep_dispatch import ep_dispatch
    b, full = bufs(all_to_all=False), bufs()
    for f in (pb.F_RECV_X, pb.F_RET_X, pb.F_XOUT, pb.F_POS, pb.F_STAGE):
        assert b.view(f).numel() == 0 and full.view(f).numel() > 0, pb.FIELD_NAMES[f]
    for f in (pb.F_AR_IN, pb.F_AR_MID, pb.F_SIG):
        assert b.view(f).shape == full.view(f).shape, pb.FIELD_NAMES[f]
    assert b.layout.peer_bytes < full.layout.peer_bytes / 4
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="all_to_all=True"):
        ep_dispatch(b, x, torch.zeros(4, 4, dtype=torch.int32), [1, 1, 1, 1])
    assert not recorded


def real_rank(spec, rank):
    """Rank `rank`'s buffers as from_process_group lays them out (n_local = 1), on the CPU; the
    peers' heap addresses are stand-ins (nothing is launched)."""
    lay = pb.HeapLayout.of(spec)
    heaps = [torch.zeros(lay.peer_bytes, dtype=torch.uint8) for _ in range(spec.world_size)]
    local = torch.zeros(lay.local_bytes, dtype=torch.uint8)
    return pb.PeerBuffers(spec, "cpu", "ipc", rank, [heaps[rank]], [local],
                          [h.data_ptr() for h in heaps], keepalive=heaps)


def test_real_rank_dispatch_mode_follows_the_token_limit(recorded):
    """A real rank cannot see its peers' T, and the flag chunk of decode and prefill differs
    (it is part of the protocol): auto picks the mode from max_tokens_per_rank, not from T."""
    from moe_runtime.kernels.ep_dispatch import (DECODE_MAX_TOKENS, PH_ALL, PREFILL_PHASES,
                                                 ep_dispatch)
    for t_max, want in ((DECODE_MAX_TOKENS, "decode"), (DECODE_MAX_TOKENS + 1, "prefill")):
        b = real_rank(pb.PeerSpec(2, t_max, 256, 4, 16), rank=1)
        for T in (0, 1, t_max):
            recorded.clear()
            h = ep_dispatch(b, torch.zeros(T, 256, dtype=torch.bfloat16),
                            torch.zeros(T, 4, dtype=torch.int32))
            assert h.mode == want, (t_max, T)
            phases = [c[1][0] for c in recorded]
            assert phases == ([PH_ALL] if want == "decode" else list(PREFILL_PHASES))
            assert all(c[2][3] == 1 for c in recorded)  # rank0 = this rank
            assert b.table[pb.F_ARG_T].tolist() == [0, T]


@pytest.mark.parametrize("kernel,fails", [("dispatch", ("PH_RECV",)), ("combine", ("PH_CREDUCE",)),
                                          ("allreduce", ("COMBINE", "ONESHOT"))])
def test_a_compile_error_leaves_epochs_unchanged(recorded, monkeypatch, kernel, fails):
    """Every launch of a call is compiled before its epoch is reserved: a compile failure (of
    the last phase; the tp combine + all-reduce has one) launches nothing and leaves the
    protocol state as it was."""
    from moe_runtime.kernels import allreduce, ep_combine, ep_dispatch
    mod = {"dispatch": ep_dispatch, "combine": ep_combine, "allreduce": allreduce}[kernel]
    name = f"compile_{kernel}"
    record, bad = getattr(mod, name), 0
    for f in fails:
        bad |= getattr(mod, f)

    def compile_(phase, *key, **kw):
        if phase == bad:
            raise RuntimeError("compile failed")
        return record(phase, *key, **kw)

    b = bufs()
    tokens = [3, 0, 16, 1]
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, 16, (20, 4), dtype=torch.int32)
    h = ep_dispatch.ep_dispatch(b, x, ids, tokens, mode="prefill")
    state = (b.epoch, b.sig_epoch, b._last_dispatch, len(recorded))
    monkeypatch.setattr(mod, name, compile_)
    with pytest.raises(RuntimeError, match="compile failed"):
        if kernel == "dispatch":
            ep_dispatch.ep_dispatch(b, x, ids, tokens, mode="prefill")
        elif kernel == "combine":
            ep_combine.ep_combine(b, h, h.expert_x, torch.rand(20, 4))
        else:
            allreduce.tp_combine_all_reduce(b, [torch.zeros(8, 256, dtype=torch.bfloat16)] * 4,
                                            torch.full((4, 2, 4), -1, dtype=torch.int32),
                                            torch.rand(2, 4))
    assert (b.epoch, b.sig_epoch, b._last_dispatch, len(recorded)) == state


# ------------------------------------------------------------ real ranks (gloo, CPU): transport
def w_from_process_group(rank, world, symm_ok, rdv_ok=(True, True)):
    """PeerBuffers.from_process_group on CPU with torch symmetric memory faked: symm_mem.empty
    works on the ranks where symm_ok[rank] (a stand-in heap), the rendezvous where rdv_ok[rank].
    Returns the mode per transport (or the error) and how often this rank entered the
    rendezvous (a collective: no rank may enter it unless every rank has its heaps)."""
    import torch.distributed._symmetric_memory as symm_mem
    rendezvous = []

    def empty(n, dtype, device):
        if not symm_ok[rank]:
            raise RuntimeError(f"no symmetric memory on rank {rank}")
        return torch.zeros(n, dtype=dtype, device=device)

    def rdv(t, group):
        rendezvous.append(t.numel())
        if not rdv_ok[rank]:
            raise RuntimeError(f"rendezvous failed on rank {rank}")
        return type("Handle", (), {"buffer_ptrs": [t.data_ptr()] * world})

    symm_mem.empty, symm_mem.rendezvous = empty, rdv
    spec = pb.PeerSpec(world, 4, 256, 2, 4)
    out = {"auto": pb.PeerBuffers.from_process_group(spec, device="cpu").mode}
    try:
        out["symm_mem"] = pb.PeerBuffers.from_process_group(spec, device="cpu",
                                                            transport="symm_mem").mode
    except pb.PeerSetupError as e:
        out["symm_mem"] = str(e)
    out["rendezvous"] = len(rendezvous)
    return out


def w_epoch_restart(rank, world):
    """Two real ranks at the epoch limit: both restart together (two bounded gathers), each
    zeroing its own epoch fields."""
    b = pb.PeerBuffers.from_process_group(pb.PeerSpec(world, 4, 256, 2, 4), device="cpu",
                                          transport="ipc")
    b.epoch = pb.EPOCH_LIMIT
    b.view(pb.F_SIG).fill_(5)
    b.view(pb.F_AR_IN).fill_(3)
    return (b.next_epoch(), int(b.view(pb.F_SIG).abs().sum()), bool(b.view(pb.F_AR_IN).eq(3).all()))


def test_epoch_restart_on_real_ranks():
    from _dist import run_distributed
    assert run_distributed(w_epoch_restart, 2, timeout_s=120) == [(1, 0, True)] * 2


@pytest.mark.parametrize("symm_ok,rdv_ok", [((True, False), (True, True)),
                                            ((True, True), (True, True)),
                                            ((True, True), (False, True))])
def test_auto_transport_is_the_same_on_every_rank(symm_ok, rdv_ok):
    """transport "auto": symm_mem (the heaps or the rendezvous) failing on one rank only sends
    EVERY rank to CUDA IPC (the ranks gather who succeeded); "symm_mem" then raises on every
    rank, naming the failing one. A rank enters the rendezvous only once every rank has its
    symm_mem heaps (it is a collective: entering it alone would hang)."""
    from _dist import run_distributed
    for rank, o in enumerate(run_distributed(w_from_process_group, 2, symm_ok, rdv_ok,
                                             timeout_s=120)):
        if all(symm_ok) and all(rdv_ok):
            assert o == {"auto": "symm_mem", "symm_mem": "symm_mem", "rendezvous": 2}
            continue
        assert o["auto"] == "ipc"
        why = ("RuntimeError: no symmetric memory on rank 1" if not all(symm_ok)
               else "RuntimeError: rendezvous failed on rank 0")
        bad = 1 if not all(symm_ok) else 0
        assert o["symm_mem"] == (f"peer buffers: torch symmetric memory failed on rank(s) "
                                 f"{bad}: {why}")
        assert o["rendezvous"] == (0 if not all(symm_ok) else 2), (rank, o)


def w_ipc_failure(rank, world, fail_rank, where):
    """transport "ipc" (and "auto" after symm_mem failed everywhere) where rank `fail_rank`
    cannot allocate its peer heap ("alloc") or open its peers' handles ("open"). Returns
    (transport, exception type, message, seconds) per transport."""
    import time

    import torch.distributed._symmetric_memory as symm_mem
    spec = pb.PeerSpec(world, 4, 256, 2, 4)
    peer_bytes, empty = pb.HeapLayout.of(spec).peer_bytes, torch.empty

    def failing_empty(*size, **kw):
        if rank == fail_rank and size == (peer_bytes,):
            raise RuntimeError(f"CUDA out of memory on rank {rank}")
        return empty(*size, **kw)

    def failing_open(handle, device):
        raise RuntimeError(f"cudaIpcOpenMemHandle failed on rank {rank}")

    def no_symm(*a, **kw):
        raise RuntimeError("no symmetric memory")

    symm_mem.empty = no_symm
    if where == "alloc":
        torch.empty = failing_empty
    elif rank == fail_rank:
        pb._open_ipc_handle = failing_open
    out = []
    for transport in ("ipc", "auto"):
        t0 = time.monotonic()
        try:
            pb.PeerBuffers.from_process_group(spec, device="cpu", transport=transport)
            out.append((transport, None, "", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - the parent checks the type
            out.append((transport, type(e).__name__, str(e), time.monotonic() - t0))
    return out


@pytest.mark.parametrize("where", ["alloc", "open"])
def test_ipc_failure_on_one_rank_raises_on_every_rank(where):
    """A rank whose peer heap allocation (or handle opening) fails no longer raises alone while
    its peers wait in the handle gather until the group timeout: every rank gathers the
    outcome first and raises PeerSetupError at once, naming the failing rank and its error."""
    from _dist import run_distributed
    want = ({"alloc": "CUDA IPC heaps", "open": "opening the peers' CUDA IPC handles"}[where]
            + " failed on rank(s) 1: RuntimeError: "
            + {"alloc": "CUDA out of memory on rank 1",
               "open": "cudaIpcOpenMemHandle failed on rank 1"}[where])
    outs = run_distributed(w_ipc_failure, 2, 1, where, timeout_s=120, group_timeout_s=20)
    for rank_out in outs:
        for transport, kind, msg, secs in rank_out:
            assert (kind, msg) == ("PeerSetupError", "peer buffers: " + want), (transport, msg)
            assert secs < 10, secs  # not the group timeout (20 s)


def test_ipc_handles_are_opened_on_this_ranks_device(monkeypatch):
    """torch's rebuild_cuda_tensor opens a CUDA IPC handle on its storage_device argument, the
    EXPORTER's device index; the peer heap must be mapped into this rank's own device's context
    instead. Anything but rebuild_cuda_tensor (a torch change) raises a clear error."""
    import inspect

    from torch.multiprocessing import reductions
    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[6] == "storage_device", params  # the installed torch's reduction
    opened = []

    def fake_rebuild(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                     storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
                     requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
                     event_sync_required):
        opened.append(storage_device)
        return torch.zeros(tensor_size, dtype=dtype)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake_rebuild)
    args = (torch.Tensor, (64,), (1,), 0, torch.UntypedStorage, torch.uint8, 0, b"handle", 64, 0,
            False, b"ref", 0, b"event", True)  # exported by the rank on device 0
    assert pb._open_ipc_handle((fake_rebuild, args), torch.device("cuda", 3)).shape == (64,)
    assert opened == [3]
    with pytest.raises(RuntimeError, match="not rebuild_cuda_tensor"):
        pb._open_ipc_handle((lambda *a: None, args), torch.device("cuda", 3))
    assert opened == [3]
