"""swap_moe_layers against HF transformers 5.x on tiny random fp32 models (CPU).

The HF originals run their eager experts path (`experts_implementation="eager"`) and eager
attention; each model is compared with itself before and after the in-place swap.
"""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import transformers as tf
from hypothesis import given, settings, strategies as st
from torch import nn

from moe_runtime import MoEConfig, MoELayer, swap_moe_layers
from moe_runtime.hf_swap import FAMILIES
from moe_runtime.routing import Router
from moe_runtime.topologies import LocalTopology, Topology

EAGER = dict(experts_implementation="eager", attn_implementation="eager")
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, initializer_range=0.1, **EAGER)
DSV3_ATTN = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                 v_head_dim=8, num_key_value_heads=2)

# family id -> (config class, model class, tiny settings, HF block class)
MODELS = {
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                       num_experts_per_tok=2)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                       num_experts_per_tok=3, shared_expert_intermediate_size=24)),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
              dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                         n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3,
                         **DSV3_ATTN)),
}
CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False), ("qwen2_moe", True),
         ("mixtral", None), ("olmoe", False), ("olmoe", True), ("deepseek_v3", True),
         ("deepseek_v3", False)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    names = {f.block for f in FAMILIES}
    return [m for m in model.modules() if type(m).__name__ in names]


def randomize_bias(model: nn.Module, seed: int) -> None:
    """DeepSeek-V3 initializes e_score_correction_bias to 0; give it random values of both signs
    (a negative biased score is where a 0.0 group mask and HF's -inf differ)."""
    g = torch.Generator().manual_seed(seed)
    for block in hf_blocks(model):
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.5)


def tiny_model(family: str, norm_topk_prob=None, seed: int = 0, **over):
    cfg_cls, model_cls, extra = MODELS[family]
    kw = {**COMMON, **extra, **over}
    if norm_topk_prob is not None:
        kw["norm_topk_prob"] = norm_topk_prob
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    randomize_bias(model, seed)
    return model


def tensor_ptrs(module: nn.Module) -> set[int]:
    return {t.data_ptr() for t in (*module.parameters(), *module.buffers())}


def moe_tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of an HF block that the swap must share, keyed by our MoELayer's names."""
    out = {"router.weight": block.gate.weight, "experts.gate_up_proj": block.experts.gate_up_proj,
           "experts.down_proj": block.experts.down_proj}
    if hasattr(block.gate, "e_score_correction_bias"):
        out["router.e_score_correction_bias"] = block.gate.e_score_correction_bias
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if mlp is not None:
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_expert.{n}.weight"] = getattr(mlp, n).weight
    if hasattr(block, "shared_expert_gate"):
        out["shared_expert.gate.weight"] = block.shared_expert_gate.weight
    return out


@pytest.mark.parametrize("family,norm", CASES)
def test_logits_match_and_weights_shared(family, norm):
    model = tiny_model(family, norm)
    blocks = hf_blocks(model)
    assert len(blocks) == 2
    expected = [moe_tensors(b) for b in blocks]
    before = tensor_ptrs(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        assert swap_moe_layers(model) is model
        out = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and not hf_blocks(model)
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    # Shared storage: every HF tensor is the replacement's tensor, and the model gained no tensor.
    assert tensor_ptrs(model) == before
    for layer, hf in zip(layers, expected):
        ours = dict((*layer.named_parameters(), *layer.named_buffers()))
        assert set(ours) == set(hf)
        for name, t in hf.items():
            assert ours[name].data_ptr() == t.data_ptr() and ours[name].shape == t.shape, name


# every supported block -> (model directory, its config class); a family added to FAMILIES without
# an entry here fails test_every_family_block_matches_hf
BLOCK_CONFIGS = {
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "Qwen3MoeConfig"),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "Qwen2MoeConfig"),
    "MixtralSparseMoeBlock": ("mixtral", "MixtralConfig"),
    "OlmoeSparseMoeBlock": ("olmoe", "OlmoeConfig"),
    "DeepseekV3MoE": ("deepseek_v3", "DeepseekV3Config"),
    "DeepseekV32MoE": ("deepseek_v32", "DeepseekV32Config"),
    "Glm4MoeMoE": ("glm4_moe", "Glm4MoeConfig"),
    "Glm4vMoeTextMoE": ("glm4v_moe", "Glm4vMoeTextConfig"),
    "Glm4MoeLiteMoE": ("glm4_moe_lite", "Glm4MoeLiteConfig"),
    "GlmMoeDsaMoE": ("glm_moe_dsa", "GlmMoeDsaConfig"),
    "KimiLinearMoE": ("kimi_linear", "KimiLinearConfig"),
    "Dots1MoE": ("dots1", "Dots1Config"),
    "SolarOpenMoE": ("solar_open", "SolarOpenConfig"),
    "BailingHybridMoE": ("bailing_hybrid", "BailingHybridConfig"),
    "Qwen3NextSparseMoeBlock": ("qwen3_next", "Qwen3NextConfig"),
    "Qwen4ExpTextSparseMoeBlock": ("qwen4_exp", "Qwen4ExpTextConfig"),
    "Qwen3_5MoeSparseMoeBlock": ("qwen3_5_moe", "Qwen3_5MoeTextConfig"),
    # (a released talker's config.json carries shared_expert_intermediate_size, the class not)
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig",
                                             dict(shared_expert_intermediate_size=24)),
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": ("qwen3_omni_moe", "Qwen3OmniMoeTextConfig"),
    "MellumSparseMoeBlock": ("mellum", "MellumConfig"),
    "Qwen3VLMoeTextSparseMoeBlock": ("qwen3_vl_moe", "Qwen3VLMoeTextConfig"),
    "FlexOlmoSparseMoeBlock": ("flex_olmo", "FlexOlmoConfig"),
    "MiniMaxSparseMoeBlock": ("minimax", "MiniMaxConfig"),
}
# tiny sizes, set where the config has the attribute (its aliases included)
BLOCK_SIZES = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                   n_routed_experts=8, num_local_experts=8, num_experts_per_tok=3, n_group=4,
                   topk_group=2, n_shared_experts=2, shared_expert_intermediate_size=24,
                   routed_scaling_factor=2.5)
BLOCK_CASES = [(f.block, norm) for f in FAMILIES
               for norm in ((False, True) if f.norm_topk_prob is None else (None,))]


@pytest.mark.parametrize("block_name,norm", BLOCK_CASES)
def test_every_family_block_matches_hf(block_name, norm):
    """Each supported block, built from its own config with random weights (and a random
    correction bias), against the swapped MoELayer on the same input, sharing its tensors."""
    model_dir, config_name, *extra = BLOCK_CONFIGS[block_name]
    where = f"transformers.models.{model_dir}"
    modeling = pytest.importorskip(f"{where}.modeling_{model_dir}",
                                   reason=f"{where} is not in this transformers version")
    cfg = getattr(importlib.import_module(f"{where}.configuration_{model_dir}"), config_name)(
        **(extra[0] if extra else {}))
    for name, value in {**BLOCK_SIZES, **({} if norm is None else {"norm_topk_prob": norm})}.items():
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    block = _build_block(getattr(modeling, block_name), cfg)
    g = torch.Generator().manual_seed(len(block_name))
    with torch.no_grad():
        for t in (*block.parameters(), *block.buffers()):
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        x = torch.randn(2, 7, 32, generator=g)
        ref = block(x)
        before = tensor_ptrs(block)
        layer = swap_moe_layers(block)
        out = layer(x)
    assert isinstance(layer, MoELayer) and tensor_ptrs(layer) == before
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    if norm is not None:
        assert layer.config.norm_topk_prob is norm


def _build_block(cls, cfg) -> torch.nn.Module:
    """An HF block from its config (Bailing-Hybrid's takes a layer_idx since transformers 5.25)."""
    import inspect
    takes_layer = "layer_idx" in inspect.signature(cls.__init__).parameters
    return (cls(cfg, 0) if takes_layer else cls(cfg)).eval()


def test_a_clipped_swiglu_is_refused():
    """transformers 5.25's Bailing-Hybrid clips the experts' and the shared expert's SwiGLU
    where the config sets per-layer swiglu_limits; the swap must refuse, not drop the clip."""
    modeling = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
    cfg = BailingHybridConfig()
    for name, value in BLOCK_SIZES.items():
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    if not hasattr(cfg, "swiglu_limits"):
        pytest.skip("this transformers' Bailing-Hybrid does not clip")
    for limits in ("swiglu_limits", "swiglu_limits_shared"):
        setattr(cfg, "swiglu_limits", [0.0] * cfg.num_hidden_layers)
        setattr(cfg, "swiglu_limits_shared", [0.0] * cfg.num_hidden_layers)
        setattr(cfg, limits, [7.0] * cfg.num_hidden_layers)
        block = _build_block(modeling.BailingHybridMoE, cfg)
        with pytest.raises(ValueError, match=r"clip the SwiGLU at 7\.0"):
            swap_moe_layers(block)
    setattr(cfg, "swiglu_limits", [0.0] * cfg.num_hidden_layers)
    setattr(cfg, "swiglu_limits_shared", [0.0] * cfg.num_hidden_layers)
    assert isinstance(swap_moe_layers(_build_block(modeling.BailingHybridMoE, cfg)), MoELayer)


def test_every_supported_block_has_a_test_config():
    assert set(BLOCK_CONFIGS) == {f.block for f in FAMILIES}


def test_moe_config_per_family():
    """The MoEConfig read from each block carries its family's routing rules."""
    got = {}
    for family in MODELS:
        model = tiny_model(family, **({} if family == "mixtral" else {"norm_topk_prob": False}))
        got[family] = next(m for m in swap_moe_layers(model).modules() if isinstance(m, MoELayer)).config
    q2, ds, mx = got["qwen2_moe"], got["deepseek_v3"], got["mixtral"]
    assert (q2.shared_expert_intermediate_size, q2.shared_expert_gate, q2.top_k) == (24, True, 3)
    assert (ds.scoring, ds.n_group, ds.topk_group, ds.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (ds.use_correction_bias, ds.router_logits_fp32, ds.shared_expert_intermediate_size) == (True, True, 32)
    assert ds.shared_expert_gate is False and ds.norm_topk_prob is False
    assert mx.norm_topk_prob is True and mx.num_experts == 6 and mx.moe_intermediate_size == 16
    for family in ("qwen3_moe", "olmoe"):
        c = got[family]
        assert (c.scoring, c.norm_topk_prob, c.shared_expert_intermediate_size) == ("softmax", False, 0)
        assert not c.router_logits_fp32 and not c.use_correction_bias
    assert all(c.dtype == torch.float32 for c in got.values())


def test_topology_instance_and_layer_kwargs():
    model = tiny_model("qwen3_moe")
    topo = LocalTopology(8, align=4, backend="reference")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        swap_moe_layers(model, topology=topo, backend="reference")
        out = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert all(l.topology is topo and l.router.backend == "reference" for l in layers)
    assert rel_err(out, ref) <= 1e-5
    with pytest.raises(TypeError, match="device"):
        swap_moe_layers(tiny_model("olmoe"), device="cpu")


def gpt_oss_model():
    """A tiny GPT-OSS: its MoE block (GptOssMLP: biased, clamped SwiGLU experts) is unsupported."""
    return tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, **EAGER))


def test_unsupported_block_raises_naming_supported():
    model = gpt_oss_model()
    with pytest.raises(ValueError, match="GptOssMLP") as e:
        swap_moe_layers(model)
    for fam in FAMILIES:
        assert fam.block in str(e.value)
    jetmoe = tf.JetMoeForCausalLM(tf.JetMoeConfig(  # (its MLP has a router and no experts)
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_local_experts=4,
        num_experts_per_tok=2, kv_channels=8, intermediate_size=16, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"unsupported MoE block\(s\): model.layers.0.mlp "
                                         r"\(\S+JetMoeMoE\), model.layers.0.self_attention "):
        swap_moe_layers(jetmoe)
    with pytest.raises(ValueError, match="no MoE block found.*Qwen3MoeSparseMoeBlock"):
        swap_moe_layers(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="takes a loaded torch.nn.Module .* got str"):
        swap_moe_layers("Qwen/Qwen3-30B-A3B")  # (a model id is not a model)


def test_mixed_model_is_left_untouched_on_error():
    """A supported block next to an unsupported one: nothing is replaced."""
    qwen = tiny_model("qwen3_moe")
    gpt = gpt_oss_model()
    both = nn.ModuleDict({"a": qwen.model.layers[0], "b": gpt.model.layers[0]})
    with pytest.raises(ValueError, match="GptOssMLP"):
        swap_moe_layers(both)
    assert type(both["a"].mlp).__name__ == "Qwen3MoeSparseMoeBlock"


def test_meta_device_model_raises_before_any_swap():
    """A model whose weights are not loaded yet (meta) gets a clear error; nothing is replaced."""
    cfg_cls, model_cls, extra = MODELS["qwen3_moe"]
    with torch.device("meta"):
        model = model_cls(cfg_cls(**{**COMMON, **extra}))
    with pytest.raises(ValueError, match="meta device.*load or materialize"):
        swap_moe_layers(model)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"


def test_non_silu_experts_raise():
    model = tiny_model("olmoe", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"SiLU.*got act_fn GELUActivation$"):
        swap_moe_layers(model)
    assert len(hf_blocks(model)) == 2


def test_a_float64_model_is_refused_naming_the_block_and_the_fix():
    model = tiny_model("qwen3_moe").double()
    with pytest.raises(ValueError, match=r"Qwen3MoeSparseMoeBlock: its experts are torch.float64;"
                                         r".*from_pretrained\(\.\.\., dtype=torch.float32\)"):
        swap_moe_layers(model)
    assert len(hf_blocks(model)) == 2


def test_root_block_and_second_swap():
    model = tiny_model("qwen2_moe")
    block = hf_blocks(model)[0]
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x)
        layer = swap_moe_layers(block)
        out = layer(x)
    assert isinstance(layer, MoELayer) and rel_err(out, ref) <= 1e-5
    swapped = swap_moe_layers(model)
    layers = [m for m in swapped.modules() if isinstance(m, MoELayer)]
    assert swap_moe_layers(swapped) is swapped  # already swapped: nothing to do, no error
    assert [m for m in swapped.modules() if isinstance(m, MoELayer)] == layers


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_cast_after_swap_equals_cast_before(family):
    """A cast after the swap converts the MoE layers too (config.dtype follows their weights):
    the logits equal those of the model cast before the swap."""
    base = tiny_model(family)
    after = swap_moe_layers(copy.deepcopy(base)).to(torch.bfloat16)
    before = swap_moe_layers(copy.deepcopy(base).to(torch.bfloat16))
    assert {m.config.dtype for m in after.modules() if isinstance(m, MoELayer)} == {torch.bfloat16}
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(after(ids).logits, before(ids).logits)


# ---- property tests over block configurations --------------------------------------------------

def _init_block(block: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.5)


def _check_block(block: nn.Module, hidden: int, seed: int) -> None:
    _init_block(block, seed)
    block.eval()
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref = block(x)
        out = swap_moe_layers(block)(x)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)


@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(4, 48), E=st.integers(1, 12), data=st.data(), inter=st.integers(1, 24),
       norm=st.booleans(), seed=st.integers(0, 2**16))
def test_property_qwen3_block(hidden, E, data, inter, norm, seed):
    k = data.draw(st.integers(1, E), label="top_k")
    cfg = tf.Qwen3MoeConfig(hidden_size=hidden, num_experts=E, num_experts_per_tok=k,
                            moe_intermediate_size=inter, norm_topk_prob=norm, **EAGER)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    _check_block(Qwen3MoeSparseMoeBlock(cfg), hidden, seed)


@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(4, 48), n_group=st.integers(1, 4), group_size=st.integers(2, 4),
       data=st.data(), inter=st.integers(1, 16), n_shared=st.integers(1, 2), norm=st.booleans(),
       scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2**16))
def test_property_deepseek_v3_block(hidden, n_group, group_size, data, inter, n_shared, norm, scale, seed):
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    k = data.draw(st.integers(1, topk_group * group_size), label="top_k")
    cfg = tf.DeepseekV3Config(hidden_size=hidden, n_routed_experts=n_group * group_size,
                              num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                              moe_intermediate_size=inter, n_shared_experts=n_shared,
                              norm_topk_prob=norm, routed_scaling_factor=scale, **EAGER)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    _check_block(DeepseekV3MoE(cfg), hidden, seed)


# ---- routing against HF's routers on random logits ---------------------------------------------

def _compare_routing(hf_router: nn.Module, moe_cfg, logits: torch.Tensor, bias=None) -> None:
    """HF router and ours on the same logits: identity router weights make x the logits."""
    E = logits.shape[1]
    with torch.no_grad():
        hf_router.weight.copy_(torch.eye(E))
        ours = Router(moe_cfg, backend="reference")
        ours.weight.copy_(torch.eye(E))
        if bias is not None:
            hf_router.e_score_correction_bias.copy_(bias)
            ours.e_score_correction_bias.copy_(bias)
        _, hf_w, hf_ids = hf_router(logits)
        ids, w = ours(logits)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    for t in range(logits.shape[0]):
        assert set(ids[t].tolist()) == set(hf_ids[t].tolist()), t
    # weights compared expert by expert (HF's sigmoid router returns ids unsorted)
    ours_sorted = w.gather(1, ids.long().argsort(1))
    hf_sorted = hf_w.float().gather(1, hf_ids.argsort(1))
    torch.testing.assert_close(ours_sorted, hf_sorted, atol=1e-6, rtol=0)


@pytest.mark.parametrize("E,k", [(8, 1), (8, 3), (8, 8), (1, 1), (13, 5)])
@pytest.mark.parametrize("norm", [False, True])
def test_softmax_routing_matches_hf(E, k, norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    hf = Qwen3MoeTopKRouter(tf.Qwen3MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=k,
                                              norm_topk_prob=norm))
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(E * 10 + k)) * 3
    cfg = MoEConfig(hidden_size=E, num_experts=E, top_k=k, moe_intermediate_size=1,
                    norm_topk_prob=norm, dtype=torch.float32)
    _compare_routing(hf, cfg, logits)


@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (8, 8)])
def test_mixtral_routing_matches_hf(E, k):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    hf = MixtralTopKRouter(tf.MixtralConfig(hidden_size=E, num_local_experts=E, num_experts_per_tok=k))
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(k)) * 3
    cfg = MoEConfig(hidden_size=E, num_experts=E, top_k=k, moe_intermediate_size=1, dtype=torch.float32)
    _compare_routing(hf, cfg, logits)


@pytest.mark.parametrize("E,k,n_group,topk_group", [
    (8, 1, 1, 1), (8, 8, 1, 1), (8, 2, 4, 2), (8, 4, 4, 2), (8, 8, 4, 4), (16, 1, 4, 1),
    (16, 6, 8, 3), (12, 12, 3, 3)])
@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0)])
def test_deepseek_v3_routing_matches_hf(E, k, n_group, topk_group, norm, scale):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    hf = DeepseekV3TopkRouter(tf.DeepseekV3Config(
        hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale))
    g = torch.Generator().manual_seed(E + k + n_group)
    logits = torch.randn(64, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5
    cfg = MoEConfig(hidden_size=E, num_experts=E, top_k=k, moe_intermediate_size=1, scoring="sigmoid",
                    norm_topk_prob=norm, n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=scale, use_correction_bias=True, router_logits_fp32=True,
                    dtype=torch.float32)
    _compare_routing(hf, cfg, logits, bias)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_a_nan_router_weight_reaches_the_output_as_in_hf(family):
    """A NaN row in the router weight (a corrupted checkpoint) gives HF a NaN output; DeepSeek-V3's
    sigmoid routing chose around it and returned finite values, hiding it."""
    model = tiny_model(family)
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.gate.weight[3] = float("nan")
        x = torch.randn(1, 4, block.gate.weight.shape[1])
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = swap_moe_layers(copy.deepcopy(block))(x)
    assert torch.isnan(want).all() and torch.isnan(got).all()


def test_deepseek_negative_bias_group_mask():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    hf = DeepseekV3TopkRouter(tf.DeepseekV3Config(hidden_size=4, n_routed_experts=4, num_experts_per_tok=2,
                                                  n_group=2, topk_group=1))
    # group 0 = {0, 1} wins (biased sums ~ -1 vs ~ -5); expert 1's biased score is negative, so HF
    # picks {0, 1} while a 0.0 mask ranks the masked experts 2, 3 above expert 1.
    cfg = MoEConfig(hidden_size=4, num_experts=4, top_k=2, moe_intermediate_size=1, scoring="sigmoid",
                    n_group=2, topk_group=1, routed_scaling_factor=2.5, use_correction_bias=True,
                    router_logits_fp32=True, dtype=torch.float32)
    _compare_routing(hf, cfg, torch.zeros(3, 4), torch.tensor([0.0, -2.0, -3.0, -3.0]))


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_bf16_model(family):
    """bf16 end to end; HF rounds routing weights to bf16 and sums experts in bf16, we sum in fp32,
    so the two agree to bf16 rounding (measured ~5e-3), not to 1e-5."""
    model = tiny_model(family, True).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
        out = swap_moe_layers(model)(ids).logits.float()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and all(l.config.dtype == torch.bfloat16 for l in layers)
    assert rel_err(out, ref) <= 2e-2, rel_err(out, ref)


class _HalfOfTheExperts(LocalTopology):
    """Rank 1 of 2 for the bookkeeping only (construction; never dispatches)."""

    def __init__(self, num_experts):
        super().__init__(num_experts)
        Topology.__init__(self, num_experts, rank=1, world_size=2)


def test_multi_rank_topology_shares_this_ranks_slice():
    model = tiny_model("olmoe")
    hf = [(b.experts.gate_up_proj, b.experts.down_proj) for b in hf_blocks(model)]
    swap_moe_layers(model, topology=_HalfOfTheExperts(8))
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer, (gate_up, down) in zip(layers, hf):
        assert layer.local_expert_range == range(4, 8)
        for ours, theirs in ((layer.experts.gate_up_proj, gate_up), (layer.experts.down_proj, down)):
            assert ours.shape == theirs[4:].shape and ours.data_ptr() == theirs[4].data_ptr()
            assert ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()


def test_multi_rank_state_dict_warns_that_it_holds_one_slice():
    """save_pretrained of a multi-rank swap would write one rank's experts under HF names: the
    state_dict warns, naming the rank's range; a local swap does not warn."""
    model = swap_moe_layers(tiny_model("olmoe"), topology=_HalfOfTheExperts(8))
    with pytest.warns(UserWarning, match=r"rank 1 of 2\) holds only this rank's routed experts "
                                         r"\[4, 8\) of 8"):
        state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap_moe_layers(tiny_model("olmoe")).state_dict()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("hooked_before_swap", [True, False])
def test_router_logits_and_aux_loss(family, hooked_before_swap):
    """output_router_logits=True: the same per-layer router logits and aux loss as HF, whether HF
    installed its recording hooks before the swap (on its routers) or installs them after."""
    model = tiny_model(family, **({} if family == "mixtral" else {"norm_topk_prob": True}))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        if hooked_before_swap:
            ref = model(ids, labels=ids, output_router_logits=True)
        else:
            ref = copy.deepcopy(model)(ids, labels=ids, output_router_logits=True)
            assert not getattr(model, "_output_capturing_hooks_installed", False)
        with warnings.catch_warnings():  # (transformers' own recording hooks: no warning)
            warnings.simplefilter("error")
            swap_moe_layers(model)
        out = model(ids, labels=ids, output_router_logits=True)
        plain = model(ids)
    assert len(ref.router_logits) == len(out.router_logits) == 2
    for a, b in zip(out.router_logits, ref.router_logits):
        assert a.dtype == b.dtype and a.shape == b.shape and rel_err(a, b) <= 1e-5
    if ref.aux_loss is not None:  # DeepSeek-V3's head computes no aux loss
        assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-5 and rel_err(out.loss, ref.loss) <= 1e-5
    assert plain.router_logits is None


def test_hooks_on_replaced_modules_are_named_in_a_warning():
    """Hooks on an HF block or its submodules (here a forward hook on the block, a pre-hook on
    its router, an accelerate-style `_hf_hook`) do not move to the new layer: the swap warns,
    naming where they were; the swapped model still runs."""
    model = tiny_model("qwen3_moe", True)
    seen = []
    blocks = hf_blocks(model)
    blocks[0].register_forward_hook(lambda m, a, o: seen.append(m))
    blocks[1].gate.register_forward_pre_hook(lambda m, a: seen.append(m))
    blocks[1].experts._hf_hook = object()
    with pytest.warns(UserWarning, match=r"hooks on the replaced HF modules are not carried over "
                                         r"\(model\.layers\.0\.mlp, model\.layers\.1\.mlp\.experts, "
                                         r"model\.layers\.1\.mlp\.gate:"):
        swap_moe_layers(model)
    model(torch.randint(0, 64, (1, 4)))
    assert seen == []


def test_a_swapped_model_compiles_whole_with_router_logits():
    """torch.compile(fullgraph=True) of a whole swapped model (the layers' hooks read
    transformers' output recording, traceable inside the model's compiled forward): the eager
    swapped model's loss, router logits and gradients, without dynamo's warnings about
    tracing through a cache."""
    model = tiny_model("qwen2_moe", norm_topk_prob=True).train()
    swap_moe_layers(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    ref, ref_g = step(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, out_g = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    # (dynamo warns where it traces through a functools.lru_cache: the package bypasses them)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert rel_err(out.loss, ref.loss) <= 1e-5 and rel_err(out.aux_loss, ref.aux_loss) <= 1e-5
    assert len(out.router_logits) == len(ref.router_logits) == 2
    for a, b in zip(out.router_logits, ref.router_logits):
        assert rel_err(a, b) <= 1e-5
    assert ref_g.keys() == out_g.keys() and any("experts" in n for n in ref_g)
    for n, g in ref_g.items():
        assert rel_err(out_g[n], g) <= 1e-4, n


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_router_logits_under_gradient_checkpointing(family):
    """Training with activation checkpointing (transformers' default, non-reentrant) and
    output_router_logits=True: the recomputation in backward saves the same tensors as the
    forward (the recorded logits are the router's own, not a second GEMM that only the recorded
    pass runs); loss and gradients equal HF's."""
    model = tiny_model(family, True).train()
    ref = copy.deepcopy(model)
    swap_moe_layers(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    losses = []
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        out = m(ids, labels=ids, output_router_logits=True)
        (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
        losses.append(out.loss)
    assert rel_err(losses[0], losses[1]) <= 1e-5
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.shape == b.shape and (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert rel_err(a.grad, b.grad) <= 1e-4


def test_router_logits_recording_leaves_nothing_behind(monkeypatch):
    """A layer that raises after its router ran (here in the experts) keeps nothing (its forward
    hook runs anyway and clears it), and the next recording call records its own logits; calls
    that record nothing keep nothing and do not invalidate the layers' cached walks (a bump of
    structure_version per call would redo them on every call)."""
    from moe_runtime.param_checks import structure_version
    model = swap_moe_layers(tiny_model("qwen3_moe", True))
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
        with monkeypatch.context() as m:
            m.setattr(type(layer.experts), "forward", lambda *a, **k: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                model(ids, output_router_logits=True)
        assert layer.router.kept_logits is None
        model(ids)
        version = structure_version[0]
        model(ids)
        out = model(ids, output_router_logits=True).router_logits
        assert structure_version[0] == version and layer.router.kept_logits is None
    assert len(out) == 2 and all(torch.equal(a, b) for a, b in zip(out, ref))


def test_swapped_layers_run_where_transformers_has_no_output_recording(monkeypatch):
    """A transformers without the output-recording context variable (utils.output_capturing):
    the swapped layers' hooks find no collector, keep nothing and the model runs as before."""
    from moe_runtime import hf_swap
    model = swap_moe_layers(tiny_model("qwen3_moe", True))
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(ids).logits
        monkeypatch.setattr(hf_swap, "_output_collector", lambda: None)
        out = model(ids).logits
    assert torch.equal(out, ref) and layer.router.kept_logits is None


def test_router_logits_of_a_replayed_graph_come_from_the_real_rows():
    """A layer that replays a CUDA graph runs no Python inside (its router keeps nothing): the
    recorded logits are then recomputed from the call's real rows (here a CPU stand-in capture
    whose replay hides the router's recording)."""
    model = swap_moe_layers(tiny_model("qwen3_moe", True))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for layer in layers:
            def capture(fn, x_static, router=layer.router):
                out = fn(x_static)

                def replay():
                    kept, router.kept_logits = router.kept_logits, None
                    try:
                        out.copy_(fn(x_static))
                    finally:
                        router.kept_logits = kept
                return replay, out
            layer.enable_cuda_graphs(capture_fn=capture)
        out = model(ids, output_router_logits=True).router_logits
    assert all(layer.cuda_graphs.captured for layer in layers) and len(out) == len(ref) == 2
    assert torch.equal(out[0], ref[0])  # (the next layer's input moves by the padded GEMMs' rounding)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_greedy_generate_unchanged(family):
    """generate() with a KV cache (prefill, then one-token decode steps) picks the same tokens."""
    model = tiny_model(family, True)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        out = swap_moe_layers(model).generate(ids, **kw)
    assert ref.shape == (2, 11) and torch.equal(out, ref)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_forward_mode_ad_matches_hf(family):
    """torch.func.jvp through a swapped block gives HF's tangent (the HF experts' eager loop has
    forward derivatives; the swapped layer takes its own loop under forward AD)."""
    block = hf_blocks(tiny_model(family, True))[-1]
    x, v = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    want = torch.func.jvp(block, (x,), (v,))
    got = torch.func.jvp(swap_moe_layers(copy.deepcopy(block)), (x,), (v,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_deepseek_router_weight_kept_in_fp32_in_a_bf16_model():
    """HF keeps DeepseekV3's gate.weight in fp32 (_keep_in_fp32_modules_strict) when a checkpoint
    is loaded in bf16; the swapped layer must accept that (its router computes in fp32)."""
    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                              moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                              q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8)
    model = tf.DeepseekV3ForCausalLM(cfg).eval().to(torch.bfloat16)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.weight.data = gate.weight.data.float()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = model(ids).logits.float()
        swap_moe_layers(model, backend="reference")
        out = model(ids).logits.float()
    assert (out - ref).abs().max() / ref.abs().max() < 2e-2


@pytest.mark.parametrize("family,over", [("deepseek_v3", {"n_shared_experts": 0}),
                                         ("qwen2_moe", {"shared_expert_intermediate_size": 0})])
def test_zero_width_shared_expert_keeps_hf_keys(family, over):
    """An empty HF shared MLP (width 0; Qwen2-MoE keeps its [1, H] gate) adds zeros: the swap
    keeps it as a zero-width SharedExpert, so state_dicts load strictly both ways."""
    model = tiny_model(family, True, **over)
    plain = copy.deepcopy(model)
    hf_sd = model.state_dict()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(ids).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no zero-element init warnings)
            swap_moe_layers(model)
        out = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2 and all(m.config.shared_expert_intermediate_size == 0 for m in layers)
    assert all(m.shared_expert.down_proj.weight.shape == (32, 0) for m in layers)
    assert rel_err(out, ref) <= 1e-5
    assert list(model.state_dict()) == list(hf_sd)
    model.load_state_dict(hf_sd, strict=True)
    plain.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("family", list(MODELS))
def test_load_state_dict_names_keys_as_the_state_dict_does(family):
    """Strict loading of a swapped model reports HF's key of a missing router weight (it named
    MoELayer's own `router.weight`), and refuses that own name next to HF's as an unexpected
    key (it loaded with "All keys matched" and the value was dropped); alone it loads."""
    model = tiny_model(family)
    swap_moe_layers(model)
    sd = model.state_dict()
    hf, ours = "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.router.weight"
    assert hf in sd and ours not in sd
    missing = {k: v for k, v in sd.items() if k != hf}
    with pytest.raises(RuntimeError, match=f'Missing key\\(s\\) in state_dict: "{hf}"'):
        model.load_state_dict(missing)
    assert model.load_state_dict(missing, strict=False) == ([hf], [])
    before = model.model.layers[1].mlp.router.weight.clone()
    with pytest.raises(RuntimeError, match=f'Unexpected key\\(s\\) in state_dict: "{ours}"'):
        model.load_state_dict({**sd, ours: torch.zeros_like(sd[hf])})
    assert model.load_state_dict({**sd, ours: torch.zeros_like(sd[hf])}, strict=False) == ([], [ours])
    assert torch.equal(model.model.layers[1].mlp.router.weight, before)
    assert model.load_state_dict(sd) == ([], [])
    assert model.load_state_dict({**missing, ours: torch.zeros_like(sd[hf])}) == ([], [])
    assert not model.model.layers[1].mlp.router.weight.any()


@pytest.mark.parametrize("family", list(MODELS))
def test_parameter_and_key_order_kept(family):
    """parameters() and state_dict() list the same tensors in HF's order after the swap (an
    optimizer state_dict saved before it, index-based, resumes on the right tensors)."""
    model = tiny_model(family)
    params, keys = [p.data_ptr() for p in model.parameters()], list(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 64, (2, 5))).logits.square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    swap_moe_layers(model)
    assert [p.data_ptr() for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    model(torch.randint(0, 64, (2, 5))).logits.square().mean().backward()
    resumed.step()  # shapes line up (a mismatch raises inside AdamW)


class _LoraLikeLinear(nn.Linear):
    """A wrapper that adds to nn.Linear's output, as PEFT's LoRA layers do."""

    def forward(self, x):
        return super().forward(x) + 1.0


def test_blocks_with_wrapped_submodules_are_refused():
    """The swap takes plain weights: a block holding an adapter-like subclass of nn.Linear (in
    the shared expert) or another class in place of the experts raises, naming it, and
    nothing is replaced."""
    model = tiny_model("qwen2_moe")
    mlp = hf_blocks(model)[1].shared_expert
    wrapped = _LoraLikeLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    wrapped.weight = mlp.up_proj.weight
    mlp.up_proj = wrapped
    with pytest.raises(ValueError, match=r"shared_expert.up_proj \(.*_LoraLikeLinear\).*merge"):
        swap_moe_layers(model)
    assert len(hf_blocks(model)) == 2
    model = tiny_model("qwen3_moe")
    block = hf_blocks(model)[0]
    block.experts = nn.ModuleDict({"base_layer": block.experts})
    with pytest.raises(ValueError, match=r"experts \(torch.nn.modules.container.ModuleDict\)"):
        swap_moe_layers(model)


def test_router_logits_with_cuda_graphs_match_eager_on_every_call():
    """output_router_logits=True on a swapped model whose layers replay (stand-in) CUDA graphs:
    the logits come from the real rows on every call, the same as eager, and the graphs run."""
    from test_layer_graphs_cpu import address_bound_capture
    model = tiny_model("qwen2_moe", True)
    ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(7))
    kw = dict(labels=ids, output_router_logits=True)
    with torch.no_grad():
        swap_moe_layers(model)
        ref = model(ids, **kw)
        log = []
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            layer.enable_cuda_graphs(capture_fn=address_bound_capture(layer, log))
        outs = [model(ids, **kw) for _ in range(2)]
    assert log == [8, 8]  # T = 6 rows -> bucket 8, captured once per layer, replayed after
    for out in outs:
        assert len(out.router_logits) == 2
        for a, b in zip(out.router_logits, ref.router_logits):
            assert a.shape == b.shape == (6, 8) and rel_err(a, b) <= 1e-6
        assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-5 and rel_err(out.logits, ref.logits) <= 1e-5


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen2_moe", False),
                                         ("mixtral", None), ("olmoe", True), ("deepseek_v3", True)])
def test_state_dict_keeps_hf_names_and_save_pretrained_round_trips(family, norm, tmp_path):
    """After the swap the model's state_dict has exactly the HF keys and tensors, save_pretrained
    writes a checkpoint that HF loads with no missing or unexpected key and the same logits, and
    an HF state_dict loads (strict) into a swapped model."""
    model = tiny_model(family, norm)
    hf_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
        swap_moe_layers(model)
        state = model.state_dict()
        assert sorted(state) == sorted(hf_state)
        assert all(torch.equal(state[k], t) for k, t in hf_state.items())
        model.save_pretrained(tmp_path)
        back, info = type(model).from_pretrained(tmp_path, output_loading_info=True, **EAGER)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert torch.equal(back.eval()(ids).logits, ref)
        other = swap_moe_layers(tiny_model(family, norm, seed=7))
        other.load_state_dict(hf_state)
        assert rel_err(other(ids).logits, ref) <= 1e-5


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_state_dict_keys_are_attribute_paths_and_dcp_round_trips(family):
    """Every state_dict key of a swapped model (HF names) resolves as an attribute path to the
    tensor itself (MoELayer.module_aliases), so torch.distributed.checkpoint's model and
    optimizer state_dict helpers work: a DCP round trip into another swapped model gives the
    same logits."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict)
    model = swap_moe_layers(tiny_model(family, True))
    for key, t in model.state_dict(keep_vars=True).items():
        mod, _, leaf = key.rpartition(".")
        assert getattr(model.get_submodule(mod), leaf) is t, key
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    assert layer.gate is layer.router
    plain = MoELayer(layer.config)
    assert plain.module_aliases == {}
    with pytest.raises(AttributeError):
        plain.gate  # a layer built directly has no HF aliases
    router = copy.deepcopy(layer.router)  # assigning through an alias replaces the target
    layer.gate = router
    assert layer.router is router and "gate" not in layer._modules
    assert layer.state_dict(keep_vars=True)["gate.weight"] is router.weight
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    other = swap_moe_layers(tiny_model(family, True, seed=9))
    with torch.no_grad():
        assert rel_err(other(ids).logits, model(ids).logits) > 1e-3
    set_model_state_dict(other, get_model_state_dict(model))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)
    opt = torch.optim.AdamW(model.parameters())
    model(ids).logits.sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    assert sorted(msd) == sorted(model.state_dict())
    assert len(osd["state"]) == len(list(model.parameters()))


def test_swapped_model_pickles(tmp_path):
    """torch.save / torch.load of a whole swapped model (its state_dict hooks pickle)."""
    model = swap_moe_layers(tiny_model("qwen2_moe", True))
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    assert sorted(back.state_dict()) == sorted(model.state_dict())


def test_mixtral_router_jitter_noise_warns():
    """HF applies Mixtral's router jitter in training; the swap does not, and says so."""
    model = tiny_model("mixtral", router_jitter_noise=0.5)
    with pytest.warns(UserWarning, match=r"router_jitter_noise=0.5 \(Mixtral; .* not applied") as w:
        swap_moe_layers(model)
    assert len(w) == 1 and w[0].filename == __file__  # once, at the caller's line
