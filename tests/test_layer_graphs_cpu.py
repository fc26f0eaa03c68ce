"""The bucketed CUDA-graph logic of MoELayer, checked on the CPU with a stand-in for the capture.

`address_bound_capture` behaves like a CUDA graph where it matters for the bookkeeping: a replay
recomputes the captured output from the static input buffer, and it refuses to run once the
layer's weights have moved (a real graph would read freed memory there), so a missing
invalidation fails these tests.
"""
import copy

import pytest
import torch

from moe_runtime import MoEConfig, MoELayer
from moe_runtime.cuda_graphs import (DEFAULT_BUCKETS, BucketedGraphs, check_buckets, select_bucket,
                                     storage_fingerprint)
from moe_runtime.experts import grouped_mm_supported, Experts, grouped_mm_host_sync_free
from moe_runtime.topologies.local import LocalTopology
from test_layer import naive_moe, rel_err


class StaleGraph(RuntimeError):
    pass


def address_bound_capture(layer, log):
    """capture_fn: records the bucket, and binds the 'graph' to the weights' current addresses."""
    def capture(fn, x_static):
        key = storage_fingerprint(layer)
        out = fn(x_static)
        log.append(x_static.shape[0])

        def replay():
            if storage_fingerprint(layer) != key:
                raise StaleGraph("replayed a graph whose weights moved")
            out.copy_(fn(x_static))
        return replay, out
    return capture


def make_layer(family="softmax", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    kw = dict(hidden_size=32, num_experts=8, top_k=2, moe_intermediate_size=16, dtype=dtype)
    if family == "sigmoid_groups_shared":
        kw.update(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  use_correction_bias=True, shared_expert_intermediate_size=24, router_logits_fp32=True)
    layer = MoELayer(MoEConfig(**kw), topology=LocalTopology(8, backend="reference"), backend="reference")
    if layer.router.e_score_correction_bias is not None:
        layer.router.e_score_correction_bias.normal_(std=0.1)
    return layer


def close(a, b):
    """CPU GEMMs may block differently for T and the padded bucket: equal to fp32 rounding."""
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def eager(layer, x):
    graphs, layer.cuda_graphs = layer.cuda_graphs, None
    try:
        return layer(x)
    finally:
        layer.cuda_graphs = graphs


# --- bucket selection ------------------------------------------------------------------------------

@pytest.mark.parametrize("T,bucket", [(0, None), (1, 1), (2, 2), (3, 4), (5, 8), (129, 256),
                                      (256, 256), (257, None), (4096, None)])
def test_select_bucket_default(T, bucket):
    assert select_bucket(T, DEFAULT_BUCKETS) == bucket


def test_select_bucket_custom_and_validation():
    b = check_buckets([24, 3, 8])
    assert b == (3, 8, 24)
    assert [select_bucket(t, b) for t in (1, 3, 4, 9, 24, 25)] == [3, 3, 8, 24, 24, None]
    for bad in ([], [0, 4], [4, 4], [2.5]):
        with pytest.raises(ValueError, match="buckets"):
            check_buckets(bad)


# --- replay equals eager, padding, fallback -------------------------------------------------------

@pytest.mark.parametrize("family", ["softmax", "sigmoid_groups_shared"])
def test_graph_path_matches_eager_and_float64(family):
    layer = make_layer(family)
    log = []
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    runs = []
    with torch.no_grad():
        for T in (1, 3, 7, 64, 200, 256):
            x = torch.randn(T, 32)
            y = layer(x)
            assert y.shape == (T, 32)
            close(y, eager(layer, x))
            runs.append((x, y))
    assert log == [1, 4, 8, 64, 256]              # captured on first use; 256 replayed for T=200
    assert layer.cuda_graphs.captured == (1, 4, 8, 64, 256)
    for x, y in runs:  # naive_moe casts the shared expert (new storage): check after the replays
        assert rel_err(y, naive_moe(layer, x)) <= 1e-5


def test_padding_rows_do_not_change_real_rows():
    layer = make_layer()
    log = []
    g = layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    with torch.no_grad():
        layer(torch.full((8, 32), 1e4))           # leaves huge rows in the static buffer
        x = torch.randn(5, 32)
        y = layer(x)                              # bucket 8: rows 5..7 are padding
        close(y, eager(layer, x))
        assert torch.equal(g._static_in[5:8], torch.zeros(3, 32))
        # the property padding relies on: rows are independent
        junk = torch.randn(3, 32) * 100
        close(eager(layer, torch.cat([x, junk]))[:5], eager(layer, x))
    assert log == [8]


def test_eager_fallback_sizes_grad_mode_and_empty():
    layer = make_layer()
    log = []
    layer.enable_cuda_graphs(buckets=(1, 2, 4), capture_fn=address_bound_capture(layer, log))
    with torch.no_grad():
        x = torch.randn(5, 32)                    # above the largest bucket
        close(layer(x), eager(layer, x))
        assert layer(torch.randn(0, 32)).shape == (0, 32)
    layer(torch.randn(2, 32))                     # grad mode: eager (graphs cannot record autograd)
    assert log == []
    with torch.inference_mode():
        layer(torch.randn(2, 32))
    with torch.no_grad():                         # static buffer made in inference mode still works
        x = torch.randn(2, 32)
        close(layer(x), eager(layer, x))
    assert log == [2]
    with torch.inference_mode(), torch.enable_grad():  # nothing recorded: graphs, no reference
        x = torch.randn(4, 32)                         # switch (it was taken for autograd)
        y = layer(x)
        assert y.grad_fn is None and not layer._wants_grad(x)
        close(y, eager(layer, x))
    assert log == [2, 4]


def test_nd_input_and_copy_output():
    layer = make_layer()
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, []))
    with torch.no_grad():
        x = torch.randn(2, 3, 32)
        y1 = layer(x)
        assert y1.shape == (2, 3, 32)
        y1_saved = y1.clone()
        layer(torch.randn(2, 3, 32))              # same bucket (8) replays again
        assert torch.equal(y1, y1_saved)          # copy_output=True: earlier results survive
        layer.enable_cuda_graphs(copy_output=False, capture_fn=address_bound_capture(layer, []))
        y2 = layer(x)
        layer(torch.randn(2, 3, 32))
        assert not torch.equal(y2, y1_saved)      # a view of the static output, overwritten


@pytest.mark.parametrize("where", ["router", "experts", "shared_expert", "global"])
@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_hooks_inside_the_layer_run_eagerly_on_the_real_rows(where, kind):
    """A replay runs no Python hooks and a capture would run them on padding rows: while a hook
    that fires inside forward exists, calls run eagerly; hooks on the layer itself keep graphs."""
    layer = make_layer("sigmoid_groups_shared")
    log, seen = [], []
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    outer = layer.register_forward_pre_hook(lambda m, args: None)
    target = layer.router if where == "global" else getattr(layer, where)

    def hook(m, args, out=None):
        if m is target:
            seen.append(args[0].clone())
    if where == "global":
        register = (torch.nn.modules.module.register_module_forward_hook if kind == "forward"
                    else torch.nn.modules.module.register_module_forward_pre_hook)
        handle = register(hook)
    else:
        handle = (target.register_forward_hook(hook) if kind == "forward"
                  else target.register_forward_pre_hook(hook))
    xs = [torch.randn(3, 32) for _ in range(2)]
    with torch.no_grad():
        try:
            for x in xs:
                close(layer(x), eager(layer, x))
        finally:
            handle.remove()
        assert log == [] and len(seen) == 4       # once per call (eager() calls it too)
        if where != "experts":                    # (the experts see the dispatched rows)
            assert all(torch.equal(s, xs[i // 2]) for i, s in enumerate(seen))
        close(layer(xs[0]), eager(layer, xs[0]))
    assert log == [4]                             # hook gone: graphs again (the layer's own stays)
    outer.remove()


def test_hook_on_a_replaced_submodule_is_seen():
    """The submodules scanned for hooks are cached; assigning a new submodule refreshes them, so
    a hook on the replacement still sends calls to the eager path."""
    layer = make_layer("sigmoid_groups_shared")
    log, seen = [], []
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    x = torch.randn(3, 32)
    with torch.no_grad():
        layer(x)  # fills the cache
        assert not layer._inner_hooks()
        new = type(layer.shared_expert)(32, layer.config.shared_expert_intermediate_size,
                                        gated=layer.config.shared_expert_gate,
                                        dtype=layer.config.dtype)
        new.load_state_dict(layer.shared_expert.state_dict())
        layer.shared_expert = new
        new.register_forward_pre_hook(lambda m, args: seen.append(1))
        assert layer._inner_hooks()
        close(layer(x), eager(layer, x))
        assert len(seen) == 2
        # a nested replacement (not assigned on the layer itself) refreshes the cache too
        proj = torch.nn.Linear(32, layer.config.shared_expert_intermediate_size, bias=False)
        layer.shared_expert = type(layer.shared_expert)(
            32, layer.config.shared_expert_intermediate_size,
            gated=layer.config.shared_expert_gate, dtype=layer.config.dtype)
        layer(x)
        assert not layer._inner_hooks()
        n = len(log)
        layer.shared_expert.gate_proj = proj
        proj.register_forward_hook(lambda m, args, out: seen.append(2))
        assert layer._inner_hooks()
        close(layer(x), eager(layer, x))
        assert seen[2:] == [2, 2] and len(log) == n  # eager: no capture, no replay
        # add_module / register_module bypass __setattr__: seen by the children's ids
        up = torch.nn.Linear(32, layer.config.shared_expert_intermediate_size, bias=False)
        up.register_forward_pre_hook(lambda m, args: seen.append(3))
        layer.shared_expert.add_module("up_proj", up)
        assert layer._inner_hooks() and up in layer._tree()[0]
        close(layer(x), eager(layer, x))
        assert seen[-3:] == [3, 2, 3]


# --- invalidation ----------------------------------------------------------------------------------

def test_weight_swap_recaptures():
    layer = make_layer()
    log = []
    g = layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    x = torch.randn(3, 32)
    with torch.no_grad():
        y0 = layer(x)
        assert log == [4]
        layer.load_expert_weights(torch.randn_like(layer.experts.gate_up_proj),
                                  torch.randn_like(layer.experts.down_proj))
        y1 = layer(x)                             # a stale replay would raise StaleGraph
        assert log == [4, 4] and not torch.allclose(y0, y1)
        close(y1, eager(layer, x))
        # a Parameter replaced behind the layer's back is caught by the fingerprint
        layer.router.weight = torch.nn.Parameter(torch.randn_like(layer.router.weight))
        close(layer(x), eager(layer, x))
        assert log == [4, 4, 4] and g.num_captures == 3
        # in-place updates keep the addresses: no recapture, and the replay sees them
        layer.experts.down_proj.mul_(2)
        close(layer(x), eager(layer, x))
        assert log == [4, 4, 4]
        layer.invalidate_cuda_graphs()
        assert g.captured == ()
        layer(x)
        assert log == [4, 4, 4, 4]


def test_the_cached_fingerprint_follows_every_kind_of_replacement():
    """The graphs' fingerprint (read from the layer's cached walk) equals the full
    storage_fingerprint walk after replacements that bypass assignment, so a replay never
    reads a tensor that moved: `.data =`, a direct dict write of a buffer, register_parameter,
    add_module of a new shared expert, a None buffer slot that gets a tensor, and buffers
    registered under a new name or deleted and registered again."""
    layer = make_layer("sigmoid_groups_shared")
    fp = layer._storage_fingerprint
    seen = [fp()]
    assert seen[-1] == storage_fingerprint(layer)

    def changed():
        seen.append(fp())
        assert seen[-1] == storage_fingerprint(layer) and seen[-1] != seen[-2]

    layer.experts.down_proj.data = layer.experts.down_proj.data.clone()
    changed()
    bias = layer.router._buffers["e_score_correction_bias"]
    layer.router._buffers["e_score_correction_bias"] = bias.clone()
    changed()
    layer.experts.register_parameter("gate_up_proj",
                                     torch.nn.Parameter(layer.experts.gate_up_proj.detach().clone()))
    changed()
    layer.add_module("shared_expert", copy.deepcopy(layer.shared_expert))
    changed()
    layer.router._buffers["e_score_correction_bias"] = None
    changed()
    layer.router._buffers["e_score_correction_bias"] = bias
    changed()
    layer.experts.register_buffer("scale", torch.ones(4))  # (a new name: no assignment seen)
    changed()
    del layer.router.e_score_correction_bias
    changed()
    layer.router.register_buffer("e_score_correction_bias", bias)
    changed()


def test_a_deep_copy_starts_uncaptured_and_follows_its_own_weights():
    """copy.deepcopy of a layer with graphs: the copy's graphs check the copy's weights (a
    weight replaced on the copy recaptures) and start with none captured."""
    layer = make_layer()
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, []))
    with torch.no_grad():
        layer(torch.randn(3, 32))
    dup = copy.deepcopy(layer)
    g = dup.cuda_graphs
    assert g.captured == () and layer.cuda_graphs.captured == (4,)
    assert g.fn.__self__ is dup and g.fingerprint() == storage_fingerprint(dup)
    dup.router.weight = torch.nn.Parameter(torch.randn_like(dup.router.weight))
    assert g.fingerprint() != layer.cuda_graphs.fingerprint()


def test_to_dtype_invalidates():
    layer = make_layer()
    log = []
    g = layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    with torch.no_grad():
        layer(torch.randn(2, 32))
    layer.to(torch.float64).to(torch.float32)     # new storage
    assert g.captured == () and g.device == torch.device("cpu")


# --- eligibility ----------------------------------------------------------------------------------

def test_enable_requires_sync_free_cuda():
    layer = make_layer()
    assert layer.host_sync_free("cpu")
    assert not layer.host_sync_free("cuda")       # the reference backend syncs (dispatch sizes)
    with pytest.raises(RuntimeError, match="host-sync-free"):
        layer.enable_cuda_graphs()


def test_grouped_mm_sync_free_rules():
    assert grouped_mm_host_sync_free(torch.device("cpu"), torch.float32)
    for dtype in (torch.float32, torch.float16):   # CUDA fallback path copies offsets to the host
        assert not grouped_mm_host_sync_free(torch.device("cuda"), dtype)
    loop = Experts(2, 16, 8, dtype=torch.float32, use_grouped_mm=False)
    assert not loop.host_sync_free("cuda", torch.bfloat16)
    assert loop.host_sync_free("cpu", torch.float32)
    if not torch.cuda.is_available():  # CPU-only torch: a question about CUDA is answered, not a crash
        probed = Experts(2, 16, 8, dtype=torch.bfloat16)
        assert not probed.host_sync_free("cuda", torch.bfloat16)
        assert not grouped_mm_supported("cuda", None, torch.bfloat16)


def test_bucketed_graphs_rejects_bad_input():
    g = BucketedGraphs(lambda x: x, hidden_size=4, dtype=torch.float32, device="cpu",
                       capture_fn=lambda fn, x: (lambda: None, fn(x)))
    for bad in (torch.randn(2, 5), torch.randn(2, 4, dtype=torch.float64), torch.randn(4)):
        with pytest.raises(ValueError, match=r"expected \[T, 4\]"):
            g(bad)
    with pytest.raises(ValueError, match="bucket 3"):
        g.capture([3])
    g.capture()
    assert g.captured == DEFAULT_BUCKETS


def test_calls_under_autocast_run_eagerly():
    """A graph captured outside torch.autocast would replay other kernels than eager runs inside
    it (and vice versa): calls under autocast never use the graphs."""
    layer = make_layer()
    log = []
    layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
    x = torch.randn(3, 32)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert log == [] and y.shape == (3, 32)
        layer(x)
    assert log == [4]


@pytest.mark.parametrize("buckets, max_tokens, want", [
    (None, 10, 10), (DEFAULT_BUCKETS, 10, 16), (DEFAULT_BUCKETS, 300, 300), ((1, 2, 4), 3, 4),
    (DEFAULT_BUCKETS, None, None)])
def test_warm_up_covers_the_bucket_a_graphed_forward_runs(monkeypatch, buckets, max_tokens, want):
    """A graphed forward of T tokens runs its kernels at T's bucket: warm_up(10) compiled the
    kernels of up to 10 tokens while a graphed 10-token forward launched those of 16 (review)."""
    layer = make_layer()
    asked = []
    monkeypatch.setattr(layer.topology, "compile_kernels",
                        lambda hidden, dtype, k, max_tokens, device: asked.append(max_tokens) or 0)
    if buckets is not None:
        layer.enable_cuda_graphs(buckets, capture_fn=address_bound_capture(layer, []))
    layer.warm_up(max_tokens)
    assert asked == [want]


def test_invalidate_drops_the_capture_stream():
    """A layer moved to another GPU invalidates its graphs and recaptures on the new device: the
    old device's capture stream must go with them (it was kept)."""
    layer = make_layer()
    g = layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, []))
    g._stream = "a stream of the old device"
    g.invalidate()
    assert g._stream is None and g.captured == ()


def test_compiled_calls_trace_the_kernels_not_the_graphs():
    """Under torch.compile a layer with graphs enabled runs its kernels inside the compiled
    graph: nothing is captured or replayed while dynamo traces."""
    layer = make_layer()
    log = []
    layer.enable_cuda_graphs(buckets=(1, 2, 4), capture_fn=address_bound_capture(layer, log))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        x = torch.randn(2, 32)
        close(compiled(x), eager(layer, x))
    assert log == []
