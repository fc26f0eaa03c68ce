"""CPU CI: every multi-rank kernel configuration compiles for sm_90a and sm_100a (no GPU needed),
and its PTX holds what the protocol relies on. The NVLS kernel is compiled only: its PTX must
contain the multimem instructions; it is never launched anywhere.

Configurations: W in {2, 4, 8} virtual ranks (n_local = W, CTAs per rank as on a 132-SM H200,
the decode launches at each CTAs-per-SM count they take on the architecture) and one real-rank
layout (n_local = 1); the dispatch in decode (one cooperative launch) and
prefill (one launch per phase) modes, the combine in one decode launch and its two prefill
phases; one-shot, two-shot, each also with the tp combine fused in front. No kernel may read a
timer (%globaltimer or %clock64 in a wait loop faulted these kernels on the H200:
sync/grid_barrier.py); waits are bounded by poll counts.
"""
import re

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from moe_runtime.kernels import allreduce as ar  # noqa: E402
from moe_runtime.kernels import ep_combine as ec  # noqa: E402
from moe_runtime.kernels import ep_dispatch as ed  # noqa: E402
from moe_runtime.kernels import nvls_allreduce as nv  # noqa: E402
from moe_runtime.kernels import peer_sync as ps  # noqa: E402

# Compile for real: never load a binary from the DSL's on-disk cache (a test that only loaded
# would not show that the current source compiles).
from cutlass.cutlass_dsl import CuTeDSL  # noqa: E402

CuTeDSL._get_dsl().envar.disable_file_caching = True

ARCHS = ("sm_90a", "sm_100a")
SMS = 132
H, K, E = 7168, 8, 256
V4LD = r"ld\.global(\.L1::no_allocate)?\.v4\.b32|ld\.global\.v8\.b32"
V4ST = r"st\.global\.v4\.b32|st\.global\.v8\.b32"
REL, ACQ = r"st\.release\.sys\.global", r"ld\.acquire\.sys\.global"
GENERIC = r"\s(ld|st)\.v4\."          # a raw pointer without AddressSpace.gmem
DEPOT = r"__local_depot"              # register arrays spilled to local memory
TIMER = r"%globaltimer|%clock"

# (world, n_local): virtual ranks, plus a real rank's own launch
LAYOUTS = [(2, 2), (4, 4), (8, 8), (8, 1)]


def _cpr(n_local, per_sm):
    return max(1, min(per_sm * SMS // n_local, 1024))


def _decode_per_sm(arch):
    """The CTAs per SM the cooperative decode launches take on `arch`, for few and for many
    items (peer_sync.cooperative_ctas_per_sm): each is its own compiled configuration."""
    major = int(re.match(r"sm_(\d+)0a", arch).group(1))
    return sorted({ps.cooperative_ctas_per_sm(n, major) for n in (1, ps.WIDE_DECODE_ITEMS)})


def test_decode_takes_two_ctas_per_sm_on_sm90_only_for_many_items(monkeypatch):
    assert _decode_per_sm("sm_90a") == [1, 2] and _decode_per_sm("sm_100a") == [1]
    assert ps.cooperative_ctas_per_sm(ps.WIDE_DECODE_ITEMS - 1, 9) == 1
    monkeypatch.setattr(ps, "sm_count", lambda: SMS)
    for major, wide in ((9, 2), (10, 1)):
        monkeypatch.setattr(ps, "device_major", lambda major=major: major)
        assert ps.ctas_per_rank(1, True, 8) == SMS  # few items: one per SM
        assert ps.ctas_per_rank(1, True, ps.WIDE_DECODE_ITEMS) == wide * SMS
        assert ps.ctas_per_rank(2, True, 4096) == wide * SMS // 2  # W = 2 virtual ranks
        assert ps.ctas_per_rank(1, False, 4096) == 4 * SMS  # prefill launches
        assert ps.ctas_per_rank(1, True) == SMS  # the all-reduce passes no items
        assert ps.decode_grids(2) == sorted({SMS // 2, wide * SMS // 2})


def _check(f, arch, expect, forbid=(GENERIC, DEPOT, TIMER)):
    ptx = f.__ptx__ or ""
    assert ptx, "no PTX kept"
    target = re.search(r"\.target\s+(\S+)", ptx)
    assert target and target.group(1) == arch, f"PTX target {target and target.group(1)}, want {arch}"
    missing = [p for p in expect if not re.search(p, ptx)]
    present = [p for p in forbid if re.search(p, ptx)]
    assert not missing and not present, f"PTX missing {missing}, forbidden present {present}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world,n_local", LAYOUTS)
def test_dispatch_compiles(arch, world, n_local):
    El = E // world
    for per_sm in _decode_per_sm(arch):
        f = ed.compile_dispatch(ed.PH_ALL, H, K, world, El, ed.DECODE_CHUNK,
                                _cpr(n_local, per_sm), n_local, 1, "bfloat16", arch)
        _check(f, arch, [V4LD, V4ST, REL, ACQ, r"atom\.global", r"nanosleep"])
    expect = {ed.PH_COUNT: [r"atom\.global", REL], ed.PH_PUBLISH: [REL, ACQ],
              ed.PH_SEND: [V4LD, V4ST, REL], ed.PH_RECV: [V4LD, V4ST, ACQ]}
    for ph in ed.PREFILL_PHASES:
        f = ed.compile_dispatch(ph, H, K, world, El, ed.PREFILL_CHUNK, _cpr(n_local, 4),
                                n_local, 1, "bfloat16", arch)
        _check(f, arch, expect[ph])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world,n_local", LAYOUTS)
def test_combine_compiles(arch, world, n_local):
    El = E // world
    fma = r"fma\.rn\.f32|add\.f32"
    expect = {ec.PH_CSEND: [V4LD, V4ST, REL], ec.PH_CREDUCE: [V4LD, V4ST, ACQ, fma],
              ec.PH_CALL: [V4LD, V4ST, REL, ACQ, fma]}
    for chunk, per_sms, phases in ((ed.DECODE_CHUNK, _decode_per_sm(arch), (ec.PH_CALL,)),
                                   (ed.PREFILL_CHUNK, [4], (ec.PH_CSEND, ec.PH_CREDUCE))):
        for ph in phases:
            for per_sm in per_sms:
                f = ec.compile_combine(ph, H, K, world, El, chunk, _cpr(n_local, per_sm),
                                       n_local, "bfloat16", arch)
                _check(f, arch, expect[ph])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world,n_local", LAYOUTS)
def test_allreduce_compiles(arch, world, n_local):
    fma = r"fma\.rn\.f32|add\.f32"
    expect = {ar.ONESHOT: [V4LD, V4ST, REL, ACQ], ar.TWOSHOT: [V4LD, V4ST, REL, ACQ],
              ar.COMBINE | ar.ONESHOT: [V4LD, V4ST, REL, ACQ, fma],
              ar.COMBINE | ar.TWOSHOT: [V4LD, V4ST, REL, ACQ, fma]}
    for algo, exp in expect.items():
        f = ar.compile_allreduce(algo, H, K, world, _cpr(n_local, 1), n_local, "bfloat16", arch)
        _check(f, arch, exp)


@pytest.mark.parametrize("arch", ARCHS)
def test_nvls_ptx_has_multimem(arch):
    f = nv.compile_nvls_allreduce(8, SMS, arch)
    ptx = f.__ptx__ or ""
    assert re.search(r"\.target\s+" + arch, ptx)
    missing = [p for p in nv.PTX_EXPECTED if not re.search(p, ptx)]
    assert not missing, f"multimem instructions missing from the NVLS PTX: {missing}"
    assert not re.search(TIMER, ptx), "the NVLS kernel reads a timer"


def test_nvls_refused_when_disabled(monkeypatch):
    from moe_runtime.comm.peer_buffers import nvls_allowed
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ok, why = nvls_allowed()
    assert not ok and "TORCH_SYMM_MEM_DISABLE_MULTICAST" in why
    with pytest.raises(RuntimeError, match="not allowed"):
        nv.nvls_all_reduce()
