"""CUDA-graph replay of the engine's decode steps, for a model on one GPU (`local` topology).

An eager decode step launches several hundred small kernels (attention, norms, RoPE, and the
MoE layers' routing, dispatch, experts and combine in every layer), so the host sets its pace,
not the GPU: Qwen3-30B-A3B's layers (8 of 48) on an H200 took ~11 ms per step eagerly for
~2 ms of kernels (benchmarks/engine_step.py). `DecodeGraph` captures the step once per
generate call, for the batch's B sequences over its KV cache, and replays it for every token.

The captured step has fixed shapes and never reads the device from the host
(MoECausalLM.forward with `kv_len` and valid None): attention reads all `cache.max_len`
positions (the causal mask hides those past each sequence's position), and every sequence
goes through the MoE layers, finished ones too (their logits are not used and their cache
slot is past anything read). Multi-rank topologies stay eager: their collectives check
errors and peers from the host.
"""
from __future__ import annotations

import torch

from ..layer import MoELayer


def graphs_apply(model) -> bool:
    """Whether `model` (a MoECausalLM) can replay its decode steps from a CUDA graph: on a
    CUDA device, one rank, and every MoE layer's forward free of host synchronization
    (MoELayer.host_sync_free: the cute backend, 16-bit experts)."""
    return (model.device.type == "cuda" and model.parallel.world_size == 1
            and all(layer.mlp.host_sync_free() for layer in model.layers
                    if isinstance(layer.mlp, MoELayer)))


class DecodeGraph:
    """The decode step of `model` for `batch` sequences over `cache`, captured by the first
    call and replayed by every call.

    Args:
        model: a MoECausalLM for which `graphs_apply` holds.
        cache: its engine.kv_cache.KVCache for these sequences (the graph reads and writes
            this cache's tensors).
        batch: B, the sequences (>= 1).
    """

    def __init__(self, model, cache, batch: int):
        dev = model.device
        self.model, self.cache = model, cache
        self.ids = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.last = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.graph = None
        self.logits = None

    def _step(self) -> torch.Tensor:
        return self.model(self.ids, self.positions, None, self.last, self.cache,
                          kv_len=self.cache.max_len)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step: token `tokens[b]` at position `positions[b]` of sequence b.

        Args:
            tokens, positions: int64 [B] (any device; copied to the model's).

        Returns:
            fp32 logits [B, vocab_size]: the graph's output buffer, overwritten by the next
            call (read it first).
        """
        self.ids.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions.view(-1, 1))
        if self.graph is None:
            # The first step runs eagerly on a side stream (kernels compiled, workspaces
            # allocated: nothing may do that inside a capture), then is captured; replaying it
            # writes the same cache entries again.
            side = torch.cuda.Stream(self.ids.device)
            side.wait_stream(torch.cuda.current_stream(self.ids.device))
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream(self.ids.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.logits = self._step()
            except Exception as e:
                raise RuntimeError(f"capturing the decode step in a CUDA graph failed ({e}); "
                                   "decode eagerly with Engine(cuda_graphs=False) or "
                                   "`moe-runtime generate --eager`") from e
            self.graph = graph
        self.graph.replay()
        return self.logits
