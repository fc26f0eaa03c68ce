"""GPU, two or more GPUs (issue 6): one rank per GPU, W = 2 processes.

  * The reference topologies (tp, dp_nvlink, dp_p2p) over an NCCL group, CUDA tensors on
    cuda:rank: every case of tests/test_topologies_multirank.py, checked against LocalTopology
    on the whole batch in this process (offsets, the rows each expert receives, y within the
    dtype's tolerance).
  * The `cute` tp and dp_nvlink backends with peer buffers mapped over CUDA IPC between the
    GPUs (NVLink peer access): the plans of tests/gpu/test_topologies_cute_gpu.py against the
    reference topology over gloo in the same processes.
  * backend "auto" settles on "cute" when every rank has a GPU of its own.
  * cute ranks out of step (one skipped a layer) raise ValueError on every rank.
  * the engine's decode step under tp over NCCL replayed from a CUDA graph on every rank.

Skipped, with the reason, on machines with fewer than two GPUs. Every pool call is bounded
(RUN_TIMEOUT_S in test_topologies_cute_gpu.py); device-side waits by the topologies' timeout_s.
Keep NCCL_NVLS_ENABLE=0 (set for this module when unset): NVLink multicast must not run on
shared hosts.

Run: source .device/setup.sh && python3 -m pytest -m gpu tests/gpu/test_multi_gpu.py
"""
import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs, one per rank (issue 6)")]
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from test_topologies_cute_gpu import (CASES as CUTE_CASES, W, check, check_out_of_step,  # noqa: E402,F401
                                     run, w_auto, w_compare, w_out_of_step)
from test_topologies_multirank import BASE, CASES, TOPOS, check_against_local  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def no_nvlink_multicast():
    """NCCL_NVLS_ENABLE=0 for the rank processes of this module (inherited at spawn) when the
    environment does not set it; restored afterwards (other tests read these variables)."""
    with pytest.MonkeyPatch.context() as mp:
        if "NCCL_NVLS_ENABLE" not in os.environ:
            mp.setenv("NCCL_NVLS_ENABLE", "0")
        yield


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("topo_name", TOPOS)
def test_reference_topologies_over_nccl_match_local(run, topo_name, case_name):
    case = {**BASE, **CASES[case_name], "nccl": True}
    # check_against_local takes a pool: its run() is the bounded `run` fixture here
    check_against_local(SimpleNamespace(run=run), W, topo_name, case)


@pytest.mark.parametrize("case", list(CUTE_CASES))
def test_cute_backends_across_gpus_match_reference(run, case):
    kw, plan = CUTE_CASES[case]
    check(case, run(w_compare, "tp" if case == "tp" else "dp_nvlink", kw, plan, True), W)


def test_auto_picks_cute_with_a_gpu_per_rank(run):
    for before, after, reason, no_buffers in run(w_auto, True):
        assert (before, after, no_buffers) == ("auto", "cute", False), reason


@pytest.mark.parametrize("name", ["tp", "dp_nvlink"])
def test_cute_ranks_out_of_step_across_gpus_raise_on_every_rank(run, name):
    check_out_of_step(name, run(w_out_of_step, name, True))


def w_decode_graph(rank, world, ckpt, topology):
    """A bf16 tp / dp_nvlink model over an NCCL group, its MoE topologies on the reference
    backend (as Ray actors that see one GPU each settle), decoding the same steps eagerly and
    from a DecodeGraph on every rank; then run_requests, which replays the graphs (dp: rank 1
    without requests, so it replays a graph of idle slots with its peer)."""
    from moe_runtime.engine.decode_graph import graphs_apply
    from moe_runtime.engine.sampler import SamplingParams
    from moe_runtime.engine.scheduler import run_requests
    from moe_runtime.layer import MoELayer
    from moe_runtime.models import Parallel, load_model
    from test_moe_layer_gpu import decode_graph_against_eager
    from test_topologies_multirank import rank_device_and_group
    dev, group = rank_device_and_group(rank, {"nccl": True})
    with torch.inference_mode():
        model = load_model(ckpt, Parallel(topology, rank, world, group, "auto", 60.0),
                           dtype="bfloat16", device=dev, progress=False)
        for layer in model.layers:
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.topology.backend = "reference"
        capturable = graphs_apply(model)
        errs, buckets, replayed = decode_graph_against_eager(
            model, dev, seed=3 + (rank if topology != "tp" else 0))
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
        if topology != "tp" and rank == 1:
            prompts = []
        runs = [run_requests(model, prompts, range(len(prompts)),
                             SamplingParams(max_new_tokens=8), stop_ids=[], cuda_graphs=graphs)
                for graphs in (True, False)]
    return (capturable, errs, buckets, replayed, [r.extra["cuda_graphs"] for r in runs],
            [r.token_ids for r in runs])


@pytest.mark.parametrize("topology", ["tp", "dp_nvlink"])
def test_decode_steps_replay_from_cuda_graphs_on_every_rank(run, tmp_path, topology):
    """Each rank's replayed logits match its eager step (bf16) over two length buckets (tp: the
    same on both ranks, the all-reduces giving every rank the same sums), and run_requests
    replays graphs (dp: the fixed-capacity exchange, rank 1 idle) with the eager run's tokens."""
    from moe_runtime.models.make_checkpoint import make_checkpoint
    ckpt = make_checkpoint(str(tmp_path / "qwen3"), "qwen3-moe", "tiny")
    got = run(w_decode_graph, ckpt, topology)
    for capturable, errs, buckets, _, graphed, tokens in got:
        assert capturable and graphed == [True, False]
        assert max(errs) < 2e-2, errs
        assert buckets == [256, 260]
        assert tokens[0] == tokens[1]
    if topology == "tp":
        assert torch.equal(got[0][3], got[1][3])
        assert got[0][5] == got[1][5]
    else:
        assert got[1][5][0] == [] and len(got[0][5][0]) == 2
    assert all(len(t) == 8 for t in got[0][5][0])
