"""HF-format checkpoint loading: config.json via transformers, tensors via safetensors' safe_open.

Each rank reads only what it owns: its experts (E / W of them under tp and dp_*), and under tp
only the rows of q/k/v and the columns of o_proj of its attention heads (safetensors slices
read just those bytes). Both expert layouts are accepted:
    per-expert  `model.layers.{i}.{block}.experts.{e}.{gate,up,down}.weight` (what
                transformers 5 save_pretrained writes, and the published Qwen3 / Mixtral
                checkpoints; Mixtral names them w1 / w3 / w2 under `block_sparse_moe`)
    fused       `model.layers.{i}.{block}.experts.gate_up_proj` [E, 2I, H] and
                `...experts.down_proj` [E, H, I] (transformers' in-memory layout)
"""
from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import ExitStack
from dataclasses import replace
from typing import Callable, Optional, Union

import torch

from .spec import Architecture, ModelSpec, eos_ids, rope_parameters
from .transformer import MoECausalLM, Parallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' names of the dtypes read, and their torch names (each converted to the compute
# dtype: a float64 checkpoint computes in float32, resolve_dtype)
_STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointError(ValueError):
    """A checkpoint is unusable: no safetensors, a tensor missing, or a tensor of the wrong shape
    or stored dtype. The message names the tensor and the file (or the files searched)."""


def resolve_dtype(dtype: Union[str, torch.dtype, None], hf_config,
                  model_dir: Optional[str] = None) -> torch.dtype:
    """"auto"/None -> the config's dtype, or where config.json has none the dtype of the first
    floating-point tensor stored in model_dir (HF transformers' "auto"), else float32; float32
    for any other (e.g. float64). A name or a torch.dtype -> itself.

    Raises:
        ValueError: a dtype other than float32, bfloat16, float16.
    """
    if dtype in (None, "auto"):
        d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        d = str(d).replace("torch.", "") if d is not None else (
            model_dir and _first_stored_dtype(model_dir))
        return _DTYPES.get(d, torch.float32)
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def _first_stored_dtype(model_dir: str) -> Optional[str]:
    """The dtype name of the first floating-point tensor of the checkpoint's first file, or None
    (no weights, or a file this cannot read: loading reports it with its name)."""
    from safetensors import SafetensorError, safe_open
    index = os.path.join(model_dir, INDEX_FILE)
    try:
        with open(index) as f:
            first = min(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        first = SINGLE_FILE
    try:
        with safe_open(os.path.join(model_dir, first), framework="pt") as f:
            return next((_STORED_DTYPES[c] for c in (f.get_slice(k).get_dtype() for k in f.keys())
                         if c in _STORED_DTYPES), None)
    except (OSError, SafetensorError):
        return None


def read_spec(model_dir: str, dtype: Union[str, torch.dtype, None] = None
              ) -> tuple[ModelSpec, Architecture]:
    """Read config.json with transformers' AutoConfig and build the ModelSpec.

    Its eos_token_ids are config.json's followed by generation_config.json's (when that file
    exists; HF generate stops on those too, e.g. Qwen3-Instruct's <|endoftext|> and <|im_end|>).

    Raises:
        FileNotFoundError: no config.json in model_dir.
        ValueError: a config.json transformers cannot read (e.g. a field of the wrong type) or
            whose values the architecture (or its RoPE: `spec.rope_parameters`) refuses (named
            with the file), unsupported model_type or dtype, an unreadable
            generation_config.json, or a quantized checkpoint (config.json has a
            `quantization_config`: FP8, GPTQ, AWQ, ...; only float32 / bfloat16 / float16 /
            float64 weights are read).
    """
    from transformers import AutoConfig

    from . import get_architecture
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF-format checkpoint)")
    try:  # (a model_type that transformers does not know either gets this project's list)
        with open(path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None  # (AutoConfig reports an unreadable file)
    if isinstance(model_type, str):
        get_architecture(model_type)
    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except (ImportError, OSError):
        raise
    except Exception as e:  # e.g. a field of the wrong type (huggingface_hub's strict checks)
        raise ValueError(f"{model_dir}/config.json: {type(e).__name__}: {e}") from e
    quant = getattr(cfg, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise ValueError(f"{model_dir}: quantized checkpoints are not supported (quantization_config, "
                         f"quant_method {method!r}); use a float32, bfloat16, float16 or float64 "
                         "checkpoint")
    arch = get_architecture(cfg.model_type)
    compute = resolve_dtype(dtype, cfg, model_dir)  # (a bad `dtype` argument is the caller's)
    try:
        spec = arch.spec_from_config(cfg, compute)
        rope_parameters(cfg, spec.rotary_dim or spec.head_dim)  # (the ranks compute it again)
    except (TypeError, ValueError) as e:  # e.g. num_experts not divisible by n_group, longrope
        raise ValueError(f"{model_dir}/config.json: {e}") from e
    except Exception as e:  # (transformers' RoPE functions on parameters they cannot use)
        raise ValueError(f"{model_dir}/config.json: {type(e).__name__}: {e}") from e
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        from transformers import GenerationConfig
        try:
            more = eos_ids(GenerationConfig.from_pretrained(model_dir).eos_token_id)
        except (OSError, TypeError, ValueError) as e:  # e.g. an eos_token_id that is not an int
            raise ValueError(f"{model_dir}/generation_config.json: {type(e).__name__}: {e}") from e
        spec = replace(spec, eos_token_ids=tuple(dict.fromkeys(spec.eos_token_ids + more)))
    return spec, arch


class CheckpointReader:
    """Reads (slices of) tensors from a single-file or sharded safetensors checkpoint.

    Args:
        model_dir: holds model.safetensors, or model.safetensors.index.json and its shards.

    Attributes:
        weight_map: {tensor name: file} of the whole checkpoint.
        read_keys: the tensor names `read` was asked for so far.

    Raises:
        CheckpointError: neither file exists, the index is not a JSON object with a
            `weight_map`, or it names a shard that is missing.
    """

    def __init__(self, model_dir: str):
        from safetensors import safe_open
        self._safe_open = safe_open
        self.model_dir = model_dir
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._keys: dict[str, set[str]] = {}  # the tensor names in each opened file
        index = os.path.join(model_dir, INDEX_FILE)
        single = os.path.join(model_dir, SINGLE_FILE)
        self.read_keys: set[str] = set()  # every key `read` was asked for
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map: dict[str, str] = json.load(f)["weight_map"]
                if not isinstance(self.weight_map, dict):
                    raise TypeError(f"weight_map is a {type(self.weight_map).__name__}")
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a "
                                      f"'weight_map' of tensor name -> shard file): "
                                      f"{type(e).__name__}: {e}") from e
            for fname in sorted(set(self.weight_map.values())):
                if not os.path.isfile(os.path.join(model_dir, fname)):
                    raise CheckpointError(f"{index} names shard {fname!r}, which is missing")
        elif os.path.isfile(single):
            self.weight_map = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()
        self._keys.clear()

    def _open(self, fname: str):
        if fname not in self._handles:
            path = os.path.join(self.model_dir, fname)
            try:
                handle = self._safe_open(path, framework="pt")
            except Exception as e:  # safetensors' own errors do not name the file
                raise CheckpointError(f"{path}: not a readable safetensors file "
                                      f"({type(e).__name__}: {e})") from e
            self._handles[fname] = self._stack.enter_context(handle)
            self._keys[fname] = set(handle.keys())
        return self._handles[fname]

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def stored(self, key: str) -> bool:
        """Whether the shard the index names for `key` holds it (a stale index may name
        tensors its shards lack)."""
        fname = self.weight_map[key]
        self._open(fname)
        return key in self._keys[fname]

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of tensor `key` (read from its file's header); `stored(key)` first."""
        return tuple(self._open(self.weight_map[key]).get_slice(key).get_shape())

    def read(self, key: str, shape: tuple[int, ...], *, dim: int = 0,
             start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Tensor `key`, checked to have the full `shape`, sliced to [start, stop) along `dim`.

        Returns:
            a CPU tensor in the checkpoint's dtype (only the slice is read from disk).

        Raises:
            CheckpointError: the tensor is missing (names the files searched) or not in the
                shard the index names for it (names the shard), or its shape in
                the file differs from `shape` or it is stored in a dtype other than F32, BF16,
                F16, F64 (e.g. FP8 or int quantized weights; names the tensor, the file and the
                dtype).
        """
        if key not in self.weight_map:
            files = sorted(set(self.weight_map.values()))
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint in "
                                  f"{self.model_dir} (searched {', '.join(files)})")
        fname = self.weight_map[key]
        self.read_keys.add(key)
        handle = self._open(fname)
        if key not in self._keys[fname]:
            raise CheckpointError(f"tensor {key!r} is not in {os.path.join(self.model_dir, fname)}, "
                                  f"the shard {INDEX_FILE} names for it")
        sl = handle.get_slice(key)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"tensor {key!r} in {os.path.join(self.model_dir, fname)} has "
                                  f"shape {list(got)}, expected {list(shape)}")
        if sl.get_dtype() not in _STORED_DTYPES:
            raise CheckpointError(f"tensor {key!r} in {os.path.join(self.model_dir, fname)} is stored "
                                  f"as {sl.get_dtype()}; only {', '.join(_STORED_DTYPES)} are read "
                                  "(quantized and integer weights are not)")
        if start is None:
            return sl[:]
        index = (slice(None),) * dim + (slice(start, stop),)
        return sl[index]


def _tensor_loaders(model: MoECausalLM, arch: Architecture, reader: CheckpointReader
                    ) -> dict[str, Callable[[], torch.Tensor]]:
    """For every parameter of `model` (this rank's shapes), a function reading it."""
    spec, sh = model.spec, model.shard
    H, D, V = spec.hidden_size, spec.head_dim, spec.vocab_size
    Hq, Hkv, E, I = spec.num_heads, spec.num_kv_heads, spec.moe.num_experts, spec.moe.moe_intermediate_size
    q_rows = (sh.q_start * D, (sh.q_start + sh.q_heads) * D)
    kv_rows = (sh.kv_start * D, (sh.kv_start + sh.kv_heads) * D)
    full = {  # suffix -> (full shape, dim, (start, stop) or None)
        "self_attn.q_proj.weight": ((Hq * D, H), 0, q_rows),
        "self_attn.q_proj.bias": ((Hq * D,), 0, q_rows),
        "self_attn.k_proj.weight": ((Hkv * D, H), 0, kv_rows),
        "self_attn.k_proj.bias": ((Hkv * D,), 0, kv_rows),
        "self_attn.v_proj.weight": ((Hkv * D, H), 0, kv_rows),
        "self_attn.v_proj.bias": ((Hkv * D,), 0, kv_rows),
        "self_attn.o_proj.weight": ((H, Hq * D), 1, q_rows),
        "self_attn.o_proj.bias": ((H,), 0, None),
        "self_attn.q_norm.weight": ((Hq * D if spec.qk_norm_whole else D,), 0, None),
        "self_attn.k_norm.weight": ((Hkv * D if spec.qk_norm_whole else D,), 0, None),
        "input_layernorm.weight": ((H,), 0, None),
        "post_attention_layernorm.weight": ((H,), 0, None),
        "mlp.gate_proj.weight": ((spec.dense_intermediate_size, H), 0, None),
        "mlp.up_proj.weight": ((spec.dense_intermediate_size, H), 0, None),
        "mlp.down_proj.weight": ((H, spec.dense_intermediate_size), 0, None),
    }
    if spec.mla is not None:
        full.update(_latent_attention_shapes(spec, sh))
    embed = "model.embed_tokens.weight"
    if spec.tie_word_embeddings and not reader.has(embed) and reader.has("lm_head.weight"):
        embed = "lm_head.weight"  # (tied, stored under the head's name: HF ties them so too)
    top = {"embed_tokens.weight": (embed, (V, H)),
           "norm.weight": ("model.norm.weight", (H,)), "lm_head.weight": ("lm_head.weight", (V, H))}

    def plain(key, shape, dim=0, rng=None):
        return lambda: reader.read(key, shape, dim=dim, start=rng and rng[0], stop=rng and rng[1])

    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    for name in model.state_dict():
        if name in top:
            loaders[name] = plain(*top[name])
            continue
        _, idx, suffix = name.split(".", 2)
        if suffix in full:
            shape, dim, rng = full[suffix]
            loaders[name] = plain(f"model.layers.{idx}.{suffix}", shape, dim, rng)
            continue
        layer = model.layers[int(idx)].mlp
        block = next((b for b in arch.moe_block_names
                      if reader.has(f"model.layers.{idx}.{b}.gate.weight")), arch.moe_block_names[0])
        prefix = f"model.layers.{idx}.{block}"
        experts = layer.local_expert_range
        fused = reader.has(f"{prefix}.experts.gate_up_proj")
        gate, up, down = arch.expert_proj_names
        shared = spec.moe.shared_expert_intermediate_size
        if suffix == "mlp.router.weight":
            loaders[name] = plain(f"{prefix}.gate.weight", (E, H))
        elif suffix == "mlp.router.e_score_correction_bias":
            loaders[name] = plain(f"{prefix}.gate.e_score_correction_bias", (E,))
        elif suffix == "mlp.shared_expert.gate.weight":  # (Qwen2-MoE's sigmoid gate)
            loaders[name] = plain(f"{prefix}.shared_expert_gate.weight", (1, H))
        elif suffix.startswith("mlp.shared_expert.") and arch.shared_expert_name:
            proj = suffix.split(".")[2]  # gate_proj / up_proj / down_proj
            loaders[name] = plain(f"{prefix}.{arch.shared_expert_name}.{proj}.weight",
                                  (H, shared) if proj == "down_proj" else (shared, H))
        elif fused:
            shape = {"mlp.experts.gate_up_proj": (E, 2 * I, H), "mlp.experts.down_proj": (E, H, I)}[suffix]
            key = f"{prefix}.experts.{suffix.rsplit('.', 1)[1]}"
            loaders[name] = plain(key, shape, 0, (experts.start, experts.stop))
        elif suffix == "mlp.experts.gate_up_proj":
            loaders[name] = lambda p=prefix, r=experts: torch.stack([torch.cat([
                reader.read(f"{p}.experts.{e}.{gate}.weight", (I, H)),
                reader.read(f"{p}.experts.{e}.{up}.weight", (I, H))]) for e in r])
        elif suffix == "mlp.experts.down_proj":
            loaders[name] = lambda p=prefix, r=experts: torch.stack(
                [reader.read(f"{p}.experts.{e}.{down}.weight", (H, I)) for e in r])
        else:
            raise CheckpointError(f"no checkpoint mapping for parameter {name!r}")
    return loaders


def load_model(model_dir: str, parallel: Parallel = Parallel(), *, dtype=None, device="cpu",
               progress: bool = True) -> MoECausalLM:
    """Build this rank's model and fill it with its share of the checkpoint.

    Args:
        model_dir: an HF-format checkpoint (config.json + safetensors).
        parallel: this rank's topology, rank, world size and process group (torch.distributed
            must be initialized for world size > 1: MoE layers build their topology here).
        dtype: "auto"/None (config dtype), or float32 / bfloat16 / float16.
        device: where the parameters go.
        progress: show a tqdm bar (one step per tensor).

    Returns:
        MoECausalLM in inference mode (no grads), RoPE buffers initialized.

    Warns (UserWarning, as HF transformers' from_pretrained logs them): on rank 0, checkpoint
    tensors no rank uses (e.g. more layers than config.json's num_hidden_layers); and, when
    config.json ties the embeddings but the checkpoint's lm_head.weight differs from them, that
    lm_head.weight is used untied (HF's rule).

    Raises:
        CheckpointError: missing tensor, shape mismatch or a stored dtype other than F32 / BF16 /
            F16 / F64 (names the tensor and the file).
        ValueError: unsupported model_type / dtype, a quantized checkpoint
            (`quantization_config`), heads/experts not divisible for the world, or a
            world size > 1 whose process group does not match (`MoECausalLM`).
        TypeError: `parallel` is not a Parallel (dtype and device are keyword-only).
    """
    from tqdm.auto import tqdm

    if not isinstance(parallel, Parallel):
        raise TypeError(f"parallel must be a moe_runtime.models.Parallel, got "
                        f"{type(parallel).__name__} {parallel!r} (dtype= and device= are "
                        f"keyword-only)")

    spec, arch = read_spec(model_dir, dtype)
    state = {}
    with CheckpointReader(model_dir) as reader:
        spec = _untie_if_lm_head_differs(spec, reader)
        with torch.device("meta"):
            model = MoECausalLM(spec, parallel)
        loaders = _tensor_loaders(model, arch, reader)
        desc = f"rank {parallel.rank}: loading {os.path.basename(os.path.normpath(model_dir))}"
        for name, load in tqdm(loaders.items(), desc=desc, unit="tensor", disable=not progress):
            state[name] = load().to(device=device, dtype=_param_dtype(name, spec, arch))
        if parallel.rank == 0:
            _warn_unused(reader, spec, arch)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers()
    return model.eval()


def _latent_attention_shapes(spec: ModelSpec, sh) -> dict:
    """`_tensor_loaders`' entries of MLA's attention (transformer.LatentAttention): the per-head
    projections sliced to this rank's heads, the latent ones whole."""
    m, H = spec.mla, spec.hidden_size
    Hq, Dk, Dkv = spec.num_heads, spec.head_dim, m.qk_nope_head_dim + m.v_head_dim
    heads = (sh.q_start, sh.q_start + sh.q_heads)
    rows = lambda width: (heads[0] * width, heads[1] * width)  # noqa: E731
    out = {"self_attn.kv_a_proj_with_mqa.weight": ((m.kv_lora_rank + m.qk_rope_head_dim, H), 0, None),
           "self_attn.kv_a_proj_with_mqa.bias": ((m.kv_lora_rank + m.qk_rope_head_dim,), 0, None),
           "self_attn.kv_a_layernorm.weight": ((m.kv_lora_rank,), 0, None),
           "self_attn.kv_b_proj.weight": ((Hq * Dkv, m.kv_lora_rank), 0, rows(Dkv)),
           "self_attn.o_proj.weight": ((H, Hq * m.v_head_dim), 1, rows(m.v_head_dim))}
    if m.q_lora_rank:
        out.update({"self_attn.q_a_proj.weight": ((m.q_lora_rank, H), 0, None),
                    "self_attn.q_a_proj.bias": ((m.q_lora_rank,), 0, None),
                    "self_attn.q_a_layernorm.weight": ((m.q_lora_rank,), 0, None),
                    "self_attn.q_b_proj.weight": ((Hq * Dk, m.q_lora_rank), 0, rows(Dk))})
    return out


def _param_dtype(name: str, spec: ModelSpec, arch: Architecture) -> torch.dtype:
    """The model's dtype, except float32 for the routers' correction bias, and for the router
    weight where HF keeps it so (Architecture.router_fp32)."""
    if name.endswith("mlp.router.e_score_correction_bias") or (
            arch.router_fp32 and name.endswith("mlp.router.weight")):
        return torch.float32
    return spec.dtype


def _untie_if_lm_head_differs(spec: ModelSpec, reader: CheckpointReader) -> ModelSpec:
    """config.json ties lm_head to embed_tokens but the checkpoint also stores an lm_head.weight
    that differs: use it untied, with a warning (what HF transformers' from_pretrained does)."""
    if not (spec.tie_word_embeddings and reader.has("lm_head.weight")
            and reader.has("model.embed_tokens.weight")):  # (one only: tied, _tensor_loaders)
        return spec
    shape = (spec.vocab_size, spec.hidden_size)
    if torch.equal(reader.read("lm_head.weight", shape), reader.read("model.embed_tokens.weight", shape)):
        return spec
    warnings.warn(f"{reader.model_dir}: config.json has tie_word_embeddings=true, but the "
                  f"checkpoint's lm_head.weight differs from model.embed_tokens.weight: they are "
                  f"not tied and lm_head.weight is used (as HF transformers does)", stacklevel=3)
    return replace(spec, tie_word_embeddings=False)


def _warn_unused(reader: CheckpointReader, spec: ModelSpec, arch: Architecture) -> None:
    """Warn (rank 0) about checkpoint tensors no rank reads: keys that are neither read here nor
    another rank's experts (per-expert keys of an existing layer and expert) nor empty nor the
    gate of a 0-wide shared expert (Qwen2-MoE: HF saves it; its output is 0), e.g. the layers of
    a checkpoint with more layers than config.json's num_hidden_layers (GLM-4-MoE's
    multi-token-prediction layers); and about tensors the index names but no shard holds."""
    pattern = re.compile(r"model\.layers\.(\d+)\.(?:%s)\.experts\.(\d+)\."
                         % "|".join(map(re.escape, arch.moe_block_names)))

    def other_ranks(key: str) -> bool:
        m = pattern.match(key)
        return m is not None and int(m[1]) < spec.num_layers and int(m[2]) < spec.moe.num_experts

    no_shared = spec.moe.shared_expert_intermediate_size == 0
    candidates = [k for k in reader.weight_map if k not in reader.read_keys and not other_ranks(k)]
    absent = sorted(k for k in candidates if not reader.stored(k))
    if absent:
        warnings.warn(f"{reader.model_dir}: {INDEX_FILE} names {len(absent)} tensor(s) that its "
                      f"shards do not hold, none used by the model: {', '.join(absent[:8])}"
                      + (f" and {len(absent) - 8} more" if len(absent) > 8 else ""), stacklevel=3)
    unused = sorted(k for k in candidates if k not in absent
                    and 0 not in reader.shape(k)  # (empty: e.g. HF's 0-wide shared expert)
                    and not (no_shared and k.endswith(".shared_expert_gate.weight")))
    if unused:
        more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
        warnings.warn(f"{reader.model_dir}: {len(unused)} checkpoint tensor(s) are not used by "
                      f"the model config.json describes: {', '.join(unused[:8])}{more}",
                      stacklevel=3)
