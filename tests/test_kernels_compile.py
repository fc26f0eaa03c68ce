"""Every CuTeDSL kernel configuration compiles for sm_90a and sm_100a (CPU only, fake tensors),
and the PTX holds the instructions the design relies on.

Grid (issue 4): dtype {bf16, fp16, fp32} x hidden {128, 576, 2048, 2880, 4096, 7168} x (E, k)
{(8,2), (64,6), (128,8), (256,8), (384,8)} x mode {decode, prefill} for dispatch and combine
(combine also in its one-warp decode shape for k >= 4; decode dispatch: the barrier-free kernel
in each block shape of cute_compile.DISPATCH_DECODE_SHAPES), plus the routing kernel (softmax,
and sigmoid + bias + groups; with and without counts; each ROUTE_WARPS block shape) for each
(E, k), plus the grid-barrier probe, plus the decode expert GEMV (gate_up + SwiGLU and down) at
the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral expert shapes and as the router's logits GEMV for the
16-bit dtypes. Compiles run in a process pool of min(2, CPUs) workers, one task per
(arch, dtype) (about 6-7 minutes on 2 cores).

Optional result cache: set MOE_RUNTIME_COMPILE_CACHE to a directory and a configuration that
passed (compile + PTX checks) is not recompiled while the key is unchanged. The key hashes the
text of every kernel, sync and compile-cache source file, this test file and the cutlass
version, so any edit to a kernel or to the checks recompiles everything; failures are never
cached.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

# no module-level cutlass import: the spawned workers must set CUTE_DSL_KEEP before importing it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                reason="nvidia-cutlass-dsl is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHS = ("sm_90a", "sm_100a")
DTYPES = ("bfloat16", "float16", "float32")
HIDDEN = (128, 576, 2048, 2880, 4096, 7168)
EK = ((8, 2), (64, 6), (128, 8), (256, 8), (384, 8))
MODES = ("decode", "prefill")

# PTX facts (regexes) per kernel kind. V4_LD/V4_ST: 128-bit global accesses, as 4 x 32 bits
# (sm_90a, and 16-bit types on sm_100a) or 2 x 64 bits (fp32 rows on sm_100a).
V4_LD = r"ld\.global(\.[A-Za-z0-9_:]+)*\.(v4\.[bfsu]32|v2\.[bfsu]64)"
V4_ST = r"st\.global(\.[A-Za-z0-9_:]+)*\.(v4\.[bfsu]32|v2\.[bfsu]64)"
FACTS = {
    "dispatch_decode": [V4_LD, V4_ST, r"vote\.sync\.ballot\.b32", r"popc\.b32", r"bar\.warp\.sync",
                        r"bar\.sync", r"griddepcontrol\.wait", r"griddepcontrol\.launch_dependents"],
    "dispatch_slots": [r"atom\.shared\.add", r"atom\.global(\.acq_rel)?(\.gpu)?\.add",
                       r"griddepcontrol\.wait", r"griddepcontrol\.launch_dependents"],
    "dispatch_copy": [V4_LD, V4_ST, r"shfl\.sync\.idx", r"shfl\.sync\.up", r"bar\.sync",
                      r"griddepcontrol\.wait"],
    "combine": [V4_LD, V4_ST, r"shfl\.sync\.idx", r"fma\.rn\.f32|add\.f32", r"griddepcontrol\.wait",
                r"griddepcontrol\.launch_dependents"],
    "route": [r"shfl\.sync\.bfly", r"atom\.shared\.add", r"atom\.global\.acq_rel(\.gpu)?\.add\.u32",
              r"griddepcontrol\.wait", r"griddepcontrol\.launch_dependents"],
    "route_nocounts": [r"shfl\.sync\.bfly", r"griddepcontrol\.wait",
                       r"griddepcontrol\.launch_dependents"],
    "expert_gemv": [V4_LD, r"shfl\.sync\.bfly", r"redux\.sync\.add", r"fma\.rn\.f32|add\.f32",
                    r"griddepcontrol\.wait",
                    r"griddepcontrol\.launch_dependents"],
    "barrier_probe": [r"atom\.global\.release(\.gpu)?\.add\.u32", r"ld\.acquire\.gpu\.global\.b32"],
}
# a register fragment spilled to local memory; a timer read (one in a wait loop
# faulted the multi-rank kernels on the H200: sync/grid_barrier.py)
FORBID = [r"__local_depot", r"%globaltimer", r"%clock"]
# per kind: the barrier-free decode dispatch has no global atomics, no acquire/release spin
# and no cross-block wait
FORBID_KIND = {"dispatch_decode": [r"atom\.global", r"red\.global", r"ld\.acquire",
                                   r"fence\.acq_rel"],
               # the router without counts: no atomics, no cross-block step
               "route_nocounts": [r"atom\.", r"red\.", r"fence\.acq_rel", r"bar\.sync"]}


def _route_specs():
    out = []
    for E, k in EK:
        for dtype in DTYPES:  # the router logits' dtype
            n_group = 8 if E % 8 == 0 and E >= 64 else 4
            for warps in sorted(set(ROUTE_WARPS.values())):
                for counts, kind in ((True, "route"), (False, "route_nocounts")):
                    out.append((kind, (dtype, E, k, False, False, 1, 1, True, counts, warps)))
                    out.append((kind, (dtype, E, k, True, True, n_group, n_group // 2, True,
                                       counts, warps)))
    return out


# the launch-shape tables of cute_compile, copied here (no cutlass import at module level)
DECODE_SHAPES = ((2, 64), (4, 128), (8, 256), (8, 512), (8, 1024), (8, 2048))
ROUTE_WARPS = {"decode": 4, "prefill": 16}
# combine (warps, V) by mode; "narrow": decode of few units at top_k >= COMBINE_NARROW_MIN_K
COMBINE_SHAPES = {"decode": (4, 1), "prefill": (8, 1), "narrow": (1, 1)}
COMBINE_NARROW_MIN_K = 4
DECODE_MAX_E = 1024  # cute_ops.MAX_EXPERTS: the decode dispatch keeps [warps, E] counts in smem

# (H, I, E) of the expert GEMV: Qwen3-30B-A3B, DeepSeek-V3, Mixtral, and an odd small shape
GEMV_SHAPES = ((2048, 768, 128), (7168, 2048, 256), (4096, 14336, 8), (576, 72, 8))
# (H, E) of the router logits GEMV (cute_ops.linear_gemv: one expert of E rows): Qwen3-30B-A3B,
# Qwen2-MoE, OLMoE, Mixtral, and an odd small one
ROUTER_GEMV_SHAPES = ((2048, 128), (2048, 60), (2048, 64), (4096, 8), (136, 3))


def specs_for(arch: str, dtype: str) -> list[tuple]:
    """(kind, getter args) for one (arch, dtype) task; dtype-free kernels go with bf16."""
    out = []
    for H in HIDDEN:
        for E, k in EK:
            out += [("dispatch_decode", (dtype, H, E, k, w, c)) for w, c in DECODE_SHAPES]
            out.append(("dispatch_copy", (dtype, H, E, k)))
        for k in sorted({k for _, k in EK}):
            for mode in MODES + (("narrow",) if k >= COMBINE_NARROW_MIN_K else ()):
                out.append(("combine", (dtype, H, k, mode)))
    if dtype != "float32":
        for H, I, E in GEMV_SHAPES:
            out += [("expert_gemv", (dtype, H, 2 * I, E, True)), ("expert_gemv", (dtype, I, H, E, False))]
        out += [("expert_gemv", (dtype, H, E, 1, False)) for H, E in ROUTER_GEMV_SHAPES]
    if dtype == "bfloat16":
        # largest shared memory ([warps, E] counts), and the most experts per thread
        out += [("dispatch_decode", (dtype, 2048, DECODE_MAX_E, 8, w, c)) for w, c in DECODE_SHAPES]
        out += [("dispatch_slots", (E, k)) for E, k in EK]
        out += _route_specs() + [("barrier_probe", ())]
    return out


def source_key() -> str:
    files = sorted((ROOT / "moe_runtime" / "kernels").glob("*.py")) + \
        sorted((ROOT / "moe_runtime" / "sync").glob("*.py")) + [pathlib.Path(__file__)]
    import cutlass
    h = hashlib.sha256(cutlass.__version__.encode())
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _compile_task(arch: str, dtype: str, key: str, cached: list) -> list[tuple]:
    """Worker: compile every spec of the task not in `cached`; (arch, kind, args, error|None, s)."""
    os.environ["CUTE_DSL_KEEP"] = "ptx"  # fills .artifacts.PTX; read when cutlass is imported
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="moe_ptx_")
    from moe_runtime.kernels import cute_compile as cc

    getters = {"dispatch_decode": cc.dispatch_decode_fn, "dispatch_slots": cc.dispatch_slots_fn,
               "dispatch_copy": cc.dispatch_copy_fn,
               "combine": lambda d, h, k, mode, arch: cc.combine_fn(d, h, k, *COMBINE_SHAPES[mode],
                                                                    arch=arch),
               "route": cc.route_fn, "route_nocounts": cc.route_fn,
               "barrier_probe": cc.barrier_probe_fn,
               "expert_gemv": cc.expert_gemv_fn}
    results = []
    for kind, args in specs_for(arch, dtype):
        if _cache_id(key, arch, kind, args) in cached:
            continue
        t0 = time.time()
        try:
            ptx = getters[kind](*args, arch=arch).artifacts.PTX
            err = _ptx_problems(kind, args, ptx) or _ptxas_spills(kind, arch, ptx)
        except Exception as ex:  # reported by the test, per configuration
            err = f"{type(ex).__name__}: {str(ex)[:400]}"
        results.append((arch, kind, args, err, time.time() - t0))
    return results


# programmatic dependent launches that must wait (griddepcontrol.wait) before their first
# global memory access (the prefill copy loads x rows and ids before its wait on purpose, but
# writes nothing before it)
WAIT_FIRST = ("dispatch_decode", "dispatch_slots", "combine", "route", "route_nocounts")
WRITE_AFTER_WAIT = ("dispatch_copy",)
GLOBAL_ACCESS = r"\b(ld|st|atom|red)\.global\b"
GLOBAL_WRITE = r"\b(st|atom|red)\.global\b"
# kernels compiled under a blocks-per-SM bound (.minnctapersm), where ptxas may spill to fit
PTXAS_CHECKED = ("dispatch_copy",)


def _ptxas_spills(kind: str, arch: str, ptx: str) -> str | None:
    """ptxas's spill report for a kernel compiled under a register bound, when a ptxas is on
    PATH (a spill happens in ptxas, after the PTX the other checks read)."""
    ptxas = shutil.which("ptxas")
    if kind not in PTXAS_CHECKED or ptxas is None or ".minnctapersm" not in ptx:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:  # a ptxas too old for the arch: nothing to read
        return None
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out.stderr)]
    return f"ptxas spills under the blocks-per-SM bound: {spills}" if any(spills) else None


def _ptx_problems(kind: str, args: tuple, ptx: str) -> str | None:
    need = FACTS[kind]
    missing = [p for p in need if not re.search(p, ptx)]
    present = [p for p in FORBID + FORBID_KIND.get(kind, []) if re.search(p, ptx)]
    if missing or present:
        return f"PTX missing {missing} / forbidden present {present}"
    if kind == "dispatch_copy" and args and not re.search(r"\.minnctapersm\s+\d+", ptx):
        from moe_runtime.kernels import cute_compile as cc
        from moe_runtime.kernels.dispatch_copy import full_occupancy_blocks
        bits = cc.DTYPES[args[0]].width
        if full_occupancy_blocks(cc.DISPATCH_COPY_WARPS, cc.dispatch_copy_v(args[3]), args[2],
                                 bits):
            return "the copy launch lost its blocks-per-SM bound (.minnctapersm)"
    if kind in WAIT_FIRST + WRITE_AFTER_WAIT:
        first = re.search(GLOBAL_ACCESS if kind in WAIT_FIRST else GLOBAL_WRITE, ptx)
        wait = re.search(r"griddepcontrol\.wait", ptx)
        if wait is None or (first is not None and first.start() < wait.start()):
            what = "access" if kind in WAIT_FIRST else "write"
            return f"a global memory {what} precedes griddepcontrol.wait"
    return None


def _cache_id(key: str, arch: str, kind: str, args: tuple) -> str:
    return hashlib.sha256(repr((key, arch, kind, args)).encode()).hexdigest()[:32]


def _cache_path() -> pathlib.Path | None:
    d = os.environ.get("MOE_RUNTIME_COMPILE_CACHE")
    return pathlib.Path(d) / "kernels_compile_ok.json" if d else None


def test_every_configuration_compiles_for_sm90a_and_sm100a():
    key = source_key()
    cache_file = _cache_path()
    cached = set()
    if cache_file and cache_file.exists():
        cached = set(json.loads(cache_file.read_text()).get(key, []))
    tasks = [(arch, dtype) for arch in ARCHS for dtype in DTYPES]
    t0 = time.time()
    workers = max(1, min(2, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futs = [pool.submit(_compile_task, a, d, key, sorted(cached)) for a, d in tasks]
        results = [r for f in futs for r in f.result()]
    wall = time.time() - t0
    failed = [r for r in results if r[3]]
    expected = sum(len(specs_for(a, d)) for a, d in tasks)
    assert len(results) + len(cached & _all_ids(key, tasks)) == expected
    if cache_file:
        ok = cached | {_cache_id(key, a, k, g) for a, k, g, e, _ in results if not e}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({key: sorted(ok)}))
    slowest = max((r[4] for r in results), default=0.0)
    print(f"\n{len(results)} compiled ({expected - len(results)} cached) in {wall:.0f} s with "
          f"{workers} workers; slowest {slowest:.1f} s")
    assert not failed, "\n".join(f"{a} {k}{g}: {e}" for a, k, g, e, _ in failed)


def _all_ids(key: str, tasks) -> set:
    return {_cache_id(key, a, k, g) for a, d in tasks for k, g in specs_for(a, d)}


ORDERED_PTX = [r"ld\.acquire\.gpu\.global\.b32", r"ld\.acquire\.sys\.global\.b32",
               r"ld\.relaxed\.gpu\.global\.b32", r"ld\.relaxed\.sys\.global\.b32",
               r"st\.release\.gpu\.global\.b32", r"st\.release\.sys\.global\.b32",
               r"st\.relaxed\.gpu\.global\.b32", r"st\.relaxed\.sys\.global\.b32",
               r"atom\.global\.release(\.gpu)?\.add\.u32", r"atom\.global\.sys\.release\.add\.u32",
               r"atom\.global\.acq_rel(\.gpu)?\.add\.u32", r"atom\.global\.sys\.acq_rel\.add\.u32",
               r"fence\.acq_rel\.gpu", r"fence\.acq_rel\.sys"]


def _ordered_probe_ptx(arch: str) -> str:
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="moe_ptx_")
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass import Int32

    import tests._ordered_probe as probe
    flags = make_fake_compact_tensor(Int32, (8,), assumed_align=16)
    return cute.compile(probe.ordered_probe, flags, options=f"--gpu-arch {arch}").artifacts.PTX


@pytest.mark.parametrize("arch", ARCHS)
def test_sync_primitives_emit_ordered_ptx(arch):
    """Every moe_runtime.sync.ordered helper, at .gpu and .sys scope, emits its PTX."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        ptx = pool.submit(_ordered_probe_ptx, arch).result()
    missing = [p for p in ORDERED_PTX if not re.search(p, ptx)]
    assert not missing, f"{arch}: PTX lacks {missing}"


def test_spec_grid_covers_the_issue_grid():
    """The compile grid really is dtypes x hidden x (E, k) x modes (so the test above can fail
    only by a kernel, not by a shrunken grid)."""
    dec = {(a, g) for a in ARCHS for d in DTYPES for k, g in specs_for(a, d) if k == "dispatch_decode"}
    cpy = {(a, g) for a in ARCHS for d in DTYPES for k, g in specs_for(a, d) if k == "dispatch_copy"}
    comb = {(a, g) for a in ARCHS for d in DTYPES for k, g in specs_for(a, d) if k == "combine"}
    n = len(ARCHS) * len(DTYPES) * len(HIDDEN) * len(EK)
    # every block shape, + the E = 1024 decode configs
    assert len(dec) == (n + len(ARCHS)) * len(DECODE_SHAPES) and len(cpy) == n
    ks = {k for _, k in EK}
    assert len(comb) == len(ARCHS) * len(DTYPES) * len(HIDDEN) * (
        len(ks) * len(MODES) + len([k for k in ks if k >= COMBINE_NARROW_MIN_K]))
    routes = [g for k, g in specs_for("sm_90a", "bfloat16") if k.startswith("route")]
    assert {(g[0], g[1], g[2], g[3], g[8], g[9]) for g in routes} == {
        (d, E, k, s, c, w) for d in DTYPES for E, k in EK for s in (False, True)
        for c in (False, True) for w in ROUTE_WARPS.values()}
    from moe_runtime.kernels import cute_compile as cc
    assert DECODE_SHAPES == cc.DISPATCH_DECODE_SHAPES
    # each decode block shape ranks whole 32-item chunks per warp up to its item cap
    assert all(c % (w * 32) == 0 for w, c in DECODE_SHAPES)
    with pytest.raises(ValueError, match="whole 32-item chunks"):
        cc.dispatch_decode_fn("bfloat16", 2048, 128, 8, 8, 100, arch="sm_90a")
    assert ROUTE_WARPS == cc.ROUTE_WARPS
    assert COMBINE_NARROW_MIN_K == cc.COMBINE_NARROW_MIN_K
    assert {m: cc.combine_shape(m) for m in MODES} == {m: COMBINE_SHAPES[m] for m in MODES}
    few = cc.COMBINE_NARROW_UNITS_PER_SM * 132  # units on an H200
    assert cc.combine_shape("decode", few, COMBINE_NARROW_MIN_K, 132) == COMBINE_SHAPES["narrow"]
    assert cc.combine_shape("decode", few + 1, 8, 132) == COMBINE_SHAPES["decode"]
    assert cc.combine_shape("decode", 1, COMBINE_NARROW_MIN_K - 1, 132) == COMBINE_SHAPES["decode"]
    assert cc.combine_shape("prefill", 1, 8, 132) == COMBINE_SHAPES["prefill"]


def test_dispatch_decode_grid_rule():
    """One block per SM from T * k * E_local = DISPATCH_DECODE_ONE_BLOCK_WORK on, else a few."""
    from moe_runtime.kernels import cute_ops as ops
    bound, few = ops.DISPATCH_DECODE_ONE_BLOCK_WORK, ops.DISPATCH_DECODE_BLOCKS_PER_SM
    assert few > 1
    assert ops.dispatch_decode_grid(bound // 128, 128, 132) == 132  # Qwen3 T = 64
    assert ops.dispatch_decode_grid(bound // 128 - 1, 128, 132) == few * 132
    assert ops.dispatch_decode_grid(256 * 8, 8, 132) == few * 132  # Mixtral T = 1024
    assert ops.dispatch_decode_grid(8, 256, 78) == few * 78


def test_ptx_checker_rejects_scalar_copies():
    """The PTX facts catch a kernel that lost its 128-bit accesses."""
    scalar = "ld.global.b16 %rs1, [%rd1];\nst.global.b16 [%rd2], %rs1;\nshfl.sync.idx.b32 ..."
    assert "missing" in _ptx_problems("dispatch_copy", (), scalar)
    load = "ld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1];\n"
    rest = ("shfl.sync.up.b32 %r6, %r5, 1, 0, -1;\nbar.sync 0;\nshfl.sync.idx.b32\n"
            "st.global.v4.b32 [%rd2], {...};")
    assert "griddepcontrol" in _ptx_problems("dispatch_copy", (), load + rest)  # PDL wait missing
    vector = load + "griddepcontrol.wait;\n" + rest
    assert _ptx_problems("dispatch_copy", (), vector) is None
    # E = 128 at the default shape must carry the occupancy bound; E = 384 need not
    assert "minnctapersm" in _ptx_problems("dispatch_copy", ("bfloat16", 2048, 128, 8), vector)
    assert _ptx_problems("dispatch_copy", ("bfloat16", 2048, 128, 8),
                         vector + "\n.minnctapersm 16") is None
    assert _ptx_problems("dispatch_copy", ("bfloat16", 2048, 384, 8), vector) is None
    assert _ptx_problems("dispatch_copy", ("float32", 2048, 128, 8), vector) is None
    # the copy launch may load before its wait, but not write
    early = "st.global.b32 [%rd9], %r1;\n" + vector
    assert "write precedes" in _ptx_problems("dispatch_copy", (), early)
    assert _ptx_problems("dispatch_copy", (), "ld.global.b32 %r1, [%rd9];\n" + vector) is None
    assert _ptx_problems("dispatch_copy", (), vector + "\n.local .align 4 .b8 __local_depot0[16];")
    decode = vector + "\nvote.sync.ballot.b32 %r1, %p2, -1;\npopc.b32 %r3, %r1;\nbar.warp.sync -1;\nbar.sync 0;\ngriddepcontrol.launch_dependents;"
    # the decode dispatch must wait before its first global access (the copy launch need not)
    assert "precedes griddepcontrol.wait" in _ptx_problems("dispatch_decode", (), decode)
    decode = "griddepcontrol.wait;\n" + decode
    assert _ptx_problems("dispatch_decode", (), decode) is None
    assert "forbidden" in _ptx_problems("dispatch_decode", (), decode + "\natom.global.add.u32 %r4, [%rd1], 1;")


def test_hidden_policy_rejects_rows_that_are_not_16_byte_multiples():
    torch = pytest.importorskip("torch")
    from moe_runtime.kernels import cute_ops

    for dtype, bad in ((torch.bfloat16, 2884), (torch.float16, 7), (torch.float32, 2882)):
        t = torch.empty(2, bad, dtype=dtype)
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            cute_ops._check_hidden("x", t)
    cute_ops._check_hidden("x", torch.empty(2, 2880, dtype=torch.bfloat16))
    cute_ops._check_hidden("x", torch.empty(2, 4, dtype=torch.float32))
