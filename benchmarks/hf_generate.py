"""HF transformers generate() on one GPU, its MoE blocks as shipped and swapped for MoELayer.

What a swap-in user sees end to end: the same model (bf16, random weights, built from a config
in memory: a released model's layer sizes, fewer layers) runs HF's own greedy generate loop
(its dynamic KV cache, eager, one forward per token) three ways:
  hf            the stock MoE blocks, experts_implementation="grouped_mm" (HF's fastest);
  ours          swap_moe_layers(model, backend="cute") (the same weights, shared);
  ours+graphs   the same, each MoELayer replaying CUDA graphs for decode-sized calls
                (MoELayer.enable_cuda_graphs; the rest of the model stays eager).
With --static, two more: "hf static" and "ours static", generate(cache_implementation="static"),
HF's fast decoding path: a static KV cache, and generate compiles the model's decoding forward
itself (torch.compile with transformers' CompileConfig defaults, mode "reduce-overhead": the
decode steps replay inductor's CUDA graphs; the swapped layers enter that graph as the
torch.ops.moe_runtime ops). The first generate of each row compiles (the warm-up, untimed).
Rows: B prompts of P random tokens, N new tokens (min_new_tokens = N: no early stop).
Columns: prefill ms (generate with one new token), decode ms per token ((time of N tokens -
time of 1) / (N - 1)), decode tokens/s (B per step), and the share of the generated ids equal
to HF's (bf16: near-ties in the random model's logits can go either way after a rounding
difference; every later token of that sequence then follows another path).
Times are the best of --repeats runs. Prints a table, writes JSON; never asserts a time.

Usage: python benchmarks/hf_generate.py [--models qwen3-30b-a3b,mixtral] [--layers 4]
       [--batch 1,16] [--prompt 128] [--new 64] [--static] [--out F]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from moe_runtime import MoELayer, swap_moe_layers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from engine_step import MODELS as ENGINE_MODELS  # noqa: E402
from local_dispatch_combine import require_cuda  # noqa: E402

# name -> (transformers config class, config kwargs: a released model's per-layer sizes; the
# layer count is --layers)
MODELS = {
    "qwen3-30b-a3b": ENGINE_MODELS["qwen3-30b-a3b"][1:3],
    "mixtral": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768)),
}


def hf_model(name: str, layers: int) -> torch.nn.Module:
    """The HF causal LM of `name` with `layers` layers, bf16 on the GPU, grouped_mm experts,
    random weights (normal, std 0.02 as HF's initializer_range; norms at 1)."""
    import transformers
    cfg_name, kw = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**{**kw, "num_hidden_layers": layers},
                                          experts_implementation="grouped_mm")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return model


def generate_s(model, ids: torch.Tensor, new: int, repeats: int, static: bool = False
               ) -> tuple[float, torch.Tensor]:
    """Best wall seconds of greedy generate(ids, exactly `new` tokens), and its new ids;
    `static`: with a static KV cache (generate then compiles the decoding forward)."""
    best, out = float("inf"), None
    cache = {"cache_implementation": "static"} if static else {}
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **cache)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out[:, ids.shape[1]:]


def measure(model, ids: torch.Tensor, new: int, repeats: int, static: bool = False) -> dict:
    # warm-up: compiles, workspaces, first-touch of the weights (static: the cache is sized to
    # the prompt + `new`, so the timed shape is the one compiled)
    generate_s(model, ids, new if static else 2, 1, static)
    prefill, _ = generate_s(model, ids, 1, repeats, static)
    whole, out = generate_s(model, ids, new, repeats, static)
    step = (whole - prefill) / (new - 1)
    return dict(prefill_ms=prefill * 1e3, decode_ms_per_token=step * 1e3,
                decode_tokens_per_s=ids.shape[0] / step, ids=out)


def run_model(name: str, a) -> list[dict]:
    model = hf_model(name, a.layers)
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = model.config.vocab_size
    prompts = {B: torch.randint(1, vocab, (B, a.prompt), device="cuda", generator=gen)
               for B in a.batch}
    rows = {B: {} for B in a.batch}
    for B, ids in prompts.items():
        rows[B]["hf"] = measure(model, ids, a.new, a.repeats)
        if a.static:
            rows[B]["hf static"] = measure(model, ids, a.new, a.repeats, static=True)
    torch._dynamo.reset()  # (the swap changes the model: compile it afresh)
    swap_moe_layers(model, backend="cute")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for B, ids in prompts.items():
        rows[B]["ours"] = measure(model, ids, a.new, a.repeats)
        if a.static:
            rows[B]["ours static"] = measure(model, ids, a.new, a.repeats, static=True)
    for layer in layers:
        layer.enable_cuda_graphs()
    for B, ids in prompts.items():
        rows[B]["ours+graphs"] = measure(model, ids, a.new, a.repeats)
    out = []
    for B in a.batch:
        ref = rows[B]["hf"]["ids"]
        for way, r in rows[B].items():
            same = float((r.pop("ids") == ref).float().mean())
            out.append(dict(model=name, layers=a.layers, B=B, prompt=a.prompt, new=a.new, way=way,
                            same_ids_as_hf=same, **r))
    del model, layers
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"subset of {sorted(MODELS)}")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    ap.add_argument("--batch", default="1,16", help="comma-separated prompt counts B")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens P")
    ap.add_argument("--new", type=int, default=64, help="new tokens N (>= 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--static", action="store_true",
                    help="also time generate with a static KV cache (compiled decoding)")
    ap.add_argument("--out", default="bench_out/hf_generate.json")
    a = ap.parse_args(argv)
    a.batch = [int(b) for b in a.batch.split(",")]
    names = a.models.split(",")
    if set(names) - set(MODELS):
        ap.error(f"unknown models {sorted(set(names) - set(MODELS))}; known: {sorted(MODELS)}")
    if a.new < 2 or a.layers < 1 or a.prompt < 1 or min(a.batch) < 1:
        ap.error("--new must be >= 2; --layers, --prompt and every --batch >= 1")
    require_cuda()
    import transformers
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__}
    rows = []
    for name in names:
        rows += run_model(name, a)
    head = (f"{'model':<15}{'layers':>7}{'B':>4}{'way':>12}{'prefill ms':>12}{'ms/token':>10}"
            f"{'tokens/s':>10}{'vs hf':>7}{'same ids':>10}")
    print(f"# {machine}, prompt {a.prompt} tokens, {a.new} new\n{head}")
    for r in rows:
        hf = next(h for h in rows if h["model"] == r["model"] and h["B"] == r["B"] and h["way"] == "hf")
        print(f"{r['model']:<15}{r['layers']:>7}{r['B']:>4}{r['way']:>12}{r['prefill_ms']:>12.2f}"
              f"{r['decode_ms_per_token']:>10.2f}{r['decode_tokens_per_s']:>10.0f}"
              f"{hf['decode_ms_per_token'] / r['decode_ms_per_token']:>6.2f}x"
              f"{r['same_ids_as_hf']:>10.2f}")
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
