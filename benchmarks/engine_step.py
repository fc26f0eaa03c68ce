"""The engine's model forward on one GPU: a prefill and decode steps at long contexts.

Models (bf16, random weights, built in memory: released per-layer sizes, fewer layers):
  qwen3-30b-a3b  Qwen3-30B-A3B's layers (H 2048, 32 query / 4 kv heads of 128, E 128, k 8,
                 I 768), 8 of its 48 layers;
  deepseek-v3    DeepSeek-V3's layers (H 7168, 128 heads, MLA q_lora 1536 / kv_lora 512 / rope
                 64, E 256, k 8, I 2048, 1 shared expert), its first (dense) layer and one MoE
                 layer.
Rows, µs per forward (CUDA events over back-to-back forwards, after warm-up):
  prefill  B = 1, L tokens, fresh positions 0..L-1 (forward(prefill=True), as run_requests
           calls it); `peak GiB` is the allocator's peak during it above what was allocated
           before;
  decode   B sequences, one token each at position S - 1 (S cached positions): `eager` the
           forward as run_requests calls it without graphs, `graph` its step replayed from
           engine.decode_graph's CUDA graph (attention over all S positions of the cache).
Floor (decode rows): the bytes a step must read once at the device copy bandwidth measured in
this run: every weight except the routed experts and the embedding (B of its rows, unless
tied to the LM head), min(E, B * k) routed experts per MoE layer (what B * k picks touch when
they go to distinct experts), and the cached keys / values of the B sequences up to S.
Prints a table, writes JSON; never asserts a time.

Usage: python benchmarks/engine_step.py [--models qwen3-30b-a3b,deepseek-v3] [--out F]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from moe_runtime.engine.decode_graph import DecodeGraph
from moe_runtime.models import Parallel
from moe_runtime.models.transformer import MoECausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from local_dispatch_combine import copy_bandwidth, eager_us, require_cuda  # noqa: E402

# name -> (spec module, transformers config class, config kwargs, prefill L, decode (B, S) cases)
MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeConfig",
                      dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                           num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, num_experts=128, num_experts_per_tok=8,
                           norm_topk_prob=True, max_position_embeddings=40960,
                           vocab_size=151936),
                      (4096, 16384), ((1, 4096), (1, 32768), (16, 4096), (16, 16384))),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3Config",
                    dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=128,
                         num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                         n_group=8, topk_group=4, routed_scaling_factor=2.5,
                         norm_topk_prob=True, rope_interleave=True,
                         max_position_embeddings=163840, vocab_size=129280),
                    (4096, 16384), ((1, 4096), (1, 32768), (16, 4096), (16, 16384))),
}


def build(name: str) -> MoECausalLM:
    """The model `name` on the GPU in bf16 with N(0, 0.02) weights (norms 1)."""
    import importlib

    import transformers
    module, cls, kwargs = MODELS[name][:3]
    spec_module = importlib.import_module(f"moe_runtime.models.{module}")
    spec = spec_module.spec_from_config(getattr(transformers, cls)(**kwargs), torch.bfloat16)
    with torch.device("cuda"):
        model = MoECausalLM(spec, Parallel())
    g = torch.Generator(device="cuda").manual_seed(0)
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.data.fill_(1.0)
        elif "correction_bias" in pname:
            p.data.zero_()
        else:
            p.data.normal_(0, 0.02, generator=g)
    model.init_buffers()
    return model.eval()


def step_floor_bytes(model: MoECausalLM, B: int, S: int) -> int:
    """Bytes a decode step reads at least (see the module docstring)."""
    total = 0
    moe = model.spec.moe
    for pname, p in model.named_parameters():
        if ".experts." in pname:  # (the routed experts; shared ones are "shared_experts")
            total += p.numel() * p.element_size() * min(moe.num_experts, B * moe.top_k) // moe.num_experts
        elif pname == "embed_tokens.weight" and not model.spec.tie_word_embeddings:
            total += B * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    cache = model.new_cache(1, 1, device="meta")
    per_pos = sum(t.shape[1] * t.shape[3] * t.element_size() for t in cache.k)
    per_pos += sum(t.shape[1] * t.shape[3] * t.element_size() for t in cache.v or [])
    return total + B * S * per_pos


def run_model(name: str, bw: float) -> list[dict]:
    model = build(name)
    V = model.spec.vocab_size
    rows = []
    for L in MODELS[name][3]:
        row = {"model": name, "kind": "prefill", "B": 1, "L": L}
        try:
            cache = model.new_cache(1, L, device="cuda")
            ids = torch.randint(0, V, (1, L), device="cuda")
            pos = torch.arange(L, device="cuda")[None]
            valid = torch.ones(1, L, dtype=torch.bool, device="cuda")
            last = torch.full((1,), L - 1, device="cuda")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row["us"] = eager_us(lambda: model(ids, pos, valid, last, cache, prefill=True), reps=3)
            row["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except torch.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e).splitlines()[0]}"
        rows.append(row)
        cache = None
        torch.cuda.empty_cache()
    for B, S in MODELS[name][4]:
        cache = model.new_cache(B, S, device="cuda")
        ids = torch.randint(0, V, (B, 1), device="cuda")
        pos = torch.full((B, 1), S - 1, device="cuda")
        valid = torch.ones(B, 1, dtype=torch.bool, device="cuda")
        zeros = torch.zeros(B, dtype=torch.int64, device="cuda")
        us = eager_us(lambda: model(ids, pos, valid, zeros, cache), reps=20)
        graph = DecodeGraph(model, cache, B)
        host_ids, host_pos = ids.flatten().cpu(), pos.flatten().cpu()  # (as run_requests passes them)
        graph_us = eager_us(lambda: graph(host_ids, host_pos), reps=50)
        floor = step_floor_bytes(model, B, S) / bw * 1e6
        rows.append({"model": name, "kind": "decode", "B": B, "S": S, "us": us,
                     "graph_us": graph_us, "floor_us": floor, "vs_floor": graph_us / floor})
        graph = None
        cache = None
        torch.cuda.empty_cache()
    model = None  # (its memory goes back before the next model is built)
    torch.cuda.empty_cache()
    return rows


def fmt(r: dict) -> str:
    length = f"L={r['L']:<6d}" if r["kind"] == "prefill" else f"S={r['S']:<6d}"
    head = f"{r['model']:14s} {r['kind']:8s} B={r['B']:<3d} {length}"
    if "error" in r:
        return f"{head} {r['error'][:60]}"
    if r["kind"] == "prefill":
        return f"{head} {r['us']:10.1f} us   peak {r['peak_GiB']:.2f} GiB"
    return (f"{head} eager {r['us']:9.1f} us   graph {r['graph_us']:8.1f} us   floor "
            f"{r['floor_us']:8.1f} us   graph/floor {r['vs_floor']:.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="bench_out/engine_step.json")
    args = ap.parse_args(argv)
    require_cuda()
    bw = copy_bandwidth()["best"]
    rows = []
    with torch.inference_mode():
        for name in args.models.split(","):
            for r in run_model(name, bw):
                print(fmt(r), flush=True)
                rows.append(r)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
