"""MoELayer = router -> topology.dispatch -> experts (grouped GEMM) -> topology.combine (+ shared)."""
from __future__ import annotations

import torch
from torch import nn

from .config import MoEConfig
from .experts import Experts, SharedExpert
from .routing import Router
from .topologies.base import Topology


class MoELayer(nn.Module):
    """A Mixture-of-Experts block whose token movement goes through a topology.

    Args:
        config: MoEConfig.
        topology: a Topology instance, or a name ("local", "tp", "dp_nvlink", "dp_p2p") built
            with `group`, `align` and `backend`.
        group: torch.distributed process group for multi-rank topologies (None = default).
        backend: kernel backend "auto" (CuTeDSL on CUDA when importable, else torch),
            "reference" or "cute".
        align: row alignment of each expert's segment (grouped GEMM friendliness).
        device: where parameters live.

    Shapes:
        forward(hidden_states [..., H] in config.dtype) -> [..., H] in config.dtype.
        Under `tp` every rank passes the same tokens and gets the full output; under `dp_*`
        each rank passes its own tokens (any count, 0 included).

    Raises:
        ValueError / TypeError: bad config, topology name, or input shape/dtype/device.
    """

    def __init__(self, config: MoEConfig, *, topology: str | Topology = "local", group=None,
                 backend: str = "auto", align: int = 1, device=None):
        super().__init__()
        self.config = config
        if isinstance(topology, str):
            from .topologies import make_topology
            topology = make_topology(topology, config.num_experts, group=group, align=align,
                                     backend=backend)
        if topology.num_experts != config.num_experts:
            raise ValueError(f"topology has {topology.num_experts} experts, config {config.num_experts}")
        self.topology = topology
        self.router = Router(config, backend=backend, device=device)
        self.experts = Experts(topology.num_local_experts, config.hidden_size,
                               config.moe_intermediate_size, dtype=config.dtype, device=device)
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size, config.shared_expert_intermediate_size,
                                              gated=config.shared_expert_gate, dtype=config.dtype,
                                              device=device)

    @property
    def local_expert_range(self) -> range:
        """Global ids of the experts whose weights this rank holds."""
        t = self.topology
        return range(t.expert_start, t.expert_start + t.num_local_experts)

    def load_expert_weights(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Use existing expert weights without copying.

        Args:
            gate_up_proj: [E, 2I, H] for all experts (this rank's slice is taken as a view) or
                [E_local, 2I, H] already sliced.
            down_proj: [E, H, I] or [E_local, H, I], likewise.

        Raises:
            ValueError: shapes that fit neither form.
        """
        r = self.local_expert_range
        if gate_up_proj.shape[0] == self.config.num_experts != len(r):
            gate_up_proj, down_proj = gate_up_proj[r.start:r.stop], down_proj[r.start:r.stop]
        self.experts = Experts(len(r), self.config.hidden_size, self.config.moe_intermediate_size,
                               gate_up_proj=gate_up_proj, down_proj=down_proj,
                               use_grouped_mm=self.experts.use_grouped_mm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        c = self.config
        if hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must be [..., {c.hidden_size}], got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != c.dtype:
            raise TypeError(f"hidden_states must be {c.dtype} (the layer's dtype), got {hidden_states.dtype}")
        x = hidden_states.reshape(-1, c.hidden_size)
        topk_ids, topk_weights = self.router(x)
        result = self.topology.dispatch(x, topk_ids, topk_weights, check_values=False)
        expert_y = self.experts(result.expert_x, result.expert_offsets)
        y = self.topology.combine(expert_y, result)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y.view(hidden_states.shape)
