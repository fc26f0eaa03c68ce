"""Model families and the checkpoint loader, in one process (no Ray): numerics against HF
transformers on tiny random checkpoints written by transformers itself, both expert layouts,
sharded checkpoints, clear errors for missing / misshaped tensors, sampler and scheduler rules."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_runtime.engine.sampler import SamplingParams, request_generators, sample
from moe_runtime.engine.scheduler import assign_requests, run_requests
from moe_runtime.models import CheckpointError, Parallel, head_shard, load_model, read_spec
from moe_runtime.models.make_checkpoint import make_checkpoint

PROMPTS = ["The quick brown fox jumps over", "Hello", "A mixture of experts model sends every token to a few"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"qwen3-moe": make_checkpoint(str(root / "qwen3"), "qwen3-moe", "tiny"),
            "qwen2-moe": make_checkpoint(str(root / "qwen2"), "qwen2-moe", "tiny"),
            "olmoe": make_checkpoint(str(root / "olmoe"), "olmoe", "tiny"),
            "dots1": make_checkpoint(str(root / "dots1"), "dots1", "tiny"),
            "mixtral": make_checkpoint(str(root / "mixtral"), "mixtral", "tiny", max_shard_size="100KB"),
            "glm4-moe": make_checkpoint(str(root / "glm4"), "glm4-moe", "tiny"),
            "deepseek-v3": make_checkpoint(str(root / "dsv3"), "deepseek-v3", "tiny")}


def hf_greedy(model_dir: str, prompts, max_new_tokens: int, eos_token_id=None):
    """Greedy continuation of each prompt (batch of one, no padding) by HF generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        kw = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
        g = hf.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                        pad_token_id=tok.eos_token_id, **kw)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def encode(model_dir, prompts):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "olmoe", "mixtral", "glm4-moe", "dots1",
                                  "deepseek-v3"])
def test_local_batch_greedy_equals_hf_generate(ckpts, arch):
    d = ckpts[arch]
    model = load_model(d, Parallel(), progress=False)
    out = run_requests(model, encode(d, PROMPTS), range(len(PROMPTS)),
                       SamplingParams(max_new_tokens=NEW_TOKENS), stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS, NEW_TOKENS)
    assert out.finish_reasons == ["length"] * len(PROMPTS)
    assert out.prefill_tokens == sum(len(p) for p in encode(d, PROMPTS))


@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_a_model_cast_after_loading_caches_in_its_new_dtype(ckpts, arch):
    """`.to(torch.bfloat16)` after load_model: the KV cache follows the weights (it took the
    checkpoint's dtype, and attention failed on bf16 queries against fp32 keys)."""
    d = ckpts[arch]
    model = load_model(d, Parallel(), progress=False).to(torch.bfloat16)
    assert model.new_cache(1, 8).k[0].dtype == torch.bfloat16
    out = run_requests(model, encode(d, PROMPTS[:2]), range(2),
                       SamplingParams(max_new_tokens=4), stop_ids=[])
    assert out.finish_reasons == ["length"] * 2 and all(len(t) == 4 for t in out.token_ids)


def test_stop_token_ends_a_request_early_like_hf_eos(ckpts):
    d = ckpts["qwen3-moe"]
    ref = hf_greedy(d, PROMPTS, NEW_TOKENS)
    stop = ref[0][3]  # the 4th greedy token of prompt 0 becomes the stop token
    want = hf_greedy(d, PROMPTS, NEW_TOKENS, eos_token_id=stop)
    want = [w[:w.index(stop) + 1] if stop in w else w for w in want]  # HF pads after EOS
    model = load_model(d, Parallel(), progress=False)
    out = run_requests(model, encode(d, PROMPTS), range(3), SamplingParams(max_new_tokens=NEW_TOKENS),
                       stop_ids=[stop])
    assert out.token_ids == want
    assert out.finish_reasons[0] == "stop" and len(out.token_ids[0]) == 4


@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_continuous_batching_refills_slots_and_equals_hf(ckpts, arch):
    """One KV cache slot (max_batch_size=1) or two for three prompts: each request finishing
    (at a stop token or the length) hands its slot to the next, which is prefilled into the
    cache rows the previous one left (the latent cache too); the ids are HF's, prompt by
    prompt, and the forward passes are one prefill per placement plus the decode steps."""
    d = ckpts[arch]
    ref = hf_greedy(d, PROMPTS, NEW_TOKENS)
    stop = ref[0][3]
    want = [w[:w.index(stop) + 1] if stop in w else w
            for w in hf_greedy(d, PROMPTS, NEW_TOKENS, eos_token_id=stop)]
    model = load_model(d, Parallel(), progress=False)
    for slots in (1, 2):
        passes = []
        out = run_requests(model, encode(d, PROMPTS), range(3),
                           SamplingParams(max_new_tokens=NEW_TOKENS), stop_ids=[stop],
                           max_batch_size=slots, on_step=passes.append)
        assert out.token_ids == want, slots
        assert passes == list(range(1, len(passes) + 1))
        if slots == 1:  # one request at a time: its prefill, then a step per further token
            assert out.steps == sum(len(w) - 1 for w in want) and len(passes) == 3 + out.steps
        else:  # prompt 2 takes prompt 0's slot while prompt 1 decodes
            assert out.steps < sum(len(w) - 1 for w in want) and len(passes) == 2 + out.steps
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        run_requests(model, encode(d, PROMPTS), range(3), SamplingParams(), stop_ids=[],
                     max_batch_size=0)


def test_a_prefill_does_not_pad_short_prompts_to_a_long_one(ckpts):
    """Prompts are placed in order while the padded prefill stays within pads_too_much: 300
    one-token prompts then one of 40 tokens take two prefills (one would pad 341 x 40 = 13640
    positions for 340 tokens), 3 equal prompts one; the ids are those of the groups run alone."""
    from moe_runtime.engine.scheduler import PREFILL_PAD_FREE, pads_too_much
    assert pads_too_much(301, 40, 340) and not pads_too_much(300, 1, 300)
    assert not pads_too_much(PREFILL_PAD_FREE // 40, 40, 40)  # small prefills: any lengths
    model = load_model(ckpts["qwen3-moe"], Parallel(), progress=False)
    short, long_ = [[5 + i % 50] for i in range(300)], [list(range(3, 43))]
    params = SamplingParams(max_new_tokens=3)

    def run(prompts):
        passes = []
        out = run_requests(model, prompts, range(len(prompts)), params, stop_ids=[],
                           on_step=passes.append)
        return out.token_ids, len(passes) - out.steps  # (ids, prefills)

    ids, prefills = run(short + long_)
    assert prefills == 2
    assert ids == run(short)[0] + run(long_)[0]
    assert run(long_ * 3)[1] == 1


@pytest.mark.parametrize("arch,key,value,message", [
    (arch, key, 0, f"{name} must be a positive int, got 0")
    for arch in ("qwen3-moe", "deepseek-v3")
    for key, name in (("max_position_embeddings", "max_position_embeddings"),
                      ("vocab_size", "vocab_size"), ("num_hidden_layers", "num_layers"),
                      ("num_attention_heads", "num_heads"))] + [
    ("qwen3-moe", "sliding_window", -1, "sliding_window must be None or a positive int, got -1")])
def test_a_config_with_sizes_no_model_has_is_named(ckpts, tmp_path, arch, key, value, message):
    """A damaged config.json (e.g. max_position_embeddings 0) fails in read_spec naming the
    file and the field; max_position_embeddings 0 was reported as every prompt exceeding it."""
    d = str(tmp_path / "bad")
    shutil.copytree(ckpts[arch], d)
    cfg_path = os.path.join(d, "config.json")
    json.dump({**json.load(open(cfg_path)), key: value, "use_sliding_window": True},
              open(cfg_path, "w"))
    with pytest.raises(ValueError) as e:
        read_spec(d)
    assert f"{d}/config.json" in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize("values_in_keys", [None, 3])
def test_kv_cache_rows_write_and_read_their_own_sequences(values_in_keys):
    """KVCache.at(rows): consecutive rows as views, others gathered; each writes only its rows
    and reads back what it wrote (the keys' first dims as values for the latent cache)."""
    from moe_runtime.engine.kv_cache import KVCache
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 4, 1, 8, 5, dtype=torch.float32, values_in_keys=values_in_keys)
    before = [k.clone() for k in cache.k]
    for rows in ([1, 2], [0, 3], [2]):
        sub = cache.at(rows)
        k = torch.randn(len(rows), 1, 3, 5, generator=g)
        v = None if values_in_keys else torch.randn(len(rows), 1, 3, 5, generator=g)
        keys, values = sub.write(1, torch.arange(3).expand(len(rows), 3), k, v, 3)
        torch.testing.assert_close(keys, k)
        torch.testing.assert_close(values, k[..., :3] if values_in_keys else v)
        torch.testing.assert_close(cache.k[1][rows, :, :3], k)
        assert keys.data_ptr() == cache.k[1][rows[0]].data_ptr() or len(rows) > 1 and \
            rows != list(range(rows[0], rows[0] + len(rows)))  # (consecutive: a view)
    torch.testing.assert_close(cache.k[0], before[0])  # (layer 0 untouched)
    torch.testing.assert_close(cache.k[1][:, :, 3:], before[1][:, :, 3:])


def test_prefill_places_requests_within_the_moe_token_limit(ckpts):
    """A rank's MoE topologies may refuse calls above max_tokens_per_rank (dp_nvlink cute):
    one prefill places waiting prompts up to that many tokens (one at least, even a longer
    one), and the completions stay HF's."""
    from moe_runtime.layer import MoELayer
    d = ckpts["qwen3-moe"]
    model = load_model(d, Parallel(), progress=False)
    moe = [l.mlp for l in model.layers if isinstance(l.mlp, MoELayer)]
    prompts = encode(d, PROMPTS)
    lens = [len(p) for p in prompts]
    want = hf_greedy(d, PROMPTS, NEW_TOKENS)
    seen = []
    moe[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).shape[0]))
    # limit of prompts 0 and 1: they go together, then 2 alone; limit 1: each alone (longer)
    for limit, prefills in ((lens[0] + lens[1], [lens[0] + lens[1], lens[2]]), (1, lens)):
        seen.clear()
        try:
            for m in moe:
                m.topology.max_tokens_per_call = lambda limit=limit: limit
            out = run_requests(model, prompts, range(3), SamplingParams(max_new_tokens=NEW_TOKENS),
                               stop_ids=[])
        finally:
            for m in moe:
                del m.topology.max_tokens_per_call
        assert out.token_ids == want
        assert seen[:len(prefills) + 1] == prefills + [3]  # (then decode steps of all three)


def _to_fused(src: str, dst: str) -> None:
    """Rewrite a per-expert checkpoint with transformers' fused in-memory expert layout."""
    spec, a = read_spec(src)
    gate, up, down = a.expert_proj_names
    block = a.moe_block_names[0]
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}.{block}.experts"
        E = spec.moe.num_experts
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors.pop(f"{p}.{e}.{gate}.weight"), tensors.pop(f"{p}.{e}.{up}.weight")]) for e in range(E)])
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.{down}.weight") for e in range(E)])
    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


def test_fused_expert_layout_loads_identically(ckpts, tmp_path):
    src = ckpts["qwen3-moe"]
    _to_fused(src, str(tmp_path / "fused"))
    a, b = load_model(src, progress=False), load_model(str(tmp_path / "fused"), progress=False)
    for (n1, t1), (n2, t2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_sharded_checkpoint_has_an_index_and_several_files(ckpts):
    d = ckpts["mixtral"]
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(d, "model.safetensors"))
    assert len({f for f in os.listdir(d) if f.endswith(".safetensors")}) > 1


def _rewrite_tensor(model_dir: str, key: str, new) -> str:
    """Replace (or drop, new=None) one tensor in the file that holds it; returns that file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    fname = json.load(open(index))["weight_map"][key] if os.path.isfile(index) else "model.safetensors"
    path = os.path.join(model_dir, fname)
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if new is None:
        del tensors[key]
        if os.path.isfile(index):
            data = json.load(open(index))
            del data["weight_map"][key]
            json.dump(data, open(index, "w"))
    else:
        tensors[key] = new
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_missing_tensor_error_names_tensor_and_files(ckpts, tmp_path, arch):
    d = str(tmp_path / "broken")
    shutil.copytree(ckpts[arch], d)
    key = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_tensor(d, key, None)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' "
                                              r"is missing .*safetensors"):
        load_model(d, progress=False)


def _edit_config(model_dir: str, **kw) -> None:
    path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(path))
    cfg.update(kw)
    json.dump(cfg, open(path, "w"))


def test_tied_config_with_a_different_lm_head_uses_it_like_hf(ckpts, tmp_path):
    """config.json ties the embeddings but the checkpoint stores an lm_head.weight that differs:
    it is used untied (HF's rule), with a warning, and greedy output equals HF's; an lm_head
    equal to the embeddings stays tied, silently."""
    d = str(tmp_path / "tieflip")
    shutil.copytree(ckpts["qwen3-moe"], d)
    _edit_config(d, tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="lm_head.weight differs from model.embed_tokens.weight"):
        model = load_model(d, progress=False)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        lm_head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert model.lm_head is not None and torch.equal(model.lm_head.weight, lm_head)
    out = run_requests(model, encode(d, PROMPTS[:2]), range(2), SamplingParams(max_new_tokens=6),
                       stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS[:2], 6)
    _rewrite_tensor(d, "lm_head.weight", embed.clone())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_model(d, progress=False).lm_head is None
    # tied and stored only as lm_head.weight (HF's tie_weights takes it for both): loaded so
    _rewrite_tensor(d, "model.embed_tokens.weight", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_model(d, progress=False)
    assert model.lm_head is None and torch.equal(model.embed_tokens.weight, embed)
    out = run_requests(model, encode(d, PROMPTS[:2]), range(2), SamplingParams(max_new_tokens=6),
                       stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS[:2], 6)


def test_unused_checkpoint_tensors_are_named_in_a_warning(ckpts, tmp_path):
    """Tensors no rank reads (a layer config.json no longer has, a stray key) are listed; a
    complete checkpoint loads without a warning (rank 0 of 2, whose checkpoint holds the other
    rank's experts: test_each_rank_reads_only_its_own_experts)."""
    import warnings
    d = str(tmp_path / "fewer_layers")
    shutil.copytree(ckpts["qwen3-moe"], d)
    _edit_config(d, num_hidden_layers=1)
    _rewrite_tensor(d, "foo.bar", torch.zeros(3))
    with pytest.warns(UserWarning, match=r"checkpoint tensor\(s\) are not used .*foo\.bar.*"
                                         r"model\.layers\.1\.input_layernorm\.weight"):
        load_model(d, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(ckpts["mixtral"], progress=False)  # sharded, all tensors used
    # a stale index entry (its shard lacks the tensor; HF loads such a checkpoint): a warning,
    # not a safetensors error after every weight was read
    d = str(tmp_path / "stale_index")
    shutil.copytree(ckpts["mixtral"], d)
    index = os.path.join(d, "model.safetensors.index.json")
    data = json.load(open(index))
    data["weight_map"]["model.layers.9.mlp.stale.weight"] = next(iter(data["weight_map"].values()))
    json.dump(data, open(index, "w"))
    with pytest.warns(UserWarning, match=r"index.json names 1 tensor\(s\) that its shards do not "
                                         r"hold, none used by the model: model\.layers\.9\.mlp"):
        load_model(d, progress=False)


def test_sharded_index_errors_name_the_files(ckpts, tmp_path):
    """An index without a weight_map, and an index that names the wrong shard for a tensor,
    raise CheckpointError naming the index / the shard."""
    d = str(tmp_path / "badindex")
    shutil.copytree(ckpts["mixtral"], d)
    index = os.path.join(d, "model.safetensors.index.json")
    data = json.load(open(index))
    key = "model.layers.0.self_attn.q_proj.weight"
    other = next(f for f in sorted(set(data["weight_map"].values())) if f != data["weight_map"][key])
    data["weight_map"][key] = other
    json.dump(data, open(index, "w"))
    with pytest.raises(CheckpointError, match=f"tensor '{key}' is not in {os.path.join(d, other)}, "
                                              "the shard model.safetensors.index.json names"):
        load_model(d, progress=False)
    json.dump({"metadata": {}}, open(index, "w"))
    with pytest.raises(CheckpointError, match=f"{index}: not a safetensors index .*weight_map"):
        load_model(d, progress=False)


def test_truncated_safetensors_file_is_named(ckpts, tmp_path):
    d = str(tmp_path / "truncated")
    shutil.copytree(ckpts["qwen3-moe"], d)
    path = next(os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".safetensors"))
    with open(path, "r+b") as f:
        f.truncate(6)
    with pytest.raises(CheckpointError, match=f"{path}: not a readable safetensors file"):
        load_model(d, progress=False)


def test_misshaped_expert_error_names_tensor_file_and_shapes(ckpts, tmp_path):
    d = str(tmp_path / "broken")
    shutil.copytree(ckpts["qwen3-moe"], d)
    key = "model.layers.0.mlp.experts.5.down_proj.weight"
    path = _rewrite_tensor(d, key, torch.zeros(64, 31))
    with pytest.raises(CheckpointError) as e:
        load_model(d, progress=False)
    msg = str(e.value)
    assert key in msg and path in msg and "[64, 31]" in msg and "[64, 32]" in msg


def test_quantized_checkpoints_are_refused(ckpts, tmp_path):
    """A config with quantization_config, or a tensor stored in another dtype than F32 / BF16 /
    F16 (FP8, int8), is an error naming it instead of garbage weights."""
    d = str(tmp_path / "fp8")
    shutil.copytree(ckpts["qwen3-moe"], d)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="quantized checkpoints are not supported .*'fp8'"):
        load_model(d, progress=False)
    json.dump(cfg, open(cfg_path, "w"))
    for key, dtype, name in (("model.layers.1.mlp.experts.3.up_proj.weight", torch.float8_e4m3fn, "F8_E4M3"),
                             ("model.layers.0.self_attn.q_proj.weight", torch.int8, "I8")):
        d2 = str(tmp_path / name)
        shutil.copytree(d, d2)
        with safe_open(os.path.join(d2, "model.safetensors"), "pt") as f:
            shape = f.get_slice(key).get_shape()
        path = _rewrite_tensor(d2, key, torch.zeros(shape).to(dtype))
        with pytest.raises(CheckpointError) as e:
            load_model(d2, progress=False)
        assert f"tensor {key!r} in {path} is stored as {name}" in str(e.value)


def test_float64_checkpoint_loads_and_computes_in_float32(ckpts, tmp_path):
    """A checkpoint saved in float64 (config dtype float64, F64 tensors): read and converted,
    computing in float32 with the same answers (its F64 tensors failed after the ranks started,
    called "quantized")."""
    from safetensors.torch import load_file
    d = str(tmp_path / "f64")
    shutil.copytree(ckpts["qwen3-moe"], d)
    path = os.path.join(d, "model.safetensors")
    save_file({k: v.double() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(d, "config.json")
    json.dump({**json.load(open(cfg_path)), "dtype": "float64"}, open(cfg_path, "w"))
    model = load_model(d, progress=False)
    assert model.spec.dtype == torch.float32
    prompts = encode(d, PROMPTS)
    out = run_requests(model, prompts, range(len(prompts)),
                       SamplingParams(max_new_tokens=NEW_TOKENS), stop_ids=[])
    assert out.token_ids == hf_greedy(ckpts["qwen3-moe"], PROMPTS, NEW_TOKENS)


def test_generation_config_eos_ids_are_stop_ids(ckpts, tmp_path):
    """generation_config.json's eos_token_id (int or list) adds to config.json's; absent: ignored."""
    d = str(tmp_path / "gen")
    shutil.copytree(ckpts["qwen3-moe"], d)
    gen = os.path.join(d, "generation_config.json")
    json.dump({"eos_token_id": [5, 0, 7]}, open(gen, "w"))
    assert read_spec(d)[0].eos_token_ids == (0, 5, 7)
    json.dump({"eos_token_id": 9}, open(gen, "w"))
    assert read_spec(d)[0].eos_token_ids == (0, 9)
    json.dump({"eos_token_id": [0, "x"]}, open(gen, "w"))  # (a bare int() error named no file)
    with pytest.raises(ValueError, match=f"{d}/generation_config.json: ValueError: invalid literal"):
        read_spec(d)
    os.remove(gen)
    assert read_spec(d)[0].eos_token_ids == (0,)
    cfg_path = os.path.join(d, "config.json")  # values the architecture refuses: the file named
    json.dump({**json.load(open(cfg_path)), "num_experts_per_tok": 99}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=f"{d}/config.json: "):
        read_spec(d)
    for model_type in ("llama", "bogus_moe"):  # (known to transformers or not: our list)
        json.dump({**json.load(open(cfg_path)), "model_type": model_type}, open(cfg_path, "w"))
        with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'; "
                                             r"supported: \['deepseek_v3'"):
            read_spec(d)


def _load_rank(rank: int, world_size: int, model_dir: str):
    """Load rank's share under dp_nvlink, warnings as errors (rank 0 must not call the other
    rank's experts unused); ("ok", expert range) or ("error", message)."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m = load_model(model_dir, Parallel("dp_nvlink", rank, world_size), progress=False)
    except CheckpointError as e:
        return "error", str(e)
    r = m.layers[0].mlp.local_expert_range
    return "ok", [r.start, r.stop]


@pytest.mark.parametrize("topology", ["tp", "dp_nvlink"])
def test_a_multirank_parallel_needs_its_process_group(ckpts, topology):
    """Parallel(rank 0 of 2) in a process without torch.distributed: a ValueError that says so
    before any weight is read, not a model whose attention is split while its MoE layers and
    collectives run as a world of one rank (wrong logits under tp)."""
    with pytest.raises(ValueError, match=r"rank 0 of 1 \(torch.distributed is not initialized\)"):
        load_model(ckpts["qwen3-moe"], Parallel(topology, 0, 2), progress=False)


def test_load_model_names_a_dtype_passed_as_the_parallel(ckpts):
    with pytest.raises(TypeError, match="got str 'bfloat16' .*keyword-only"):
        load_model(ckpts["qwen3-moe"], "bfloat16")


def test_each_rank_reads_only_its_own_experts(ckpts, tmp_path):
    """Expert 7 is misshaped: rank 1 of 2 (experts 4..7) must fail, rank 0 must never read it."""
    from _dist import run_distributed
    d = str(tmp_path / "broken")
    shutil.copytree(ckpts["qwen3-moe"], d)
    key = "model.layers.1.mlp.experts.7.gate_proj.weight"
    _rewrite_tensor(d, key, torch.zeros(33, 64))
    res = run_distributed(_load_rank, 2, d)
    assert res[0] == ("ok", [0, 4])
    assert res[1][0] == "error" and key in res[1][1] and "[33, 64]" in res[1][1]


class _GraphStandIn:
    """engine.decode_graph.DecodeGraph on the CPU: the step it captures (dp: inside
    fixed_capacity, attending over its bucket's positions) run eagerly; each capture is logged
    with the rank's dispatch calls so far."""
    log = []

    def __init__(self, model, cache, batch, capacity):
        from moe_runtime.layer import MoELayer
        self.model, self.cache, self.batch, self.capacity, self.bucket = model, cache, batch, capacity, 0
        self.topologies = [l.mlp.topology for l in model.layers if isinstance(l.mlp, MoELayer)]

    def __call__(self, tokens, positions, needed):
        from moe_runtime.engine.decode_graph import DecodeGraph
        from moe_runtime.topologies import fixed_capacity
        bucket = max(self.bucket, DecodeGraph.kv_bucket(needed))
        if bucket != self.bucket:
            self.bucket = bucket
            _GraphStandIn.log.append((bucket, self.batch, self.capacity, self.topologies[0].calls))
        with fixed_capacity(self.topologies, self.capacity):
            return self.model(tokens[:, None], positions[:, None], None,
                              torch.zeros(self.batch, dtype=torch.int64), self.cache,
                              kv_len=min(bucket, self.cache.max_len))


def _dp_graphed_rank(rank: int, world_size: int, model_dir: str):
    from moe_runtime.engine import scheduler
    scheduler.graphs_apply = lambda model: True
    scheduler.DecodeGraph = _GraphStandIn
    model = load_model(model_dir, Parallel("dp_nvlink", rank, world_size), progress=False)
    prompts = [[5] * 250, [1, 2, 3], [4, 5]] if rank == 0 else []
    runs = [run_requests(model, prompts, range(len(prompts)), SamplingParams(max_new_tokens=8),
                         stop_ids=[], cuda_graphs=graphs) for graphs in (True, False)]
    calls, log = model.layers[0].mlp.topology.calls, list(_GraphStandIn.log)
    # every first token a stop token: graphs agreed on, but no decode step ran
    stopped = run_requests(model, prompts, range(len(prompts)), SamplingParams(max_new_tokens=8),
                           stop_ids=range(model.spec.vocab_size))
    return ([r.extra["cuda_graphs"] for r in runs + [stopped]], [r.token_ids for r in runs],
            log, calls)


def test_dp_ranks_agree_on_graphed_decode_steps(ckpts):
    """The scheduler's dp branch of CUDA-graph decode, on the CPU (a stand-in replays the step
    eagerly): rank 1 has no requests and keeps one idle slot; every MoE call of a step has the
    capacity of rank 0's 3 slots; both ranks move to the 512-position bucket at the same step
    (rank 0's sequence of 250 passes 256) with the same dispatch calls behind them; the tokens
    are the split-size protocol's (eager run). A run whose requests all stop at their first
    token reports no graphs (no decode step ran)."""
    from _dist import run_distributed
    (graphed0, ids0, log0, calls0), (graphed1, ids1, log1, calls1) = run_distributed(
        _dp_graphed_rank, 2, ckpts["qwen3-moe"])
    assert graphed0 == graphed1 == [True, False, False]
    assert ids0[0] == ids0[1] and ids1 == [[], []] and all(len(t) == 8 for t in ids0[0])
    assert [(b, c) for b, _, c, _ in log0] == [(256, 3), (512, 3)]
    assert [(b, n) for b, n, _, _ in log1] == [(256, 1), (512, 1)]
    assert [c for *_, c in log0] == [c for *_, c in log1] and calls0 == calls1


def test_glm4_moe_spec_and_bf16_routers_kept_fp32(ckpts, tmp_path):
    """GLM-4.5's structure read from its config: half-rotary heads, q/k/v biases without an
    o_proj bias, a dense first layer, DeepSeek-V3 routing with a shared expert; in bf16 the
    router weight and correction bias stay fp32 (HF's _keep_in_fp32_modules_strict), and the
    prefill logits follow HF's bf16 model."""
    from transformers import AutoModelForCausalLM
    d = ckpts["glm4-moe"]
    spec, arch = read_spec(d)
    assert (spec.rotary_dim, spec.head_dim, spec.attention_bias, spec.o_proj_bias) == (8, 16, True, False)
    assert spec.dense_layers == (0,) and spec.dense_intermediate_size == 128
    m = spec.moe
    assert (m.scoring, m.n_group, m.topk_group, m.routed_scaling_factor, m.use_correction_bias) == (
        "sigmoid", 2, 1, 2.5, True)
    assert m.shared_expert_intermediate_size == 32 and not m.shared_expert_gate
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().min() > 0
    model = load_model(d, dtype="bfloat16", progress=False)
    router = model.layers[1].mlp.router
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    ids = torch.tensor([encode(d, PROMPTS[:1])[0]])
    L = ids.shape[1]
    cache = model.new_cache(1, L)
    ours = model(ids, torch.arange(L)[None], torch.ones(1, L, dtype=torch.bool),
                 torch.tensor([L - 1]), cache)
    with torch.no_grad():
        ref = hf(ids).logits[:, -1].float()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 3e-2


def test_glm4_moe_without_shared_experts_loads_quietly(tmp_path, recwarn):
    """HF writes 0-wide shared-expert tensors for n_shared_experts=0: nothing to warn about."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from moe_runtime.models.make_checkpoint import _glm4_moe_kwargs, train_tokenizer
    tok = train_tokenizer()
    cfg = Glm4MoeConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                        **{**_glm4_moe_kwargs("tiny"), "n_shared_experts": 0})
    d = str(tmp_path / "g")
    Glm4MoeForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.shared_experts.up_proj.weight").get_shape()[0] == 0
    model = load_model(d, progress=False)
    assert model.layers[1].mlp.shared_expert is None
    assert not [w for w in recwarn if "not used" in str(w.message)], [str(w.message) for w in recwarn]
    out = run_requests(model, encode(d, PROMPTS[:2]), range(2), SamplingParams(max_new_tokens=6),
                       stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS[:2], 6)


@pytest.mark.parametrize("variant", [
    dict(),  # the make-checkpoint structure: query latent, interleaved RoPE, Dv < Dk
    dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, first_k_dense_replace=0),
    dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                              original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                              mscale=1.0, mscale_all_dim=1.0)),
    dict(rms_norm_eps=1e-2),  # (HF's latent norms keep eps 1e-6)
], ids=["latent_q", "plain_q_bias_no_dense", "yarn_mscale", "rms_norm_eps"])
def test_deepseek_v3_latent_attention_logits_equal_hf(tmp_path, variant, monkeypatch):
    """MLA (LatentAttention) against HF's DeepseekV3ForCausalLM in fp32: every position's
    logits of a prefill (prompts longer than yarn's original context) with kv_b_proj absorbed
    (also with the query positions in chunks of 5: a scores budget of 5 rows) and with the
    keys and values expanded (MLA_EXPAND_ROWS), and greedy decoding."""
    from moe_runtime.models import transformer
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    from moe_runtime.models.make_checkpoint import (_deepseek_v3_kwargs,
                                                    _randomize_correction_biases, train_tokenizer)
    tok = train_tokenizer()
    cfg = DeepseekV3Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                           **{**_deepseek_v3_kwargs("tiny"), **variant})
    torch.manual_seed(2)
    hf = DeepseekV3ForCausalLM(cfg)
    _randomize_correction_biases(hf)
    d = str(tmp_path / "ds")
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, progress=False)
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))
    B, L = ids.shape
    with torch.no_grad():
        ref = hf(ids).logits.float()
    heads = model.spec.num_heads
    for budget, expand in ((transformer.SCORES_PER_CHUNK, L + 1), (5 * B * heads * L, L + 1),
                           (transformer.SCORES_PER_CHUNK, L)):
        monkeypatch.setattr(transformer, "SCORES_PER_CHUNK", budget)
        monkeypatch.setattr(transformer, "MLA_EXPAND_ROWS", expand)
        for last in (0, 9, L - 1):  # (yarn: 16 positions originally) a fresh prefill each
            cache = model.new_cache(B, L)
            ours = model(ids, torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool),
                         torch.full((B,), last), cache)
            err = ((ours - ref[:, last]).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (budget, expand, last, err)
    monkeypatch.undo()
    out = run_requests(model, encode(d, PROMPTS), range(3), SamplingParams(max_new_tokens=8),
                       stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS, 8)


@pytest.mark.parametrize("L,S", [(1, 37), (3, 40), (200, 203)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6), (4, 1)])
def test_gqa_attention_equals_repeated_kv_heads(L, S, heads, kv_heads, monkeypatch):
    """_attend against float64 SDPA over kv heads repeated per query head, on a filled cache
    with a causal + padding mask: decode-sized calls (L <= DECODE_POSITIONS: two bmm over the
    folded query rows), SDPA on repeated kv heads otherwise, and the folded form in query
    chunks (a scores budget of 3 rows)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from moe_runtime.engine.kv_cache import KVCache
    from moe_runtime.models import transformer
    from moe_runtime.models.transformer import _attend
    g = torch.Generator().manual_seed(L * 100 + heads)
    B, D = 2, 4
    cache = KVCache(1, B, kv_heads, S + 4, D, dtype=torch.float32)
    old = torch.arange(S - L).expand(B, -1)
    cache.write(0, old, torch.randn(B, kv_heads, S - L, D, generator=g),
                torch.randn(B, kv_heads, S - L, D, generator=g), S - L)
    pos = torch.arange(S - L, S).expand(B, L)
    q = torch.randn(B, heads, L, D, generator=g)
    k, v = (torch.randn(B, kv_heads, L, D, generator=g) for _ in range(2))
    mask = (torch.arange(S) <= pos[:, None, :, None]) & (torch.arange(S) >= torch.tensor([0, 3])[:, None, None, None])
    ours = _attend(SimpleNamespace(layer_idx=0), q, k, v, pos, mask, cache, 0.3)
    keys, values = cache.k[0][:, :, :S], cache.v[0][:, :, :S]
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.double(), keys.repeat_interleave(rep, 1).double(),
                                         values.repeat_interleave(rep, 1).double(),
                                         attn_mask=mask, scale=0.3)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(transformer, "SCORES_PER_CHUNK", 3 * B * heads * S)
    chunked = transformer._grouped_attention(q, keys, values, mask, 0.3)
    torch.testing.assert_close(chunked.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_attention_bf16_is_as_accurate_as_sdpa(device):
    """bf16 inputs, large scores (queries x3): the two-bmm attention keeps its scores in fp32,
    so it stays within a small multiple of SDPA's error against float64 (bf16 scores were
    4.9e-2 against SDPA's 2.1e-3 at B 2, 32/4 heads, S 4096); on CUDA from the bf16 keys
    themselves (bmm with fp32 output), on the CPU from their fp32 copy."""
    from moe_runtime.models.transformer import _fp32_scores, _grouped_attention
    g = torch.Generator().manual_seed(0)
    B, h, kv, S, D = 2, 8, 2, 1024, 64
    q = (3 * torch.randn(B, h, 1, D, generator=g)).bfloat16().to(device)
    k, v = (torch.randn(B, kv, S, D, generator=g).bfloat16().to(device) for _ in range(2))
    assert _fp32_scores(q, k) == (device == "cuda")
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=device)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(h // kv, 1), v.double().repeat_interleave(h // kv, 1))
    err = lambda out: float((out.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1))
    ours = _grouped_attention(q, k, v, mask, D ** -0.5)
    assert err(ours) <= max(3 * err(sdpa), 8e-3), (err(ours), err(sdpa))


@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_fixed_shape_decode_step_equals_the_eager_one(ckpts, arch):
    """The decode step that engine.decode_graph captures (attention over the whole cache,
    every sequence through the MoE layers: MoECausalLM.forward with kv_len and valid None)
    gives the eager step's logits for the sequences still generating, in fp32 on CPU, and
    writes the same cache entries for them; run_requests replays graphs on CUDA only."""
    d = ckpts[arch]
    model = load_model(d, progress=False)
    prompts = encode(d, PROMPTS)
    B, L = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, L, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    pos = torch.arange(L).expand(B, L)
    caches = [model.new_cache(B, L + 6), model.new_cache(B, L + 6)]
    for c in caches:
        model(ids, pos, pos < lens[:, None], lens - 1, c)
    active = torch.tensor([True, False, True])  # sequence 1 finished
    tokens = torch.tensor([[5], [7], [11]])
    eager = model(tokens, lens[:, None], active[:, None], torch.zeros(B, dtype=torch.int64), caches[0])
    fixed = model(tokens, lens[:, None], None, torch.zeros(B, dtype=torch.int64), caches[1],
                  kv_len=L + 6)
    torch.testing.assert_close(fixed[active], eager[active], rtol=1e-5, atol=1e-5)
    for k0, k1 in zip(caches[0].k, caches[1].k):  # (the finished one's: written, never read)
        torch.testing.assert_close(k0[active], k1[active], rtol=1e-5, atol=1e-6)
    out = run_requests(model, prompts, range(B), SamplingParams(max_new_tokens=3), stop_ids=[])
    assert out.extra["cuda_graphs"] is False


@pytest.mark.parametrize("arch,expand", [("qwen3-moe", None), ("mixtral", None),
                                         ("deepseek-v3", None), ("deepseek-v3", 1)])
def test_causal_prefill_equals_the_masked_one(ckpts, arch, expand, monkeypatch):
    """forward(prefill=True) (positions 0..L-1: SDPA's is_causal, or the causal mask built
    where attention is two bmm) gives the explicit mask's logits at every position, fp32;
    deepseek-v3 absorbed (short L) and expanded (MLA_EXPAND_ROWS=1)."""
    from moe_runtime.models import transformer
    if expand is not None:
        monkeypatch.setattr(transformer, "MLA_EXPAND_ROWS", expand)
    model = load_model(ckpts[arch], progress=False)
    B, L = 2, 11
    ids = torch.randint(0, model.spec.vocab_size, (B, L), generator=torch.Generator().manual_seed(1))
    pos, valid = torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool)
    for last in (0, 5, L - 1):
        ref = model(ids, pos, valid, torch.full((B,), last), model.new_cache(B, L))
        got = model(ids, pos, valid, torch.full((B,), last), model.new_cache(B, L), prefill=True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topology", ["tp", "dp_nvlink", "dp_p2p"])
def test_one_rank_of_a_multi_rank_topology_runs_local_moe_quietly(ckpts, topology, caplog):
    """Engine(world_size=1, topology="tp") built tp MoE topologies without a process group,
    each logging "built while torch.distributed is not initialized"; one rank is `local`."""
    import logging
    with caplog.at_level(logging.WARNING):
        model = load_model(ckpts["qwen3-moe"], Parallel(topology, 0, 1), progress=False)
    assert {l.mlp.topology.name for l in model.layers} == {"local"}
    assert "not initialized" not in caplog.text


def test_qwen2_moe_without_shared_expert_loads_quietly(tmp_path, recwarn):
    """HF saves the [1, H] gate of a 0-wide shared expert (its output is 0): not reported as
    an unused tensor; greedy ids still equal HF's."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from moe_runtime.models.make_checkpoint import _qwen2_kwargs, train_tokenizer
    tok = train_tokenizer()
    cfg = Qwen2MoeConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         **{**_qwen2_kwargs("tiny"), "shared_expert_intermediate_size": 0})
    torch.manual_seed(0)
    d = str(tmp_path / "q2")
    Qwen2MoeForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    model = load_model(d, progress=False)
    assert not [w for w in recwarn if "not used" in str(w.message)]
    out = run_requests(model, encode(d, PROMPTS[:2]), range(2), SamplingParams(max_new_tokens=5),
                       stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS[:2], 5)


def test_qwen2_moe_spec_gated_shared_expert_and_refusals(ckpts):
    """Qwen2-MoE: q/k/v biases without an o_proj bias, the shared expert and its sigmoid gate
    loaded from `shared_expert` / `shared_expert_gate`, routing weights not renormalized
    (HF's default); a 0-wide shared expert has no gate; per-layer sliding windows refused."""
    from transformers import Qwen2MoeConfig

    from moe_runtime.models import qwen2_moe
    model = load_model(ckpts["qwen2-moe"], progress=False)
    s = model.spec
    assert (s.attention_bias, s.o_proj_bias, s.qk_norm, s.moe.norm_topk_prob) == (True, False, False, False)
    layer = model.layers[0]
    assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
    from safetensors.torch import load_file
    stored = load_file(os.path.join(ckpts["qwen2-moe"], "model.safetensors"))
    torch.testing.assert_close(layer.mlp.shared_expert.gate.weight,
                               stored["model.layers.0.mlp.shared_expert_gate.weight"])
    no_shared = qwen2_moe.spec_from_config(Qwen2MoeConfig(shared_expert_intermediate_size=0), torch.float32)
    assert (no_shared.moe.shared_expert_intermediate_size, no_shared.moe.shared_expert_gate) == (0, False)
    dense = qwen2_moe.spec_from_config(Qwen2MoeConfig(num_experts=0, num_hidden_layers=2), torch.float32)
    assert dense.dense_layers == (0, 1)  # (HF runs it all dense; top_k 4 > 1 expert was refused)
    with pytest.raises(ValueError, match="sliding-window attention on some layers only"):
        qwen2_moe.spec_from_config(Qwen2MoeConfig(use_sliding_window=True), torch.float32)
    qwen2_moe.spec_from_config(Qwen2MoeConfig(use_sliding_window=True, max_window_layers=0),
                               torch.float32)  # (no layer is windowed)


def test_olmoe_norms_span_all_heads_clip_qkv_and_tp_is_refused(ckpts):
    """OLMoE: q/k RMSNorm weights over the whole projection ([heads * D], [kv_heads * D]),
    clip_qkv 2.0 active in the tiny checkpoint (its logits differ without it: the greedy test
    checks them against HF), and tp refused up front (the norm would span ranks)."""
    from dataclasses import replace

    from moe_runtime.engine.driver import check_world_size
    model = load_model(ckpts["olmoe"], progress=False)
    s, attn = model.spec, model.layers[0].self_attn
    assert (s.qk_norm, s.qk_norm_whole, s.clip_qkv) == (True, True, 2.0)
    assert attn.q_norm.weight.shape == (s.num_heads * s.head_dim,)
    assert attn.k_norm.weight.shape == (s.num_kv_heads * s.head_dim,)
    ids = torch.tensor([[5, 9, 13, 2]])
    args = (torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool), torch.tensor([3]))
    clipped = model(ids, *args, model.new_cache(1, 4))
    attn_modules = [layer.self_attn for layer in model.layers]
    for a in attn_modules:
        a.clip_qkv = None
    assert not torch.allclose(model(ids, *args, model.new_cache(1, 4)), clipped)
    check_world_size(s, 2)  # dp: fine
    with pytest.raises(ValueError, match="q/k RMSNorm spans all heads"):
        check_world_size(s, 2, tensor_parallel=True)
    check_world_size(replace(s, qk_norm_whole=False), 2, tensor_parallel=True)


def test_layer_types_decide_the_sliding_window():
    """dots.llm1's config says sliding_window 4096 with every layer "full_attention": HF
    windows none, so neither does the engine (common_spec_fields alone took the 4096); all
    layers windowed -> the window; some only -> refused."""
    from transformers import Dots1Config

    from moe_runtime.models import dots1
    from moe_runtime.models.make_checkpoint import _dots1_kwargs
    kw = {**_dots1_kwargs("tiny"), "num_hidden_layers": 4}
    assert dots1.spec_from_config(Dots1Config(**kw), torch.float32).sliding_window is None
    windowed = Dots1Config(**kw, layer_types=["sliding_attention"] * 4, sliding_window=64)
    assert dots1.spec_from_config(windowed, torch.float32).sliding_window == 64
    mixed = Dots1Config(**kw, layer_types=["sliding_attention", "full_attention"] * 2)
    with pytest.raises(ValueError, match=r"some layers only \(2 of 4 in layer_types\)"):
        dots1.spec_from_config(mixed, torch.float32)


def test_auto_dtype_without_one_in_config_json_is_the_stored_one_as_in_hf(ckpts, tmp_path):
    """config.json without dtype / torch_dtype: "auto" takes the first stored floating-point
    tensor's dtype (HF transformers 5's rule), not float32 (twice a bf16 model's memory)."""
    from transformers import AutoModelForCausalLM
    d = str(tmp_path / "nodtype")
    make_checkpoint(d, "mixtral", "tiny", dtype="bfloat16", max_shard_size="100KB")
    path = os.path.join(d, "config.json")
    cfg = {k: v for k, v in json.load(open(path)).items() if k not in ("dtype", "torch_dtype")}
    json.dump(cfg, open(path, "w"))
    assert AutoModelForCausalLM.from_pretrained(d).dtype == torch.bfloat16
    assert read_spec(d)[0].moe.dtype == torch.bfloat16
    assert read_spec(d, "float16")[0].moe.dtype == torch.float16
    cfg_only = str(tmp_path / "cfg_only")
    os.makedirs(cfg_only)
    shutil.copy(path, cfg_only)
    assert read_spec(cfg_only)[0].moe.dtype == torch.float32  # (no weights to ask)


def test_families_whose_hf_model_never_windows_ignore_a_sliding_window_key():
    """A config.json with `sliding_window` (a converted or merged checkpoint): HF's GLM-4-MoE,
    OLMoE and DeepSeek-V3 build full causal masks whatever it says, so the engine does not
    window them either; Mixtral reads it, Qwen3-MoE only with use_sliding_window."""
    import transformers

    from moe_runtime.models import get_architecture
    from moe_runtime.models.make_checkpoint import _KWARGS, ARCH_NAMES
    for arch, window in (("glm4-moe", None), ("olmoe", None), ("deepseek-v3", None),
                         ("mixtral", 8)):
        a = get_architecture(ARCH_NAMES[arch])
        cfg = getattr(transformers, a.hf_class_name.replace("ForCausalLM", "Config"))(
            **_KWARGS[arch]("tiny"))
        cfg.sliding_window = 8  # (as transformers keeps an unknown config.json key)
        assert a.spec_from_config(cfg, torch.float32).sliding_window == window, arch
    qwen = transformers.Qwen3MoeConfig(**_KWARGS["qwen3-moe"]("tiny"), sliding_window=8)
    assert get_architecture("qwen3_moe").spec_from_config(qwen, torch.float32).sliding_window is None
    qwen = transformers.Qwen3MoeConfig(**_KWARGS["qwen3-moe"]("tiny"), sliding_window=8,
                                       use_sliding_window=True)
    assert get_architecture("qwen3_moe").spec_from_config(qwen, torch.float32).sliding_window == 8


def test_rank_progress_grows_inside_a_prefill(ckpts):
    """RankWorker.progress (what the driver polls to tell a long generation from a stuck one)
    grows with every decoder layer of an eager forward, so one long prefill is not taken for
    a stall (it counted forward passes only: a 7000-token prefill outlasting a short timeout
    was killed as "made no progress")."""
    from moe_runtime.engine.worker import RankWorker
    w = RankWorker(0, 1, "cpu")
    w.load(ckpts["qwen3-moe"], "local", progress=False)
    seen = []
    w.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append((w.steps, w.progress())))
    w.generate([[1, 2, 3]], [0], SamplingParams(max_new_tokens=3), stop_ids=[])
    layers = len(w.model.layers)
    assert seen[0] == (0, 1)  # in the prefill: no forward pass done yet, one layer
    assert w.steps == 3 and w.progress() == 3 + 3 * layers


def test_warm_up_runs_a_long_prefill_and_a_decode_step_and_changes_nothing(ckpts):
    """scheduler.warm_up (run at load on GPU ranks, so kernel compiles are not charged to the
    first request): one prefill of WARM_UP_TOKENS (capped by max_position_embeddings), then
    one decode step, through every MoE layer; the model's answers afterwards are HF's."""
    from moe_runtime.engine.scheduler import WARM_UP_TOKENS, warm_up
    from moe_runtime.layer import MoELayer
    d = ckpts["qwen3-moe"]
    model = load_model(d, Parallel(), progress=False)
    moe = [l.mlp for l in model.layers if isinstance(l.mlp, MoELayer)]
    seen = []
    for m in moe:
        m.register_forward_pre_hook(lambda mod, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).shape[0]))
    assert warm_up(model) > 0
    want = min(WARM_UP_TOKENS, model.spec.max_position_embeddings - 2)
    assert want < WARM_UP_TOKENS  # (the tiny checkpoint caps it)
    assert seen == [want] * len(moe) + [1] * len(moe)
    seen.clear()
    # a dp_nvlink topology refuses calls above 100 tokens until its first call settles it on
    # the reference backend: one prefill within the limit, then one of the full length
    moe[0].topology.max_tokens_per_call = lambda: math.inf if seen else 100
    warm_up(model)
    n = len(moe)
    assert seen == [100] * n + [1] * n + [want] * n + [1] * n
    seen.clear()
    moe[0].topology.max_tokens_per_call = lambda: 100  # (cute: stays)
    warm_up(model)
    assert seen == [100] * n + [1] * n
    del moe[0].topology.max_tokens_per_call
    out = run_requests(model, encode(d, PROMPTS), range(len(PROMPTS)),
                       SamplingParams(max_new_tokens=NEW_TOKENS), stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS, NEW_TOKENS)


def test_non_silu_activation_and_unsplittable_heads_are_refused_up_front(ckpts):
    """A gelu config would run with SiLU MLPs silently; tp with heads the ranks cannot split
    fails in the driver, before Ray starts."""
    from dataclasses import replace

    from transformers import Qwen3MoeConfig

    from moe_runtime.engine.driver import check_world_size
    from moe_runtime.models import qwen3_moe
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        qwen3_moe.spec_from_config(Qwen3MoeConfig(hidden_act="gelu"), torch.float32)
    spec = replace(read_spec(ckpts["qwen3-moe"])[0], num_heads=6)
    check_world_size(spec, 4)  # (dp: heads not split)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be divisible by the world size \(4\)"):
        check_world_size(spec, 4, tensor_parallel=True)


def test_deepseek_v3_caches_the_latent_and_follows_hf_in_bf16(ckpts):
    """The MLA cache holds one latent head [kv_lora + qk_rope] per position (no per-head keys,
    no separate values: ~70x less than expanded keys and values at DeepSeek-V3's sizes); in
    bf16 (routers fp32) the prefill logits follow HF's bf16 model."""
    from transformers import AutoModelForCausalLM
    d = ckpts["deepseek-v3"]
    model = load_model(d, dtype="bfloat16", progress=False)
    m = model.spec.mla
    ids = torch.randint(0, model.spec.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    B, L = ids.shape
    cache = model.new_cache(B, L)
    assert cache.v is None and cache.k[0].shape == (B, 1, L, m.kv_lora_rank + m.qk_rope_head_dim)
    ours = model(ids, torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool),
                 torch.full((B,), L - 1), cache)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(ids).logits[:, -1].float()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 3e-2


def test_longrope_is_refused_not_computed_once():
    """transformers switches longrope's factors by sequence length while it runs."""
    from transformers import Qwen3MoeConfig

    from moe_runtime.models.spec import rope_parameters
    cfg = Qwen3MoeConfig(head_dim=16, max_position_embeddings=256, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
        original_max_position_embeddings=64))
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        rope_parameters(cfg, 16)


def test_read_spec_refuses_an_unsupported_rope(ckpts, tmp_path):
    """read_spec (which the Engine calls before Ray starts) computes the RoPE parameters once:
    longrope failed only on the ranks, about 14 s into a CLI run."""
    d = str(tmp_path / "rope")
    shutil.copytree(ckpts["qwen3-moe"], d)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    half = cfg["head_dim"] // 2
    cfg["rope_parameters"] = dict(rope_type="longrope", rope_theta=10000.0,
                                  short_factor=[1.0] * half, long_factor=[2.0] * half,
                                  original_max_position_embeddings=64)
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=f"{d}/config.json: rope_type 'longrope' is not supported"):
        read_spec(d)


def test_a_model_without_moe_layers_splits_no_experts(ckpts):
    """Qwen3-MoE's num_experts 0 makes every layer dense: no experts to split over the ranks
    (the check quoted the placeholder `num_experts (1)`); with MoE layers it still applies."""
    from dataclasses import replace

    from moe_runtime.engine.driver import check_world_size
    s = read_spec(ckpts["qwen3-moe"])[0]
    dense = replace(s, dense_layers=tuple(range(s.num_layers)),
                    moe=replace(s.moe, num_experts=1, top_k=1))
    check_world_size(dense, 2)
    check_world_size(dense, 3)
    with pytest.raises(ValueError, match=r"num_experts \(1\) must be divisible by world_size"):
        check_world_size(replace(dense, dense_layers=dense.dense_layers[1:]), 2)


def test_read_spec_of_both_families(ckpts):
    q, qa = read_spec(ckpts["qwen3-moe"])
    m, ma = read_spec(ckpts["mixtral"])
    assert (q.qk_norm, m.qk_norm) == (True, False)
    assert (q.moe.num_experts, q.moe.top_k, q.num_heads, q.num_kv_heads) == (8, 2, 8, 2)
    assert ma.moe_block_names[0] == "block_sparse_moe" and m.moe.norm_topk_prob
    assert q.dtype == torch.float32 and q.eos_token_ids == (0,)


def test_qwen3_30b_preset_writes_config_only_without_force(tmp_path):
    d = make_checkpoint(str(tmp_path / "q30"), "qwen3-moe", "qwen3-30b-a3b")
    assert not any(f.endswith(".safetensors") for f in os.listdir(d))
    spec, _ = read_spec(d)
    assert (spec.num_layers, spec.moe.num_experts, spec.moe.top_k, spec.head_dim) == (48, 128, 8, 128)
    assert spec.dtype == torch.bfloat16 and spec.vocab_size == 151936
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        make_checkpoint(str(tmp_path / "m30"), "mixtral", "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="not empty"):
        make_checkpoint(d, "qwen3-moe", "tiny")


def test_tp_head_shards_cover_every_head(ckpts):
    spec, _ = read_spec(ckpts["qwen3-moe"])  # 8 q heads, 2 kv heads
    for W in (2, 4, 8):
        shards = [head_shard(spec, Parallel("tp", r, W)) for r in range(W)]
        assert [s.q_start for s in shards] == [r * 8 // W for r in range(W)]
        for s in shards:  # every q head's kv head (h // 4) is on the same rank
            assert all(s.kv_start <= h // 4 < s.kv_start + s.kv_heads
                       for h in range(s.q_start, s.q_start + s.q_heads))
    with pytest.raises(ValueError, match="divisible"):
        head_shard(spec, Parallel("tp", 0, 3))
    assert head_shard(spec, Parallel("dp_nvlink", 1, 2)).q_heads == 8
    with pytest.raises(ValueError, match="local"):
        Parallel("local", 0, 2)


def test_sampler_greedy_top_p_and_seeds():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 2.5]])
    assert sample(logits, SamplingParams(), []).tolist() == [1, 3]
    tiny_p = SamplingParams(temperature=5.0, top_p=1e-6)
    gens = request_generators(0, [0, 1])
    assert all(sample(logits, tiny_p, gens).tolist() == [1, 3] for _ in range(20))
    hot = SamplingParams(temperature=10.0, top_p=1.0, seed=7)
    a = [sample(logits, hot, request_generators(7, [0, 1])).tolist() for _ in range(3)]
    assert a[0] == a[1] == a[2]  # same seed, same draws
    g = request_generators(1, [0, 1])
    draws = {tuple(sample(logits, hot, g).tolist()) for _ in range(50)}
    assert len(draws) > 3  # a high temperature really samples
    half = SamplingParams(temperature=1.0, top_p=0.5)
    g = request_generators(3, [0])
    assert {int(sample(logits[:1], half, g)) for _ in range(50)} == {1}  # p(1)=0.84 >= 0.5
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    # a NaN checkpoint: a named cause, greedy (argmax would pick an arbitrary token) or not
    # (torch.multinomial's text names none)
    for params in (hot, SamplingParams()):
        for bad in (float("nan"), float("inf")):
            poisoned = logits.clone()
            poisoned[1, 2] = bad
            with pytest.raises(ValueError, match="sampling: the logits of row 1 hold NaN or \\+inf"):
                sample(poisoned, params, request_generators(0, [0, 1]))
        masked = logits.clone()
        masked[0, :3] = float("-inf")  # (-inf logits are masked tokens: fine while one is finite)
        assert int(sample(masked, params, request_generators(0, [0, 1]))[0]) == 3
        masked[0, 3] = float("-inf")
        with pytest.raises(ValueError, match="row 0 hold NaN or \\+inf or no finite value"):
            sample(masked, params, request_generators(0, [0, 1]))


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-46, 1e-300, 1e-20])
def test_sampler_tiny_temperature_is_greedy(temperature):
    """logits / T overflows to +-inf for a tiny T (nan probabilities): shifted, it is greedy."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [-2.0, -50.0, 40.0, 39.5], [7.0, -7.0, 0.0, 6.0]])
    p = SamplingParams(temperature=temperature, top_p=0.9)
    gens = request_generators(0, [0, 1, 2])
    assert all(sample(logits, p, gens).tolist() == [1, 2, 0] for _ in range(10))


def test_the_last_position_is_used_and_its_answer_is_hf(ckpts):
    """check_prompts lets prompt + max_new_tokens - 1 reach max_position_embeddings (the last
    new token is never fed): the longest allowed request runs, HF's ids."""
    d = ckpts["qwen3-moe"]
    model = load_model(d, Parallel(), progress=False)
    L = model.spec.max_position_embeddings
    prompt = encode(d, PROMPTS)[0]
    prompt = (prompt * (L // len(prompt) + 1))[:L - 2]  # positions 0 .. L - 3, then L - 2, L - 1
    out = run_requests(model, [prompt], [0], SamplingParams(max_new_tokens=3), stop_ids=[])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert out.token_ids == [want[0, len(prompt):].tolist()]


def test_sampler_extreme_temperature_and_top_p_beyond_float32():
    """A temperature above fp32's largest (it rounded to inf: -inf / inf = nan with top_k) and a
    top_p below fp32's smallest (it rounded to 0 and dropped every token) killed every rank."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [-2.0, -50.0, 40.0, 39.5]])
    gens = request_generators(0, [0, 1])
    hot = SamplingParams(temperature=1e39, top_k=3)
    draws = {tuple(sample(logits, hot, gens).tolist()) for _ in range(200)}
    assert {d[0] for d in draws} == {0, 1, 2} and {d[1] for d in draws} == {0, 2, 3}  # top 3, ~uniform
    narrow = SamplingParams(temperature=1.0, top_p=1e-50)
    assert all(sample(logits, narrow, gens).tolist() == [1, 2] for _ in range(20))  # greedy


def test_assign_requests_balances_prompt_tokens():
    assert assign_requests([5, 1, 1], 2, data_parallel=False) == [[0, 1, 2], [0, 1, 2]]
    assert assign_requests([5, 1, 1, 4], 2, data_parallel=True) == [[0, 2], [1, 3]]  # loads 6, 5
    assert assign_requests([3], 4, data_parallel=True) == [[0], [], [], []]


def test_qwen3_dense_layer_bias_tied_embeddings_sliding_window_equal_hf(tmp_path):
    """The less common config branches in one checkpoint: a dense MLP layer (mlp_only_layers),
    attention biases, tied embeddings (no lm_head tensor) and a 4-token sliding window."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_runtime.models.make_checkpoint import train_tokenizer
    tok = train_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         mlp_only_layers=[1], attention_bias=True, tie_word_embeddings=True,
                         use_sliding_window=True, sliding_window=4, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    d = str(tmp_path / "q")
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.layers.0.self_attn.q_proj.bias" in f.keys()
    model = load_model(d, progress=False)
    assert model.spec.dense_layers == (1,) and model.lm_head is None and model.spec.sliding_window == 4
    out = run_requests(model, encode(d, PROMPTS), range(3), SamplingParams(max_new_tokens=8), stop_ids=[])
    assert out.token_ids == hf_greedy(d, PROMPTS, 8)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=2.5), dict(seed=1.5), dict(max_new_tokens=True),
                                dict(seed=False), dict(max_new_tokens="4"), dict(seed=None)])
def test_sampling_params_reject_non_int_max_new_tokens_and_seed(kw):
    """A float max_new_tokens / seed used to pass and then kill the rank actors in generate."""
    name = next(iter(kw))
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,error,message", [
    (dict(stop_token_ids="151645"), TypeError, "stop_token_ids must be a sequence of ints"),
    (dict(stop_token_ids=12), TypeError, "stop_token_ids must be a sequence of ints"),
    (dict(stop_token_ids=[True]), TypeError, "a stop token id must be an int"),
    (dict(stop_token_ids=[1.0]), TypeError, "a stop token id must be an int"),
    (dict(temperature="1"), TypeError, "temperature must be a number"),
    (dict(top_p=None), TypeError, "top_p must be a number"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(top_k=0), ValueError, "top_k must be >= 1"),
])
def test_sampling_params_name_the_bad_field(kw, error, message):
    """A string of stop ids used to become its digits ("151645" -> (1, 5, 1, 6, 4, 5)) and
    wrong types raised Python's own messages; each now names the field."""
    with pytest.raises(error, match=message):
        SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=range(3), top_k=2).stop_token_ids == (0, 1, 2)
    # one-element tensors, as int() and float() took them before these checks
    p = SamplingParams(stop_token_ids=torch.tensor([4, 2]), temperature=torch.tensor(0.5),
                       top_p=torch.tensor(0.9))
    assert (p.stop_token_ids, p.temperature, p.top_p) == ((4, 2), 0.5, 0.8999999761581421)
    for bad in (dict(stop_token_ids=torch.tensor([1.5])), dict(temperature=torch.tensor([0.5, 1.0])),
                dict(stop_token_ids=torch.tensor([True]))):
        with pytest.raises(TypeError):
            SamplingParams(**bad)


def test_sampler_top_k_and_distinct_request_seeds():
    """top_k keeps the k most likely tokens (then top_p); request streams come from a hash of
    (seed, request): seed 2**63 is not seed 0, and (1, 0) is not (0, 1000003)."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 2.8]])
    hot = dict(temperature=100.0, seed=0)
    g = request_generators(0, [0])
    assert {int(sample(logits, SamplingParams(top_k=2, **hot), g)) for _ in range(200)} == {1, 2}
    assert {int(sample(logits, SamplingParams(top_k=1, **hot), g)) for _ in range(20)} == {1}
    assert {int(sample(logits, SamplingParams(top_k=3, top_p=0.5, **hot), g))
            for _ in range(200)} == {1, 2}  # top_p over the 3 kept (each ~1/3)
    assert len({int(sample(logits, SamplingParams(**hot), g)) for _ in range(200)}) == 5

    def draws(seed, request):
        return torch.rand(8, generator=request_generators(seed, [request])[0]).tolist()
    assert draws(2 ** 63, 0) != draws(0, 0) and draws(1, 0) != draws(0, 1_000_003)
    assert draws(5, 3) == draws(5, 3)


def test_sampling_params_take_integral_numbers_as_int():
    import numpy as np
    p = SamplingParams(max_new_tokens=np.int64(3), seed=np.int32(-2))
    assert (p.max_new_tokens, p.seed) == (3, -2) and type(p.max_new_tokens) is int and type(p.seed) is int


def _modes(root):
    out = {".": os.stat(root).st_mode & 0o777}
    out.update({f: os.stat(os.path.join(root, f)).st_mode & 0o777 for f in os.listdir(root)})
    return out


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoint_modes_follow_the_umask(tmp_path, mask):
    """Ray workers on other nodes must read the checkpoint: the directory and every file (the
    safetensors shards and index included) get 0777 / 0666 less the umask, not tempfile's 0700 /
    safetensors' 0600. The demo's cached checkpoint is written the same way."""
    from moe_runtime.models.make_checkpoint import cached_checkpoint
    old = os.umask(mask)
    try:
        sharded = make_checkpoint(str(tmp_path / "sharded"), "mixtral", "tiny", max_shard_size="100KB")
        cached = cached_checkpoint("qwen3-moe", "tiny", cache_dir=str(tmp_path / "cache"))
    finally:
        os.umask(old)
    for d in (sharded, cached):
        modes = _modes(d)
        assert sum(f.endswith(".safetensors") for f in modes) >= 1
        assert modes.pop(".") == 0o777 & ~mask
        assert set(modes.values()) == {0o666 & ~mask}, {f: oct(m) for f, m in modes.items()}
    # an existing copy is used as it is (a user may have made it private on purpose)
    os.chmod(cached, 0o700)
    assert cached_checkpoint("qwen3-moe", "tiny", cache_dir=str(tmp_path / "cache")) == cached
    assert _modes(cached)["."] == 0o700


def test_parse_shard_size():
    from moe_runtime.models.make_checkpoint import parse_shard_size
    assert parse_shard_size("500MB") == 500 * 10 ** 6 and parse_shard_size("2gb") == 2 * 10 ** 9
    assert parse_shard_size("1.5GB") == 1_500_000_000 and parse_shard_size("200KB") == 200_000
    assert parse_shard_size("1000000") == parse_shard_size(1000000) == 10 ** 6
    for bad in ("banana", "5PB", "MB", "", "-5MB", "0", 0, True, "1e3MB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_shard_size(bad)
