"""Engine + RankWorker Ray actors on CPU: greedy ids equal HF transformers generate for world
size 1 (local), 2 and 4 (tp, dp_nvlink, dp_p2p); stop tokens; seeded sampling independent of
the topology; faults (a rank that raises, a misshaped tensor) end in a RankError naming the rank
with every actor gone. One Ray instance serves the whole file; engines are reused across
topologies through Engine.load()."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from moe_runtime.engine import Engine, RankError, SamplingParams  # noqa: E402
from moe_runtime.models.make_checkpoint import make_checkpoint  # noqa: E402

# different lengths; 5 prompts so that 4 dp ranks get uneven shares
PROMPTS = ["The quick brown fox jumps over the lazy dog. Once upon a time",
           "Hello", "A mixture of experts model sends", "Greedy decoding takes the most likely token",
           "Rotary position"]
NEW = 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    # (address "local": a new instance even where `ray start` left a cluster, or its address
    # file, on this machine)
    ray.init(address="local", num_cpus=16, num_gpus=torch.cuda.device_count(),
             include_dashboard=False, object_store_memory=100 * 1024 ** 2,
             logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("engine") / "qwen3"), "qwen3-moe", "tiny")


def hf_greedy(model_dir, prompts, new_tokens, eos_token_id=None):
    """HF generate(do_sample=False), one prompt at a time; generated ids cut after EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = hf.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=tok.eos_token_id,
                        **({} if eos_token_id is None else {"eos_token_id": eos_token_id}))
        g = g[0, ids.shape[1]:].tolist()
        out.append(g[:g.index(eos_token_id) + 1] if eos_token_id in g else g)
    return out


@pytest.fixture(scope="module")
def reference(ckpt):
    return hf_greedy(ckpt, PROMPTS, NEW)


@pytest.fixture(scope="module")
def engines(ray_session, ckpt):
    """Engines by world size, started on first use and shut down at the end of the module."""
    made: dict[int, Engine] = {}

    def get(world_size: int, topology: str) -> Engine:
        if world_size not in made:
            made[world_size] = Engine(ckpt, world_size=world_size, topology=topology, progress=False)
        eng = made[world_size]
        if eng.topology != topology:
            eng.load(topology)
        return eng

    yield get
    for eng in made.values():
        eng.shutdown()


def ids_of(result):
    return [c.token_ids for c in result.completions]


@pytest.mark.parametrize("world_size,topology", [
    (1, "local"), (2, "tp"), (2, "dp_nvlink"), (2, "dp_p2p"), (4, "tp"), (4, "dp_nvlink"), (4, "dp_p2p")])
def test_greedy_ids_equal_hf_generate(engines, reference, world_size, topology):
    eng = engines(world_size, topology)
    # (any iterable of prompts: a generator is read once)
    res = eng.generate((p for p in PROMPTS), SamplingParams(max_new_tokens=NEW))
    assert ids_of(res) == reference
    assert res.topology == topology and res.world_size == world_size
    assert [c.finish_reason for c in res.completions] == ["length"] * len(PROMPTS)
    assert res.prefill_tokens == sum(len(eng.tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert res.decode_tokens == len(PROMPTS) * (NEW - 1) and res.decode_tokens_per_s > 0
    experts = sorted(tuple(i["experts"]) for i in eng.rank_info)
    want = [(r * 8 // world_size, (r + 1) * 8 // world_size) for r in range(world_size)]
    assert experts == want  # experts partitioned across the ranks


def test_dp_ranks_without_requests_still_step(engines, reference):
    """4 dp ranks, 2 prompts: two ranks own nothing and must still join every MoE collective."""
    eng = engines(4, "dp_p2p")
    res = eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=NEW))
    assert ids_of(res) == reference[:2]
    assert sorted(len(o.request_ids) for o in res.per_rank) == [0, 0, 1, 1]
    assert len({o.steps for o in res.per_rank}) == 1  # lockstep


def test_stop_token_finishes_requests_at_different_steps(engines, ckpt, reference):
    stop = reference[0][4]
    want = hf_greedy(ckpt, PROMPTS, NEW, eos_token_id=stop)
    eng = engines(2, "dp_nvlink")
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
    assert ids_of(res) == want
    assert res.completions[0].finish_reason == "stop" and len(res.completions[0].token_ids) == 5


def test_seeded_sampling_is_the_same_on_every_topology(engines):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=11)
    runs = {topo: ids_of(engines(w, topo).generate(PROMPTS, params))
            for w, topo in [(1, "local"), (2, "tp"), (2, "dp_p2p")]}
    assert runs["local"] == runs["tp"] == runs["dp_p2p"]
    other = ids_of(engines(1, "local").generate(PROMPTS, SamplingParams(
        max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=12)))
    assert other != runs["local"]
    greedy = ids_of(engines(1, "local").generate(PROMPTS, SamplingParams(max_new_tokens=NEW)))
    assert greedy != runs["local"]


@pytest.mark.parametrize("world_size,topology", [(1, "local"), (2, "tp"), (2, "dp_p2p")])
def test_continuous_batching_gives_the_same_completions(engines, ckpt, reference, world_size,
                                                        topology):
    """max_batch_size caps the sequences a rank decodes together, and a finished request's KV
    cache slot takes the next waiting prompt while the others decode: seeded and greedy
    completions are those of one batch and of HF, also when a stop token ends requests at
    different steps, and the slots are refilled (fewer decode steps than consecutive batches
    of max_batch_size would take)."""
    eng = engines(world_size, topology)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=11)
    whole = eng.generate(PROMPTS, params)
    split = eng.generate(PROMPTS, params, max_batch_size=2)
    assert ids_of(split) == ids_of(whole)
    assert split.prefill_tokens == whole.prefill_tokens
    assert split.decode_tokens == whole.decode_tokens
    assert len(split.per_rank) == world_size and len({o.steps for o in split.per_rank}) == 1
    stop = reference[0][4]
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)),
                       max_batch_size=2)
    assert ids_of(res) == hf_greedy(ckpt, PROMPTS, NEW, eos_token_id=stop)
    if topology != "dp_p2p":  # (every rank holds all 5 prompts: consecutive pairs would take
        # 3 rounds of NEW - 1 steps, as the first pair's second request runs to the length)
        assert res.per_rank[0].steps < 3 * (NEW - 1)
    assert ids_of(eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW),
                               max_batch_size=1)) == reference
    for bad, error, msg in ((0, ValueError, "max_batch_size must be >= 1"),
                            (-1, ValueError, "max_batch_size must be >= 1"),
                            (2.5, TypeError, "max_batch_size must be an int"),
                            (True, TypeError, "max_batch_size must be an int")):
        with pytest.raises(error, match=msg):
            eng.generate(PROMPTS, params, max_batch_size=bad)


def test_mixtral_tp_equals_hf_generate(ray_session, tmp_path):
    d = make_checkpoint(str(tmp_path / "mixtral"), "mixtral", "tiny", max_shard_size="100KB")
    with Engine(d, world_size=2, topology="tp", progress=False) as eng:
        res = eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=8))
    assert ids_of(res) == hf_greedy(d, PROMPTS[:3], 8)


@pytest.mark.parametrize("arch,topology", [
    ("glm4-moe", "tp"), ("glm4-moe", "dp_nvlink"), ("deepseek-v3", "tp"),
    ("deepseek-v3", "dp_nvlink"), ("qwen2-moe", "tp"), ("olmoe", "dp_nvlink"), ("dots1", "tp")])
def test_glm4_moe_deepseek_v3_qwen2_moe_equal_hf_generate(ray_session, tmp_path, arch, topology):
    """GLM-4.5's structure (half-rotary heads, q/k/v biases) and DeepSeek-V3's (MLA: query and
    key/value latents, interleaved RoPE, values narrower than keys), both with a dense first
    layer, sigmoid group routing with a random correction bias and a shared expert, on 2 ranks:
    tp splits the heads (and their biases / latent up-projections), dp_nvlink the experts;
    Qwen2-MoE (q/k/v biases, a sigmoid-gated shared expert, no renormalization) under tp;
    OLMoE (q/k norms over all heads, q/k/v clipping) under dp_nvlink; dots.llm1 (QK norms,
    DeepSeek-V3 routing, two shared experts) under tp."""
    d = make_checkpoint(str(tmp_path / arch), arch, "tiny")
    with Engine(d, world_size=2, topology=topology, progress=False) as eng:
        res = eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=8))
    assert ids_of(res) == hf_greedy(d, PROMPTS[:3], 8)


def _wait_gone(pids, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        time.sleep(0.2)
    return alive


def _stat(pid) -> list[str]:
    """/proc/<pid>/stat's fields after "pid (comm)" (comm may hold spaces): state, ppid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _state(pid):
    try:
        return _stat(pid)[0]
    except OSError:
        return "gone"


def test_a_rank_that_raises_fails_the_driver_naming_the_rank(ray_session, ckpt):
    eng = Engine(ckpt, world_size=2, topology="tp", progress=False, timeout_s=60)
    pids = list(eng.worker_pids)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed during generate: RuntimeError: injected fault") as e:
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW), fail_at_step={1: 2})
    assert time.monotonic() - t0 < 30  # rank 0 is stuck in a collective; the driver does not wait for it
    assert e.value.rank == 1
    assert _wait_gone(pids) == []
    assert eng.workers == [] and eng.placement_group is None
    with pytest.raises(RuntimeError, match=r"the engine's ranks are gone \(rank 1 failed during "
                                           r"generate: RuntimeError: injected fault.*\): build a "
                                           r"new Engine"):  # (it said "shut down")
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match=r"the engine's ranks are gone"):  # (an IndexError)
        eng.load("dp_p2p")
    eng.shutdown()
    for call in (lambda: eng.generate(PROMPTS, SamplingParams(max_new_tokens=2)),
                 lambda: eng.load("tp")):
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            call()
    with pytest.raises(TypeError, match="prompts must be a str or a list of str, got NoneType"):
        eng.generate(None)


def test_a_stalled_rank_is_named_not_the_peer_that_timed_out(ray_session, ckpt):
    """Rank 1's process is stopped (SIGSTOP): rank 0 waits in a collective until it or the
    driver's bound times out, and the RankError names rank 1, which no longer answers, not
    rank 0."""
    eng = Engine(ckpt, world_size=2, topology="dp_p2p", progress=False, timeout_s=120)
    eng.timeout_s = 3  # (the driver's bound from here on; loading may take longer on CI)
    pids = list(eng.worker_pids)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(RankError, match=r"rank 1 failed during generate: TimeoutError: ranks "
                                            r"\[1\] stopped answering .*(rank 0 reported "
                                            r"CollectiveError|made no progress)") as e:
            eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
        assert e.value.rank == 1
        assert _wait_gone(pids) == []
    finally:
        if os.path.exists(f"/proc/{pids[1]}"):
            os.kill(pids[1], signal.SIGCONT)
        eng.shutdown()


def test_misshaped_expert_on_one_rank_fails_load_naming_rank_and_tensor(engines, ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    d = str(tmp_path / "broken")
    shutil.copytree(ckpt, d)
    path = os.path.join(d, "model.safetensors")
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = "model.layers.0.mlp.experts.6.up_proj.weight"  # expert 6: rank 1 of 2
    tensors[key] = torch.zeros(32, 65)
    save_file(tensors, path)
    engines(2, "dp_nvlink")  # (shared) live RankWorkers: the scan below must see them
    before = _rank_worker_pids()
    assert len(before) >= 2, before
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        Engine(d, world_size=2, topology="dp_nvlink", progress=False, timeout_s=60)
    msg = str(e.value)
    assert e.value.rank == 1 and "CheckpointError" in msg and key in msg and path in msg, msg
    assert "[32, 65]" in msg and "[32, 64]" in msg
    assert time.monotonic() - t0 < 60
    # the failed engine's actors are gone: only the shared engines' RankWorkers remain
    deadline = time.monotonic() + 20
    while not _rank_worker_pids() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rank_worker_pids() <= before


def _rank_worker_pids() -> set[int]:
    """Live processes whose title Ray set to `ray::RankWorker...` (one per rank actor) in this
    test's Ray instance: descendants of this process (ray.init started the raylet that forks
    the workers), so other Ray jobs on the machine do not count."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if (f.read().startswith(b"ray::RankWorker") and _state(pid) != "Z"
                            and _descends_from_me(int(pid))):
                        out.add(int(pid))
            except OSError:
                pass
    return out


def _descends_from_me(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        pid = int(_stat(pid)[1])
    return False


def test_bad_topology_for_world_size_fails_before_ray_work(ckpt):
    with pytest.raises(ValueError, match="local"):
        Engine(ckpt, world_size=2, topology="local")
    with pytest.raises(ValueError, match="topology"):
        Engine(ckpt, world_size=1, topology="nvls")


@pytest.mark.parametrize("attention,want", [("dp", "dp_p2p"), ("tp", "tp")])
def test_auto_topology_asks_the_selector(ray_session, ckpt, reference, attention, want):
    with Engine(ckpt, world_size=2, topology="auto", attention=attention, progress=False) as eng:
        assert eng.topology == want and "CPU" in eng.topology_reason
        assert ids_of(eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=NEW))) == reference[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,topology", [(1, "local"), (2, "tp"), (2, "dp_nvlink")])
def test_cuda_ranks_greedy_ids_equal_hf_generate(ray_session, ckpt, reference, world_size, topology):
    """GPU ranks (nccl between them) give HF's greedy ids on the fp32 tiny checkpoint."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    with Engine(ckpt, world_size=world_size, topology=topology, device="cuda", progress=False) as eng:
        assert eng.device == "cuda"
        assert ids_of(eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))) == reference


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["tp", "dp_nvlink"])
def test_gpu_ranks_replay_their_decode_steps_from_cuda_graphs(ray_session, tmp_path, topology):
    """2 GPU ranks, bf16: each actor sees one GPU, so the MoE topologies exchange over NCCL,
    and every rank replays its decode steps from a CUDA graph (RankOutput.extra), giving the
    eager steps' tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    d = make_checkpoint(str(tmp_path / "bf16"), "qwen3-moe", "tiny", dtype="bfloat16")
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=[])
    got = []
    for graphs in (True, False):
        with Engine(d, world_size=2, topology=topology, device="cuda", progress=False,
                    cuda_graphs=graphs) as eng:
            got.append(eng.generate(PROMPTS, params))
    assert [[o.extra["cuda_graphs"] for o in r.per_rank] for r in got] == [[True, True], [False, False]]
    assert ids_of(got[0]) == ids_of(got[1])
    assert all(len(t) == NEW for t in ids_of(got[0]))


def test_bad_requests_are_rejected_in_the_driver_and_the_engine_lives_on(engines, reference):
    eng = engines(2, "dp_nvlink")
    vocab = eng.spec.vocab_size
    for bad in ([[vocab]], [[-1]], [[5, vocab + 7]]):
        with pytest.raises(ValueError, match=f"vocab_size={vocab}"):
            eng.generate_ids(bad, SamplingParams(max_new_tokens=2))
    # a single string is one prompt (as vLLM's LLM.generate), not one prompt per character
    one = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=NEW))
    assert len(one.completions) == 1 and one.completions[0].token_ids == reference[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_sampling_params_reject_non_finite_temperature(bad):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=float("nan"))


def test_unreachable_ray_address_fails_fast(ckpt):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        Engine(ckpt, world_size=1, topology="local", ray_address=f"127.0.0.1:{port}", timeout_s=5)


def test_http_addresses_fail_fast_naming_the_gcs(ckpt, monkeypatch):
    """Ray's dashboard / job-API address (what `ray job submit` takes) is not the cluster's GCS:
    ray.init retried it without end (Ctrl-C and timeout_s ignored); refused at once."""
    import http.server
    import threading
    import ray
    started = ray.is_initialized()
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=f"'127.0.0.1:{port}' answers HTTP: that is Ray's "
                                                  f"dashboard .* not the cluster's GCS"):
            Engine(ckpt, world_size=1, topology="local", ray_address=f"127.0.0.1:{port}")
        with pytest.raises(ValueError, match="ray_address 'http://.*' is an HTTP address .* "
                                             "host:6379"):
            Engine(ckpt, world_size=1, topology="local", ray_address=f"http://127.0.0.1:{port}")
        with monkeypatch.context() as m:  # (from the environment, e.g. set for the jobs CLI)
            from types import SimpleNamespace
            m.setenv("RAY_ADDRESS", f"http://127.0.0.1:{port}")
            not_started = SimpleNamespace(is_initialized=lambda: False)
            with pytest.raises(ValueError, match="RAY_ADDRESS in the environment 'http://.*' is "
                                                 "an HTTP address"):
                _bare_engine()._init_ray(not_started, None, "cpu", {})
        assert time.monotonic() - t0 < 30 and ray.is_initialized() == started
    finally:
        server.shutdown()
        server.server_close()


def test_bad_arguments_fail_before_ray_starts(ckpt):
    import ray
    started = ray.is_initialized()
    with pytest.raises(ValueError, match="attention must be 'dp' or 'tp', got 'xx'"):
        Engine(ckpt, world_size=1, attention="xx")
    with pytest.raises(ValueError, match="backend 'cute' runs CuTeDSL kernels on GPUs"):
        Engine(ckpt, world_size=1, topology="local", device="cpu", backend="cute")
    with pytest.raises(ValueError, match="ray_address must be 'auto' or the cluster's GCS host:port"):
        Engine(ckpt, world_size=1, topology="local", ray_address=" ")
    for bad in ("garbage", "10.0.0.1:0", "10.0.0.1:port", ":6379"):
        with pytest.raises(ValueError, match=f"GCS host:port \\(e.g. 10.0.0.1:6379\\), got '{bad}'"):
            Engine(ckpt, world_size=1, topology="local", ray_address=bad)
    with pytest.raises(ValueError, match=r"'::1:6379': write an IPv6 host in brackets, \[::1\]:6379"):
        Engine(ckpt, world_size=1, topology="local", ray_address="::1:6379")
    from moe_runtime.engine.driver import check_ray_address
    for ok in ("auto", "local", "ray://head:10001", "anyscale://prod", "[::1]:6379",
               "head-1.cluster:6379", "localhost:6379"):
        check_ray_address(ok)
    from moe_runtime.engine.driver import _check_reachable
    _check_reachable("anyscale://prod", 1.0)  # (a scheme's own connection: no TCP probe here)
    if not started and torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="2 GPU rank\\(s\\) need as many GPUs"):
            Engine(ckpt, world_size=2, topology="tp", device="cuda")
    assert ray.is_initialized() == started


def test_a_second_engine_on_anothers_embedded_ray_is_refused():
    """Ray runs once per process: a second Engine would join the first one's embedded Ray
    (sized for the first one's ranks, and stopped by its shutdown) and wait timeout_s for room.
    A Ray left by an Engine collected without shutdown() is stopped; one that is no longer the
    embedded one (the user's own) is joined; a stale Engine's shutdown() leaves a later
    Engine's Ray alone."""
    import weakref
    from types import SimpleNamespace

    from moe_runtime.engine import driver
    stopped = []
    gcs = ["10.0.0.1:6379"]
    fake_ray = SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {"CPU": 2.0},
                               get_runtime_context=lambda: SimpleNamespace(gcs_address=gcs[0]),
                               shutdown=lambda: stopped.append(True))
    first, second = _bare_engine(), _bare_engine()
    try:
        driver._EMBEDDED.update(owner=weakref.ref(first), gcs="10.0.0.1:6379")
        with pytest.raises(RuntimeError, match="another Engine of this process runs on the Ray it "
                                               "started embedded"):
            second._init_ray(fake_ray, None, "cpu", {})
        first._init_ray(fake_ray, None, "cpu", {})  # (its own Ray: fine)
        assert driver._EMBEDDED["owner"]() is first
        del first  # collected without shutdown(): its Ray is stopped, the next Engine goes on
        second._init_ray(fake_ray, None, "cpu", {})
        assert stopped == [True] and not driver._EMBEDDED and second.device == "cpu"
        driver._EMBEDDED.update(owner=weakref.ref(second), gcs="10.0.0.1:6379")
        gcs[0] = "10.0.0.2:6379"  # the user's own Ray now
        third = _bare_engine()
        third._init_ray(fake_ray, None, "cpu", {})
        assert stopped == [True] and not driver._EMBEDDED
    finally:
        driver._EMBEDDED.clear()


@pytest.mark.parametrize("later", ["another Engine's embedded Ray", "the user's own Ray"])
def test_a_stale_engines_shutdown_leaves_a_later_ray_alone(monkeypatch, later):
    """An Engine whose Ray was stopped under it (ray.shutdown()), then another Ray started (by a
    later Engine, or by the user), must not stop that Ray or kill its actors when it is shut
    down at last: it touches only the Ray it ran on (its GCS address)."""
    import weakref
    from types import SimpleNamespace

    from moe_runtime.engine import driver
    stopped, killed = [], []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.2:6379"))
    monkeypatch.setattr(ray, "kill", lambda w, no_restart: killed.append(w))
    monkeypatch.setattr(ray, "wait", lambda *a, **k: ([], []))
    stale, current = _bare_engine(), _bare_engine()
    stale._started_ray, stale._ray_gcs, stale.workers = True, "10.0.0.1:6379", ["stale actor"]
    current._ray_gcs, current.workers = "10.0.0.2:6379", []
    embedded = current._started_ray = later == "another Engine's embedded Ray"
    if embedded:
        driver._EMBEDDED.update(owner=weakref.ref(current), gcs="10.0.0.2:6379")
    try:
        stale.shutdown()
        assert stopped == [] and killed == [] and stale.workers == []
        assert (driver._EMBEDDED.get("owner") is not None) == embedded
        current.shutdown()
        assert stopped == ([True] if embedded else []) and not driver._EMBEDDED
    finally:
        driver._EMBEDDED.clear()


def test_a_silent_address_fails_fast():
    """A listener that never answers (not a GCS: a GCS sends its HTTP/2 SETTINGS frame at once)
    would keep ray.init retrying inside Ray's C++ code, out of Ctrl-C's reach."""
    import socket

    from moe_runtime.engine.driver import _check_reachable
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="accepts connections but does not answer like "
                                                  "a Ray GCS"):
            _check_reachable(f"127.0.0.1:{port}", 1.0)
        assert time.monotonic() - t0 < 5


def test_auto_resolving_to_a_dead_recorded_cluster_fails_fast(tmp_path, monkeypatch):
    """ray_address 'auto' with a cluster that a `ray start` recorded and that has died since:
    ray.init would retry it without end (found by a fresh-user trial); the address Ray resolves
    'auto' to is checked like any other."""
    import socket

    from ray._private import services

    from moe_runtime.engine.driver import _check_reachable
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # (no GCS runs here)
    t0 = time.monotonic()
    # (Ray resolves 127.0.0.1 to this node's address)
    with pytest.raises(ConnectionError, match=rf"ray_address 'auto' is the cluster at "
                                              rf"'[^']*:{port}' .* cannot be reached"):
        _check_reachable("auto", 2.0)
    assert time.monotonic() - t0 < 5
    (tmp_path / "ray" / "ray_current_cluster").unlink()  # nothing recorded: Ray's own error
    _check_reachable("auto", 2.0)


def test_an_ignored_sigint_stays_ignored_during_ray_init(monkeypatch):
    """A background job (SIGINT ignored, as deploy/README.md runs it) is not made
    interruptible by the Ctrl-C holding around ray.init."""
    import signal

    from moe_runtime.engine import driver
    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(signal.getsignal(signal.SIGINT)))
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(seen))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _bare_engine()._start_ray(None, "cpu", {})
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
        driver._EMBEDDED.clear()


def test_indivisible_world_size_and_bad_timeout_fail_before_ray_starts(ckpt):
    import ray
    started = ray.is_initialized()
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible by world_size \(3\)"):
        Engine(ckpt, world_size=3, topology="dp_p2p")
    for bad in (0, 1e-4):  # (the ranks refuse bounds below c10d's whole millisecond)
        with pytest.raises(ValueError, match=r"timeout_s must be in \[0.001, 1e\+06\] s"):
            Engine(ckpt, world_size=1, topology="local", timeout_s=bad)
    with pytest.raises(ValueError, match="backend must be auto, reference or cute, got 'triton'"):
        Engine(ckpt, world_size=1, topology="local", backend="triton")
    with pytest.raises(TypeError, match="world_size must be an int, got str '2'"):
        Engine(ckpt, world_size="2", topology="local")
    # bounds Ray and torch.distributed overflow on (inf, 1e10 and 1e14 s failed after Ray started)
    for bad in (float("inf"), float("nan"), 1e10):
        with pytest.raises(ValueError, match=r"timeout_s must be in \[0.001, 1e\+06\] s"):
            Engine(ckpt, world_size=1, topology="local", timeout_s=bad)
    for bad, msg in (("30", "timeout_s must be a number, got str '30'"),
                     (True, "timeout_s must be a number, got bool True")):
        with pytest.raises(TypeError, match=msg):
            Engine(ckpt, world_size=1, topology="local", timeout_s=bad)
    assert ray.is_initialized() == started


@pytest.mark.parametrize("gpus,device,embedded,want", [
    (0, "auto", False, "cpu"), (0, "auto", True, "cpu"), (0, "cpu", False, "cpu"),
    (16, "auto", False, "cuda"), (8, "auto", False, "cuda"), (1, "cuda", False, "cuda"),
    (8, "cpu", False, "cpu"), (8, "auto", True, ValueError), (8, "cuda", True, ValueError),
    (16, "cuda", True, "cuda")])
def test_device_choice_from_cluster_gpus(gpus, device, embedded, want, caplog):
    """auto: CPU ranks only on a cluster without GPUs; fewer GPUs than ranks on a joined cluster
    still asks for GPU bundles (an autoscaler may add nodes) with a warning; embedded: an error."""
    from types import SimpleNamespace
    fake_ray = SimpleNamespace(is_initialized=lambda: True,
                               cluster_resources=lambda: {"CPU": 64.0, "GPU": float(gpus)})
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s, eng._started_ray, eng.backend = 16, 30.0, embedded, "auto"
    if want is ValueError:
        with pytest.raises(ValueError, match=f"16 GPU rank\\(s\\) need as many GPUs, this machine has {gpus}"):
            eng._init_ray(fake_ray, None, device, {})
        return
    with caplog.at_level(logging.WARNING, logger="moe_runtime"):
        eng._init_ray(fake_ray, None, device, {})
    assert eng.device == want
    assert ("requesting the GPU bundles anyway" in caplog.text) == (want == "cuda" and gpus < 16)


@pytest.mark.parametrize("gpus,ok", [(0, False), (8, True)])
def test_cute_backend_on_a_cluster_without_gpus_fails_before_the_ranks_start(gpus, ok):
    """device "auto" on a cluster with no GPU gives CPU ranks, which backend "cute" cannot run
    on: a ValueError once the device is known (not a dead engine at the first generate)."""
    from types import SimpleNamespace
    fake_ray = SimpleNamespace(is_initialized=lambda: True,
                               cluster_resources=lambda: {"CPU": 64.0, "GPU": float(gpus)})
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s, eng._started_ray, eng.backend = 8, 30.0, False, "cute"
    if ok:
        eng._init_ray(fake_ray, None, "auto", {})
        assert eng.device == "cuda"
        return
    with pytest.raises(ValueError, match="backend 'cute' .* device 'auto' resolved to CPU ranks"):
        eng._init_ray(fake_ray, None, "auto", {})


def test_load_tp_of_a_model_whose_heads_do_not_split_fails_before_the_ranks(tmp_path):
    """Engine.load("tp") checks the heads as the constructor does (OLMoE's q/k norms span all
    heads): a ValueError before any rank is asked, so the loaded model stays usable."""
    from moe_runtime.models import read_spec
    from moe_runtime.models.make_checkpoint import make_checkpoint
    make_checkpoint(str(tmp_path), arch="olmoe", preset="tiny", progress=False)
    eng = _bare_engine()
    eng.spec = read_spec(str(tmp_path), "auto")[0]
    eng._load = lambda *a: pytest.fail("the ranks were asked to load")
    with pytest.raises(ValueError, match="q/k RMSNorm spans all heads"):
        eng.load("tp")


def test_join_failure_names_our_option():
    """ray.init(address="auto") without a cluster: the error names --ray-address (Ray's own text
    names its CLI's --address flag)."""
    from types import SimpleNamespace

    def refuse(**kw):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one "
                              "to connect to by setting `--address` flag")
    fake_ray = SimpleNamespace(is_initialized=lambda: False, init=refuse)
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s, eng._started_ray = 2, 30.0, False
    with pytest.raises(ConnectionError, match=r"cannot join the Ray cluster at 'auto' "
                                              r"\(--ray-address or RAY_ADDRESS"):
        eng._init_ray(fake_ray, "auto", "auto", {})


def test_embedded_ray_is_a_new_local_instance():
    """ray_address=None starts Ray with address="local": a cluster already running on this
    machine (`ray start --head`) must not be joined with num_cpus/num_gpus (Ray refuses that)."""
    from types import SimpleNamespace
    calls = []
    fake_ray = SimpleNamespace(is_initialized=lambda: bool(calls), init=lambda **kw: calls.append(kw),
                               cluster_resources=lambda: {"CPU": 4.0})
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s, eng._started_ray = 2, 30.0, False
    eng._init_ray(fake_ray, None, "cpu", {})
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 2 and eng._started_ray


def test_ray_address_from_the_environment_is_joined(monkeypatch):
    """Under `ray job submit` (RAY_ADDRESS set) an Engine built from Python joins that cluster."""
    from types import SimpleNamespace

    from moe_runtime.engine import driver
    calls, checked = [], []
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(driver, "_check_reachable", lambda address, timeout_s: checked.append(address))
    fake_ray = SimpleNamespace(is_initialized=lambda: bool(calls), init=lambda **kw: calls.append(kw),
                               cluster_resources=lambda: {"CPU": 4.0})
    eng = _bare_engine()
    eng._init_ray(fake_ray, None, "cpu", {})
    assert checked == ["10.0.0.1:6379"] and calls == [{"address": "10.0.0.1:6379"}]
    assert not eng._started_ray


def _bare_engine(world_size: int = 2) -> Engine:
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s, eng._started_ray = world_size, 30.0, False
    eng.workers, eng.placement_group, eng._joined_ray, eng._stopped_by = [], None, False, None
    return eng


def test_an_engine_that_joined_a_cluster_disconnects_at_shutdown(monkeypatch):
    """A cluster an Engine joined stayed connected after its shutdown: the next Engine in the
    process reused that connection and, once the cluster had restarted, Ray's C++ check
    aborted the whole process. A connection the user made (ray.init before the Engine) stays."""
    from types import SimpleNamespace

    from moe_runtime.engine import driver
    state = {"up": False, "shutdowns": 0}
    fake = SimpleNamespace(
        is_initialized=lambda: state["up"], init=lambda **kw: state.update(up=True),
        shutdown=lambda: state.update(up=False, shutdowns=state["shutdowns"] + 1),
        cluster_resources=lambda: {"CPU": 4.0},
        get_runtime_context=lambda: SimpleNamespace(gcs_address="10.0.0.1:6379"))
    monkeypatch.setattr(driver, "_check_reachable", lambda address, timeout_s: None)
    monkeypatch.setattr(driver, "_ray_module", lambda: fake)
    eng = _bare_engine()
    eng._init_ray(fake, "10.0.0.1:6379", "cpu", {})
    eng.shutdown()
    assert state == {"up": False, "shutdowns": 1}
    state["up"] = True  # (the user's own ray.init)
    eng = _bare_engine()
    eng._init_ray(fake, "10.0.0.1:6379", "cpu", {})
    eng.shutdown()
    assert state == {"up": True, "shutdowns": 1}


def test_signal_inside_ray_init_is_an_interrupt_and_stops_the_half_started_ray(monkeypatch):
    """ray.init's own SIGTERM handler exits (SystemExit) when the signal lands inside it: the
    engine raises KeyboardInterrupt instead, carrying the signal (the CLI's exit 143), and its
    shutdown stops the Ray it was starting, though ray.is_initialized() never became True."""
    from moe_runtime.cli import _interrupted_code
    stopped = []

    def init(**kw):
        raise SystemExit(15)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    eng = _bare_engine()
    with pytest.raises(KeyboardInterrupt, match="signal during ray.init") as e:
        eng._start_ray(None, "cpu", {})
    assert _interrupted_code(e.value) == 143
    try:  # (a Ctrl-C during the clean-up that follows keeps the SIGTERM's code)
        try:
            raise e.value
        except KeyboardInterrupt:
            raise KeyboardInterrupt("Ctrl-C during the shutdown")
    except KeyboardInterrupt as later:
        assert _interrupted_code(later) == 143
    eng.shutdown()
    eng.shutdown()  # idempotent
    assert stopped == [True]
    def init_exiting_1(**kw):
        raise SystemExit(1)
    monkeypatch.setattr(ray, "init", init_exiting_1)  # (not a signal: passed on)
    with pytest.raises(SystemExit):
        _bare_engine()._start_ray(None, "cpu", {})


def test_ctrl_c_inside_ray_init_is_held_until_it_returns(monkeypatch):
    """SIGINT while ray.init runs is raised as KeyboardInterrupt only after it returned (an
    interrupt inside Ray's start-up left its agents running), and the handler is restored."""
    import signal
    started = []

    def init(**kw):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs here, between bytecodes)
        started.append(True)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    before = signal.getsignal(signal.SIGINT)
    eng = _bare_engine()
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C during ray.init"):
        eng._start_ray(None, "cpu", {})
    assert started == [True] and eng._started_ray and signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_interrupts_a_ray_init_that_does_not_return(monkeypatch):
    import signal

    def init(**kw):  # (a join that waits without end)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        time.sleep(30)
        pytest.fail("the second Ctrl-C did not interrupt")
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    before = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="a second Ctrl-C during ray.init"):
        _bare_engine()._start_ray(None, "cpu", {})
    assert time.monotonic() - t0 < 10 and signal.getsignal(signal.SIGINT) is before


def test_load_warnings_of_the_ranks_reach_the_driver(ray_session, ckpt, tmp_path):
    """A rank's loader warning (an unused checkpoint tensor) is raised by the driver (Ray
    forwards a worker's stderr only asynchronously, after the output at times)."""
    from safetensors.torch import load_file, save_file
    d = str(tmp_path / "extra")
    shutil.copytree(ckpt, d)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["foo.bar"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.warns(UserWarning, match=r"not used .*foo\.bar.* \(rank 0\)"):
        eng = Engine(d, world_size=1, topology="local", progress=False)
    eng.shutdown()


def test_signal_inside_import_ray_shuts_down_quietly(monkeypatch):
    """A signal inside `import ray` leaves a partial module in sys.modules: the engine's and the
    CLI's clean-up must not touch it (it raised AttributeError, hiding the interrupt)."""
    import sys
    import types

    from moe_runtime.cli import _stop_ray
    partial = types.ModuleType("ray")
    partial.__spec__ = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, "ray", partial)
    eng = _bare_engine()
    eng._started_ray = True
    eng.shutdown()
    _stop_ray()


def test_interrupt_during_a_call_kills_the_ranks_at_once(monkeypatch):
    """Ctrl-C while the ranks run a call (generate): their actors are killed right away, since
    they would take shutdown's call only after the running one (the CLI waited 10 s)."""
    from types import SimpleNamespace
    killed = []

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(ray, "wait", interrupted)
    eng = _bare_engine()
    method = SimpleNamespace(remote=lambda *a, **kw: object())
    eng.workers = [SimpleNamespace(generate=method) for _ in range(2)]
    monkeypatch.setattr(eng, "_kill_workers", lambda: killed.append(True))
    with pytest.raises(KeyboardInterrupt):
        eng._call_all("generate", "generate")
    assert killed == [True]


def test_generate_runs_past_timeout_while_it_progresses(engines):
    """timeout_s bounds generate's time without progress, not its length: with a bound far
    below the generation's time the ranks finish (the driver reads their step counts)."""
    eng = engines(2, "tp")
    saved = eng.timeout_s
    eng.timeout_s = 0.2
    try:
        t0 = time.monotonic()
        out = eng.generate(["Hello"], SamplingParams(max_new_tokens=400))
        took = time.monotonic() - t0
    finally:
        eng.timeout_s = saved
    assert took > 1.0 and len(out.completions[0].token_ids) > 1  # several bounds long


def test_generate_without_progress_times_out_naming_the_ranks(monkeypatch):
    """Step counts that stop advancing end the call after one timeout_s without progress: a
    RankError naming the stuck ranks, every actor killed."""
    from types import SimpleNamespace
    main = [object(), object()]
    counts = iter([3, 3, 5, 5, 5, 5, 5, 5])  # (ranks 0, 1 per query) advances twice, then stops
    progress_refs = set()

    def remote_progress():
        ref = object()
        progress_refs.add(ref)
        return ref

    def wait(refs, num_returns=1, timeout=None):
        if all(r in progress_refs for r in refs):
            return list(refs), []
        time.sleep(timeout)
        return [], list(refs)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda ref: next(counts))
    eng = _bare_engine()
    eng.timeout_s = 0.2
    refs = iter(main)
    eng.workers = [SimpleNamespace(generate=SimpleNamespace(remote=lambda *a, **kw: next(refs)),
                                   progress=SimpleNamespace(remote=remote_progress))
                   for _ in range(2)]
    killed = []
    monkeypatch.setattr(eng, "_kill_workers", lambda: killed.append(True))
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 failed during generate: TimeoutError: ranks "
                                        r"\[0, 1\] made no progress for 0.2s \(timeout_s, "
                                        r"the CLI's --timeout: raise it"):
        eng._call_all("generate", "generate", progress=True)
    assert killed == [True] and 0.5 < time.monotonic() - t0 < 5  # two bounds extended it once


def test_check_prompts_names_the_prompt(ckpt):
    from moe_runtime.engine.driver import check_prompts
    from moe_runtime.models import read_spec
    spec = read_spec(ckpt)[0]  # vocab 512, max_position_embeddings 512
    check_prompts([[1, 2], [3]], spec, 510)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        check_prompts([[1, 2], [], [3]], spec, 4)
    with pytest.raises(ValueError, match=r"prompt 2 has 512"):
        check_prompts([[1], [2], [3, 512]], spec, 4)
    # positions fed: the prompt's and every new token's but the last (sampled, never fed)
    check_prompts([[1, 2], [1, 2, 3]], spec, 510)
    check_prompts([[1] * 512], spec, 1)  # (was refused)
    with pytest.raises(ValueError, match=r"prompt 1 \(3 tokens\) \+ max_new_tokens \(511\) - 1 "
                                         r"exceeds max_position_embeddings \(512\)"):
        check_prompts([[1, 2], [1, 2, 3]], spec, 511)


def test_bad_sampling_params_never_reach_the_ranks(ckpt):
    """A SamplingParams whose max_new_tokens became a float after construction (or not a
    SamplingParams at all) is refused in the driver: the ranks are not called, the engine lives."""
    from moe_runtime.models import read_spec
    eng = Engine.__new__(Engine)
    eng.spec, eng.workers = read_spec(ckpt)[0], ["a live rank"]
    eng._call_all = lambda *a, **k: pytest.fail("reached the ranks")
    bad = SamplingParams(max_new_tokens=4)
    object.__setattr__(bad, "max_new_tokens", 2.5)
    with pytest.raises(TypeError, match="max_new_tokens must be an int, got float 2.5"):
        eng.generate_ids([[1, 2]], bad)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate_ids([[1, 2]], {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate_ids([[], [1]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000000000000000000000000000\] are "
                                         r"outside the vocabulary"):
        eng.generate_ids([[1]], SamplingParams(max_new_tokens=4, stop_token_ids=[10**30, 1]))
    # token ids that are not ints (ids from a JSON payload as strings killed every rank; a
    # string prompt's characters became ids; floats were truncated)
    for bad, msg in ((["123"], r"prompt 0 must be a sequence of token ids, got str '123'"),
                     ([[1, "5"]], r"prompt 0 token 1 must be an int, got str '5'"),
                     ([[1], [2.5]], r"prompt 1 token 0 must be an int, got float 2.5"),
                     ([[True]], r"prompt 0 token 0 must be an int, got bool True"),
                     ("12", "prompt_ids must be a list of token id lists .*, got str"),
                     ([7], "prompt 0 must be a sequence of token ids, got int 7"),
                     ([memoryview(b"ab")], "prompt 0 must be a sequence of token ids, got "
                                           "memoryview"),
                     ([{3, 1, 2}], "prompt 0 must be a sequence of token ids, got set"),
                     ({(1, 2), (3,)}, "prompt_ids must be a list of token id lists .*, got set"),
                     (torch.tensor([1, 2]), r"got a 1-d tensor"),  # (torch's 0-d tensor error)
                     ([torch.tensor(5)], "prompt 0 must be a sequence of token ids, got a 0-d "
                                         "tensor"),
                     ([torch.tensor([1.0])], "prompt 0 token 0 must be an int, got float 1.0")):
        with pytest.raises(TypeError, match=msg):
            eng.generate_ids(bad, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompts labels 1 completions, prompt_ids has 2"):
        eng.generate_ids([[1], [2]], SamplingParams(max_new_tokens=4), prompts=["one"])
    with pytest.raises(TypeError, match="max_batch_size must be an int, got float 2.0"):
        eng.generate_ids([[1]], SamplingParams(max_new_tokens=4), max_batch_size=2.0)
    with pytest.raises(TypeError, match="prompts must be a str or a list of str, got dict"):
        eng.generate({"a": 1}, SamplingParams(max_new_tokens=4))
    assert eng.workers == ["a live rank"]


def test_checkpoint_without_weights_fails_before_ray_starts(ckpt, tmp_path):
    """config.json but no model.safetensors / index (a config-only checkpoint): a CheckpointError
    in Engine(), not a RankError after the workers started."""
    import ray

    from moe_runtime.models import CheckpointError
    cfg_only = str(tmp_path / "cfg_only")
    shutil.copytree(ckpt, cfg_only, ignore=shutil.ignore_patterns("*.safetensors"))
    started = ray.is_initialized()
    with pytest.raises(CheckpointError, match="no weights: neither model.safetensors nor "
                                              "model.safetensors.index.json"):
        Engine(cfg_only, world_size=1, topology="local")
    open(os.path.join(cfg_only, "pytorch_model.bin"), "wb").close()  # (another format)
    with pytest.raises(CheckpointError, match=r"index.json \(it holds pytorch_model.bin: only "
                                              "HF's safetensors layout is read; convert it"):
        Engine(cfg_only, world_size=1, topology="local")
    open(os.path.join(cfg_only, "model-00001-of-00002.safetensors"), "wb").close()
    with pytest.raises(CheckpointError, match=r"the shards' index, model.safetensors.index.json, "
                                              "is missing"):
        Engine(cfg_only, world_size=1, topology="local")
    assert ray.is_initialized() == started


def test_checkpoint_with_a_missing_shard_fails_before_ray_starts(tmp_path):
    """The index names a shard that is not there: CheckpointError in Engine(), before Ray."""
    from moe_runtime.models import CheckpointError
    d = make_checkpoint(str(tmp_path / "mixtral"), "mixtral", "tiny", max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(d, shard))
    started = ray.is_initialized()
    with pytest.raises(CheckpointError, match=f"names shard '{shard}', which is missing"):
        Engine(d, world_size=1, topology="local")
    assert ray.is_initialized() == started


def test_a_relative_model_path_reaches_the_ranks_absolute(ckpt, monkeypatch):
    """The ranks of a joined cluster (`ray start`, the deploy entry) run in another working
    directory: a relative --model that the driver had found failed there with "no config.json"."""
    seen = []

    def stop(self, *a):
        seen.append(self.model_dir)
        raise KeyboardInterrupt("stop before Ray starts")
    monkeypatch.setattr(Engine, "_start_ray", stop)
    monkeypatch.chdir(os.path.dirname(ckpt))
    with pytest.raises(KeyboardInterrupt):
        Engine(os.path.basename(ckpt), world_size=1, topology="local")
    assert seen == [os.path.abspath(ckpt)]


def test_checkpoint_without_tokenizer_fails_before_ray_starts(ckpt, tmp_path):
    """Weights and config but no tokenizer files (a model's save_pretrained alone): transformers
    returns an empty tokenizer there; Engine() and the CLI name the missing tokenizer instead of
    calling every prompt empty."""
    import ray

    from moe_runtime.cli import main
    from moe_runtime.models import CheckpointError
    no_tok = str(tmp_path / "no_tokenizer")
    os.makedirs(no_tok)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(ckpt, f), no_tok)
    started = ray.is_initialized()
    with pytest.raises(CheckpointError, match="no usable tokenizer"):
        Engine(no_tok, world_size=1, topology="local")
    assert ray.is_initialized() == started
    assert main(["generate", "--model", no_tok, "--prompt", "hello world"]) != 0


def test_unreadable_tokenizer_and_config_are_named(ckpt, tmp_path, capsys):
    """A tokenizer.json that is not JSON, and a config.json field of the wrong type (a
    huggingface_hub error class outside the CLI's list): one line naming the checkpoint, exit 1."""
    from moe_runtime.cli import main
    bad_tok, bad_cfg = str(tmp_path / "bad_tok"), str(tmp_path / "bad_cfg")
    for d in (bad_tok, bad_cfg):
        shutil.copytree(ckpt, d)
    with open(os.path.join(bad_tok, "tokenizer.json"), "w") as f:
        f.write("not json")
    with open(os.path.join(bad_cfg, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(bad_cfg, "config.json"), "w") as f:
        json.dump({**cfg, "hidden_size": str(cfg["hidden_size"])}, f)
    for d, what in ((bad_tok, "cannot load its tokenizer"), (bad_cfg, "config.json: ")):
        assert main(["generate", "--model", d, "--prompt", "hello world"]) == 1
        err = capsys.readouterr().err
        assert f"moe-runtime: error: {d}" in err and what in err and "Traceback" not in err
    for bad, what in (("", "--ray-address must be 'auto' or the cluster's GCS host:port"),
                      ("http://127.0.0.1:8265", "--ray-address 'http://127.0.0.1:8265' is an "
                                                "HTTP address")):  # exit 2, before Ray starts
        assert main(["generate", "--model", ckpt, "--prompt", "hi", "--ray-address", bad]) == 2
        assert what in capsys.readouterr().err


def test_a_tokenizer_config_without_tokenizer_json_is_named(ckpt, tmp_path):
    """transformers' error for it asks for sentencepiece / tiktoken; the message says which
    file is missing first."""
    from moe_runtime.engine.driver import load_tokenizer
    from moe_runtime.models import CheckpointError
    d = str(tmp_path / "half_tok")
    shutil.copytree(ckpt, d)
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(CheckpointError, match="cannot load its tokenizer \\(tokenizer_config.json "
                                              "is there but tokenizer.json is not"):
        load_tokenizer(d)
    assert load_tokenizer(ckpt)("a b")["input_ids"]


def test_prompts_file_of_blank_lines_is_a_usage_error_and_crlf_is_stripped(tmp_path):
    from types import SimpleNamespace

    from moe_runtime.cli import UsageError, _read_prompts
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"hello there\r\n\r\nsecond one\r\n")
    assert _read_prompts(SimpleNamespace(prompt=None, prompts_file=str(f))) == ["hello there", "second one"]
    f.write_text("\n  \n")
    with pytest.raises(UsageError, match="no prompts"):
        _read_prompts(SimpleNamespace(prompt=None, prompts_file=str(f)))


def test_an_interrupt_while_submitting_a_call_kills_the_ranks_already_busy():
    """Ctrl-C / SIGTERM between two ranks' submissions (right after the CLI prints "loaded")
    left rank 0 busy and unkilled: shutdown's graceful call then waited its full 10 s behind
    rank 0's generate (a CI flake of the signal test). Ranks are stubs here; no Ray starts."""
    class Method:
        def __init__(self, rank, log):
            self.rank, self.log = rank, log

        def remote(self, *args, **kwargs):
            if self.rank == 1:
                raise KeyboardInterrupt("signal 15")
            self.log.append(self.rank)
            return object()

    class Worker:
        def __init__(self, rank, log):
            self.generate = Method(rank, log)

    submitted, killed = [], []
    eng = Engine.__new__(Engine)
    eng.world_size, eng.timeout_s = 2, 60.0
    eng.workers = [Worker(r, submitted) for r in range(2)]
    eng._kill_workers = lambda: killed.append(len(submitted))
    with pytest.raises(KeyboardInterrupt):
        eng._call_all("generate", "generate")
    assert submitted == [0] and killed == [1]
