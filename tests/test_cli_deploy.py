"""The `moe-runtime` command line and the Ray job entry, as a user runs them (subprocesses):
make-checkpoint, demo (embedded Ray, 2 CPU ranks), Ctrl-C or SIGTERM during generate leaves no
Ray process behind, and `ray job submit -- python -m moe_runtime.deploy` on a local Ray head."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from moe_runtime.cli import main as cli_main
from moe_runtime.engine.driver import _CONTROL_PLANE_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cli") / "tiny")
    assert cli_main(["make-checkpoint", "--arch", "qwen3-moe", "--preset", "tiny", out]) == 0
    return out


@pytest.fixture
def short_tmp():
    """A short directory for Ray's sockets (Unix socket paths are limited to ~107 bytes)."""
    d = tempfile.mkdtemp(prefix="mrt", dir="/tmp")
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra)
    return env


def _parents() -> dict[int, int]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(pid)] = int(fields[1])
    return out


def _descendants(root: int) -> set[int]:
    parents, found, frontier = _parents(), set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _mentioning(text: str) -> set[int]:
    """Live processes whose command line contains `text` (e.g. a Ray temp dir)."""
    out = set()
    for pid in _parents():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


def _alive(pids) -> set[int]:
    return set(pids) & set(_parents())


def _wait_dead(pids, timeout_s=20.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def test_make_checkpoint_cli_writes_hf_loadable_sharded_mixtral(tmp_path, capsys):
    import glob

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = str(tmp_path / "mx")
    assert cli_main(["make-checkpoint", "--arch", "mixtral", "--preset", "tiny",
                     "--max-shard-size", "100KB", "--dtype", "float16", out]) == 0
    assert "wrote mixtral tiny checkpoint" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    with safe_open(sorted(glob.glob(os.path.join(out, "*.safetensors")))[0], "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float16
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    batch = tok(["hello world", "hi"], padding=True)  # left-padded for batched generate()
    assert batch["attention_mask"][1][0] == 0 and batch["attention_mask"][1][-1] == 1
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "MixtralForCausalLM"
    assert cli_main(["make-checkpoint", "--preset", "tiny", out]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err


def test_demo_runs_two_cpu_ranks_under_embedded_ray(tmp_path, short_tmp):
    cache = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-m", "moe_runtime", "demo", "--max-new-tokens", "4"],
                       env=_env(MOE_RUNTIME_CACHE=cache, RAY_TMPDIR=short_tmp),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Writing model shards" not in p.stderr  # (the demo shows no progress bars)
    out = p.stdout
    assert f"demo checkpoint: {cache}/qwen3-moe-tiny" in out
    assert "topology: dp_p2p (world size 2) -- data-parallel attention" in out
    assert out.count("completion: ") == 3 and "(4 tokens, length)" in out
    assert "prefill: " in out and " tok/s; decode: " in out
    assert _wait_dead(_mentioning(short_tmp)) == set()  # embedded Ray stopped with the command


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                       (signal.SIGTERM, True)],
                         ids=["ctrl-c", "sigterm", "sigterm-to-the-process-group"])
def test_signal_during_generate_leaves_no_ray_processes(ckpt, short_tmp, tmp_path, sig, group):
    """A signal to the command, or SIGTERM to its whole process group (`timeout`, systemd,
    Slurm), which stops the embedded Ray's GCS too: then its requests would block until Ray
    aborted the process 60 s later (exit code 1); the command exits 143 after its bound."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nThe quick brown fox\n\nA mixture of experts\n")
    p = subprocess.Popen(["moe-runtime", "generate", "--model", ckpt, "--prompts-file", str(prompts),
                          "--world-size", "2", "--topology", "tp", "--max-new-tokens", "490",
                          "--no-progress"],
                         env=_env(RAY_TMPDIR=short_tmp), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=group)
    try:
        lines = []
        for line in p.stdout:  # wait until the ranks are loaded and generation has started
            lines.append(line)
            if line.startswith("loaded "):
                break
        assert lines and lines[-1].startswith("loaded "), "".join(lines)
        ray_procs = _descendants(p.pid) | _mentioning(short_tmp)
        assert len(ray_procs) >= 4, ray_procs  # gcs, raylet, 2 rank actors at least
        t0 = time.monotonic()
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        rest = p.stdout.read()
        assert p.wait(timeout=60) == 128 + sig, rest  # (130 Ctrl-C, 143 SIGTERM: the shell's)
        # the busy ranks are killed at once, not after a graceful call queued behind generate
        # (which took the full 10 s of its bound); a GCS that stopped answering takes the
        # bound of the kill (driver._CONTROL_PLANE_S)
        assert time.monotonic() - t0 < (8 + _CONTROL_PLANE_S if group else 8), rest
        assert "interrupted" in rest and "completion:" not in rest
    finally:
        if p.poll() is None:
            p.kill()
    assert _wait_dead(ray_procs) == set()
    assert _wait_dead(_mentioning(short_tmp)) == set()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _stop_head(temp_dir: str) -> set[int]:
    """Stop the Ray head started with --temp-dir temp_dir, and only it (`ray stop` would kill
    every Ray on the machine). Returns the pids still alive afterwards."""
    procs = _mentioning(temp_dir)
    procs |= {d for p in procs for d in _descendants(p)}
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        for pid in _alive(procs):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not _wait_dead(procs, wait):
            break
    return _alive(procs)


def test_ray_job_submit_runs_the_deploy_entry(ckpt, short_tmp):
    gcs, dash, client, agent = _free_ports(4)
    env = _env(RAY_AUTH_MODE="disabled")  # a 127.0.0.1-only test head; see deploy/README.md
    start = subprocess.run(
        ["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
         "--num-cpus", "4", "--num-gpus", "0", "--object-store-memory", str(100 * 1024 ** 2),
         "--temp-dir", short_tmp, "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=120)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        # `ray start` returns before the head's job module has seen the dashboard agent; a submit
        # in that window is refused with "No available agent" (no job created), as on a cluster.
        deadline = time.monotonic() + 120
        while True:
            job = subprocess.run(
                ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--",
                 "python", "-m", "moe_runtime.deploy", "--model", ckpt, "--world-size", "2",
                 "--prompt", "Hello", "--prompt", "The quick brown fox", "--max-new-tokens", "6",
                 "--no-progress"],
                env=env, capture_output=True, text=True, timeout=300)
            out = job.stdout + job.stderr
            if "No available agent to submit job" not in out or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert job.returncode == 0, out
        assert "succeeded" in out, out
        assert "topology: dp_p2p (world size 2)" in out and "[1] completion: " in out, out
        assert "(6 tokens, length)" in out and "prefill: " in out
    finally:
        left = _stop_head(short_tmp)
    assert left == set()


def test_generate_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    """A --model that is no directory is a usage error (2), as a missing --prompts-file is;
    a directory without a checkpoint is an error (1)."""
    assert cli_main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    assert f"--model {tmp_path / 'none'}: no such directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert cli_main(["generate", "--model", str(tmp_path / "config.json"), "--prompt", "hi"]) == 2
    assert "config.json: not a directory" in capsys.readouterr().err
    (tmp_path / "config.json").unlink()
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be >= 1, got -5"),
    (["--max-new-tokens", "2.5"], "argument --max-new-tokens: must be an integer, got '2.5'"),
    (["--max-batch-size", "0"], "argument --max-batch-size: must be >= 1, got 0"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["--timeout", "0"], "argument --timeout: must be in [0.001, 1e+06] (seconds), got 0"),
    (["--timeout", "inf"], "argument --timeout: must be in [0.001, 1e+06] (seconds), got inf"),
    (["--timeout", "1e10"], "argument --timeout: must be in [0.001, 1e+06] (seconds), got 1e10"),
    (["--timeout", "0.0005"], "argument --timeout: must be in [0.001, 1e+06] (seconds), got 0.0005")])
def test_generate_argument_value_errors_are_usage_errors(tmp_path, capsys, argv, message):
    """Exit 2 (usage) with argparse's message, before anything is read or started."""
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"moe-runtime generate: error: {message}"


def test_version(capsys):
    from moe_runtime import __version__
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"moe-runtime {__version__}\n"


def test_make_checkpoint_arch_preset_mismatch_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["make-checkpoint", "--arch", "mixtral", "--preset", "qwen3-30b-a3b",
                     str(tmp_path / "x")]) == 2
    assert "use --arch qwen3-moe" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
    assert cli_main(["make-checkpoint", "--force", str(tmp_path / "x")]) == 2  # (preset tiny)
    assert "preset 'tiny' takes no force" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_make_checkpoint_refuses_unusable_paths_and_seeds_before_writing(tmp_path, capsys,
                                                                          monkeypatch):
    """A file, an empty path, an unwritable parent or an out-of-range seed fail at once, naming
    the given path, before any weights are made (they were written first, then the rename
    failed naming a temporary directory)."""
    import moe_runtime.models.make_checkpoint as mc

    def refuse():
        raise AssertionError("weights were about to be made")
    monkeypatch.setattr(mc, "train_tokenizer", refuse)
    a_file = tmp_path / "prompts.txt"
    a_file.write_text("hi")
    for out, message in ((str(a_file), f"{a_file} exists and is not a directory"),
                         ("", "out_dir must be a directory path"),
                         (str(a_file / "x"), f"cannot write a checkpoint at {a_file / 'x'}: "
                                             f"{a_file} is not a directory")):  # (said File exists)
        assert cli_main(["make-checkpoint", out]) == 2  # (usage: checked before writing)
        err = capsys.readouterr().err
        assert err.startswith(f"moe-runtime: error: {message}") and len(err.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["prompts.txt"]  # no temporary directory left
    with pytest.raises(SystemExit) as e:
        cli_main(["make-checkpoint", "--seed", str(2 ** 64), str(tmp_path / "x")])
    assert e.value.code == 2 and "must be >= 0 and <= 9223372036854775807" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seed must be an int in"):
        mc.make_checkpoint(str(tmp_path / "x"), seed=-1)


def test_demo_with_a_damaged_cache_says_how_to_rebuild_it(tmp_path, capsys, monkeypatch):
    from moe_runtime.models.make_checkpoint import cached_checkpoint
    monkeypatch.setenv("MOE_RUNTIME_CACHE", str(tmp_path / "cache"))
    path = cached_checkpoint("qwen3-moe", "tiny")
    os.remove(os.path.join(path, "model.safetensors"))
    assert cli_main(["demo"]) == 1
    err = capsys.readouterr().err
    assert f"the demo's cached checkpoint {path} may be damaged: delete that directory" in err
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MOE_RUNTIME_CACHE", str(tmp_path / "file"))
    assert cli_main(["demo"]) == 1
    assert f"the checkpoint cache {tmp_path / 'file'} is not a directory" in capsys.readouterr().err


def test_deploy_entry_help_names_itself_and_its_ray_default(capsys):
    from moe_runtime import deploy
    with pytest.raises(SystemExit) as e:
        deploy.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m moe_runtime.deploy ")
    assert "moe-runtime generate" not in out and "default: $RAY_ADDRESS (set by" in " ".join(out.split())


def test_cuda_ranks_beyond_this_machines_gpus_are_a_usage_error(ckpt, capsys, no_engine,
                                                                 monkeypatch):
    """On an embedded Ray (no --ray-address / RAY_ADDRESS) GPU ranks need this machine's GPUs
    (the Engine refused it, exit 1); a joined cluster may have them elsewhere."""
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = ["generate", "--model", str(ckpt), "--prompt", "hi", "--device", "cuda",
            "--world-size", "2"]
    assert cli_main(argv) == 2
    assert ("device 'cuda': 2 GPU rank(s) need as many GPUs, this machine has 1 (lower "
            "--world-size or use --device cpu)") in capsys.readouterr().err
    with pytest.raises(AssertionError, match="the Engine was started"):
        cli_main(argv + ["--ray-address", "10.0.0.1:6379"])


def test_ray_address_from_the_environment_is_checked_and_empty_is_unset(ckpt, capsys, no_engine,
                                                                       monkeypatch):
    """RAY_ADDRESS=garbage ended in Ray's bare "Invalid address format" (exit 1); an empty
    RAY_ADDRESS made the deploy entry complain about a --ray-address '' nobody passed."""
    from moe_runtime import deploy
    monkeypatch.setenv("RAY_ADDRESS", "garbage")
    assert cli_main(["generate", "--model", str(ckpt), "--prompt", "hi"]) == 2
    assert ("RAY_ADDRESS in the environment must be 'auto' or the cluster's GCS host:port"
            in capsys.readouterr().err)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")  # (as set for `ray job submit`)
    assert cli_main(["generate", "--model", str(ckpt), "--prompt", "hi", "--ray-address",
                     "auto"]) == 2  # (Ray's "auto" reads it: exit 1 with Ray's own message)
    assert ("RAY_ADDRESS in the environment (read by --ray-address auto) "
            "'http://10.0.0.1:8265' is an HTTP address") in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", "")
    seen = []
    monkeypatch.setattr("moe_runtime.cli.main", lambda argv, parser=None: seen.append(argv) or 0)
    assert deploy.main(["--model", str(ckpt), "--prompt", "hi"]) == 0
    assert seen[0][:2] == ["--ray-address", "auto"]


def test_make_checkpoint_max_shard_size_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["make-checkpoint", "--max-shard-size", "banana", str(tmp_path / "x")])
    assert e.value.code == 2 and "Unit" not in (err := capsys.readouterr().err)
    assert "argument --max-shard-size: must be a positive size such as 500MB, 2GB" in err
    assert not os.path.exists(tmp_path / "x")
    from moe_runtime.cli import build_parser
    for ok, size in (("500MB", 500 * 10 ** 6), ("2GB", 2 * 10 ** 9), ("1000000", 10 ** 6),
                     ("4096B", 4096)):
        assert build_parser().parse_args(["make-checkpoint", "--max-shard-size", ok, "o"]).max_shard_size == size


@pytest.fixture
def no_engine(monkeypatch):
    """generate must fail before the Engine (and Ray) starts."""
    import moe_runtime.engine

    def refuse(*a, **k):
        raise AssertionError("the Engine was started")
    monkeypatch.setattr(moe_runtime.engine, "Engine", refuse)


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "hi", "--prompt", ""], "prompt 1 is empty"),
    (["--prompt", "hi", "--prompt", "hello world", "--max-new-tokens", "510"],
     "prompt 1 (5 tokens) + max_new_tokens (510) - 1 exceeds max_position_embeddings (512)"),
    (["--prompt", "hi", "--world-size", "3"], "num_experts (8) must be divisible by world_size (3)"),
    (["--prompt", "hi", "--world-size", "2", "--topology", "local"], "topology 'local' needs world size 1"),
    (["--prompt", "hi", "--world-size", "2", "--topology", "tp", "--attention", "dp"],
     "--attention applies to --topology auto only"),
    (["--prompt", "ab\udcffcd"], "prompt 0 is not UTF-8 text (surrogates not allowed at character 2"),
    (["--prompt", "hi", "--ray-address", "garbage"],
     "--ray-address must be 'auto' or the cluster's GCS host:port (e.g. 10.0.0.1:6379), got 'garbage'"),
    (["--prompt", "hi", "--ray-address", "head:99999"], "got 'head:99999'"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: No such file")])
def test_generate_input_errors_are_found_before_ray_starts(ckpt, capsys, no_engine, argv, message):
    """(A prompt with undecodable command-line bytes, '\\udcff' as Python decodes them, used to
    end in the tokenizer's TypeError traceback; a missing prompts file exited 1.)"""
    assert cli_main(["generate", "--model", str(ckpt)] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-runtime: error: ") and message in err


@pytest.mark.parametrize("argv,named", [
    (["--top-k", "5", "--seed", "3"], "--top-k, --seed apply"), (["--top-p", "0.9"], "--top-p applies"),
    (["--top-k", "5", "--temperature", "0.7"], None)])
def test_sampling_options_without_temperature_are_named_as_unused(ckpt, capsys, no_engine, argv,
                                                                   named):
    with pytest.raises(AssertionError, match="the Engine was started"):
        cli_main(["generate", "--model", str(ckpt), "--prompt", "hi"] + argv)
    err = capsys.readouterr().err
    assert (f"note: {named} when sampling (--temperature > 0); decoding greedily" in err
            if named else "note:" not in err)


@pytest.mark.parametrize("handler", [signal.SIG_IGN, lambda signum, frame: None, None],
                         ids=["ignored", "own", "outside-python"])
def test_generate_restores_the_callers_signal_handlers(ckpt, no_engine, handler, monkeypatch):
    """(cli.main left SIGINT at Python's default handler: an ignored SIGINT under nohup, or a
    host program's own handler, was replaced.)"""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        if handler is None:  # (getsignal's answer for a handler a C host installed)
            real = signal.getsignal
            monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGINT else real(s))
        else:
            signal.signal(signal.SIGINT, handler)
            signal.signal(signal.SIGTERM, handler)
        with pytest.raises(AssertionError, match="the Engine was started"):
            cli_main(["generate", "--model", str(ckpt), "--prompt", "hi"])
        if handler is None:  # (restored to Python's own, not a TypeError hiding the result)
            monkeypatch.undo()
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        else:
            assert signal.getsignal(signal.SIGINT) is handler
            assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_demo_with_a_topology_for_one_rank_names_its_world_size(capsys, no_engine):
    assert cli_main(["demo", "--topology", "local"]) == 2
    assert ("topology 'local' needs world size 1, got 2 (the demo runs --world-size 2 unless "
            "told otherwise)") in capsys.readouterr().err
    assert cli_main(["demo", "--world-size", "3"]) == 2  # (the message says world_size)
    assert ("must be divisible by world_size (3): experts are split evenly across ranks (the "
            "demo runs --world-size 2 unless told otherwise)") in capsys.readouterr().err


def test_a_lost_gcs_while_the_engine_starts_skips_ray_shutdown(ckpt, capsys, monkeypatch):
    """SIGTERM to the process group while the ranks load: Engine() finds the GCS lost, shuts
    itself down and raises; the command must not then call ray.shutdown (it blocked on the
    dead GCS until Ray aborted the process), but abandon Ray and exit at once."""
    import moe_runtime.cli as cli
    import moe_runtime.engine
    from moe_runtime.engine import driver
    monkeypatch.setattr(driver, "_LOST_GCS", {})

    def lose_the_gcs(*a, **k):
        driver._LOST_GCS["127.0.0.1:1"] = False  # (a joined cluster: nothing here to kill)
        raise KeyboardInterrupt("signal 15")
    monkeypatch.setattr(moe_runtime.engine, "Engine", lose_the_gcs)
    monkeypatch.setattr(cli, "_stop_ray", lambda: pytest.fail("ray.shutdown on a lost GCS"))
    assert cli_main(["generate", "--model", str(ckpt), "--prompt", "hi"]) == 130
    assert cli._HARD_EXIT  # (exit_with then leaves by os._exit)
    assert "Ray's control plane (GCS) stopped answering; leaving the cluster" in capsys.readouterr().err


def test_sigterm_during_make_checkpoint_removes_its_partial_output(tmp_path, monkeypatch):
    """SIGTERM (not only Ctrl-C) stops make-checkpoint with 143 and removes its temporary
    directory (it was left in the parent directory)."""
    import moe_runtime.models.make_checkpoint as mc
    monkeypatch.setattr(mc, "_randomize_correction_biases",
                        lambda model: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "ck")]) == 143
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_make_checkpoint_fills_an_empty_directory_given_as_dot_or_a_link(tmp_path, monkeypatch,
                                                                         capsys):
    """An existing empty OUT_DIR is filled in place: `.` (rename of '.': EINVAL) and a symlink
    to an empty directory (ENOTDIR) failed with errno text and exit 1; a SIGTERM while filling
    one leaves it empty; a file that appears there meanwhile is neither replaced nor removed."""
    import moe_runtime.models.make_checkpoint as mc
    (tmp_path / "here").mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    monkeypatch.chdir(tmp_path / "here")
    assert cli_main(["make-checkpoint", "--preset", "tiny", "."]) == 0
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "link")]) == 0
    for d in ("here", "target"):
        files = sorted(os.listdir(tmp_path / d))
        assert "config.json" in files and "model.safetensors" in files, (d, files)
        assert not any(f.startswith(".make_checkpoint") for f in files)
    assert (tmp_path / "link").is_symlink()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "dangling")]) == 2
    assert "dangling is a symbolic link to nothing that exists" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    modes = mc._apply_umask_modes
    monkeypatch.setattr(mc, "_apply_umask_modes",
                        lambda tmp: os.kill(os.getpid(), signal.SIGTERM))
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "empty")]) == 143
    assert os.listdir(tmp_path / "empty") == []

    def user_writes(tmp):  # a file of the user's appears in OUT_DIR meanwhile: kept as it is
        (tmp_path / "empty" / "tokenizer.json").write_text("user data")
        modes(tmp)
    monkeypatch.setattr(mc, "_apply_umask_modes", user_writes)
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "empty")]) == 1
    assert "tokenizer.json appeared while the checkpoint was made" in capsys.readouterr().err
    assert os.listdir(tmp_path / "empty") == ["tokenizer.json"]
    assert (tmp_path / "empty" / "tokenizer.json").read_text() == "user data"
    monkeypatch.setattr(mc, "_apply_umask_modes", modes)
    assert cli_main(["make-checkpoint", "--preset", "tiny", str(tmp_path / "empty")]) == 2
    assert "exists and is not empty (it holds tokenizer.json)" in capsys.readouterr().err


def test_generate_without_weights_fails_before_ray_starts(ckpt, tmp_path, capsys, no_engine):
    import shutil
    cfg_only = str(tmp_path / "cfg_only")
    shutil.copytree(ckpt, cfg_only, ignore=shutil.ignore_patterns("*.safetensors"))
    assert cli_main(["generate", "--model", cfg_only, "--prompt", "hi"]) == 1
    assert "no weights: neither model.safetensors nor model.safetensors.index.json" in capsys.readouterr().err


def test_missing_dependency_is_a_one_line_error_with_the_install_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-runtime: error: ") and "transformers" in err
    assert "pip install moe_runtime" in err


def test_engine_dependencies_are_core_dependencies():
    """The engine, loader and CLI import transformers and tokenizers: a plain install (the deploy's
    moe_runtime[gpu]) must bring them, not only the [test] extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]}
    assert {"transformers", "tokenizers", "safetensors", "ray"} <= core
    assert "transformers>=5.0" in project["dependencies"]


def test_help_shows_defaults(capsys):
    from moe_runtime.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 32)", "(default: auto)", "(default: 300.0)", "each (default: 1)"):
        assert shown in out, shown
    assert "(default: None)" not in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("each (default: 2)", "per prompt (default: 16)"):  # demo's own defaults, once
        assert shown in out, shown
    assert out.count("(default: 2)") == 1
    assert not build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"]).eager
    assert build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--eager"]).eager
    assert build_parser().parse_args(["demo"]).no_progress  # the demo's bars: off unless asked
    assert not build_parser().parse_args(["demo", "--progress"]).no_progress
    assert "--no-progress" not in out  # (one switch per command: the demo has --progress only)
    assert not build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"]).no_progress
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--progress"])


def test_prompts_file_bom_is_not_prompt_text(tmp_path):
    """A prompts file saved with a UTF-8 byte-order mark (Windows editors) kept '\\ufeff' at
    the start of its first prompt."""
    from types import SimpleNamespace

    from moe_runtime.cli import _read_prompts
    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffhello\r\n\r\nworld\n".encode("utf-8"))
    assert _read_prompts(SimpleNamespace(prompt=None, prompts_file=str(f))) == ["hello", "world"]
    f.write_bytes(b"a\rb\r\nc\n")  # (a lone carriage return split the line in two)
    assert _read_prompts(SimpleNamespace(prompt=None, prompts_file=str(f))) == ["a\rb", "c"]


def test_prompts_file_dash_reads_standard_input(monkeypatch):
    import io
    from types import SimpleNamespace

    from moe_runtime.cli import UsageError, _read_prompts
    args = SimpleNamespace(prompt=None, prompts_file="-")
    stdin = io.TextIOWrapper(io.BytesIO("\ufeffhello\r\n\n  \nwö\rrld\n".encode("utf-8")))
    monkeypatch.setattr("sys.stdin", stdin)
    assert _read_prompts(args) == ["hello", "wö\rrld"]
    assert not stdin.closed
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\n")))
    with pytest.raises(UsageError, match="--prompts-file -: 'utf-8"):
        _read_prompts(args)


def test_generate_refuses_bytes_and_non_str_prompts():
    """Engine.generate(b"abc") reported "prompt 0 must be a str, got int 97" (the bytes split
    into ints); both checks come before anything reaches the ranks."""
    from types import SimpleNamespace

    from moe_runtime.engine import Engine
    with pytest.raises(TypeError, match="got bytes"):
        Engine.generate(SimpleNamespace(), b"abc")
    with pytest.raises(TypeError, match="prompt 1 must be a str, got list"):
        Engine.generate(SimpleNamespace(), ["a", [1, 2]])
