"""cute_ops.compile_kernels (the serving warm-up, MoELayer.warm_up) compiles every launch shape
that dispatch / combine pick for some token count, and nothing else (CPU: the compile getters
are replaced by recorders; tests/test_kernels_compile.py compiles each shape for real)."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("cutlass")

from moe_runtime.kernels import cute_compile as cc  # noqa: E402
from moe_runtime.kernels import cute_ops  # noqa: E402
from moe_runtime.topologies import make_topology  # noqa: E402


@pytest.fixture
def compiled(monkeypatch):
    """The getter keys asked for (name, args), each once however often asked."""
    keys = []
    for name in ("dispatch_decode_fn", "dispatch_slots_fn", "dispatch_copy_fn", "combine_fn"):
        @functools.lru_cache(maxsize=None)
        def getter(*args, name=name):
            keys.append((name, args))
            return object()
        monkeypatch.setattr(cc, name, getter)
    return keys


def test_every_launch_shape_of_the_qwen3_layer(compiled):
    """Qwen3-30B-A3B (bf16, H 2048, E 128, k 8) on 132 SMs: the six decode dispatch item
    classes (T * k up to 2048 items fits the byte bound), the prefill slots and copy launches,
    and combine's one-warp decode grid (T * 8 row segments <= 2 per SM: T <= 33), four-warp
    decode grid and prefill grid: 11 kernels."""
    assert cute_ops.compile_kernels(torch.bfloat16, 2048, 128, 8, sms=132, arch="sm_90a") == 11
    assert sorted(compiled) == sorted(
        [("dispatch_decode_fn", ("bfloat16", 2048, 128, 8, w, cap, "sm_90a"))
         for w, cap in cc.DISPATCH_DECODE_SHAPES]
        + [("dispatch_slots_fn", (128, 8, "sm_90a")),
           ("dispatch_copy_fn", ("bfloat16", 2048, 128, 8, "sm_90a"))]
        + [("combine_fn", ("bfloat16", 2048, 8, w, 1, "sm_90a")) for w in (1, 4, 8)])
    # a second call finds them all compiled
    assert cute_ops.compile_kernels(torch.bfloat16, 2048, 128, 8, sms=132, arch="sm_90a") == 11
    assert len(compiled) == 11


@pytest.mark.parametrize("max_tokens, expected", [
    (0, []),
    (1, [("dispatch_decode_fn", ("float32", 7168, 8, 2, 2, 64, "sm_100a")),
         ("combine_fn", ("float32", 7168, 2, 4, 1, "sm_100a"))]),  # (k = 2: no one-warp grid)
    (40, [("dispatch_decode_fn", ("float32", 7168, 8, 2, 2, 64, "sm_100a")),
          ("dispatch_decode_fn", ("float32", 7168, 8, 2, 4, 128, "sm_100a")),
          ("combine_fn", ("float32", 7168, 2, 4, 1, "sm_100a"))]),
])
def test_a_token_bound_stops_the_walk(compiled, max_tokens, expected):
    """Mixtral-like rows in fp32 (H 7168, E 8, k 2): up to max_tokens only."""
    n = cute_ops.compile_kernels(torch.float32, 7168, 8, 2, max_tokens, sms=132, arch="sm_100a")
    assert (n, sorted(compiled)) == (len(expected), sorted(expected))


@pytest.mark.parametrize("args, exc, msg", [
    ((torch.int32, 2048, 128, 8, None), TypeError, "dtype must be one of"),
    ((torch.bfloat16, 2047, 128, 8, None), ValueError, "positive multiple of 16 bytes"),
    ((torch.bfloat16, 2048, 128, 8, -1), ValueError, "max_tokens must be >= 0"),
    ((torch.bfloat16, 2048, 128, 33, None), ValueError, "top_k must be in"),
    ((torch.bfloat16, 2048, 0, 8, None), ValueError, "num_local_experts must be in"),
])
def test_bad_sizes_are_refused(compiled, args, exc, msg):
    with pytest.raises(exc, match=msg):
        cute_ops.compile_kernels(*args, sms=132)
    assert compiled == []


def test_topologies_without_such_kernels_compile_nothing(compiled):
    """The reference backend, a CPU device and the multi-rank topologies: 0, no compile."""
    assert make_topology("local", 8, backend="reference").compile_kernels(
        64, torch.bfloat16, 2, None, "cpu") == 0
    assert make_topology("local", 8).compile_kernels(64, torch.bfloat16, 2, None, "cpu") == 0
    assert make_topology("tp", 8, backend="reference").compile_kernels(
        64, torch.bfloat16, 2, None, "cpu") == 0
    assert compiled == []


@pytest.mark.parametrize("max_tokens, algos", [(None, ["oneshot", "twoshot"]),
                                               (256, ["oneshot"]), (257, ["oneshot", "twoshot"])])
def test_tp_on_cute_compiles_its_dispatch_and_combine_all_reduces(compiled, monkeypatch,
                                                                   max_tokens, algos):
    """tp settled on cute (E 8, H 2048 bf16): the local dispatch kernels of every token count
    up to max_tokens (capped by max_tokens_per_rank, 1024) and the combine all-reduce of each
    algorithm those counts pick (one-shot up to 1 MiB of partials: 256 tokens here)."""
    import contextlib
    import types

    from moe_runtime.kernels import allreduce
    asked = []
    monkeypatch.setattr(allreduce, "compile_allreduce", lambda code, *a: asked.append(code))
    monkeypatch.setenv("MOE_RUNTIME_SMS", "132")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    topo = make_topology("tp", 8, backend="reference")  # (a world of one here)
    assert topo.compile_kernels(2048, torch.bfloat16, 8, max_tokens, "cuda") == 0
    topo.backend = "cute"  # (as a first call settles "auto")
    n = topo.compile_kernels(2048, torch.bfloat16, 8, max_tokens, "cuda")
    assert sorted(asked) == sorted(allreduce.COMBINE | allreduce.ALGOS[a] for a in algos)
    assert n == len(compiled) + len(algos)
    # the local kernels are those of the capped token range (asked again: all cached)
    assert cute_ops.compile_kernels(torch.bfloat16, 2048, 8, 8, min(max_tokens or 1024, 1024),
                                    sms=132) == len(compiled)
