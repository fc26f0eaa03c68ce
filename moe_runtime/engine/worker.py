"""RankWorker: the Ray actor that owns one rank (one GPU, or one CPU slot without GPUs).

The driver (`Engine`) creates one per placement-group bundle, asks rank 0 for a rendezvous
address, has every rank join the torch.distributed group (gloo on CPU, nccl on CUDA), loads
each rank's share of the checkpoint, and then calls `generate` on all ranks at once: they run
prefill and decode in lockstep (see scheduler.run_requests).
"""
from __future__ import annotations

import os
import socket
import warnings
from typing import Optional, Sequence

import ray
import torch

# the concurrency group of `progress`, which the driver declares on the actor
# (ray.remote(concurrency_groups=...)): it answers while `generate` runs
PROGRESS_GROUP = "progress"


class RankWorker:
    """One rank. Plain class; the driver wraps it with `ray.remote`.

    Args:
        rank, world_size: this rank and the number of ranks.
        device: "cpu" or "cuda" (Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU).
    """

    def __init__(self, rank: int, world_size: int, device: str):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.group = None
        self.timeout_s: Optional[float] = None
        self.model = None
        self.steps = 0  # forward passes of the running (or last) generate
        self.layers_run = 0  # decoder layers run by its eager forwards (one prefill can be long)

    def pid(self) -> int:
        """This actor's process id (tests check that the process is gone after shutdown)."""
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """(node IP, a free TCP port) for the torch.distributed store; called on rank 0."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def cluster_info(self):
        """topologies.select.ClusterInfo of all ranks (a collective: every rank must call it)."""
        from ..topologies.select import ClusterInfo
        return ClusterInfo.gather(self.group if self.world_size > 1 else None)

    def init_distributed(self, addr: str, port: int, timeout_s: float) -> None:
        """Join the default process group (gloo on CPU, nccl on CUDA) bounded by timeout_s."""
        from ..comm import init_process_group
        self.timeout_s = timeout_s
        if self.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.group = init_process_group(self.rank, self.world_size, backend=backend,
                                            init_method=f"tcp://{addr}:{port}", timeout_s=timeout_s)

    def load(self, model_dir: str, topology: str, dtype: str = "auto", backend: str = "auto",
             progress: bool = True) -> dict:
        """Build and load this rank's model for `topology`; on a GPU, warm it up
        (scheduler.warm_up: its kernels compile here, not in the first request's timings).
        Returns a short description, with the warnings the load raised (the driver shows them:
        Ray forwards a worker's stderr only asynchronously) and the warm-up's seconds."""
        from ..models import Parallel, load_model
        from .scheduler import warm_up
        self.model = None
        parallel = Parallel(topology, self.rank, self.world_size, self.group, backend, self.timeout_s)
        with warnings.catch_warnings(record=True) as caught:  # (the driver shows them)
            warnings.simplefilter("always")
            self.model = load_model(model_dir, parallel, dtype=dtype, device=self.device,
                                    progress=progress)
        # (outside the recorded warnings: the kernel libraries' own deprecation notices, which
        # the default filters hide, would otherwise reach the user as the load's warnings)
        warm_s = warm_up(self.model) if self.device.type == "cuda" else 0.0
        for layer in self.model.layers:  # (a graph replay runs no hook: its step is counted)
            layer.register_forward_hook(self._layer_done)
        layer = next((l.mlp for l in self.model.layers if hasattr(l.mlp, "local_expert_range")), None)
        experts = layer.local_expert_range if layer is not None else range(0)
        sh = self.model.shard
        return {"rank": self.rank, "experts": [experts.start, experts.stop],
                "q_heads": [sh.q_start, sh.q_start + sh.q_heads],
                "kv_heads": [sh.kv_start, sh.kv_start + sh.kv_heads],
                "eos_token_ids": list(self.model.spec.eos_token_ids), "warm_up_s": warm_s,
                "warnings": list(dict.fromkeys(str(w.message) for w in caught))}

    def generate(self, prompts: Sequence[Sequence[int]], request_ids: Sequence[int], params,
                 stop_ids: Sequence[int], fail_at_step: Optional[int] = None,
                 cuda_graphs: bool = True, max_batch_size: Optional[int] = None):
        """Run this rank's requests (see scheduler.run_requests); returns a RankOutput."""
        from .scheduler import run_requests
        if self.model is None:
            raise RuntimeError(f"rank {self.rank}: no model loaded")
        self.steps = self.layers_run = 0
        return run_requests(self.model, prompts, request_ids, params, stop_ids,
                            max_batch_size=max_batch_size, fail_at_step=fail_at_step,
                            on_step=self._count, cuda_graphs=cuda_graphs)

    def _count(self, steps: int) -> None:
        self.steps = steps

    def _layer_done(self, module, args, output) -> None:
        self.layers_run += 1

    @ray.method(concurrency_group=PROGRESS_GROUP)
    def progress(self) -> int:
        """The work done by the running (or last) generate, growing with every forward pass
        and every decoder layer of an eager one (a long prefill is one forward pass); runs
        beside it (its own concurrency group), so the driver can tell a long generation from
        a stuck one."""
        return self.steps + self.layers_run

    def shutdown(self) -> None:
        """Leave the process group (best effort)."""
        import torch.distributed as dist
        self.model = None
        if dist.is_initialized():
            dist.destroy_process_group()
