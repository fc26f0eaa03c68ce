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
