"""`moe-runtime` command line: make-checkpoint, generate, demo.

    moe-runtime make-checkpoint --arch qwen3-moe --preset tiny OUT_DIR
    moe-runtime generate --model DIR --prompt "Hello" --world-size 2 --topology auto
    moe-runtime demo            # tiny Qwen3-MoE checkpoint (made once, cached), 2 CPU ranks

Ctrl-C (SIGINT) or SIGTERM (`ray job stop`) stops generation, kills the rank actors and stops
an embedded Ray: no Ray processes are left behind. SIGTERM to the whole process group (`timeout`,
systemd, Slurm) stops an embedded Ray's GCS too: the command then kills what is left of that Ray
and exits within about 10 s (driver._CONTROL_PLANE_S) without waiting for Ray.

Exit codes: 0 ok, 1 error (a missing dependency included: one line with the install command; a
damaged checkpoint), 2 usage (a bad argument value, checked before anything starts; for
make-checkpoint also an OUT_DIR that is a file, not empty or not writable; for generate/demo
also a --model that is not a directory, a prompt that is empty or too long for the model, a
world size that does not divide the experts, or a topology that does not fit it: all checked
before Ray starts), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). `moe-runtime --version`
prints the version.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import re
import signal
import sys
import threading
from typing import NoReturn, Optional, Sequence

DEMO_PROMPTS = ("A mixture of experts model", "The quick brown fox",
                "Expert parallelism places different experts on different ranks, so")


class UsageError(ValueError):
    """A bad argument value found after parsing (needs the checkpoint): exit code 2."""


def _int_at_least(low: int, high: Optional[int] = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}" + ("" if high is None else f" and <= {high}") + f", got {value}")
        return value
    return parse


def _float_in(what: str, ok):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


def _shard_size(text: str) -> int:
    from .models.make_checkpoint import parse_shard_size
    try:
        return parse_shard_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive size such as 500MB, 2GB (units B, KB, MB, GB, TB) or a number "
            f"of bytes > 0, got {text!r}") from None


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except None / False ones (nothing to show) and
    flags (a store_true / store_false option's default says nothing about the flag)."""

    def _get_help_string(self, action):
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if action.default is None or action.default is False or flag:
            return action.help
        return super()._get_help_string(action)


def _add_make_checkpoint(sub) -> None:
    from .models.make_checkpoint import ARCH_NAMES, DTYPES, PRESETS
    p = sub.add_parser("make-checkpoint", help="write a random-weight HF checkpoint + tokenizer",
                       formatter_class=DefaultsHelp)
    p.add_argument("out_dir", help="directory to write (created; must be empty or absent)")
    p.add_argument("--arch", choices=sorted(ARCH_NAMES), default="qwen3-moe",
                   help="model family")
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="model size")
    p.add_argument("--seed", type=_int_at_least(0, 2 ** 63 - 1), default=0,
                   help="seed of the random weights")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weight dtype (default: the preset's)")
    p.add_argument("--max-shard-size", type=_shard_size, default=None,
                   help='e.g. "200KB", "500MB", "2GB" or bytes: sharded safetensors + index')
    p.add_argument("--force", action="store_true",
                   help="qwen3-30b-a3b only: also write its ~61 GB of random weights (default: config + tokenizer only)")


RAY_ADDRESS_HELP = ('join this Ray cluster ("auto" or host:port); default: $RAY_ADDRESS when '
                    'set, else start Ray embedded')


def add_engine_args(p: argparse.ArgumentParser, ray_address_help: str = RAY_ADDRESS_HELP,
                    progress: bool = True) -> None:
    """Arguments shared by generate and demo (and the deploy job entry). progress: whether the
    loading progress bars are on by default (--no-progress turns them off; else --progress on)."""
    from .engine.driver import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S, TOPOLOGY_CHOICES
    p.add_argument("--world-size", type=_int_at_least(1), default=1, help="ranks, one Ray actor each")
    p.add_argument("--topology", choices=TOPOLOGY_CHOICES, default="auto",
                   help="how ranks exchange tokens (auto: picked from the cluster)")
    p.add_argument("--attention", choices=("dp", "tp"), default=None,
                   help="with --topology auto only: data-parallel (each rank its own requests, "
                        "experts partitioned; the default) or tensor-parallel attention")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=32,
                   help="tokens generated per prompt")
    p.add_argument("--max-batch-size", type=_int_at_least(1), default=64,
                   help="sequences a rank generates together (its KV cache has this many "
                        "slots); a finished one's slot takes the next waiting prompt")
    p.add_argument("--temperature", type=_float_in("a finite number >= 0", lambda t: math.isfinite(t) and t >= 0),
                   default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=_float_in("in (0, 1]", lambda p: 0 < p <= 1), default=1.0,
                   help="nucleus sampling mass")
    p.add_argument("--top-k", type=_int_at_least(1), default=None,
                   help="sample among the k most likely tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ray-address", default=None, help=ray_address_help)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: GPU ranks when the Ray cluster has any GPU, else CPU ranks")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="compute dtype (auto: the checkpoint's)")
    p.add_argument("--timeout", type=_float_in(f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] "
                                               "(seconds)",
                                               lambda t: MIN_TIMEOUT_S <= t <= MAX_TIMEOUT_S),
                   default=DEFAULT_TIMEOUT_S,
                   help="bound on each phase (start, load), seconds; generation may run "
                        "longer while it makes progress within every such interval")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no loading progress bars")
    else:
        p.add_argument("--progress", dest="no_progress", action="store_false",
                       help="show the loading progress bars")
        p.set_defaults(no_progress=True)
    p.add_argument("--eager", action="store_true",
                   help="run every decode step eagerly (default: replayed from a CUDA graph on "
                        "one GPU, or by every rank when the MoE topologies exchange over NCCL; "
                        "needs the cute routing kernels and 16-bit experts)")


def add_generate_args(p: argparse.ArgumentParser, ray_address_help: str = RAY_ADDRESS_HELP) -> None:
    """The arguments of generate (also the deploy job entry's, with its own --ray-address help)."""
    p.add_argument("--model", required=True, help="HF-format checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", help="one prompt per line (blank lines are skipped); "
                     "- reads standard input")
    add_engine_args(p, ray_address_help)
    p.set_defaults(command="generate")


def _add_generate(sub) -> None:
    add_generate_args(sub.add_parser("generate", help="generate completions with one Ray actor "
                                     "per rank", formatter_class=DefaultsHelp))


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="tiny Qwen3-MoE checkpoint (cached), 2 CPU ranks, embedded Ray",
                       formatter_class=DefaultsHelp)
    add_engine_args(p, progress=False)
    p.set_defaults(world_size=2, max_new_tokens=16, device="cpu")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="moe-runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"moe-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_checkpoint(sub)
    _add_generate(sub)
    _add_demo(sub)
    return parser


def _read_prompts(args) -> list[str]:
    """The --prompt texts or the --prompts-file lines ("-": standard input). Raises UsageError:
    an unreadable or non-UTF-8 prompts file, one with only blank lines, or a prompt that is not
    UTF-8 text."""
    from .engine.driver import check_texts
    if args.prompt:
        prompts = list(args.prompt)
    else:
        try:
            if args.prompts_file == "-":  # standard input (a pipe; a terminal until Ctrl-D)
                f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", newline="\n")
                prompts = [line.rstrip("\r\n") for line in f if line.strip()]
                f.detach()  # (sys.stdin stays open)
            else:
                with open(args.prompts_file, encoding="utf-8-sig",  # (a BOM is not text)
                          newline="\n") as f:  # (a lone "\r" is text; "\r\n" ends a line)
                    prompts = [line.rstrip("\r\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompts-file {args.prompts_file}: "
                             f"{e.strerror if isinstance(e, OSError) else e}") from None
        if not prompts:
            raise UsageError(f"{args.prompts_file}: no prompts (only blank lines)")
    try:
        check_texts(prompts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return prompts


def print_result(result, out=sys.stdout) -> None:
    """Print the topology line, each completion and the throughput line."""
    print(f"topology: {result.topology} (world size {result.world_size}) -- {result.topology_reason}",
          file=out)
    for i, c in enumerate(result.completions):
        print(f"[{i}] prompt: {c.prompt!r}", file=out)
        print(f"[{i}] completion: {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})", file=out)
    print(f"prefill: {result.prefill_tokens} tokens in {result.prefill_s:.3f}s = "
          f"{result.prefill_tokens_per_s:.1f} tok/s; decode: {result.decode_tokens} tokens in "
          f"{result.decode_s:.3f}s = {result.decode_tokens_per_s:.1f} tok/s", file=out)
    out.flush()


def check_generate_inputs(model_dir: str, prompts: Sequence[str], args) -> None:
    """What generate can check before Ray starts: the checkpoint's config and weights, the prompts
    (Engine.generate_ids' checks on their token ids) and the world size / topology against the
    model.

    Raises:
        UsageError: a model_dir that is not a directory, a prompt that is empty or too long,
            a world size that does not divide the experts, a topology that does not fit the
            world size, or a --ray-address that is empty or an http(s) URL.
        FileNotFoundError, ValueError (CheckpointError): no config.json, no weights, no
            tokenizer, bad config.
    """
    from .engine.driver import (check_local_gpus, check_prompts, check_ray_address,
                                check_weights, check_world_size, choose_topology,
                                load_tokenizer)
    from .models import read_spec
    if not os.path.isdir(model_dir):
        raise UsageError(f"--model {model_dir}: " + ("not a directory" if os.path.exists(model_dir)
                                                     else "no such directory"))
    spec = read_spec(model_dir, args.dtype)[0]
    check_weights(model_dir)
    world_size = args.world_size
    address = getattr(args, "ray_address", None)
    try:
        if address is not None:
            check_ray_address(address, "--ray-address")
            if address == "auto" and os.environ.get("RAY_ADDRESS"):  # (which Ray's auto reads)
                check_ray_address(os.environ["RAY_ADDRESS"],
                                  "RAY_ADDRESS in the environment (read by --ray-address auto)")
        elif os.environ.get("RAY_ADDRESS"):  # (the Engine joins it; "" counts as unset)
            address = os.environ["RAY_ADDRESS"]
            check_ray_address(address, "RAY_ADDRESS in the environment")
        if args.attention is not None and args.topology != "auto":
            raise ValueError(f"--attention applies to --topology auto only; topology "
                             f"{args.topology!r} fixes how attention is split")
        check_world_size(spec, world_size, args.topology == "tp" or (
            args.topology == "auto" and args.attention == "tp"))
        if args.topology != "auto":
            choose_topology(args.topology, world_size)
        if args.device == "cuda" and address is None:  # (an embedded Ray: this machine's GPUs)
            import torch
            check_local_gpus(world_size, torch.cuda.device_count())
    except ValueError as e:
        demo = " (the demo runs --world-size 2 unless told otherwise)" if (
            args.command == "demo" and re.search(r"world[ _]size", str(e))) else ""
        raise UsageError(f"{e}{demo}") from None
    tokenizer = load_tokenizer(model_dir)
    try:
        check_prompts([tokenizer(p)["input_ids"] for p in prompts], spec, args.max_new_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_generate(model_dir: str, prompts: Sequence[str], args,
                 damaged_hint: Optional[str] = None) -> int:
    """Check the inputs, start the engine, generate, print; always shut down (Ctrl-C included).
    damaged_hint: appended to an unreadable checkpoint's error (not to usage errors)."""
    from .engine import Engine, SamplingParams
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    try:
        check_generate_inputs(model_dir, prompts, args)  # before Ray starts
    except UsageError:
        raise
    except (ValueError, OSError) as e:
        if damaged_hint is None:
            raise
        raise ValueError(f"{e} ({damaged_hint})") from None
    ignored = [f for f, on in (("--top-k", args.top_k is not None), ("--top-p", args.top_p != 1.0),
                               ("--seed", args.seed != 0)) if on]
    if ignored and args.temperature == 0:
        verb = "applies" if len(ignored) == 1 else "apply"
        print(f"note: {', '.join(ignored)} {verb} when sampling (--temperature > 0); decoding "
              "greedily", file=sys.stderr, flush=True)
    engine = None
    previous_int = signal.getsignal(signal.SIGINT)  # (restored as found: SIG_IGN under nohup)
    previous_term = signal.getsignal(signal.SIGTERM)  # (main's `_terminate`: like Ctrl-C)
    try:
        engine = Engine(model_dir, world_size=args.world_size, topology=args.topology,
                        attention=args.attention or "dp",
                        ray_address=args.ray_address, device=args.device, dtype=args.dtype,
                        timeout_s=args.timeout, progress=not args.no_progress,
                        cuda_graphs=not args.eager)
        warm = max(info.get("warm_up_s", 0.0) for info in engine.rank_info)
        print(f"loaded {model_dir} on {engine.world_size} {engine.device} rank(s)"
              + (f" (kernels compiled and warmed up in {warm:.1f}s)" if warm else ""), flush=True)
        print_result(engine.generate(prompts, params, max_batch_size=args.max_batch_size))
        return 0
    except KeyboardInterrupt as e:
        print("interrupted: shutting down the ranks", file=sys.stderr, flush=True)
        return _interrupted_code(e)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if engine is not None:
            engine.shutdown()
        from .engine.driver import lost_ray
        embedded = lost_ray()  # (also where Engine() itself was interrupted and shut down)
        if embedded is None:
            _stop_ray()
        else:
            _abandon_ray(embedded)
        # (None: a handler installed outside Python, which cannot be put back from here)
        signal.signal(signal.SIGINT, signal.default_int_handler if previous_int is None
                      else previous_int)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_term is None else previous_term)


# SIGTERMs the running command received (cleared by `main`): Ray's waits re-raise the
# KeyboardInterrupt a signal handler raises as a plain one, so the signal is recorded where it
# arrives
_SIGNALLED: list[int] = []


def _terminate(signum, frame):
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupted_code(e: BaseException) -> int:
    """The shell's exit code for the signal that stopped us: 128 + its number, i.e. 130 for
    SIGINT, 143 for SIGTERM (recorded by `_terminate`, or carried as `signum` by the engine's
    interrupt when Ray's own handler took it inside ray.init, also under a later Ctrl-C)."""
    seen = e
    while seen is not None and getattr(seen, "signum", None) is None:
        seen = seen.__context__
    if seen is not None:
        return 128 + seen.signum
    return 128 + (_SIGNALLED[-1] if _SIGNALLED else signal.SIGINT)


# set when Ray's GCS stopped answering during a shutdown (driver.lost_ray): `exit_with` then
# ends the process without the interpreter's teardown
_HARD_EXIT: list[bool] = []


def _abandon_ray(embedded: bool) -> None:
    """Ray's GCS is gone (e.g. SIGTERM to the whole process group reached an embedded Ray
    too): kill what is left of an embedded Ray (this process's descendants) and mark the
    process to end without Ray's exit hook."""
    _HARD_EXIT.append(True)
    print("moe-runtime: Ray's control plane (GCS) stopped answering; "
          + ("killing the processes of the Ray this command started" if embedded else
             "leaving the cluster (its driver's actors end with this process)"),
          file=sys.stderr, flush=True)
    if embedded:
        import psutil
        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:  # (already gone)
                pass


def exit_with(code: int) -> NoReturn:
    """sys.exit(code); os._exit(code) once the output is flushed after Ray's GCS was lost
    (`_abandon_ray`: Ray's exit hook, ray.shutdown, would block on the GCS until Ray aborted
    the process 60 s later with exit code 1) or a signal stopped the command (the clean-up has
    run; a SIGTERM that reached Ray's C++ signal handler inside ray.init made the
    interpreter's teardown abort, exit code 134)."""
    if _HARD_EXIT or code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """The `moe-runtime` console script: main() on sys.argv, then `exit_with` its code."""
    exit_with(main())


def _stop_ray() -> None:
    """Stop (embedded) or disconnect from (joined) Ray, even when the engine never finished
    starting (Ctrl-C inside ray.init; nothing to do inside `import ray`)."""
    from .engine.driver import _ray_module
    ray = _ray_module()
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def main(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
         ) -> int:
    """Run the command line `argv` (default sys.argv[1:]) parsed by `parser` (default
    build_parser()); returns the exit code (module docstring)."""
    _SIGNALLED.clear()
    _HARD_EXIT.clear()
    # SIGTERM stops every command as Ctrl-C does (make-checkpoint removes its partial output)
    main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return _run_command(argv, parser)
    except KeyboardInterrupt as e:
        return _interrupted_code(e)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_term is None else previous_term)


def _run_command(argv: Optional[Sequence[str]], parser: Optional[argparse.ArgumentParser]) -> int:
    try:
        args = (parser or build_parser()).parse_args(argv)
        if args.command == "make-checkpoint":
            from .models.make_checkpoint import make_checkpoint
            try:  # (its ValueErrors are argument checks made before anything is written)
                make_checkpoint(args.out_dir, args.arch, args.preset, seed=args.seed,
                                dtype=args.dtype, max_shard_size=args.max_shard_size,
                                force=args.force)
            except ValueError as e:
                raise UsageError(str(e)) from None
            what = "config + tokenizer only (use --force for weights)" if (
                args.preset == "qwen3-30b-a3b" and not args.force) else "weights + tokenizer"
            print(f"wrote {args.arch} {args.preset} checkpoint ({what}) to {args.out_dir}")
            return 0
        if args.command == "generate":
            return run_generate(args.model, _read_prompts(args), args)
        from .models.make_checkpoint import cached_checkpoint
        path = cached_checkpoint("qwen3-moe", "tiny", progress=not args.no_progress)
        print(f"demo checkpoint: {path}", flush=True)
        return run_generate(path, list(DEMO_PROMPTS), args, damaged_hint=(  # (changed since made)
            f"the demo's cached checkpoint {path} may be damaged: delete that directory and "
            "the demo makes it again"))
    except UsageError as e:
        print(f"moe-runtime: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an install without its dependencies
        print(f"moe-runtime: error: {e}; install moe_runtime with its dependencies "
              "(pip install moe_runtime; on GPU nodes pip install 'moe_runtime[gpu]')", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        print(f"moe-runtime: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    run()
