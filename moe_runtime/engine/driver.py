"""Engine: the driver. Starts (or joins) Ray, places one RankWorker actor per rank, sets up the
torch.distributed rendezvous on rank 0, loads the model on every rank and runs generation.

    with Engine("ckpt/", world_size=2, topology="auto") as eng:
        result = eng.generate(["Hello"], SamplingParams(max_new_tokens=16))

Failure handling: every wait on the ranks is bounded; when a rank raises, the driver raises
RankError naming that rank (and the original error) and kills every actor and the placement
group before returning, so nothing is left running. `shutdown()` also stops an embedded Ray.
"""
from __future__ import annotations

import collections.abc
import logging
import os
import re
import signal
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..comm.groups import MIN_TIMEOUT_S
from .sampler import SamplingParams, as_int, as_real
from .scheduler import RankOutput, assign_requests

log = logging.getLogger("moe_runtime")
# the Ray an Engine of this process started embedded: {"owner": weakref to it, "gcs": that
# Ray's GCS address}; empty when none runs (Engine._claim_embedded_ray)
_EMBEDDED: dict = {}


def _current_gcs(ray) -> Optional[str]:
    """The GCS address of the Ray this process is connected to, or None."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # (not connected, or a stand-in module)
        return None

TOPOLOGY_CHOICES = ("auto", "local", "tp", "dp_nvlink", "dp_p2p")
# the longest bound a phase may have (~11.6 days): Ray's and torch.distributed's waits overflow
# further up (1e10 s: the rendezvous' socket timeout, inf: ray.wait); the shortest is the ranks'
MAX_TIMEOUT_S = 1e6
DEFAULT_TIMEOUT_S = 300.0  # Engine's and the CLI's bound on each phase (a large checkpoint's
# load takes minutes)


_SILENT_S = 3.0  # a live rank answers a progress query within this (Engine._silent, _advanced)
# A bound on killing the rank actors and removing their placement group (requests to Ray's GCS,
# normally well under a second): past it the GCS counts as gone (`Engine.ray_lost`), e.g. when
# SIGTERM reached the whole process group (`timeout`, systemd, Slurm) and with it the GCS of an
# embedded Ray, whose requests otherwise block until Ray ends the process after 60 s.
_CONTROL_PLANE_S = 10.0
# GCS addresses found lost in this process -> whether an Engine had started that Ray (embedded)
_LOST_GCS: dict[str, bool] = {}


def lost_ray() -> Optional[bool]:
    """None while no Engine of this process found its Ray's GCS lost (_CONTROL_PLANE_S); else
    whether that Ray was started by the Engine (embedded: its processes run here)."""
    return next(iter(_LOST_GCS.values()), None)


class RankError(RuntimeError):
    """A rank failed (raised, died or timed out). Attributes: rank, what (the phase), cause."""

    def __init__(self, rank: int, what: str, cause: BaseException | str):
        self.rank, self.what, self.cause = rank, what, cause
        detail = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        super().__init__(f"rank {rank} failed during {what}: {detail}")


@dataclass
class Completion:
    """One request's result: generated token ids (stop token included) and their text."""

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"


@dataclass
class GenerationResult:
    """Completions in request order plus the run's topology and throughput.

    prefill_tokens counts the prompts' tokens and prefill_s the wall time of the iterations
    that ran a prefill (each also samples its requests' first token); decode_tokens counts the
    tokens the decode steps produced, i.e. each completion's tokens but its first (none with
    max_new_tokens=1), and decode_s their wall time.
    """

    completions: list[Completion]
    topology: str
    topology_reason: str
    world_size: int
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    per_rank: list[RankOutput] = field(default_factory=list, repr=False)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def choose_topology(requested: str, world_size: int, cluster=None, attention: str = "dp"
                    ) -> tuple[str, str]:
    """(topology, one-line reason).

    An explicit name is checked against the world size. "auto" asks
    moe_runtime.topologies.select.select_topology with `cluster` (a ClusterInfo gathered from
    the ranks) and `attention` ("dp": data-parallel attention, each rank its own requests;
    "tp": tensor-parallel attention, tokens replicated).

    Raises:
        ValueError: unknown name or attention, "local" with more than one rank, or "auto"
            without cluster facts.
    """
    if requested not in TOPOLOGY_CHOICES:
        raise ValueError(f"topology must be one of {TOPOLOGY_CHOICES}, got {requested!r}")
    if attention not in ("dp", "tp"):
        raise ValueError(f"attention must be 'dp' or 'tp', got {attention!r}")
    if requested == "local" and world_size != 1:
        raise ValueError(f"topology 'local' needs world size 1, got {world_size}")
    if requested != "auto":
        return requested, f"requested explicitly (world size {world_size})"
    if cluster is None:
        raise ValueError("topology 'auto' needs the cluster facts gathered from the ranks")
    from ..topologies.select import ParallelConfig, select_topology
    sel = select_topology(cluster, ParallelConfig.from_mode(attention, world_size))
    return sel.name, sel.reason


def check_texts(prompts: Sequence[str]) -> None:
    """Raises TypeError for a prompt that is not a str, ValueError for one that is not UTF-8
    text (a lone surrogate: what Python makes of undecodable bytes in a command line)."""
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {i} must be a str, got {type(p).__name__} {p!r:.60} (token "
                            "ids go to Engine.generate_ids)")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt {i} is not UTF-8 text ({e.reason} at character "
                             f"{e.start}: {p[max(0, e.start - 10):e.end + 10]!r})") from None


# iterables that are not lists of token ids: text and bytes (ids of characters), mappings and
# sets (no order)
_NOT_ID_LISTS = (str, bytes, bytearray, memoryview, collections.abc.Mapping, collections.abc.Set)


def token_id_lists(prompt_ids) -> list[list[int]]:
    """prompt_ids as one list of Python ints per prompt.

    Args:
        prompt_ids: a sequence of prompts, each a sequence of token ids (an integer tensor of
            one dimension included), or a 2-D integer tensor (a prompt per row).

    Raises:
        TypeError: text, bytes (bytes-like included), a mapping or a set (no order) where the
            prompts or one prompt's ids should be, a prompt that is not a sequence (a tensor of
            another dimension included), or a token id that is not an int (`as_int`), each
            named by its prompt (and position).
    """
    tensor = isinstance(prompt_ids, torch.Tensor)
    if isinstance(prompt_ids, _NOT_ID_LISTS) or not hasattr(prompt_ids, "__iter__") or (
            tensor and prompt_ids.dim() != 2):
        got = f"a {prompt_ids.dim()}-d tensor" if tensor else type(prompt_ids).__name__
        raise TypeError(f"prompt_ids must be a list of token id lists (or a 2-D tensor, a prompt "
                        f"per row), got {got}")
    out = []
    for i, p in enumerate(prompt_ids):
        if isinstance(p, torch.Tensor):  # (a 0-d one has __len__ but no length)
            if p.dim() != 1:
                raise TypeError(f"prompt {i} must be a sequence of token ids, got a "
                                f"{p.dim()}-d tensor")
            p = p.tolist()
        if isinstance(p, _NOT_ID_LISTS) or not hasattr(p, "__len__"):
            raise TypeError(f"prompt {i} must be a sequence of token ids, got "
                            f"{type(p).__name__} {p!r:.60} (text goes to Engine.generate)")
        out.append([t if type(t) is int else as_int(f"prompt {i} token {j}", t)  # (fast path:
                    for j, t in enumerate(p)])  # a tokenizer's ids)
    return out


def check_prompts(prompt_ids: Sequence[Sequence[int]], spec, max_new_tokens: int
                  ) -> list[list[int]]:
    """The checks of a batch of tokenized prompts that Engine.generate_ids makes before anything
    reaches the ranks; callable without an engine (the CLI runs them before Ray starts).

    Args:
        prompt_ids: one list of token ids per prompt.
        spec: the checkpoint's ModelSpec (vocab_size, max_position_embeddings), e.g.
            moe_runtime.models.read_spec(model_dir)[0].
        max_new_tokens: the tokens to generate per prompt.

    Returns:
        The prompts as lists of Python ints (`token_id_lists`).

    Raises:
        TypeError: a prompt that is a str / bytes or not a sequence, or a token id that is not
            an int (a bool, a float or a str such as "5" included; numpy integers and
            one-element integer tensors are ints).
        ValueError: a prompt without tokens (named by its index), a token id outside
            [0, vocab_size), or the longest prompt + max_new_tokens - 1 (the positions fed: the
            last new token is never) over max_position_embeddings.
    """
    prompt_ids = token_id_lists(prompt_ids)
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: every prompt must have at least one token")
    vocab = spec.vocab_size
    bad = [(i, t) for i, p in enumerate(prompt_ids) for t in p if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids must be in [0, vocab_size={vocab}); prompt {bad[0][0]} has "
                         f"{bad[0][1]}")
    limit = spec.max_position_embeddings
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]), default=None)
    # (the last new token is sampled, never fed: positions up to len + max_new_tokens - 2)
    if longest is not None and len(prompt_ids[longest]) + max_new_tokens - 1 > limit:
        raise ValueError(f"prompt {longest} ({len(prompt_ids[longest])} tokens) + max_new_tokens "
                         f"({max_new_tokens}) - 1 exceeds max_position_embeddings ({limit})")
    return prompt_ids


def check_world_size(spec, world_size: int, tensor_parallel: bool = False) -> None:
    """ValueError unless world_size divides the checkpoint's experts (spec: its ModelSpec):
    experts are split evenly across the ranks (a model whose every layer is dense has none to
    split, e.g. Qwen3-MoE's num_experts 0); with tensor_parallel (attention split by heads:
    topology tp) also unless the heads split (models.head_shard's rule)."""
    if len(spec.dense_layers) < spec.num_layers and spec.moe.num_experts % world_size:
        raise ValueError(f"num_experts ({spec.moe.num_experts}) must be divisible by world_size "
                         f"({world_size}): experts are split evenly across ranks")
    if tensor_parallel and world_size > 1:
        from ..models import Parallel, head_shard
        head_shard(spec, Parallel("tp", 0, world_size))


def check_weights(model_dir: str) -> None:
    """Fail before any rank starts when model_dir has no weights for the loader: neither
    model.safetensors nor model.safetensors.index.json (e.g. a config-only checkpoint from
    `moe-runtime make-checkpoint --preset qwen3-30b-a3b` without --force).

    Also reads the index (or the single file's header): an index that is not a safetensors
    index or names a missing shard, and an unreadable single file, fail here too.

    Raises:
        CheckpointError: naming the directory and both file names, or the bad file.
    """
    from ..models.loader import INDEX_FILE, SINGLE_FILE, CheckpointError, CheckpointReader
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in (SINGLE_FILE, INDEX_FILE)):
        other = sorted(f for f in os.listdir(model_dir)
                       if f.endswith((".bin", ".pt", ".pth", ".safetensors", ".gguf")))
        held = f"it holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}"
        shards = [f for f in other if re.fullmatch(r".+-\d+-of-\d+\.safetensors", f)]
        raise CheckpointError(
            f"{model_dir}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE} " + (
            f"({held}: the shards' index, {INDEX_FILE}, is missing)" if shards else
            f"({held}: only HF's safetensors layout is read; convert it with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir))" if other else
            "(a config-only checkpoint, e.g. make-checkpoint --preset qwen3-30b-a3b without "
            "--force, cannot generate)"))
    CheckpointReader(model_dir).close()


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer (transformers.AutoTokenizer), refused when it turns text into
    no tokens: transformers 5 returns a tokenizer with an empty vocabulary for a directory
    without tokenizer files (e.g. written by a model's save_pretrained alone), which would make
    every prompt empty.

    Raises:
        CheckpointError: no tokenizer in model_dir (names the directory and the files looked for).
    """
    from transformers import AutoTokenizer

    from ..models.loader import CheckpointError
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except ImportError:
        raise
    except Exception as e:  # e.g. a tokenizer.json that is not JSON: name the checkpoint
        files = set(os.listdir(model_dir)) if os.path.isdir(model_dir) else set()
        hint = ("" if "tokenizer.json" in files or "tokenizer_config.json" not in files else
                " (tokenizer_config.json is there but tokenizer.json is not: copy the model's "
                "tokenizer.json, e.g. tokenizer.save_pretrained(model_dir), before installing "
                "the packages this error may ask for)")
        raise CheckpointError(f"{model_dir}: cannot load its tokenizer{hint}: "
                              f"{type(e).__name__}: {e}") from e
    if not tokenizer("a b c")["input_ids"]:
        raise CheckpointError(f"{model_dir}: no usable tokenizer (it gives no token ids for text): "
                              "put the model's tokenizer files there (tokenizer.json / "
                              "tokenizer_config.json, e.g. tokenizer.save_pretrained(model_dir))")
    return tokenizer


class Engine:
    """Driver of W RankWorker actors serving one checkpoint.

    Args:
        model_dir: HF-format checkpoint directory (config.json, safetensors, tokenizer); a
            relative path is taken from this process's working directory, and on a joined
            cluster the same absolute path must hold the checkpoint on every node with a rank.
        world_size: number of ranks (one actor each).
        topology: "auto", "local", "tp", "dp_nvlink" or "dp_p2p".
        attention: for "auto": "dp" (data-parallel attention + EP, the default) or "tp".
        ray_address: join this Ray cluster ("auto" or host:port); None = the Ray already
            initialized in this process, else $RAY_ADDRESS when set (a `ray job submit` job),
            else start a new one embedded here (even when a local cluster already runs on this
            machine; stopped by shutdown()).
        device: "auto" (GPU ranks when the cluster has any GPU, CPU ranks when it has none),
            "cpu", "cuda". GPU ranks with fewer GPUs than world_size in the cluster: on an
            embedded Ray (this machine only) a ValueError at once; on a joined cluster a
            warning, and the placement waits up to timeout_s (an autoscaler may add GPU nodes).
        dtype: "auto" (the checkpoint's), "float32", "bfloat16", "float16".
        backend: kernel backend ("auto", "reference", "cute").
        timeout_s: bound on every phase (placement, rendezvous, collectives, load), seconds in
            [MIN_TIMEOUT_S, MAX_TIMEOUT_S] (1 ms .. ~11.6 days); generate may take longer as
            long as its ranks make progress (a decoder layer of a forward pass) within every
            timeout_s.
        progress: tqdm bars while loading (shown through Ray's log forwarding).
        ray_init_kwargs: extra ray.init arguments for the embedded start.
        cuda_graphs: replay each decode step from a CUDA graph where every rank allows it
            (engine.decode_graph: one GPU rank, or tp / dp_* ranks whose MoE topologies
            exchange over NCCL, as ranks that see one GPU each do; routing on the cute kernels,
            16-bit experts); False: every step eager.

    Raises:
        FileNotFoundError: model_dir has no config.json.
        CheckpointError: (a ValueError) model_dir has no model.safetensors or
            model.safetensors.index.json, or no tokenizer (before Ray starts).
        RankError: a rank failed while starting or loading (all actors are gone afterwards).
        TimeoutError: the cluster could not place world_size ranks within timeout_s.
        ConnectionError: ray_address (or RAY_ADDRESS) names a cluster that cannot be reached
            or joined.
        TypeError: world_size not an int, timeout_s not a number.
        ValueError: bad arguments (before Ray starts), unsupported model_type or dtype, GPU
            ranks on an embedded Ray with fewer GPUs than world_size, or backend "cute" where
            device "auto" resolves to CPU ranks (before the ranks start).
    """

    _ray_gcs: Optional[str] = None  # the GCS address of the Ray this engine runs on

    def __init__(self, model_dir: str, *, world_size: int = 1, topology: str = "auto",
                 attention: str = "dp", ray_address: Optional[str] = None, device: str = "auto",
                 dtype: str = "auto", backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 progress: bool = True, ray_init_kwargs: Optional[dict] = None,
                 cuda_graphs: bool = True):
        world_size = as_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("auto", "reference", "cute"):
            raise ValueError(f"backend must be auto, reference or cute, got {backend!r}")
        timeout_s = as_real("timeout_s", timeout_s)
        if not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:  # (NaN fails too)
            raise ValueError(f"timeout_s must be in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] s, got "
                             f"{timeout_s}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        if topology not in TOPOLOGY_CHOICES:
            raise ValueError(f"topology must be one of {TOPOLOGY_CHOICES}, got {topology!r}")
        if attention not in ("dp", "tp"):
            raise ValueError(f"attention must be 'dp' or 'tp', got {attention!r}")
        if topology != "auto":  # bad combinations fail before Ray starts
            choose_topology(topology, world_size, attention=attention)
        if device == "cpu" and backend == "cute":
            raise ValueError("backend 'cute' runs CuTeDSL kernels on GPUs; CPU ranks need backend "
                             "'reference' or 'auto'")
        if ray_address is not None:
            check_ray_address(ray_address)
        # (absolute: the rank actors of a joined cluster run in another working directory)
        model_dir = os.path.abspath(os.fspath(model_dir))
        self.model_dir, self.world_size, self.timeout_s = model_dir, world_size, timeout_s
        self.dtype, self.backend, self.progress = dtype, backend, progress
        self.cuda_graphs = bool(cuda_graphs)
        self.workers: list = []
        self._stopped_by: Optional[str] = None  # why the ranks were killed (a call's failure)
        self.worker_pids: list[int] = []
        self.placement_group = None
        self.topology: Optional[str] = None
        self.topology_reason = ""
        self.rank_info: list[dict] = []
        self.device: Optional[str] = None  # "cuda" or "cpu" once Ray is up
        self._started_ray = False  # (shutdown stops it)
        self._joined_ray = False  # (shutdown disconnects from it: a cluster restarted since
        # would fail the next Engine's calls on the stale connection, in Ray's C++ code)
        from ..models import read_spec
        self.spec = read_spec(model_dir, dtype)[0]  # config problems fail before Ray starts
        check_weights(model_dir)  # so do missing weights
        check_world_size(self.spec, world_size, topology == "tp" or (
            topology == "auto" and attention == "tp"))
        self.tokenizer = load_tokenizer(model_dir)  # and a missing tokenizer
        try:
            self._start_ray(ray_address, device, ray_init_kwargs or {})
            self._start_workers()
            cluster = None
            if topology == "auto":
                cluster = self._call_all("cluster_info", "gathering cluster facts")[0]
            self._load(*choose_topology(topology, world_size, cluster, attention))
        except BaseException:
            self.shutdown()
            raise

    # -- set-up ---------------------------------------------------------------------------------
    def _start_ray(self, address: Optional[str], device: str, extra: dict) -> None:
        import ray
        # ray.init installs a C-level SIGTERM handler that aborts the process; keep the host
        # program's own handler (the CLI turns SIGTERM into a clean shutdown).
        main_thread = threading.current_thread() is threading.main_thread()
        saved_term = signal.getsignal(signal.SIGTERM) if main_thread else None
        # Ctrl-C inside ray.init is held until it returns: an interrupt inside Ray's node or
        # core-worker start-up left its agents running (and could crash the process at exit);
        # once ray.init has returned, the caller's shutdown stops everything it started. A
        # second Ctrl-C interrupts at once where ray.init waits in Python (inside Ray's C++
        # retries no Python handler runs; `_check_reachable` refuses a silent address first).
        # An ignored SIGINT (a background job) stays ignored.
        held: list[int] = []
        saved_int = signal.getsignal(signal.SIGINT) if main_thread else None
        hold_int = main_thread and saved_int is not signal.SIG_IGN  # (ignored: a background job)

        def hold(signum, frame):
            held.append(signum)
            if len(held) > 1:
                raise KeyboardInterrupt("a second Ctrl-C during ray.init")
        if hold_int:
            signal.signal(signal.SIGINT, hold)
        try:
            try:
                self._init_ray(ray, address, device, extra)
            finally:
                if saved_term is not None:
                    signal.signal(signal.SIGTERM, saved_term)
                if hold_int:  # (None: a handler not set from Python; Python's own then)
                    signal.signal(signal.SIGINT, saved_int if saved_int is not None
                                  else signal.default_int_handler)
        except SystemExit as e:
            if e.code != signal.SIGTERM:
                raise
            # ray.init's own SIGTERM handler exits (sys.exit(signum)) when the signal lands
            # inside it, or, still pending, while the handlers above are put back (e.g. after
            # ray.init gave up on a GCS the signal stopped too): an interruption like any other
            # (the caller shuts down what was started), carrying the signal's number (the CLI
            # exits 128 + it)
            interrupt = KeyboardInterrupt(f"signal during ray.init ({e})")
            interrupt.signum = e.code
            raise interrupt from None
        if held:
            raise KeyboardInterrupt("Ctrl-C during ray.init")

    def _claim_embedded_ray(self, ray) -> None:
        """Ray runs once per process. While the Ray another Engine started embedded runs (sized
        for that Engine's ranks, stopped by its shutdown()), a second Engine is refused; one
        left by an Engine collected without shutdown() is stopped (its ranks hold its
        resources); a Ray that is no longer that one (the user's own) is free to join.

        Raises:
            RuntimeError: another live Engine's embedded Ray runs.
        """
        if not _EMBEDDED:
            return
        owner = _EMBEDDED["owner"]()
        if not (ray.is_initialized() and _current_gcs(ray) == _EMBEDDED["gcs"]):
            _EMBEDDED.clear()  # (that Ray is gone)
        elif owner is None:
            ray.shutdown()
            _EMBEDDED.clear()
        elif owner is not self:
            raise RuntimeError(
                "another Engine of this process runs on the Ray it started embedded (sized for "
                "its own ranks, and stopped by its shutdown()): shut it down first, or run both "
                "on a cluster (`ray start --head`, then ray_address='auto')")

    def _init_ray(self, ray, address: Optional[str], device: str, extra: dict) -> None:
        self._claim_embedded_ray(ray)
        from_env = False
        if address is None and not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None  # e.g. set by `ray job submit`
            from_env = address is not None
            if from_env:
                check_ray_address(address, "RAY_ADDRESS in the environment")
        if address is not None:
            try:
                _check_reachable(address, self.timeout_s)
            except ConnectionError as e:
                if from_env:
                    raise ConnectionError(f"RAY_ADDRESS in the environment: {e}") from e
                raise
            if not ray.is_initialized():
                self._joined_ray = True
                try:
                    ray.init(address=address, **extra)
                except ConnectionError as e:  # Ray's text names its own CLI flag (--address)
                    raise ConnectionError(
                        f"cannot join the Ray cluster at {address!r} (--ray-address or "
                        f"RAY_ADDRESS; `moe-runtime generate` without either starts Ray "
                        f"embedded, the job entry joins 'auto'; a cluster started with token "
                        f"authentication needs RAY_AUTH_MODE=token here too): {e}") from e
        elif not ray.is_initialized():
            # address "local": a new Ray of our own even when a local cluster runs here (`ray
            # start --head`, or a stale /tmp/ray/ray_current_cluster); without it ray.init joins
            # that cluster and refuses num_cpus/num_gpus. Pass ray_address="auto" to join it.
            kw = dict(address="local", include_dashboard=False,
                      object_store_memory=128 * 1024 ** 2, logging_level=logging.WARNING)
            if device == "cuda":
                check_local_gpus(self.world_size, extra.get("num_gpus", torch.cuda.device_count()))
            if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
                kw["num_cpus"] = self.world_size
                kw["num_gpus"] = 0
            kw.update(extra)
            self._started_ray = True  # (before: an interrupted ray.init leaves processes to stop)
            ray.init(**kw)
            _EMBEDDED.update(owner=weakref.ref(self), gcs=_current_gcs(ray))
        self._ray_gcs = _current_gcs(ray)
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
        if use_gpu and gpus < self.world_size:
            if self._started_ray:
                raise ValueError(f"device {device!r}: {self.world_size} GPU rank(s) need as many "
                                 f"GPUs, this machine has {gpus:g} (lower --world-size or use --device cpu)")
            log.warning("moe_runtime: the Ray cluster has %g GPU(s) for %d GPU ranks; requesting the "
                        "GPU bundles anyway (waiting up to %gs for an autoscaler to add nodes)",
                        gpus, self.world_size, self.timeout_s)
        self.device = "cuda" if use_gpu else "cpu"
        if device == "auto" and self.device == "cpu" and self.backend == "cute":
            raise ValueError(f"backend 'cute' runs CuTeDSL kernels on GPUs, and device {device!r} "
                             f"resolved to CPU ranks (the Ray cluster has no GPU): use backend "
                             f"'reference' or 'auto'")

    def _start_workers(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import PROGRESS_GROUP, RankWorker
        bundle = {"GPU": 1} if self.device == "cuda" else {"CPU": 1}
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)],
                                               strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=self.timeout_s)
        if not ready:
            raise TimeoutError(f"could not place {self.world_size} ranks of {bundle} within "
                               f"{self.timeout_s:g}s; cluster resources: {ray.cluster_resources()}")
        opts = dict(num_cpus=0, num_gpus=1) if self.device == "cuda" else dict(num_cpus=1, num_gpus=0)
        actor = ray.remote(max_restarts=0, max_task_retries=0,
                           concurrency_groups={PROGRESS_GROUP: 1}, **opts)(RankWorker)
        self.workers = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=r)).remote(
            r, self.world_size, self.device) for r in range(self.world_size)]
        self.worker_pids = self._call_all("pid", "starting rank actors")
        addr, port = self._call_all("rendezvous_address", "rendezvous", ranks=[0])[0]
        self._call_all("init_distributed", "torch.distributed rendezvous", addr, port, self.timeout_s)

    def load(self, topology: str) -> None:
        """(Re)load the model on every rank for an explicit `topology` (same actors and process
        group), e.g. to compare topologies without restarting the ranks.

        Raises:
            ValueError: "auto", "local" with world size > 1, an unknown name, or "tp" for a
                model whose heads do not split over the ranks (`check_world_size`); the loaded
                model stays.
            RuntimeError: the engine is shut down, or its ranks are gone (an earlier failure).
            RankError: a rank failed (all actors are gone afterwards).
        """
        if topology == "auto":
            raise ValueError("load() needs an explicit topology name")
        chosen = choose_topology(topology, self.world_size)
        check_world_size(self.spec, self.world_size, topology == "tp")
        self._check_ranks()
        self._load(*chosen)

    def _check_ranks(self) -> None:
        """RuntimeError unless the ranks are up (not shut down, not killed by a failure)."""
        if not self.workers:
            why = getattr(self, "_stopped_by", None)
            raise RuntimeError("the engine is shut down" if why is None else
                               f"the engine's ranks are gone ({why}): build a new Engine (call "
                               "this one's shutdown() first)")

    def _load(self, name: str, reason: str) -> None:
        self.topology = None
        self.rank_info = self._call_all("load", f"loading {self.model_dir} ({name})", self.model_dir,
                                        name, self.dtype, self.backend, self.progress)
        self.topology, self.topology_reason = name, reason
        ranks: dict[str, list[int]] = {}  # the ranks' load warnings, each text once
        for info in self.rank_info:
            for text in info.get("warnings", []):
                ranks.setdefault(text, []).append(info["rank"])
        for text, rs in ranks.items():
            warnings.warn(f"{text} (rank{'s' if len(rs) > 1 else ''} "
                          f"{', '.join(map(str, rs))})", stacklevel=3)

    # -- waiting on ranks -----------------------------------------------------------------------
    def _call_all(self, method: str, what: str, *args, ranks: Optional[Sequence[int]] = None,
                  per_rank_args: Optional[Sequence[tuple]] = None, progress: bool = False,
                  **kwargs) -> list:
        """Call `method` on the ranks, wait for all with the bound, return results in rank order.

        The bound is timeout_s for the whole call; with `progress` (generate), timeout_s without
        progress: when it runs out, the ranks still working are asked for their step count
        (RankWorker.progress) and another timeout_s starts if any of them advanced.
        On the first failure: pick the root cause (an error that is not a peer's collective
        failure, when one arrives within a short grace period), kill everything, raise RankError.
        """
        import ray
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        refs = {}
        results: dict[int, object] = {}
        steps: dict[int, int] = {}
        try:  # (from the first submission on: an interrupt between two leaves a rank busy)
            for i, r in enumerate(ranks):
                a = per_rank_args[i] if per_rank_args is not None else args
                refs[getattr(self.workers[r], method).remote(*a, **kwargs)] = r
            deadline = time.monotonic() + self.timeout_s
            while refs:
                left = deadline - time.monotonic()
                if left <= 0 and progress and self._advanced(sorted(refs.values()), steps):
                    deadline = time.monotonic() + self.timeout_s
                    continue
                if left <= 0:
                    stuck = sorted(refs.values())
                    silent = self._silent(stuck)  # (a stopped, hung or busy process: the culprit)
                    self._kill_workers()
                    bound = "made no progress for" if progress else "did not finish within"
                    why = (f"ranks {stuck} {bound} {self.timeout_s:g}s (timeout_s, the CLI's "
                           "--timeout: raise it if they need longer)")
                    if silent:
                        why = (f"ranks {silent} stopped answering (no reply to a progress query "
                               f"within {_SILENT_S:g}s: a stopped, hung or busy process); {why}")
                    raise RankError((silent or stuck)[0], what, f"TimeoutError: {why}")
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=min(left, 1.0))
                for ref in ready:
                    r = refs.pop(ref)
                    try:
                        results[r] = ray.get(ref)
                    except Exception as e:  # RayTaskError (the rank raised) or RayActorError (died)
                        raise self._fail(r, what, e, refs) from None
        except RankError as e:
            self._stopped_by = str(e)
            raise
        except (KeyboardInterrupt, SystemExit) as e:
            # interrupted while ranks still run this call: they would take no other call (e.g.
            # shutdown's) before it ends, so they are killed now
            self._kill_workers()
            self._stopped_by = f"{type(e).__name__} during {what}"
            raise
        return [results[r] for r in ranks]

    def _advanced(self, ranks: list[int], steps: dict[int, int]) -> bool:
        """Whether any of `ranks` did more steps than recorded in `steps` (updated); a rank
        that does not answer within _SILENT_S (a Ray call's round trip on a loaded machine can
        exceed a short timeout_s) counts as not advanced."""
        import ray
        refs = {self.workers[r].progress.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_SILENT_S)
        advanced = False
        for ref in ready:
            r = refs[ref]
            try:
                n = ray.get(ref)
            except Exception:  # the rank died: the main wait reports it
                continue
            advanced |= n > steps.get(r, 0)
            steps[r] = n
        return advanced

    def _silent(self, ranks: list[int]) -> list[int]:
        """The ranks among `ranks` that do not answer RankWorker.progress within _SILENT_S."""
        import ray
        refs = {self.workers[r].progress.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_SILENT_S)
        return sorted(r for ref, r in refs.items() if ref not in ready)

    def _fail(self, rank: int, what: str, err: Exception, pending: dict) -> RankError:
        """Choose the root failure among the ranks, kill the actors, build the RankError."""
        import ray

        from ..comm import CollectiveError
        failures = [(rank, _cause(err))]
        grace = time.monotonic() + 2.0
        while pending and isinstance(failures[0][1], CollectiveError) and time.monotonic() < grace:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as e:
                    failures.append((r, _cause(e)))
            failures.sort(key=lambda f: isinstance(f[1], CollectiveError))
        if isinstance(failures[0][1], CollectiveError) and pending:
            # only peers' collectives failed: a rank that neither finished nor failed and does
            # not answer a progress query (its own concurrency group) is the one that stalled
            silent = self._silent(sorted(pending.values()))
            if silent:
                r, cause = failures[0]
                failures.insert(0, (silent[0], (
                    f"TimeoutError: ranks {silent} stopped answering (no reply to a progress "
                    f"query within {_SILENT_S:g}s: a stopped, hung or busy process); rank {r} reported "
                    f"{type(cause).__name__}: {cause}")))
        self._kill_workers()
        r, cause = failures[0]
        error = RankError(r, what, cause)
        if isinstance(cause, BaseException):
            error.__cause__ = cause
        return error

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str], params: SamplingParams = SamplingParams(), *,
                 max_batch_size: Optional[int] = None,
                 fail_at_step: Optional[dict[int, int]] = None) -> GenerationResult:
        """Generate a completion for every prompt.

        Args:
            prompts: a list of texts (a single str is one prompt), tokenized with the checkpoint's tokenizer, no special tokens added
                beyond what the tokenizer adds by default).
            params: SamplingParams.
            max_batch_size: at most this many sequences per rank generate together
                (continuous batching: a finished request's KV cache slot takes the next
                waiting prompt; each rank's cache holds max_batch_size x (longest prompt +
                max_new_tokens) positions); None: every prompt at once. In float32 the
                completions do not depend on it (per-request seeds; in bf16 / fp16 near-ties
                may go either way, see SamplingParams.seed).
            fail_at_step: testing aid, {rank: decode step}: that rank raises at that step.

        Returns:
            GenerationResult (completions in prompt order).

        Raises:
            RankError: a rank failed (all actors are gone afterwards; the engine is unusable).
            TypeError: params not a SamplingParams, or one whose max_new_tokens / seed was set
                to a non-int after construction (nothing reaches the ranks; the engine lives on).
            ValueError: an empty prompt, a token id (of a prompt or stop_token_ids) outside
                the vocabulary, prompt + max_new_tokens - 1 over max_position_embeddings, a prompt
                that is not UTF-8 text (e.g. a lone surrogate from undecodable bytes), or
                max_batch_size < 1.
            TypeError: also a prompt that is not a str (use generate_ids for token ids), or
                max_batch_size not an int. generate_ids: a prompt that is not a sequence of
                int token ids (`token_id_lists`); ValueError: `prompts` labels of another
                length than prompt_ids. All before anything reaches the ranks.
        """
        if isinstance(prompts, (bytes, bytearray, dict)) or not isinstance(
                prompts, (str, collections.abc.Iterable)):
            raise TypeError(f"prompts must be a str or a list of str, got "
                            f"{type(prompts).__name__}" + (" (decode it first)" if isinstance(
                                prompts, (bytes, bytearray)) else ""))
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)  # (str: one prompt,
        # as vLLM's LLM.generate takes it; an iterator is read once)
        check_texts(prompts)
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        return self.generate_ids(ids, params, prompts=prompts, max_batch_size=max_batch_size,
                                 fail_at_step=fail_at_step)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
                     *, prompts: Optional[Sequence[str]] = None,
                     max_batch_size: Optional[int] = None,
                     fail_at_step: Optional[dict[int, int]] = None) -> GenerationResult:
        """Like generate() with token ids; `prompts` only labels the completions."""
        self._check_ranks()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if max_batch_size is not None:
            max_batch_size = as_int("max_batch_size", max_batch_size)
            if max_batch_size < 1:
                raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        params.validate()  # a field changed after construction must not reach (and kill) the ranks
        prompt_ids = check_prompts(prompt_ids, self.spec, params.max_new_tokens)
        if prompts is not None:
            prompts = list(prompts)
            if len(prompts) != len(prompt_ids):
                raise ValueError(f"prompts labels {len(prompts)} completions, prompt_ids has "
                                 f"{len(prompt_ids)}")
        outside = [t for t in params.stop_token_ids or () if not 0 <= t < self.spec.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside} are outside the vocabulary [0, "
                             f"{self.spec.vocab_size}): no token could ever stop there")
        stop = params.stop_token_ids
        if stop is None:
            stop = set(self.rank_info[0]["eos_token_ids"])
            if self.tokenizer.eos_token_id is not None:
                stop.add(int(self.tokenizer.eos_token_id))
        dp = self.topology.startswith("dp_")
        n = len(prompt_ids)
        owners = assign_requests([len(p) for p in prompt_ids], self.world_size, dp)
        per_rank = [([list(prompt_ids[i]) for i in own], own, params, sorted(stop),
                     (fail_at_step or {}).get(r), self.cuda_graphs, max_batch_size)
                    for r, own in enumerate(owners)]
        outs: list[RankOutput] = self._call_all("generate", "generate", per_rank_args=per_rank,
                                                progress=True)
        by_request: dict[int, tuple[list[int], str]] = {}
        counted = outs if dp else outs[:1]
        for o in counted:
            for i, toks, why in zip(o.request_ids, o.token_ids, o.finish_reasons):
                by_request[i] = (toks, why)
        labels = list(prompts) if prompts is not None else [self.tokenizer.decode(p) for p in prompt_ids]
        completions = [Completion(labels[i], self.tokenizer.decode(by_request[i][0], skip_special_tokens=True),
                                  by_request[i][0], by_request[i][1]) for i in range(n)]
        return GenerationResult(
            completions, self.topology, self.topology_reason, self.world_size,
            prefill_tokens=sum(o.prefill_tokens for o in counted),
            prefill_s=max((o.prefill_s for o in outs), default=0.0),
            decode_tokens=sum(o.decode_tokens for o in counted),
            decode_s=max((o.decode_s for o in outs), default=0.0), per_rank=outs)

    # -- shutdown -------------------------------------------------------------------------------
    def _kill_workers(self) -> None:
        """Kill the rank actors and remove their placement group, bounded by _CONTROL_PLANE_S:
        past it the GCS counts as lost (`ray_lost`, `lost_ray`), the actors' processes are
        killed where this engine started Ray (embedded: they run here), and no further Ray
        request is made (on a cluster, a driver's actors end with it)."""
        workers, group = self.workers, self.placement_group
        self.workers, self.placement_group = [], None
        if self.ray_lost or (not workers and group is None):
            return

        def kill():
            import ray
            for w in workers:
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # already dead
                    pass
            if group is not None:
                from ray.util.placement_group import remove_placement_group
                try:
                    remove_placement_group(group)
                except Exception:
                    pass
        done = threading.Thread(target=kill, name="moe_runtime-kill-ranks", daemon=True)
        done.start()
        done.join(_CONTROL_PLANE_S)
        if done.is_alive():
            _LOST_GCS[self._ray_gcs or ""] = self._started_ray
            log.warning("moe_runtime: Ray's GCS did not answer within %gs while stopping the "
                        "ranks (it was stopped too, e.g. SIGTERM to the whole process group)%s",
                        _CONTROL_PLANE_S, "; killing the rank processes" if self._started_ray
                        else "")
            if self._started_ray:  # (an embedded Ray's ranks run here; a cluster's need not)
                for pid in self.worker_pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:  # (gone)
                        pass

    def shutdown(self) -> None:
        """Leave the process group on every rank (best effort, bounded), kill the actors, remove
        the placement group, and stop Ray if this engine started it (also when its ray.init
        was interrupted halfway), or disconnect from a cluster it joined itself (a cluster the
        process was connected to before stays connected). Idempotent. Where Ray's GCS stopped
        answering (`ray_lost`, found by `_kill_workers`) it makes no further Ray request:
        ray.shutdown would wait for the GCS, and Ray ends a process whose GCS stays
        unreachable for 60 s (the CLI exits at once instead, see cli.exit_with)."""
        ray = _ray_module()
        if ray is None:  # interrupted inside `import ray`: nothing was started
            return
        if self.ray_lost:  # (the rank processes here were killed when it was found)
            self.workers, self.placement_group = [], None
            self._stopped_by = None
            self._started_ray = self._joined_ray = False
            return
        # the Ray up now is this engine's unless it has another GCS (the user's own, or another
        # Engine's, started after this engine's Ray was stopped): that one is left alone
        ours = (not ray.is_initialized() or self._ray_gcs is None
                or _current_gcs(ray) == self._ray_gcs)
        if ours and self.workers and ray.is_initialized():
            try:
                ray.wait([w.shutdown.remote() for w in self.workers],
                         num_returns=len(self.workers), timeout=10)
            except Exception:
                pass
        if ours and ray.is_initialized():
            self._kill_workers()
        self.workers, self.placement_group = [], None
        self._stopped_by = None  # (shut down now, whatever stopped the ranks before)
        if self._started_ray and ours:
            ray.shutdown()  # (safe on a Ray that never finished starting)
            _EMBEDDED.clear()  # (whatever it named is not running now)
        elif self._joined_ray and ours and ray.is_initialized():
            ray.shutdown()  # (disconnects this process; the cluster runs on)
        self._started_ray = self._joined_ray = False

    @property
    def ray_lost(self) -> bool:
        """Whether the GCS of the Ray this engine runs on stopped answering (_CONTROL_PLANE_S)."""
        return (self._ray_gcs or "") in _LOST_GCS

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _ray_module():
    """The ray module, or None when it is not (completely) imported: a signal inside `import ray`
    leaves a partial module behind."""
    import sys
    ray = sys.modules.get("ray")
    if ray is None or getattr(getattr(ray, "__spec__", None), "_initializing", False):
        return None  # (importlib marks a module whose import is still running)
    return ray


def _cause(err: Exception) -> BaseException:
    """The rank's own exception inside a RayTaskError (else the Ray error itself)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


_GCS_HINT = ("join the cluster at its GCS address instead: 'auto' on a node of the cluster, "
             "or host:6379 (the port of `ray start --head`)")


def check_local_gpus(world_size: int, gpus: float) -> None:
    """GPU ranks on an embedded Ray (this machine only) need world_size GPUs here.

    Raises:
        ValueError: fewer than world_size GPUs.
    """
    if gpus < world_size:
        raise ValueError(f"device 'cuda': {world_size} GPU rank(s) need as many GPUs, this "
                         f"machine has {gpus:g} (lower --world-size or use --device cpu)")


def check_ray_address(address, source: str = "ray_address") -> None:
    """The checks of a Ray address that need no network (Engine, the CLI's --ray-address and
    RAY_ADDRESS); `source` names where it came from in the message.

    Raises:
        ValueError: not a non-empty str; an http(s):// URL (Ray's dashboard / job API, which
            `ray job submit` takes: ray.init would retry it without end); none of "auto",
            "local", scheme://... (ray:// is Ray Client) and host:port with a port in
            1..65535 (an IPv6 host in brackets).
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"{source} must be 'auto' or the cluster's GCS host:port, got "
                         f"{address!r}")
    if address.startswith(("http://", "https://")):
        raise ValueError(f"{source} {address!r} is an HTTP address (Ray's dashboard and job "
                         f"API, which `ray job submit` takes); {_GCS_HINT}")
    if address in ("auto", "local") or "://" in address:  # (ray://: Ray Client, and others')
        return
    host, _, port = address.rpartition(":")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{source} {address!r}: write an IPv6 host in brackets, "
                         f"[{host}]:{port}")
    if not host.strip() or not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{source} must be 'auto' or the cluster's GCS host:port (e.g. "
                         f"10.0.0.1:6379), got {address!r}")


def _auto_address() -> Optional[str]:
    """The host:port that ray.init(address="auto") connects to (RAY_ADDRESS, the cluster the
    last `ray start` on this node recorded, or a GCS running here; Ray's own lookup,
    ray._private.services.canonicalize_bootstrap_address), or None when it finds none or the
    lookup is not where Ray 2.40-2.60 keep it."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
        return canonicalize_bootstrap_address("auto")
    except Exception:  # (none found: ray.init says so itself; another Ray layout)
        return None


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast on a Ray address nobody listens on, that never answers, or that answers HTTP
    (Ray's dashboard, port 8265 by default): ray.init would retry any of them without end.
    "auto" is checked as the address Ray resolves it to (`_auto_address`): a cluster recorded
    by a `ray start` that has since died would hang ray.init the same way.

    Raises:
        ConnectionError: naming the address, when "host:port" refuses or times out a TCP
            connect, sends nothing, or answers an HTTP request.
    """
    import socket
    if address == "auto":
        recorded = _auto_address()
        if recorded is None:
            return  # (ray.init raises at once: no cluster found)
        try:
            _check_reachable(recorded, timeout_s)
        except ConnectionError as e:
            raise ConnectionError(
                f"ray_address 'auto' is the cluster at {recorded!r} (the one `ray start` last "
                f"recorded on this node, or RAY_ADDRESS), which cannot be reached: {e}. Start "
                "one (`ray start --head`) or pass the live cluster's GCS host:port") from e
        return
    if "://" in address or ":" not in address:  # (Ray Client and other schemes: their own)
        return
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:port
    try:
        with socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)) as s:
            s.settimeout(min(timeout_s, 5.0))
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                reply = s.recv(5)
            except socket.timeout:
                reply = None
            except OSError:  # (a reset)
                reply = b""
    except (OSError, ValueError) as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r}: {e}") from e
    http = reply == b"HTTP/"
    if reply is None and os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        # a GCS (gRPC, HTTP/2) sends its SETTINGS frame as soon as it accepts a connection; a
        # silent server would keep ray.init retrying (inside Ray's C++ code: Ctrl-C cannot
        # reach it) without end. (A TLS GCS waits for the client's hello instead.)
        raise ConnectionError(f"{address!r} accepts connections but does not answer like a "
                              f"Ray GCS (no reply within {min(timeout_s, 5.0):g} s); "
                              f"{_GCS_HINT}")
    if http:
        raise ConnectionError(f"{address!r} answers HTTP: that is Ray's dashboard (port 8265 by "
                              f"default) or another web server, not the cluster's GCS; {_GCS_HINT}")
