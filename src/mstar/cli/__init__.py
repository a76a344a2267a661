"""The `mstar` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from mstar.demo import QUESTION, run_assistant_demo, run_demo

    if args.model == "assistant":
        return run_assistant_demo(args.text or QUESTION, args.out or Path("answer.wav"))
    return run_demo(text=args.text or "Hello from mstar!", out=args.out, seed=args.seed)


def _cmd_models(args: argparse.Namespace) -> int:
    from mstar.zoo import list_models, model_options, resolve_model

    for name, summary in list_models().items():
        print(f"{name:24s} {summary}")
        if args.verbose:
            options = model_options(resolve_model(name).factory)
            options.pop("config", None)  # the name chose it
            shown = ", ".join(f"{key}={value!r}" for key, value in options.items()) or "none"
            print(f"{'':24s}   options: {shown}")
    if args.verbose:
        print(
            "\nA checkpoint's path serves as MODEL too: its family and sizes are read from "
            "its files "
            "(mstar serve --help lists the flags; --model-option KEY=VALUE sets any option above)."
        )
    return 0


def make_parser() -> argparse.ArgumentParser:
    """Build the argument parser for every subcommand."""
    parser = argparse.ArgumentParser(
        prog="mstar", description="Serve composite multimodal models declared as graphs plus walks."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="serve a composite model and ask it something (default: the spoken assistant)"
    )
    demo.add_argument(
        "--model",
        choices=("assistant", "toy-composite"),
        default="assistant",
        help="assistant: ask SmolLM2 + a Piper voice a question over HTTP; toy-composite: the toy "
        "graph checked against the reference interpreter, then orpheus-tiny",
    )
    demo.add_argument(
        "--text", default=None, help="the question (assistant) or the input text (toy-composite)"
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the spoken audio to this WAV file (assistant: answer.wav)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the toy's random weights")
    demo.set_defaults(func=_cmd_demo)

    from mstar.cli.bench import add_bench_arguments, bench_command

    bench = sub.add_parser(
        "bench", help="benchmark a target (an HTTP server or async callables) against baselines"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=bench_command)

    from mstar.cli.run import add_run_arguments, run_command
    from mstar.cli.serve import add_serve_arguments, serve_command

    serve = sub.add_parser(
        "serve", help="serve one model over HTTP (OpenAI-compatible API, /generate, /metrics)"
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_command)

    run = sub.add_parser("run", help="run one request through a model and write its output file")
    add_run_arguments(run)
    run.set_defaults(func=run_command)

    models = sub.add_parser("models", help="list the models mstar can serve")
    models.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also list each model's options (its keyword arguments)",
    )
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `mstar` command line."""
    args = make_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
