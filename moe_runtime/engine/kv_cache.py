"""KV cache of one rank: preallocated keys and values per layer for a fixed batch."""
from __future__ import annotations

import copy
from typing import Sequence

import torch


class KVCache:
    """Keys and values of this rank's kv heads for B sequences of up to `max_len` positions.

    Storage per layer: k, v [B, kv_heads, max_len, head_dim] in `dtype` on `device`; with
    values_in_keys=n, no v: the values are the keys' first n dims (MLA's latent cache: keys
    [latent | rotated rope key], values the latent). Sequence b keeps position p in slot p (no
    paging); positions past a sequence's own (padding, or a previous request of the row) hold
    stale values that the causal mask never reads.

    Raises:
        ValueError: non-positive sizes (B may be 0).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype, device=None, values_in_keys: int | None = None):
        if (num_layers < 1 or kv_heads < 1 or max_len < 1 or head_dim < 1 or batch < 0
                or (values_in_keys is not None and not 1 <= values_in_keys <= head_dim)):
            raise ValueError(f"bad KV cache sizes: layers={num_layers} batch={batch} "
                             f"kv_heads={kv_heads} max_len={max_len} head_dim={head_dim} "
                             f"values_in_keys={values_in_keys}")
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = None if values_in_keys else [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values_in_keys = values_in_keys
        self.max_len = max_len
        self.rows: slice | torch.Tensor | None = None

    def at(self, rows: Sequence[int]) -> "KVCache":
        """The sequences `rows` (distinct indices) of this cache as a cache of len(rows)
        sequences sharing its storage: what a prefill of the requests just placed in those
        slots writes and reads (scheduler.run_requests). Consecutive rows are read as views,
        others gathered (a copy of the prefix read)."""
        rows = list(rows)
        start = rows[0] if rows else 0
        view = copy.copy(self)
        if rows == list(range(start, start + len(rows))):
            view.rows = slice(start, start + len(rows))
        else:
            view.rows = torch.tensor(rows, dtype=torch.int64, device=self.k[0].device)
        return view

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              length: int):
        """Store this step's keys/values and return the cached prefix that attention reads.

        Args:
            layer: layer index.
            positions: int64 [B, L], the slot of each new token.
            k, v: [B, kv_heads, L, head_dim] (v None with values_in_keys).
            length: S >= positions.max() + 1, the prefix returned (the caller computes it once
                per forward: reading it from `positions` here would wait for the device in
                every layer; so the positions are not checked against it).

        Returns:
            (keys, values) [B, kv_heads, S, head_dim] (values: [..., values_in_keys], a view of
            the keys); views of the storage, or copies of non-consecutive rows (`at`).

        Raises:
            ValueError: a length past max_len.
        """
        if length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {length}")
        rows = slice(None) if self.rows is None else self.rows
        if isinstance(rows, slice):
            first = rows.start or 0
            b = torch.arange(first, first + positions.shape[0], device=positions.device)
        else:
            b = rows
        b = b[:, None].expand_as(positions)
        kc = self.k[layer]
        kc[b, :, positions] = k.transpose(1, 2).to(kc.dtype)
        keys = kc[rows, :, :length]
        if self.v is None:
            return keys, keys[..., :self.values_in_keys]
        vc = self.v[layer]
        vc[b, :, positions] = v.transpose(1, 2).to(vc.dtype)
        return keys, vc[rows, :, :length]
