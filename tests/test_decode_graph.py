"""DecodeGraph's bookkeeping around a failed first step or capture (CPU: stand-ins)."""
from types import SimpleNamespace

import pytest
import torch

from moe_runtime.engine import decode_graph


def test_a_failed_capture_is_retried_by_the_next_call(monkeypatch):
    """The first step of a bucket fails (here: the side stream, a stand-in for a failed eager
    step or capture): the next call of the same bucket tries again and fails the same way,
    instead of replaying a graph that was never captured."""
    made = []

    def failing_stream(device):
        made.append(device)
        raise RuntimeError("planted: no stream")

    monkeypatch.setattr(decode_graph.torch.cuda, "Stream", failing_stream)
    model = SimpleNamespace(device=torch.device("cpu"), layers=[],
                            parallel=SimpleNamespace(world_size=1, data_parallel=False))
    graph = decode_graph.DecodeGraph(model, SimpleNamespace(max_len=8), 2)
    for call in range(2):
        with pytest.raises(RuntimeError, match="planted: no stream"):
            graph(torch.tensor([1, 2]), torch.tensor([2, 3]))
        assert (graph.graph, graph.bucket, len(made)) == (None, 0, call + 1)


def test_the_capture_runs_on_the_stream_of_the_eager_step(monkeypatch):
    """The first step of a bucket runs eagerly on a side stream, and the capture on that same
    stream: workspaces (sync.host.workspace) are kept per stream, so a capture on another
    stream (torch.cuda.graph's default) allocated and zeroed one inside the graph."""
    import contextlib
    current, seen = ["main"], []

    @contextlib.contextmanager
    def on(stream):
        old, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = old

    @contextlib.contextmanager
    def graph(g, stream=None, **kw):
        with on(stream if stream is not None else "capture stream"):
            yield

    cuda = decode_graph.torch.cuda
    side = SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(cuda, "Stream", lambda device: side)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: SimpleNamespace(
        wait_stream=lambda s: None))
    monkeypatch.setattr(cuda, "stream", on)
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))

    class Model:
        device, layers = torch.device("cpu"), []
        parallel = SimpleNamespace(world_size=1, data_parallel=False)

        def __call__(self, *args, **kw):
            seen.append(current[0])
            return torch.zeros(2, 4)
    step = decode_graph.DecodeGraph(Model(), SimpleNamespace(max_len=8), 2)
    step(torch.tensor([1, 2]), torch.tensor([2, 3]))
    assert seen == [side, side]
