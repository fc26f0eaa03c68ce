"""CUDA-graph replay of the engine's decode steps: a model on one GPU (`local` topology), or a
`tp` / `dp_*` rank whose collectives are NCCL's (the reference backend).

An eager decode step launches several hundred small kernels (attention, norms, RoPE, and the
MoE layers' routing, dispatch, experts and combine in every layer), so the host sets its pace,
not the GPU: Qwen3-30B-A3B's layers (8 of 48) on an H200 took ~11 ms per step eagerly for
~2 ms of kernels (benchmarks/engine_step.py). `DecodeGraph` captures the step for the batch's B
sequences over its KV cache and replays it for every token.

The captured step has fixed shapes and never reads the device from the host
(MoECausalLM.forward with `kv_len` and valid None): attention reads a fixed number of cached
positions, the power-of-two bucket of the longest sequence's (the causal mask hides those past
each sequence's position; a new bucket is captured when the sequences outgrow it), and every
sequence goes through the MoE layers, finished ones too (their logits are not used and their
cache slot is past anything read).

Under `tp` over NCCL (Ray actors that see one GPU each settle there) every rank captures and
replays the same step: the attention's and the MoE combine's all-reduces are recorded in the
graph (comm.groups: no host wait inside a capture; the combine's check of the peers' tokens is
made by the eager run before each capture), and each replay is followed by a bounded wait for
its completion (comm.wait_stream_bounded: a peer that stalls or does not replay raises
CollectiveError naming this rank and the step; NCCL's watchdog does not see recorded
collectives). Under `dp_*` over NCCL the same holds with the fixed-capacity protocol
(topologies.fixed_capacity: blocks of B * min(k, E_local) rows to every peer, no split sizes
read on the host; B is the largest rank's slots), entered around the eager run and the
capture; each rank keeps its own slots and cache, and the ranks capture at the same steps
(engine/scheduler.py agrees on B and on the cached length needed). The cute
backends (ranks that see each other's GPUs) stay eager: they read their kernels' error words
after every call.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..comm import wait_stream_bounded
from ..layer import MoELayer
from ..topologies import fixed_capacity


def graphs_apply(model) -> bool:
    """Whether `model` (a MoECausalLM) can replay its decode steps from a CUDA graph: on a
    CUDA device, and every MoE layer capturable (MoELayer.graph_capturable: on one rank the
    cute kernels and 16-bit experts; under tp / dp_* the same routing and experts with the
    reference backend over NCCL)."""
    return model.device.type == "cuda" and all(
        layer.mlp.graph_capturable() for layer in model.layers if isinstance(layer.mlp, MoELayer))


KV_BUCKET_MIN = 256  # the fewest cached positions a captured step attends over


class DecodeGraph:
    """The decode step of `model` for `batch` sequences over `cache`, captured per length
    bucket (`kv_bucket`) and replayed: a step attends over the bucket of the longest sequence's
    positions, not the whole cache, and a generate call captures O(log max_len) graphs (only
    the current one is kept; the bucket never shrinks, e.g. when a short request takes the
    slot of a long one: a larger bucket only reads more masked positions).

    Args:
        model: a MoECausalLM for which `graphs_apply` holds.
        cache: its engine.kv_cache.KVCache for these sequences (the graphs read and write this
            cache's tensors).
        batch: B, the sequences (>= 1).
        capacity: (dp_*) the tokens of every rank's fixed-capacity MoE calls
            (topologies.fixed_capacity): the largest B of the ranks (default B).
    """

    def __init__(self, model, cache, batch: int, capacity: Optional[int] = None):
        dev = model.device
        self.model, self.cache = model, cache
        self.ids = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.last = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.ranks = model.parallel.world_size
        self.topologies = [l.mlp.topology for l in model.layers if isinstance(l.mlp, MoELayer)]
        self.dp_topologies = self.topologies if model.parallel.data_parallel else []
        self.capacity = batch if capacity is None else capacity
        self.bucket = 0  # the bucket of the current graph (0: none yet) ...
        self.kv_len = 0  # ... and the cached positions it attends over, at most cache.max_len
        self.graph = None
        self.logits = None

    @staticmethod
    def kv_bucket(needed: int) -> int:
        """The bucket of a step whose sequences need `needed` cached positions: the next power
        of two, at least KV_BUCKET_MIN. The step attends over min(bucket, cache.max_len)
        positions, so it reads at most twice the cache it needs; a new bucket is a new capture
        (also past cache.max_len: under dp_* `needed` is the ranks' largest, and every rank
        captures at the same steps)."""
        return max(KV_BUCKET_MIN, 1 << (needed - 1).bit_length())

    def _step(self) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            if self.dp_topologies:  # (every rank: calls of `capacity` rows)
                stack.enter_context(fixed_capacity(self.dp_topologies, self.capacity))
            return self.model(self.ids, self.positions, None, self.last, self.cache,
                              kv_len=self.kv_len)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 needed: Optional[int] = None) -> torch.Tensor:
        """One decode step: token `tokens[b]` at position `positions[b]` of sequence b.

        Args:
            tokens, positions: int64 [B] (on the host, or the positions' max is read from the
                device); every position < cache.max_len.
            needed: the cached positions the step must attend over (None: max(positions) + 1);
                under dp_* the ranks' largest, so that they capture at the same steps.

        Returns:
            fp32 logits [B, vocab_size]: the graph's output buffer, overwritten by the next
            call (read it first).

        Raises:
            RuntimeError: the capture failed.
            CollectiveError: (several ranks) the replay did not complete within the
                collectives' timeout (module docstring).
        """
        self.ids.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions.view(-1, 1))
        needed = int(positions.max()) + 1 if needed is None else needed
        bucket = max(self.bucket, self.kv_bucket(needed))
        if bucket != self.bucket or self.graph is None:  # (dp: `needed` is agreed, so every
            # rank captures here; no graph: the last capture failed, and a call retries it)
            self.graph = self.logits = None  # (its memory goes back before the next capture)
            self.kv_len = min(bucket, self.cache.max_len)
            # The first step of a bucket runs eagerly on a side stream (kernels compiled,
            # workspaces allocated: nothing may do that inside a capture), then is captured on
            # that stream (sync.host.workspace is per stream: the capture finds the eager
            # run's); replaying it writes the same cache entries again.
            side = torch.cuda.Stream(self.ids.device)
            side.wait_stream(torch.cuda.current_stream(self.ids.device))
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream(self.ids.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # (ranks: NCCL's watchdog thread queries events while this thread captures)
            mode = "thread_local" if self.ranks > 1 else "global"
            try:
                with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
                    self.logits = self._step()
            except Exception as e:
                raise RuntimeError(f"capturing the decode step in a CUDA graph failed ({e}); "
                                   "decode eagerly with Engine(cuda_graphs=False) or "
                                   "`moe-runtime generate --eager`") from e
            self.graph, self.bucket = graph, bucket
        self.graph.replay()
        if self.ranks > 1:
            self._wait_for_replay()
        return self.logits

    def _wait_for_replay(self) -> None:
        """Several ranks: wait for the replay within the collectives' timeout. When it does not
        complete, its collectives stay stuck on the device: every MoE topology of the model
        then refuses further calls (RuntimeError, no collective) and CollectiveError is raised;
        an error the replay reports (CUDA, NCCL) marks them the same way and is raised."""
        p = self.model.parallel
        try:
            wait_stream_bounded(f"decode step (CUDA graph replay over {self.kv_len} cached "
                                "positions)", group=p.group, timeout_s=p.timeout_s,
                                device=self.ids.device)
        except Exception as e:  # (a timeout, or a CUDA / NCCL error the event reports)
            for topology in self.topologies:
                topology._mark_out_of_step(e)
            raise
