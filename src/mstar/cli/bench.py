"""`mstar bench`: measure a server or an in-process generator; write table, JSON and PNG.

    python -m mstar.bench --url http://127.0.0.1:8000 --endpoint speech \\
        --concurrency 1 2 4 8 --max-tokens 512 --ignore-eos --out results/
    python -m mstar.bench --target mypkg.engines:generate \\
        --baseline hf=mypkg.baselines:generate --rate 1 2 4 inf --num-requests 50
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from mstar.bench.http_targets import ChatTarget, GenerateTarget, ImagesTarget, SpeechTarget
from mstar.bench.loadgen import ClosedLoop, LoadPattern, OfflineWaves, OpenLoop, make_requests
from mstar.bench.records import BenchRequest
from mstar.bench.report import plot_png, print_table, write_json
from mstar.bench.runner import BenchResult, run_benchmark
from mstar.bench.targets import CallableTarget, Target
from mstar.errors import BenchConfigError, MStarError

__all__ = [
    "DEFAULT_PROMPTS",
    "add_bench_arguments",
    "bench_command",
    "load_callable",
    "main",
    "make_parser",
    "run_bench",
]

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in two sentences why the sky looks blue during the day.",
    "Describe a busy market street in the early morning, with its sounds and smells.",
)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `mstar bench` to `parser`."""
    target = parser.add_argument_group("target (a server URL, or an in-process function)")
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--endpoint",
        choices=("speech", "chat", "images", "generate"),
        default="chat",
        help="server API: /v1/audio/speech, /v1/chat/completions, /v1/images/generations, "
        "or native /generate (default: chat)",
    )
    target.add_argument("--model", help="the `model` field sent to the server")
    target.add_argument(
        "--target",
        metavar="MODULE:FUNC",
        help="benchmark an async generator function f(request) instead of a server "
        "(MODULE may be a dotted name or a .py file)",
    )
    target.add_argument("--target-name", help="label of the primary target in reports")
    target.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME=MODULE:FUNC",
        help="a baseline async generator function run on identical requests (repeatable)",
    )
    target.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")

    requests = parser.add_argument_group("requests")
    requests.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    requests.add_argument("--prompts-file", type=Path, help="a text file with one prompt per line")
    requests.add_argument("--max-tokens", type=int, help="fixed output length")
    requests.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly --max-tokens tokens, so that systems compare on equal work",
    )
    requests.add_argument(
        "--extra-body", type=json.loads, default={}, help="JSON object merged into every request"
    )
    requests.add_argument("--voice", default="default", help="speech: the voice")
    requests.add_argument("--audio-format", choices=("pcm", "wav"), default="pcm")
    requests.add_argument(
        "--sample-rate", type=int, default=24_000, help="frames/s of raw PCM (default 24000)"
    )
    requests.add_argument("--num-images", type=int, default=1, help="images: n per request")
    requests.add_argument("--image-size", help="images: size, e.g. 512x512")

    load = parser.add_argument_group("load (closed loop by default: 1 2 4 8 16 32)")
    pattern = load.add_mutually_exclusive_group()
    pattern.add_argument("--concurrency", type=int, nargs="+", help="closed loop at these c")
    pattern.add_argument(
        "--rate", type=float, nargs="+", help="open loop at these req/s ('inf': all at once)"
    )
    pattern.add_argument("--waves", type=int, nargs="+", metavar="SIZE", help="offline waves")
    load.add_argument(
        "--num-requests",
        type=int,
        help="measured requests per point (closed loop: at least 5 x c; open loop default 100)",
    )
    load.add_argument("--num-waves", type=int, default=2, help="offline: waves per point")
    load.add_argument("--burstiness", type=float, default=1.0, help="open loop: 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, help="open loop: in-flight cap")
    load.add_argument("--warmup", type=int, help="unmeasured requests per point")
    load.add_argument("--seed", type=int, default=0)

    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    output.add_argument("--bench-name", default="mstar-bench", help="name of files and titles")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def load_callable(spec: str) -> Callable[..., Any]:
    """Import `MODULE:ATTR` (MODULE a dotted name or a .py file; ATTR may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BenchConfigError(f"{spec!r}: write MODULE:FUNC, e.g. mypkg.bench:generate")
    try:
        if module_name.endswith(".py"):
            file_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if file_spec is None or file_spec.loader is None:
                raise BenchConfigError(f"cannot load {module_name!r} as a Python file")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise BenchConfigError(f"cannot import {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BenchConfigError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BenchConfigError(f"{spec!r} is not callable")
    return obj


def _server_target(args: argparse.Namespace, name: str) -> Target:
    common: dict[str, Any] = {
        "name": name,
        "model": args.model,
        "extra_body": args.extra_body,
        "timeout_s": args.timeout,
    }
    if args.endpoint == "speech":
        return SpeechTarget(
            args.url,
            voice=args.voice,
            response_format=args.audio_format,
            sample_rate=args.sample_rate,
            **common,
        )
    if args.endpoint == "chat":
        return ChatTarget(args.url, sample_rate=args.sample_rate, **common)
    if args.endpoint == "images":
        return ImagesTarget(args.url, n=args.num_images, size=args.image_size, **common)
    return GenerateTarget(args.url, sample_rate=args.sample_rate, **common)


def _targets(args: argparse.Namespace) -> dict[str, Target]:
    if (args.url is None) == (args.target is None):
        raise BenchConfigError("give exactly one of --url (a server) or --target (a function)")
    targets: dict[str, Target] = {}
    if args.url is not None:
        name = args.target_name or "server"
        targets[name] = _server_target(args, name)
    else:
        fn: Callable[[BenchRequest], AsyncIterator[Any]] = load_callable(args.target)
        name = args.target_name or args.target.rpartition(":")[2]
        targets[name] = CallableTarget(fn, name=name)
    for entry in args.baseline:
        baseline_name, sep, spec = entry.partition("=")
        if not sep or not baseline_name:
            raise BenchConfigError(f"--baseline {entry!r}: write NAME=MODULE:FUNC")
        if baseline_name in targets:
            raise BenchConfigError(f"target name {baseline_name!r} is used twice")
        targets[baseline_name] = CallableTarget(load_callable(spec), name=baseline_name)
    return targets


def _load(args: argparse.Namespace) -> LoadPattern:
    if args.rate:
        return OpenLoop(
            rates=tuple(args.rate),
            num_requests=args.num_requests or 100,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            warmup=1 if args.warmup is None else args.warmup,
        )
    if args.waves:
        return OfflineWaves(
            wave_sizes=tuple(args.waves), num_waves=args.num_waves, warmup=args.warmup
        )
    return ClosedLoop(
        concurrencies=tuple(args.concurrency or (1, 2, 4, 8, 16, 32)),
        num_requests=args.num_requests,
        warmup=args.warmup,
    )


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            text = args.prompts_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchConfigError(f"cannot read --prompts-file: {exc}") from exc
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


async def run_bench(args: argparse.Namespace, console: Console | None = None) -> BenchResult:
    """Run `mstar bench` from parsed arguments: measure, print the table, write JSON and PNG."""
    console = console or Console()
    if not isinstance(args.extra_body, dict):
        raise BenchConfigError("--extra-body must be a JSON object")
    targets = _targets(args)
    load = _load(args)
    requests = make_requests(_prompts(args), max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    config: dict[str, Any] = {"timeout_s": args.timeout}
    if args.url is not None:
        config |= {"url": args.url, "endpoint": args.endpoint, "model": args.model}
        if args.endpoint == "speech":
            config |= {"audio_format": args.audio_format, "sample_rate": args.sample_rate}
    result = await run_benchmark(
        targets,
        requests,
        load,
        name=args.bench_name,
        seed=args.seed,
        progress=not args.no_progress,
        console=console,
        config=config,
    )
    print_table(result, console)
    json_path = write_json(result, args.out / f"{args.bench_name}.json")
    png_path = plot_png(result, args.out / f"{args.bench_name}.png")
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return result


def _runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def bench_command(args: argparse.Namespace) -> int:
    """Run a parsed `mstar bench`; return 0, 1 when every measured request failed, 2 on bad options.

    Wire it into a subcommand parser with `add_bench_arguments(p)` and
    `p.set_defaults(func=bench_command)`.
    """
    try:
        with _runner() as runner:
            result = runner.run(run_bench(args))
    except MStarError as exc:
        print(f"mstar bench: {exc}", file=sys.stderr)
        return 2
    primary = [p for p in result.points if p.target == result.primary]
    if all(p.summary.num_failed == p.summary.num_requests for p in primary):
        first_error = next((r.error for p in primary for r in p.records if r.error), None)
        print(f"mstar bench: every request failed; first error: {first_error}", file=sys.stderr)
        return 1
    return 0


def make_parser() -> argparse.ArgumentParser:
    """Return the stand-alone parser of `python -m mstar.bench`."""
    parser = argparse.ArgumentParser(
        prog="mstar bench",
        description="Measure latency and throughput the way the field does: closed/open loop "
        "or offline load; TTFT, ITL, TPOT, E2E, TTFA, RTF, streaming viability, image latency, "
        "JCT; baselines in the same run. Writes a table, JSON and a PNG plot.",
    )
    add_bench_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mstar bench` from command-line arguments; return its exit code."""
    return bench_command(make_parser().parse_args(argv))
