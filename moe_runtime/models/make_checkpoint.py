"""Random-weight HF checkpoints for tests and demos, written by transformers' own model classes.

`make_checkpoint(out_dir, arch="qwen3-moe", preset="tiny")` writes config.json,
generation_config.json, safetensors weights (single file, or sharded with
model.safetensors.index.json when `max_shard_size` is given) and a byte-level BPE tokenizer
trained offline with the `tokenizers` library on the built-in text below, saved through
transformers' PreTrainedTokenizerFast so `AutoTokenizer.from_pretrained(out_dir)` loads it.
The directory and its files get the modes a plain mkdir / open would give (0777 / 0666 less the
process umask, typically 0755 / 0644), so Ray workers on other nodes can read a shared copy.

Architectures: qwen3-moe, qwen2-moe (a gated shared expert), olmoe (q/k norms over all heads),
mixtral, glm4-moe (GLM-4.5's structure), dots1 (dots.llm1's), deepseek-v3 (DeepSeek-V3's: MLA);
the routers' correction biases of the last three get random values, as a trained checkpoint's
are nonzero.

Presets:
    tiny            a few hundred KB; the CI numerics tests and `moe-runtime demo` use it.
    small           more heads and experts (32 experts, top-4): about 55 MB of weights in
                    float32 (the default), 28 MB in bfloat16.
    qwen3-30b-a3b   Qwen3-30B-A3B's real shapes (48 layers, 128 experts, top-8). Without
                    `force` only config.json, generation_config.json and the tokenizer are
                    written (enough to read the spec and build the model on the meta
                    device); with `force`, random bfloat16 weights too: about 61 GB on disk
                    and more than that in RAM.
"""
from __future__ import annotations

import contextlib
import operator
import os
import re
import shutil
import tempfile
from typing import Optional, Union

ARCH_NAMES = {"qwen3-moe": "qwen3_moe", "qwen2-moe": "qwen2_moe", "olmoe": "olmoe",
              "mixtral": "mixtral", "glm4-moe": "glm4_moe", "dots1": "dots1",
              "deepseek-v3": "deepseek_v3"}
PRESETS = ("tiny", "small", "qwen3-30b-a3b")
DTYPES = ("float32", "bfloat16", "float16")
EOS_TOKEN = "<|endoftext|>"

TRAINING_TEXT = """\
A mixture of experts model sends every token to a few experts chosen by a router.
Each expert is a small feed forward network, and only the chosen experts run for a token.
The router scores all experts, keeps the top k, and weights their outputs by the scores.
Expert parallelism places different experts on different ranks, so tokens travel between ranks.
Dispatch moves token rows to the ranks that hold their experts; combine brings the results back.
On one node the ranks share NVLink; across nodes they talk over InfiniBand.
Attention mixes information across the positions of a sequence with queries, keys and values.
Grouped query attention lets several query heads share one key and value head.
Rotary position embeddings rotate queries and keys by an angle that grows with the position.
The key value cache keeps past keys and values so that decoding reads them instead of recomputing.
Prefill processes the whole prompt at once; decode produces one new token per step.
Greedy decoding takes the most likely token; sampling draws from the distribution,
often after a temperature and a nucleus of top p probability mass.
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model
that wanted to tell a story about the sea, the mountains, the city and the stars.
Numbers like 1 2 3 4 5 6 7 8 9 10 and words like hello, world, token, expert, rank appear here.
"""


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def parse_shard_size(size: Union[str, int]) -> int:
    """A shard size in bytes: an int, or a number with a unit B, KB, MB, GB or TB (powers of 10,
    as huggingface_hub reads them; any case), e.g. "200KB", "1.5GB", "1000000", "4096B".

    Raises:
        ValueError: anything else, or a size that is not > 0.
    """
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a size such as '500MB', '2GB' or a number of bytes, got {size!r}")
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max_shard_size must be a size such as '500MB', '2GB' or a number of "
                             f"bytes, got {size!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {size!r}")
    return n


def _umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask_modes(root: str) -> None:
    """Give root and everything under it the modes of a plain mkdir / open (0777 / 0666 less the
    umask): tempfile.mkdtemp makes 0700 and safetensors writes its files 0600."""
    mask = _umask()
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def _qwen3_kwargs(preset: str) -> dict:
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    max_position_embeddings=512)
    if preset == "small":
        return dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=32,
                    num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                    max_position_embeddings=2048)
    return dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                "rope_theta": 1000000.0},
                rms_norm_eps=1e-6, vocab_size=151936)


def _qwen2_kwargs(preset: str) -> dict:
    """Qwen1.5-MoE's structure at small sizes: q/k/v biases, a sigmoid-gated shared expert,
    routing weights not renormalized."""
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                    num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=512)
    return dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                shared_expert_intermediate_size=256, num_hidden_layers=4, num_attention_heads=16,
                num_key_value_heads=4, num_experts=32, num_experts_per_tok=4,
                norm_topk_prob=False, max_position_embeddings=2048)


def _olmoe_kwargs(preset: str) -> dict:
    """OLMoE's structure at small sizes: q/k RMSNorms over all heads, q/k/v clipping."""
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                    num_experts_per_tok=2, clip_qkv=2.0, max_position_embeddings=512)
    return dict(hidden_size=256, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, num_experts=32,
                num_experts_per_tok=4, clip_qkv=8.0, max_position_embeddings=2048)


def _mixtral_kwargs(preset: str) -> dict:
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=512)
    return dict(hidden_size=256, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, num_local_experts=32,
                num_experts_per_tok=4, max_position_embeddings=2048)


def _grouped_routing_sizes(preset: str) -> dict:
    """The sizes of the GLM-4.5 and dots.llm1 structures: GQA heads, a dense first layer's and
    the experts' widths, expert groups."""
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    max_position_embeddings=512)
    return dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=32,
                n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                max_position_embeddings=2048)


def _glm4_moe_kwargs(preset: str) -> dict:
    """GLM-4.5's structure at small sizes: q/k/v biases, half-rotary heads, a dense first layer,
    sigmoid routing over groups of experts, one shared expert."""
    return dict(_grouped_routing_sizes(preset), attention_bias=True, use_qk_norm=False,
                partial_rotary_factor=0.5, first_k_dense_replace=1, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True)


def _dots1_kwargs(preset: str) -> dict:
    """dots.llm1's structure at small sizes: per-head QK norms, a dense first layer, sigmoid
    routing over expert groups, two shared experts."""
    return dict(_grouped_routing_sizes(preset), first_k_dense_replace=1, n_shared_experts=2,
                routed_scaling_factor=2.5, norm_topk_prob=True)


def _deepseek_v3_kwargs(preset: str) -> dict:
    """DeepSeek-V3's structure at small sizes: MLA with a query latent and interleaved RoPE,
    values narrower than keys, a dense first layer, sigmoid routing over expert groups, one
    shared expert."""
    common = dict(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, rope_interleave=True)
    if preset == "tiny":
        return dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                    topk_group=1, max_position_embeddings=512, **common)
    return dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                topk_group=2, max_position_embeddings=2048, **common)


_KWARGS = {"qwen3-moe": _qwen3_kwargs, "qwen2-moe": _qwen2_kwargs, "olmoe": _olmoe_kwargs,
           "mixtral": _mixtral_kwargs, "glm4-moe": _glm4_moe_kwargs, "dots1": _dots1_kwargs,
           "deepseek-v3": _deepseek_v3_kwargs}


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on TRAINING_TEXT, as a transformers
    PreTrainedTokenizerFast with EOS (= pad) `<|endoftext|>` and no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    # left padding: batched HF generate() of a decoder-only model continues after each prompt
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   padding_side="left")


@contextlib.contextmanager
def _hf_progress_bars(on: bool):
    """transformers' tqdm bars off inside (unless `on`), as they were after."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    if not on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not on:
            hf_logging.enable_progress_bar()


def check_arch_preset(arch: str, preset: str) -> None:
    """Raises ValueError unless `arch` is in ARCH_NAMES, `preset` in PRESETS and the two fit
    (qwen3-30b-a3b is a Qwen3-MoE model)."""
    if arch not in ARCH_NAMES:
        raise ValueError(f"arch must be one of {sorted(ARCH_NAMES)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    if preset == "qwen3-30b-a3b" and arch != "qwen3-moe":
        raise ValueError("preset 'qwen3-30b-a3b' is a Qwen3-MoE model: use --arch qwen3-moe")


def make_checkpoint(out_dir: str, arch: str = "qwen3-moe", preset: str = "tiny", *,
                    seed: int = 0, dtype: Optional[str] = None,
                    max_shard_size: Optional[Union[str, int]] = None,
                    force: bool = False, progress: bool = True) -> str:
    """Write a random-weight checkpoint to out_dir: created when absent; an existing empty
    directory (also `.` or a symlink to one) is filled in place. Written to a temporary directory
    first, so an interrupted run leaves nothing behind.

    Args:
        arch: "qwen3-moe", "qwen2-moe", "olmoe", "mixtral", "glm4-moe", "dots1" or
            "deepseek-v3".
        preset: "tiny", "small" or "qwen3-30b-a3b" (Qwen3-MoE only).
        seed: torch seed of the random weights.
        dtype: one of DTYPES: "float32" (default for tiny/small), "bfloat16" (default for
            qwen3-30b-a3b) or "float16".
        max_shard_size: e.g. "200KB" or a number of bytes (see parse_shard_size) to write sharded
            safetensors with an index.
        force: for qwen3-30b-a3b, write the (huge) weights too.
        progress: show transformers' shard-writing bar.

    Returns:
        out_dir, whose directory and file modes follow the umask (typically 0755 / 0644).

    Raises:
        ValueError: unknown arch/preset/dtype, a preset the arch lacks, force for another preset
            than qwen3-30b-a3b, a bad max_shard_size or seed,
            an empty out_dir, one that is a file or a non-empty directory, or one whose parent
            cannot be written.
    """
    import torch
    import transformers

    check_arch_preset(arch, preset)
    if force and preset != "qwen3-30b-a3b":
        raise ValueError(f"force writes the weights of preset qwen3-30b-a3b (the other presets "
                         f"always have theirs); preset {preset!r} takes no force")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if max_shard_size is not None:
        max_shard_size = parse_shard_size(max_shard_size)
    try:
        ok = not isinstance(seed, bool) and 0 <= operator.index(seed) < 2 ** 63
    except TypeError:  # (operator.index: ints and integer types such as numpy's)
        ok = False
    if not ok:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    if not out_dir:
        raise ValueError("out_dir must be a directory path, got an empty one")
    if os.path.islink(out_dir) and not os.path.exists(out_dir):  # (dangling, or a loop)
        raise ValueError(f"{out_dir} is a symbolic link to nothing that exists "
                         f"({os.readlink(out_dir)})")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        held = sorted(os.listdir(out_dir))
        raise ValueError(f"{out_dir} exists and is not empty (it holds {', '.join(held[:3])}"
                         f"{', ...' if len(held) > 3 else ''})")
    parent = os.path.dirname(os.path.abspath(out_dir))
    existing = parent
    while not os.path.exists(existing):  # (the root exists)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):  # (makedirs would say "File exists")
        raise ValueError(f"cannot write a checkpoint at {out_dir}: {existing} is not a directory")
    into = os.path.isdir(out_dir)  # (an empty directory, "." or a link to one: filled in place)
    try:  # (before the weights are made: a path that cannot be written fails at once)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".make_checkpoint-", dir=out_dir if into else parent)
    except OSError as e:
        raise ValueError(f"cannot write a checkpoint at {out_dir}: {e.strerror or e}") from None
    moved: list[str] = []  # (files already in an existing out_dir: removed on failure)
    try:
        from . import get_architecture
        a = get_architecture(ARCH_NAMES[arch])
        big = preset == "qwen3-30b-a3b"
        tokenizer = train_tokenizer()
        kwargs = _KWARGS[arch](preset)
        kwargs.setdefault("vocab_size", len(tokenizer))
        eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        config_cls = getattr(transformers, a.hf_class_name.replace("ForCausalLM", "Config"))
        config = config_cls(eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
                            tie_word_embeddings=False, **kwargs)
        dtype = dtype or ("bfloat16" if big else "float32")
        config.dtype = dtype
        if big and not force:
            config.save_pretrained(tmp)
            transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
        else:
            torch.manual_seed(seed)
            model = getattr(transformers, a.hf_class_name)(config).to(getattr(torch, dtype))
            _randomize_correction_biases(model)
            save_kw = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
            with _hf_progress_bars(progress):
                model.save_pretrained(tmp, **save_kw)
        tokenizer.save_pretrained(tmp)
        _apply_umask_modes(tmp)
        if into:
            for name in os.listdir(tmp):
                dst = os.path.join(out_dir, name)
                if os.path.lexists(dst):  # (never replace what appeared there meanwhile)
                    raise FileExistsError(f"{dst} appeared while the checkpoint was made")
                moved.append(name)
                os.rename(os.path.join(tmp, name), dst)
            os.rmdir(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in moved:  # (each checked absent before it was moved in: this run's own)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))
        raise
    return out_dir


def _randomize_correction_biases(model) -> None:
    """Routers with an e_score_correction_bias (GLM-4-MoE, DeepSeek-V3) start it at 0 in
    transformers; a trained checkpoint's is not, so give it N(0, 0.5^2) values: routing then
    depends on it."""
    import torch
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                buf.copy_(torch.randn(buf.shape) * 0.5)


def cached_checkpoint(arch: str = "qwen3-moe", preset: str = "tiny", cache_dir: Optional[str] = None,
                      progress: bool = True) -> str:
    """The checkpoint made once under cache_dir (default $MOE_RUNTIME_CACHE or
    ~/.cache/moe_runtime), as `<arch>-<preset>`; made on first use (atomically, so concurrent
    callers are safe: the loser of the race keeps the winner's copy); written by make_checkpoint
    (with `progress`), so its modes follow the umask too (an existing copy is used as it is)."""
    root = cache_dir or os.environ.get("MOE_RUNTIME_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moe_runtime")
    path = os.path.join(root, f"{arch}-{preset}")
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"the checkpoint cache {root} is not a directory (set MOE_RUNTIME_CACHE "
                         "to another path)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        try:
            make_checkpoint(path, arch, preset, progress=progress)
        except (ValueError, OSError):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
    return path
