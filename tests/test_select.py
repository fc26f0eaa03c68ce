"""select_topology over described clusters, ClusterInfo validation and gathering."""
from __future__ import annotations

import os

import pytest

from _dist import run_distributed
from moe_runtime.topologies.select import (NVLS_VARS, ClusterInfo, ParallelConfig,
                                           gpu_arch_name, nvls_disabled_by, select_topology)

TP, DP = "tp", "dp"


def full(W):
    return [[True] * W for _ in range(W)]


def islands(nodes, per_node):
    W = nodes * per_node
    return [[i // per_node == j // per_node for j in range(W)] for i in range(W)]


def h200_node(**kw):
    base = dict(world_size=8, num_nodes=1, gpu_name="NVIDIA H200", gpu_arch="sm_90a",
                nvlink_p2p=full(8), multicast_supported=True, nvls_env={},
                nics=["mlx5_0", "mlx5_1"], nvshmem_available=True)
    return ClusterInfo(**{**base, **kw})


def h100_2nodes(**kw):
    base = dict(world_size=16, num_nodes=2, gpu_name="NVIDIA H100 80GB HBM3", gpu_arch="sm_90a",
                nvlink_p2p=islands(2, 8), multicast_supported=True, nvls_env={},
                nics=[f"mlx5_{i}" for i in range(8)], nvshmem_available=True)
    return ClusterInfo(**{**base, **kw})


def nvl72(**kw):
    base = dict(world_size=72, num_nodes=18, gpu_name="NVIDIA GB200", gpu_arch="sm_100a",
                nvlink_p2p=full(72), multicast_supported=True, nvls_env={},
                nics=["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"], nvshmem_available=True)
    return ClusterInfo(**{**base, **kw})


def cpu(W, nodes=1):
    return ClusterInfo(world_size=W, num_nodes=nodes, gpu_name=None, gpu_arch=None,
                       nvlink_p2p=[[i == j for j in range(W)] for i in range(W)])


def pick(info, mode):
    return select_topology(info, ParallelConfig.from_mode(mode, info.world_size))


@pytest.mark.parametrize("mode", [TP, DP])
def test_one_gpu_is_local(mode):
    info = ClusterInfo(world_size=1, num_nodes=1, gpu_name="NVIDIA H200", gpu_arch="sm_90a",
                       nvlink_p2p=[[True]], multicast_supported=True)
    sel = pick(info, mode)
    assert (sel.name, sel.allreduce) == ("local", None)


def test_h200_node_tp_uses_nvls():
    name, reason, allreduce = pick(h200_node(), TP)
    assert (name, allreduce) == ("tp", "nvls")
    assert "8 x NVIDIA H200" in reason and "nvls" in reason


@pytest.mark.parametrize("var,value", [("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                                       ("NCCL_NVLS_ENABLE", "false"),
                                       ("NVSHMEM_DISABLE_NVLS", "TRUE")])
def test_nvls_variable_turns_nvls_off_and_reason_names_it(var, value):
    name, reason, allreduce = pick(h200_node(nvls_env={var: value}), TP)
    assert (name, allreduce) == ("tp", "one-shot/two-shot")
    assert f"{var}={value}" in reason


@pytest.mark.parametrize("env", [{"NCCL_NVLS_ENABLE": "1"}, {"NVSHMEM_DISABLE_NVLS": "0"},
                                 {"TORCH_SYMM_MEM_DISABLE_MULTICAST": ""}])
def test_non_disabling_values_keep_nvls(env):
    assert pick(h200_node(nvls_env=env), TP).allreduce == "nvls"


def test_no_multicast_support_falls_back_to_peer_buffers():
    name, reason, allreduce = pick(h200_node(multicast_supported=False), TP)
    assert (name, allreduce) == ("tp", "one-shot/two-shot") and "no multicast" in reason


def test_h200_node_dp_is_dp_nvlink():
    name, reason, allreduce = pick(h200_node(), DP)
    assert (name, allreduce) == ("dp_nvlink", None) and "one NVLink domain" in reason


def test_two_h100_nodes_with_ib_dp_is_dp_p2p():
    name, reason, _ = pick(h100_2nodes(), DP)
    assert name == "dp_p2p" and "NVSHMEM over IB" in reason and "mlx5_0" in reason


def test_two_h100_nodes_tp_goes_through_nccl():
    name, reason, allreduce = pick(h100_2nodes(), TP)
    assert (name, allreduce) == ("tp", "nccl") and "dp_p2p" in reason


@pytest.mark.parametrize("kw,missing", [(dict(nvshmem_available=False), "NVSHMEM not available"),
                                        (dict(nics=[]), "no InfiniBand NICs")])
def test_two_nodes_without_ib_or_nvshmem_says_reference_only(kw, missing):
    name, reason, _ = pick(h100_2nodes(**kw), DP)
    assert name == "dp_p2p" and missing in reason and "reference backend" in reason


def test_gb200_nvl72_dp_is_dp_nvlink_across_18_nodes():
    name, reason, _ = pick(nvl72(), DP)
    assert name == "dp_nvlink" and "18 node(s)" in reason
    assert pick(nvl72(), TP).allreduce == "nvls"


def test_hybrid_tp_dp_uses_dp_topology():
    info = h200_node()
    name, reason, _ = select_topology(info, ParallelConfig(tp=2, dp=4))
    assert name == "dp_nvlink" and "tp=2" in reason


@pytest.mark.parametrize("mode,name,allreduce", [(TP, "tp", "gloo"), (DP, "dp_p2p", None)])
def test_cpu_only_uses_reference_over_gloo(mode, name, allreduce):
    sel = pick(cpu(4), mode)
    assert (sel.name, sel.allreduce) == (name, allreduce) and "gloo" in sel.reason
    assert "CPU" in sel.reason or "no GPU" in sel.reason


def test_bad_descriptions_raise():
    with pytest.raises(ValueError, match=r"nvlink_p2p must be \[8\]\[8\]"):
        h200_node(nvlink_p2p=full(7))
    with pytest.raises(ValueError, match="num_nodes"):
        cpu(2, nodes=3)
    with pytest.raises(ValueError, match=r"tp \* dp == ep == world_size \(8\).*tp=2, dp=2"):
        select_topology(h200_node(), ParallelConfig(tp=2, dp=2))
    with pytest.raises(ValueError, match="ep=4"):
        select_topology(h200_node(), ParallelConfig(dp=8, ep=4))
    with pytest.raises(ValueError, match="mode"):
        ParallelConfig.from_mode("pp", 8)


def test_helpers():
    assert nvls_disabled_by({}) is None
    assert nvls_disabled_by({"NCCL_NVLS_ENABLE": " 0 "}) == "NCCL_NVLS_ENABLE= 0 "
    assert gpu_arch_name(9, 0) == "sm_90a" and gpu_arch_name(10, 0) == "sm_100a"
    assert gpu_arch_name(8, 0) == "sm_80"


def _facts(host, uuid, peers=(), fabric=None, env=None, nics=("mlx5_0",)):
    return dict(host=host, gpu_name="G", gpu_arch="sm_100a", uuid=uuid, nvlink_peers=peers,
                fabric=fabric, multicast=True, env=env or {}, nics=list(nics), nvshmem=True)


def test_from_facts_builds_matrix_from_peers_and_fabric():
    # two hosts x two GPUs, NVLink within a host only; rank 3 disables NVLS; host b has 1 NIC
    facts = [_facts("a", "u0", ("u1",)), _facts("a", "u1", ("u0",)),
             _facts("b", "u2", ("u3",), nics=()), _facts("b", "u3", ("u2",),
                                                          env={"NVSHMEM_DISABLE_NVLS": "1"})]
    info = ClusterInfo.from_facts(facts)
    assert info.nvlink_p2p == tuple(tuple(r) for r in islands(2, 2))
    assert (info.world_size, info.num_nodes, info.nics) == (4, 2, ())
    assert info.nvls_env["NVSHMEM_DISABLE_NVLS"] == "1"
    # same hosts in one NVLink fabric (NVL72-like): one domain
    fab = [dict(f, fabric="c:1") for f in facts]
    assert ClusterInfo.from_facts(fab).one_nvlink_domain


def _gather_worker(rank, world):
    from moe_runtime.comm import new_group
    if rank == 1:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    on_default = ClusterInfo.gather()  # (None: the default group, as in torch.distributed)
    return ClusterInfo.gather(new_group(timeout_s=20)), on_default


def test_gather_live_cpu_ranks():
    local = ClusterInfo.gather()
    assert (local.world_size, local.gpu_arch, local.nvlink_p2p) == (1, None, ((True,),))
    assert select_topology(local, ParallelConfig()).name == "local"
    (a, a_default), (b, b_default) = run_distributed(_gather_worker, 2)
    assert a == b == a_default == b_default
    assert (a.world_size, a.num_nodes, a.gpu_arch) == (2, 1, None)
    assert a.nvlink_p2p == ((True, False), (False, True))
    assert a.nvls_env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert set(a.nvls_env) == set(NVLS_VARS)
    assert pick(a, DP).name == "dp_p2p"
