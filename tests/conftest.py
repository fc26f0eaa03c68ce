"""Shared pytest set-up: GPU tests skip with a reason where CUDA is absent; `recorded` records
the multi-rank kernels' launches for CPU tests of their host code."""
import os
import tempfile

import pytest
import torch

# PTX kept by compile-only tests (--keep-ptx) goes to a temporary folder, not the checkout's root
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="moe_ptx_"))
# inductor's on-disk caches start empty per run: their keys leave out a custom op's autograd
# formula, so graphs cached by an older checkout's ops (expert_loop.py) would be reused
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="moe_inductor_"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU test machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def recorded(monkeypatch):
    """The multi-rank kernels' launches, recorded instead of compiled (see _recorded.py), with
    the 132 SMs of an H200 for the grid sizes."""
    pytest.importorskip("cutlass")
    from _recorded import record_launches
    from moe_runtime.kernels import peer_sync
    monkeypatch.setenv("MOE_RUNTIME_SMS", "132")
    peer_sync.sm_count.cache_clear()
    yield record_launches(monkeypatch.setattr)
    peer_sync.sm_count.cache_clear()
