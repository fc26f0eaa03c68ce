"""MoELayer = router -> topology.dispatch -> experts (grouped GEMM) -> topology.combine (+ shared)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn

from .config import _DTYPES, MoEConfig
from .cuda_graphs import DEFAULT_BUCKETS, BucketedGraphs, CaptureFn
from .experts import Experts, SharedExpert
from .kernels import _log_once, autograd_records, check_backend_name, differentiable_kernels, \
    forward_ad_active
from .param_checks import check_layer_submodule, note_assignment, structure_version, unwrapped
from .routing import Router
from .topologies.base import Topology

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # (a torch without distributed support)
    _DTensor = None


def _sharded(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (an FSDP2 parameter not unsharded yet)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def _children(layer: nn.Module, subs: tuple[nn.Module, ...]) -> tuple[tuple, ...]:
    """The children of the layer and of each of its submodules `subs`, in order (compared by
    identity: nn.Module has no __eq__)."""
    return tuple([tuple(m._modules.values()) for m in (layer, *subs)])


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
        forward(hidden_states [..., H] in `dtype`) -> [..., H] in `dtype`, the dtype the
        weights share (config.dtype unless the weights were set otherwise; a cast of the layer
        updates both; see forward).
        Under `tp` every rank passes the same tokens and gets the full output (the token
        count is checked, the values are not: ranks passing different tokens of one count get
        wrong outputs without an error, as with any tensor-parallel layer); under `dp_*`
        each rank passes its own tokens (any count, 0 included). These multi-rank layers are
        for inference (their backward raises): each rank's `experts` hold other experts, so do
        not wrap them in DDP / FSDP, whose first broadcast would overwrite every rank's
        experts with rank 0's.

    Decode on CUDA: on the `local` topology with the `cute` backend on sm_90/sm_100 (bf16; fp16
    too with quack-kernels installed), forward never synchronizes with the host (routing,
    dispatch and combine are CuTeDSL kernels; the experts are the CuTeDSL GEMV, quack's grouped
    GEMM or `torch._grouped_mm`, all with device offsets, see experts.py), so `enable_cuda_graphs()` can
    capture it per bucketed token count (see cuda_graphs.py). `torch._grouped_mm` needs no row
    alignment per expert (only 16-byte aligned rows, i.e. H and I multiples of 8), so `align`
    stays 1 by default on CUDA too. The experts choose their kernels from the rows the topology
    expects this rank to use (DispatchResult.expected_rows: under `tp` T*k/W of the T*k
    capacity rows), so `tp` decode keeps the GEMV without reading the real count on the host.

    Training: a forward that autograd must record (gradients enabled and the input or a
    parameter requires grad; parameters do by default, as in nn.Linear) on the `local` topology
    runs the torch reference kernels, which are differentiable, whatever `backend` "auto"
    would pick (logged once on CUDA); with backend "cute" it raises ValueError instead, and
    inside a CUDA-graph capture RuntimeError. Run inference under torch.inference_mode() or
    torch.no_grad() to get the CuTeDSL kernels. Under torch.compile (the `local` topology; the
    multi-rank ones' collectives are not traced) grad mode decides (kernels.resolve_backend):
    with it off, "auto" and "cute" keep the CuTeDSL routing, dispatch, combine, decode GEMVs
    and quack's prefill grouped GEMMs as custom ops (kernels/compiled_ops.py); with it on,
    "auto" is the torch reference kernels and torch._grouped_mm, which dynamo differentiates,
    and "cute" fails fullgraph=True (otherwise it runs its kernels eagerly between graph
    breaks, inference only). Compiled training with fullgraph=True works in every dtype:
    bf16 experts take torch._grouped_mm, fp32 / fp16 ones the per-expert loop as one op with
    a backward (expert_loop.py; inductor could not generate the backward of the loop's
    data-dependent row slices before, and with graph breaks dynamo recompiled per row count).

    Attributes:
        module_aliases: {name: submodule path}, other names under which submodules are
            reachable as attributes, for reading and assignment (empty unless set;
            swap_moe_layers sets the HF block's names, e.g. "gate" -> "router", which its
            state_dict keys use).

    Raises:
        ValueError / TypeError: bad config, topology name, or input shape/dtype/device.
    """

    def __init__(self, config: MoEConfig, *, topology: str | Topology = "local", group=None,
                 backend: str = "auto", align: int = 1, device=None):
        super().__init__()
        self.module_aliases: dict[str, str] = {}
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a moe_runtime.MoEConfig, got {type(config).__module__}."
                            f"{type(config).__name__} (for an HF transformers model, use "
                            "swap_moe_layers, which reads the MoEConfig from each block)")
        self.config = config
        check_backend_name(backend)
        if not isinstance(topology, (str, Topology)):
            raise TypeError(f"topology must be a name or a Topology, got {type(topology).__name__}")
        if isinstance(topology, str):
            from .topologies import make_topology
            topology = make_topology(topology, config.num_experts, group=group, align=align,
                                     backend=backend)
        if topology.num_experts != config.num_experts:
            raise ValueError(f"topology has {topology.num_experts} experts, config {config.num_experts}")
        self.topology = topology
        self.router = Router(config, backend=backend, device=device)
        self.experts = Experts(topology.num_local_experts, config.hidden_size,
                               config.moe_intermediate_size, dtype=config.dtype, device=device,
                               backend=backend)
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size, config.shared_expert_intermediate_size,
                                              gated=config.shared_expert_gate, dtype=config.dtype,
                                              device=device)
        self.cuda_graphs: Optional[BucketedGraphs] = None
        self._topology_layer = topology.register_layer()  # (last: a failed build takes no id)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype forward computes in: the one the layer's weights share (config.dtype at
        construction; a cast of the layer updates both; weights set by assignment, e.g. FSDP2's
        mixed precision or load_state_dict(assign=True), change only this).

        Raises:
            TypeError / ValueError: as forward, for weights of mixed or unsupported dtypes or
                another shape.
        """
        return self._weights_dtype()

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
            ValueError: shapes that fit neither form, the two tensors in different forms, or
                weights on another device than the layer's parameters.
            TypeError: weights that are not tensors or not in the layer's dtype (`dtype`).
        """
        device = self.router.weight.device
        dtype = self.dtype
        for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
            if w.dtype != dtype:
                raise TypeError(f"{name} must be {dtype} (the dtype of the layer's weights), "
                                f"got {w.dtype}")
            if w.device != device and device.type != "meta":  # (meta: a layer being assembled)
                raise ValueError(f"{name} is on {w.device} but the layer's other parameters are "
                                 f"on {device}: move the weights (or the layer) first")
        r, E = self.local_expert_range, self.config.num_experts
        lead = (gate_up_proj.dim() and gate_up_proj.shape[0], down_proj.dim() and down_proj.shape[0])
        if lead == (E, E) and E != len(r):
            gate_up_proj, down_proj = gate_up_proj[r.start:r.stop], down_proj[r.start:r.stop]
        elif lead != (len(r), len(r)):  # (one form for both: else ranks would differ in what fits)
            raise ValueError(
                f"expert weights must both hold all {E} experts ([{E}, 2I, H] and [{E}, H, I]) "
                f"or both only this rank's {len(r)} (experts {r.start}..{r.stop - 1}: "
                f"[{len(r)}, 2I, H] and [{len(r)}, H, I]); got gate_up_proj "
                f"{tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)}")
        self.experts = Experts(len(r), self.config.hidden_size, self.config.moe_intermediate_size,
                               gate_up_proj=gate_up_proj, down_proj=down_proj,
                               use_grouped_mm=self.experts.use_grouped_mm,
                               backend=self.experts.backend)
        self.invalidate_cuda_graphs()

    @torch.no_grad()
    def warm_up(self, max_tokens: Optional[int] = None) -> int:
        """Compile now what forward of 1..max_tokens tokens (None: any number) would compile on
        first use, on the router weight's device: the topology's dispatch and combine kernels
        for every launch shape (Topology.compile_kernels: the cute kernels of `local`, and of
        `tp` once its backend is cute, the tp combine's all-reduces included) and the experts'
        grouped GEMM tiles (Experts.warm_up). A forward of one token and one of
        more than cute_compile.ROUTE_DECODE_MAX_TOKENS tokens then compile the rest (the two
        routing launch shapes, the decode GEMV). With CUDA graphs enabled, a forward of T
        tokens runs at its bucket's size (BucketedGraphs.bucket_for), so the kernels are those
        of up to max_tokens' bucket. Returns the number of dispatch / combine kernels the
        topology compiled (or found compiled)."""
        device = self.router.weight.device
        if max_tokens is not None and self.cuda_graphs is not None:
            max_tokens = max(max_tokens, self.cuda_graphs.bucket_for(max_tokens) or 0)
        n = self.topology.compile_kernels(self.config.hidden_size, self.dtype, self.config.top_k,
                                          max_tokens, device)
        self.experts.warm_up()
        return n

    # -- CUDA graphs ----------------------------------------------------------------------------
    def extra_repr(self) -> str:
        t = self.topology
        return f"topology={t.name}" + (f", rank={t.rank}, world_size={t.world_size}"
                                       if t.world_size > 1 else "")

    def host_sync_free(self, device=None) -> bool:
        """Whether forward on `device` (default: the router weight's) never waits for the host.

        True on CUDA when routing and the topology resolve to the `cute` kernels, the topology is
        `local`, and the expert GEMMs are sync-free (`Experts.host_sync_free`: quack on
        sm_90/sm_100 in bf16/fp16, or torch's grouped-GEMM fast path in bf16); always True on
        CPU (there is no device to wait for).
        """
        device = torch.device(device if device is not None else self.router.weight.device)
        if device.type == "cpu":
            return True
        dtype = self._common_dtype()
        c = self.config
        return (device.type == "cuda" and self.topology.name == "local" and dtype is not None
                and self.topology.resolved_backend(device, c.hidden_size, dtype, c.top_k) == "cute"
                and self._kernels_sync_free(device))

    def graph_capturable(self, device=None) -> bool:
        """Whether a CUDA graph on `device` (default: the router weight's) can capture forward
        as part of a step that every rank of the topology captures and replays together (the
        engine's decode step, engine/decode_graph.py): `host_sync_free` on CUDA, or a topology
        whose collectives a capture records (Topology.records_collectives: `tp` and, inside
        topologies.fixed_capacity, `dp_*` on the reference backend over NCCL, as Ray actors
        that see one GPU each settle on) with routing and experts as `host_sync_free` asks.
        The replay's completion is then bounded by its caller (comm.wait_stream_bounded), not
        by the collectives themselves.
        """
        device = torch.device(device if device is not None else self.router.weight.device)
        if device.type != "cuda":
            return False
        return self.host_sync_free(device) or (self.topology.records_collectives()
                                               and self._kernels_sync_free(device))

    def _kernels_sync_free(self, device: torch.device) -> bool:
        """Routing on the cute kernels and sync-free expert GEMMs on CUDA `device`."""
        dtype = self._common_dtype()
        return (dtype is not None
                and self.router.resolved_backend(device, self.router.logits_dtype(dtype)) == "cute"
                and self.experts.host_sync_free(device, dtype))

    def enable_cuda_graphs(self, buckets: Sequence[int] = DEFAULT_BUCKETS, *, capture: bool = False,
                           copy_output: bool = True, capture_fn: Optional[CaptureFn] = None) -> BucketedGraphs:
        """Replay CUDA graphs for calls of 1..max(buckets) tokens (padded up to a bucket).

        Graph replay is used only where it computes what eager computes: under
        `torch.no_grad()` / `torch.inference_mode()`, outside another stream capture, on the
        layer's device, for token counts within the buckets, and while no forward hook or
        pre-hook is registered on a submodule or globally (a replay runs no Python; hooks on the
        layer itself are fine); everything else runs eagerly. A call between two buckets runs
        the expert kernels picked for its bucket's rows (Experts.forward: the GEMV or a grouped
        GEMM), so its output may differ from eager's in the last bits (another fp32 summation
        order). Graphs are recaptured
        after the weights move (`load_expert_weights`, a replaced parameter, `.to()`); in-place
        weight updates are seen by the replays as they are.

        Args:
            buckets: token counts to capture (default 1, 2, 4, ..., 256).
            capture: capture every bucket now (largest first); otherwise on first use.
            copy_output: return fresh tensors (True) or views of the graphs' outputs, valid until
                the next call of this layer (False).
            capture_fn: a stand-in for the CUDA-graph capture (tests on CPU); needs no GPU.

        Returns:
            The BucketedGraphs (also `self.cuda_graphs`).

        Raises:
            RuntimeError: forward on the layer's device is not host-sync-free (CPU, the
                `reference` backend on CUDA, fp32 experts, fp16 without quack-kernels, a
                multi-rank topology), unless
                capture_fn is given.
        """
        device = self.router.weight.device
        if capture_fn is None and (device.type != "cuda" or not self.host_sync_free(device)):
            raise RuntimeError(
                f"CUDA graphs need a host-sync-free forward on a CUDA device: got device {device}, "
                f"topology {self.topology.name!r}, backend {self.router.backend!r}, dtype "
                f"{self._common_dtype()} (needs local + cute on sm_90/sm_100, bf16, or fp16 with "
                "quack-kernels)")
        self.cuda_graphs = BucketedGraphs(
            self._forward_tokens, hidden_size=self.config.hidden_size, dtype=self.dtype,
            device=device, buckets=buckets, fingerprint=self._storage_fingerprint,
            copy_output=copy_output, capture_fn=capture_fn)
        if capture:
            self.cuda_graphs.capture()
        return self.cuda_graphs

    def disable_cuda_graphs(self) -> None:
        """Drop the graphs and run every call eagerly."""
        self.cuda_graphs = None

    def invalidate_cuda_graphs(self) -> None:
        """Drop captured graphs; they are recaptured on the next eligible call."""
        graphs = getattr(self, "cuda_graphs", None)
        if graphs is not None:
            graphs.invalidate()

    def _apply(self, fn, *args, **kwargs):
        """A conversion of the layer (.to(), .cuda(), .half(), ...): when its weights then share
        a dtype the layer computes in, config.dtype becomes it (the router's config too when
        it is the same object); captured graphs are dropped."""
        out = super()._apply(fn, *args, **kwargs)
        structure_version[0] += 1  # (parameters may be new objects: the overwrite flag)
        dtype = self._common_dtype()
        if dtype in _DTYPES.values() and dtype != self.config.dtype:
            old, self.config = self.config, dataclasses.replace(self.config, dtype=dtype)
            router = unwrapped(self.router)
            if getattr(router, "config", None) is old:
                router.config = self.config
        g = self.cuda_graphs
        if g is not None:  # .to() / .cuda(): new storage, maybe a new device or dtype
            g.invalidate()
            g.device, g.dtype = self.router.weight.device, self.config.dtype
            if not g.custom_capture and not (g.device.type == "cuda" and self.host_sync_free()):
                self.cuda_graphs = None  # (e.g. cast to fp32: its experts read offsets on the host)
                _log_once(f"moe_runtime: a MoELayer's CUDA graphs were dropped after a conversion "
                          f"to {g.device} / {self.config.dtype}, where its forward is not "
                          f"host-sync-free (enable_cuda_graphs explains what is needed)")
        return out

    def _use_graphs(self, x: torch.Tensor, device: torch.device) -> bool:
        """Whether this call of rows x [T, H] on `device` (x.device) replays CUDA graphs."""
        g = self.cuda_graphs
        return (g is not None and not torch.compiler.is_compiling()  # (traced: compile's graph)
                and not autograd_records() and not forward_ad_active() and device == g.device
                and x.dtype == g.dtype and not torch.is_autocast_enabled(device.type)
                and g.bucket_for(x.shape[0]) is not None
                and not self._inner_hooks()
                and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def _inner_hooks(self) -> bool:
        """Whether a forward hook or pre-hook would run inside forward (registered globally or on
        a submodule: router, experts, shared expert): a replay would skip it and a capture would
        run it on padding rows, so such calls run eagerly. Hooks on the layer itself run outside
        the graphs and do not count."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._tree()[0])

    def _tree(self) -> tuple[tuple[nn.Module, ...], tuple[tuple[str, nn.Module, str, tuple, bool], ...],
                             tuple[nn.Module, ...]]:
        """(submodules, (name, owner module, parameter name, shape, dtype free) of the weights
        that `_weights_dtype` checks, every module in `modules()` order (`_storage_fingerprint`
        reads their parameter and buffer dicts: a tensor registered later under a new name is
        in them)); read live from the owners, so no tensor nor tensor dict is held here (a
        tracer such as torch.export may swap a module's dicts for its own). The shape is
        the config's for the router and the routed experts, the one at the walk for the
        others. The walk costs ~10 us, a call ~1 us: cached until a tensor or
        submodule of this package's modules is assigned or the layer converted
        (param_checks.structure_version), or a submodule is set with add_module /
        register_module (every module's children); under torch.compile walked
        afresh (traced once, guarded by dynamo). A DeepSeek-V3 router may keep its weight in
        fp32 whatever the others' dtype (HF's _keep_in_fp32_modules_strict;
        config.router_logits_fp32)."""
        compiling = torch.compiler.is_compiling()
        seen, tree = self.__dict__.get("_tree_cache", (None, None))
        if compiling or tree is None or seen != (structure_version[0],
                                                 _children(self, tree[0])):
            c, e = self.config, self.topology.num_local_experts
            sized = {"router.weight": (c.num_experts, c.hidden_size),
                     "experts.gate_up_proj": (e, 2 * c.moe_intermediate_size, c.hidden_size),
                     "experts.down_proj": (e, c.hidden_size, c.moe_intermediate_size)}
            named = tuple(self.named_modules())
            subs = tuple(m for _, m in named if m is not self)
            slots = []
            for prefix, m in named:
                for n, w in m._parameters.items():
                    name = f"{prefix}.{n}" if prefix else n
                    if w is not None:
                        slots.append((name, m, n, sized.get(name, tuple(w.shape)),
                                      name == "router.weight" and c.router_logits_fp32))
            tree = (subs, tuple(slots), tuple(m for _, m in named))
            if not compiling:
                self.__dict__["_tree_cache"] = ((structure_version[0], _children(self, subs)),
                                                tree)
        return tree

    def _storage_fingerprint(self) -> tuple[int, ...]:
        """cuda_graphs.storage_fingerprint of the layer (the same tuple) from the cached walk
        (`_tree`): ~2 us a call instead of ~8 on the host, paid by every graph replay."""
        return tuple(t.data_ptr() for m in self._tree()[2] for d in (m._parameters, m._buffers)
                     for t in d.values() if t is not None)

    def __setattr__(self, name, value):
        path = self.__dict__.get("module_aliases", {}).get(name)
        if path is not None:  # an alias: set the submodule it names
            parent, _, leaf = path.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, leaf, value)
            return
        if "config" in self.__dict__:
            check_layer_submodule(self, name, value)
        note_assignment(self, name, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        # submodules also reachable under other names (`module_aliases`), e.g. the HF block's
        # names that a swapped layer's state_dict keys use (hf_swap.py): code that resolves
        # state_dict keys as attribute paths (torch.distributed.checkpoint, get_parameter)
        # finds the tensors under either name
        try:
            return super().__getattr__(name)
        except AttributeError:
            path = self.__dict__.get("module_aliases", {}).get(name)
            if path is None:
                raise
            return self.get_submodule(path)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """y = the MoE layer (+ shared expert) applied to every token.

        Args:
            hidden_states: [..., H] on the layer's device (any leading shape, e.g. [T, H] or
                [B, S, H]; zero tokens allowed) in the dtype of the layer's weights: config.dtype,
                which a cast of the layer (`.to(torch.bfloat16)`, `.half()`) changes, or what
                FSDP2's mixed precision gives them. Under torch.autocast a floating input of
                another dtype is cast to it (the ops inside then autocast as usual).

        Returns:
            [..., H] with hidden_states' shape, in the layer's dtype (`dtype`). Under autocast
            to another dtype the shared expert's output comes in that dtype and the sum
            follows torch's type promotion, as in HF's blocks (a bf16 layer with a shared
            expert under fp16 autocast returns float32); calls under autocast never replay
            CUDA graphs.

        Raises:
            TypeError: not a tensor, not dense (sparse, nested), another dtype than the
                weights' (outside autocast), weights of different dtypes (e.g. `.half()` on a
                submodule only), or float64.
            ValueError: last dimension not H, another device than the weights, the meta
                device (a layer not materialized yet), a weight
                replaced by one of another shape without an assignment (`.data = `), or
                backend="cute" where it cannot run (autograd recording, not CUDA, CuTeDSL
                not importable).
            RuntimeError: a CUDA-graph capture of a forward that autograd records; and in
                backward, from the output of a multi-rank topology's forward (`tp`, `dp_*`:
                the collectives have no backward, see `_NoBackward`).

        Under a multi-rank topology a forward that raises before its dispatch (a refused
        input, a router error) still takes this rank's part in that call, whose exchange its
        peers wait in: it dispatches no tokens and abandons the call (`Topology.abandon`), so
        the peers raise CallAbandoned naming this rank and every rank stays in step (a retry
        works). Where that cannot run (an interrupt, a CUDA graph capture such as the engine's
        decode graphs, or the empty dispatch failing), the call is still counted (`GroupTopology.calls`): the
        rank's next call is then refused as out of step on every rank. Unaccounted for, it
        paired with the peers' pending call: wrong `tp` outputs without an error.
        """
        calls = getattr(self.topology, "calls", None)  # (None: the local topology)
        if calls is None:
            return self._forward(hidden_states)
        try:
            return self._forward(hidden_states)
        except BaseException as e:
            if self.topology.calls == calls:  # (raised before its dispatch)
                self._abandon_undispatched(e, calls)
            raise

    def _abandon_undispatched(self, error: BaseException, calls: int) -> None:
        """This rank's part in a multi-rank call that raised `error` before its dispatch: an
        empty dispatch, then abandon (see forward); else only the call's number (`calls`: the
        topology's count before the call)."""
        topology, layer = self.topology, self.__dict__.get("_topology_layer", 0)
        w = self._modules["experts"].gate_up_proj
        capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
        if isinstance(error, Exception) and not capturing:
            k = self.config.top_k
            try:
                x = torch.empty(0, self.config.hidden_size, dtype=self._weights_dtype(),
                                device=w.device)
                result = topology.dispatch(
                    x, torch.empty(0, k, dtype=torch.int32, device=w.device),
                    torch.empty(0, k, dtype=torch.float32, device=w.device),
                    check_values=False, layer=layer)
            except Exception:  # (counted by dispatch unless its own argument checks failed)
                pass
            else:
                topology.abandon(result, error)
                return
        if topology.calls == calls:
            topology._count_call(layer)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """forward's body (all of it on the local topology)."""
        c = self.config
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.layout != torch.strided:  # (sparse, or a nested tensor's jagged)
            raise TypeError(f"hidden_states must be a dense tensor (torch.strided), got layout "
                            f"{hidden_states.layout}")
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must be [..., {c.hidden_size}], got {tuple(hidden_states.shape)}")
        device = hidden_states.device
        weights_device = self._modules["experts"].gate_up_proj.device  # (no alias lookup)
        if device != weights_device:
            raise ValueError(f"hidden_states is on {device} but the layer's weights are on "
                             f"{weights_device}")
        if hidden_states.is_meta:
            raise ValueError("MoELayer forward needs real tensors, got the meta device (routing "
                             "reads the expert counts): materialize the layer first, e.g. "
                             "layer.to_empty(device=...), then load_state_dict(...) or "
                             "reset_parameters() on each submodule that has one")
        dtype = self._weights_dtype(fallback=hidden_states.dtype
                                    if hidden_states.dtype in _DTYPES.values() else None)
        if hidden_states.dtype != dtype:
            if hidden_states.is_floating_point() and torch.is_autocast_enabled(device.type):
                hidden_states = hidden_states.to(dtype)  # (the ops inside autocast as usual)
            else:
                raise TypeError(f"hidden_states must be {dtype} (the dtype of the layer's "
                                f"weights), got {hidden_states.dtype}")
        flat = hidden_states.dim() == 2
        x = hidden_states if flat else hidden_states.reshape(-1, c.hidden_size)
        if not torch.compiler.is_compiling() and self._records_autograd(x):
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "a CUDA-graph capture of a MoELayer forward that autograd records: capture "
                    "under torch.no_grad() or torch.inference_mode() (the CuTeDSL kernels have "
                    "no backward, and the differentiable torch kernels read the expert offsets "
                    "on the host)")
            if x.is_cuda:
                _log_once("moe_runtime: autograd is recording a MoELayer forward (gradients "
                          "enabled and the input or a parameter requires grad): it runs the "
                          "differentiable torch reference kernels; use torch.inference_mode() "
                          "or torch.no_grad() for the CuTeDSL kernels")
            with differentiable_kernels():
                y = self._forward_tokens(x)
                return y if flat else y.view(hidden_states.shape)
        if self._use_graphs(x, device):
            router = unwrapped(self.router)
            if router.kept_logits is not None:  # (swap_moe_layers' recording: see Router)
                router.kept_logits = None
            y = self.cuda_graphs(x)
        else:
            y = self._forward_tokens(x)
        if self.topology.name != "local" and self._wants_grad(x):
            # the collectives between ranks have no backward: gradients through them would be
            # silently wrong, so the output's backward raises instead
            y = _NoBackward.apply(y, self.topology.name, x, *self.parameters())
        return y if flat else y.view(hidden_states.shape)

    def _weights_dtype(self, fallback: Optional[torch.dtype] = None) -> torch.dtype:
        """The dtype forward computes in: the one the layer's weights share (config.dtype, or
        what a cast of the layer or FSDP2's mixed precision made them). Weights that are still
        sharded DTensors (a submodule in its own FSDP2 group: its pre-forward, which runs
        later, unshards and casts them) are not counted; when no weight is left, `fallback`
        (forward: the input's dtype), else config.dtype.

        Raises:
            ValueError: a weight whose shape is not the one the layer was built for (replaced
                without an assignment: `.data = `, register_parameter).
            TypeError: weights of different dtypes (e.g. `.half()` on a submodule only), or a
                dtype the layer does not compute in (float64).
        """
        dtype = first = None
        for name, owner, n, shape, free in self._tree()[1]:
            w = owner._parameters.get(n)
            if w is None:
                continue
            if w.shape != shape:
                raise ValueError(f"the layer's weight {name} is {tuple(w.shape)} but the layer "
                                 f"was built for {shape} (its config sizes every kernel): a "
                                 f"replacement must keep the shape")
            if free or _sharded(w):
                continue
            if dtype is None:
                dtype, first = w.dtype, name
            elif w.dtype != dtype:
                raise TypeError(f"the layer's weights must share one dtype: {first} is {dtype} "
                                f"but {name} is {w.dtype}; cast the whole layer (e.g. "
                                f"layer.to(torch.bfloat16))")
        if dtype is None:
            dtype = self.config.dtype if fallback is None else fallback
        if dtype not in _DTYPES.values():
            raise TypeError(f"the layer's weights are {dtype}; MoELayer computes in "
                            f"{', '.join(_DTYPES)}: cast it to one of them")
        return dtype

    def _common_dtype(self) -> Optional[torch.dtype]:
        """`_weights_dtype`, or None where it raises."""
        try:
            return self._weights_dtype()
        except (TypeError, ValueError):
            return None

    def _wants_grad(self, x: torch.Tensor) -> bool:
        """Autograd recording (`autograd_records`) and the input or a parameter requires grad,
        or forward-mode AD on (`forward_ad_active`: a tangent may ride on any tensor)."""
        return forward_ad_active() or (autograd_records() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())))

    def _records_autograd(self, x: torch.Tensor) -> bool:
        """Whether this forward must be differentiable: `_wants_grad` on the `local` topology
        (whose reference path autograd records end to end; the multi-rank topologies'
        collectives are not differentiable, and switching one rank's kernels alone would
        desynchronize the ranks: their output gets a backward that raises, `_NoBackward`)."""
        return self.topology.name == "local" and self._wants_grad(x)

    def _forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The eager MoE on rows x [T, H] -> [T, H] (what the CUDA graphs capture)."""
        modules = self._modules  # (router / experts: no MoELayer.__getattr__ alias lookup)
        topk_ids, topk_weights = modules["router"](x)
        topology = self.topology
        result = topology.dispatch(x, topk_ids, topk_weights, check_values=False,
                                   layer=self.__dict__.get("_topology_layer", 0))
        try:
            if result.expected_rows is None:
                expert_y = modules["experts"](result.expert_x, result.expert_offsets)
            else:
                expert_y = modules["experts"](result.expert_x, result.expert_offsets,
                                              expected_rows=result.expected_rows)
        except BaseException as e:  # the peers wait in this call's combine (Topology.abandon)
            topology.abandon(result, e)
            raise
        y = topology.combine(expert_y, result)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y


class _NoBackward(torch.autograd.Function):
    """The output of a multi-rank MoELayer forward (`tp`, `dp_*`), unchanged, with a backward
    that raises: the topologies' collectives (all-to-all, all-reduce, peer copies) have no
    backward, so autograd through them would give wrong gradients without an error. The layer's
    input and parameters are inputs here only so that the output requires grad."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, topology: str, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.topology = topology
        return y.detach()  # (not a view: callers may write into the output in place)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            f"MoELayer with the '{ctx.topology}' topology has no backward: its collectives "
            f"between ranks are not differentiable, so the gradients would be wrong. Train with "
            f"topology='local' (one process), or run forward under torch.inference_mode() / "
            f"torch.no_grad()")

    @staticmethod
    def jvp(ctx, *tangents: torch.Tensor):
        """Forward-mode AD raises as backward does (torch's own error named no layer)."""
        _NoBackward.backward(ctx, None)
