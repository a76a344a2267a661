"""`mstar run MODEL [--task ...]`: one request through `AsyncEngine`, written to a file.

    mstar run toy-composite --text "Hello" --out hello.wav                   # audio -> WAV
    mstar run toy-composite --task image --text "a lighthouse" --out lh.png  # image -> PNG
    mstar run smollm2-135m --text "Why is the sky blue?" --param max_tokens=64
    mstar run pi05-tiny --observation examples/pi05_observation.json --out actions.json

Without `--task` the model's first task runs (its default). The flags are checked before the
model loads: the request is built from them and the model's own preprocessing validates it
(a dry run, no weights needed), so an unknown task, a missing input, a flag the task does not
read or an unreadable file fails at once, the message naming the flag.

For a text model whose tokenizer has a chat template (an instruct model), `--text` is sent as
the user's message of a chat, as the chat API would; `--no-chat-template` sends it as a raw
prompt instead. Text is decoded greedily (one answer, the same each run) unless
``--param temperature=...`` says otherwise. Text goes to standard output (or to --out); what
was written and how long each phase took (load, run, write) go to standard error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.cli.model_args import add_model_arguments, model_kwargs
from mstar.cli.run_request import (
    ReadLog,
    RunRequest,
    build_request,
    check_request,
    explain,
    read_inputs,
)
from mstar.errors import MStarError, RunArgumentError
from mstar.progress import progress
from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.engine_config import EngineConfig
from mstar.runtime.model import (
    Model,
    ModelSpec,
    Output,
    Request,
    supports_audio_output,
    supports_text_output,
)
from mstar.runtime.placement import Placement
from mstar.server.audio import pcm16_bytes, wav_header
from mstar.server.encoding import token_ids
from mstar.server.images import encode_image
from mstar.server.logging import configure_logging
from mstar.server.runner import loading_display

__all__ = ["add_run_arguments", "run_command"]

EXIT_USAGE = 2

_EPILOG = """\
--observation FILE.json: a robot policy's observation (pi05-*), a JSON object of the model's
observation keys. A string value naming a .png/.jpg/.jpeg/.bmp/.webp image or a .npy array is
read from that file (relative to the JSON file); numbers, strings and nested lists (pixels
too) are sent as they are. pi0.5 takes DROID's keys (examples/pi05_observation.json):
  {"observation/exterior_image_1_left": "pi05_exterior.png",
   "observation/wrist_image_left": "pi05_wrist.png",
   "observation/joint_position": [0.0, -0.6, 0.0, -2.2, 0.0, 1.6, 0.8],
   "observation/gripper_position": [0.0],
   "prompt": "pick up the red cup"}
(--text gives the instruction of a file without "prompt").

--param KEY=VALUE sets any other request field; VALUE is read as JSON when it parses, else as
a string (--param max_tokens=64 --param seed=1).

--out: .wav for audio, .png for an image, .json (or .safetensors) for actions and other
arrays, anything else for text. Without --out, text and JSON go to standard output.

The flags are checked before the model loads (errors name them); standard error says what was
written and how long each phase took (load, run, write).
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `mstar run` to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a zoo model name (see `mstar models`) or a checkpoint's path (see `mstar serve "
        "--help`)",
    )
    parser.add_argument(
        "--task",
        default=None,
        help="the task to run (e.g. speech, image, generate, act); default: the model's first task",
    )
    parser.add_argument(
        "--text",
        default=None,
        help="the request's text (for 'generate': the user's message, or the prompt)",
    )
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send --text as a raw prompt, even to a model whose tokenizer has a chat template",
    )
    parser.add_argument(
        "--image",
        type=Path,
        default=None,
        help="an input image file (sent as a uint8 [H, W, 3] tensor)",
    )
    parser.add_argument(
        "--observation",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="a robot policy's observation: a JSON object (see below)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another request field (repeatable)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output file: .wav for audio, .png for an image, .json for actions, else text",
    )
    parser.add_argument("--config", default=None, metavar="PLACEMENT.yaml", help="placement file")
    parser.add_argument(
        "--worker-processes",
        action="store_true",
        help="run each rank's worker in a process of its own",
    )
    parser.add_argument(
        "--device", default=None, help="torch device of every rank, e.g. cuda:0 (default cpu)"
    )
    add_model_arguments(parser)


# --- running and writing ----------------------------------------------------------------------


class _Collected:
    """Everything a request produced, by modality."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.token_ids: list[int] = []
        self.audio: list[bytes] = []
        self.num_samples = 0
        self.images: list[Any] = []
        # "modality:name" -> outputs (actions, latents)
        self.others: dict[str, list[torch.Tensor]] = {}

    def add(self, out: Output) -> None:
        if out.modality == "text":
            self.token_ids.extend(token_ids(out.data))
        elif out.modality == "audio":
            pcm = pcm16_bytes(out.data)
            self.audio.append(pcm)
            self.num_samples += len(pcm) // 2
        elif out.modality == "image":
            self.images.append(out.data)
        else:
            self.others.setdefault(f"{out.modality}:{out.name}", []).append(
                torch.as_tensor(out.data)
            )

    def summary(self, rate: int | None) -> str:
        parts = [f"{len(self.token_ids)} tokens"] if self.token_ids else []
        if self.num_samples and rate:
            parts.append(f"{self.num_samples / rate:.2f} s audio")
        if self.images:
            parts.append(f"{len(self.images)} images")
        parts += [f"{len(v)} {k}" for k, v in self.others.items()]
        return ", ".join(parts) or "waiting"

    def arrays(self) -> str:
        """Describe the non-media outputs, e.g. ``action:actions [10, 8]``."""
        return ", ".join(
            f"{key} {list(ts[0].shape)}"
            if len(ts) == 1
            else f"{key} {len(ts)} x {list(ts[0].shape)}"
            for key, ts in self.others.items()
        )

    @property
    def has_text(self) -> bool:
        """Whether the request produced text a tokenizer reads (a model without one sends ids)."""
        model = self.model
        return bool(self.token_ids) and supports_text_output(model) and model.tokenizer is not None

    def text(self) -> str:
        model = self.model
        if supports_text_output(model) and model.tokenizer is not None:
            return model.detokenize(self.token_ids)
        return " ".join(map(str, self.token_ids))  # no tokenizer: the ids themselves


@dataclass
class _Phases:
    """Seconds each phase of the run took."""

    load: float = 0.0
    run: float = 0.0
    write: float = 0.0

    def __str__(self) -> str:
        return " · ".join(f"{name} {_seconds(s)}" for name, s in vars(self).items())


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 1 else f"{s:.1f} s"


async def _run(
    args: argparse.Namespace,
    model: Model,
    request: RunRequest,
    placement: Placement | None,
    phases: _Phases,
    loading_started: float,
) -> tuple[_Collected, int | None]:
    devices = (
        {r: args.device for r in (placement.ranks if placement else (0,))} if args.device else {}
    )
    with loading_display(args.model):
        engine = await AsyncEngine.start(
            model, placement, EngineConfig(worker_processes=args.worker_processes, devices=devices)
        )
    started = time.perf_counter()
    phases.load = started - loading_started
    try:
        rate = model.audio_sample_rate if supports_audio_output(model) else None
        collected = _Collected(model)
        log = ReadLog(request.data)
        try:
            with progress(request.task) as update:
                async for out in engine.generate(Request(request.task, log)):
                    collected.add(out)
                    update(collected.summary(rate))
        except ValueError as exc:  # rejected after loading (e.g. too long for the model's cache)
            raise RunArgumentError(explain(str(exc), request, log, args.model)) from None
        phases.run = time.perf_counter() - started
        return collected, rate
    finally:
        await engine.shutdown()


def _write_media(collected: _Collected, rate: int | None, out: Path) -> str:
    """Write the audio (.wav) or the last image (.png) to ``out``; return what it holds."""
    if out.suffix.lower() == ".wav":
        if not collected.audio or not rate:
            raise RunArgumentError(
                "--out: the request produced no audio: choose another --out (.png, .json, .txt)"
            )
        pcm = b"".join(collected.audio)
        out.write_bytes(wav_header(rate, num_data_bytes=len(pcm)) + pcm)
        return f"{collected.num_samples / rate:.2f} s of {rate / 1000:g} kHz audio"
    if not collected.images:
        raise RunArgumentError(
            "--out: the request produced no image: choose another --out (.wav, .json, .txt)"
        )
    encoded = encode_image(collected.images[-1])  # PNG whatever the node emitted
    out.write_bytes(encoded.png)
    from PIL import Image

    with Image.open(out) as written:
        return f"{written.width} x {written.height} {written.mode} image"


def _write(collected: _Collected, rate: int | None, out: Path | None) -> str:
    """Write the output; return where it went, e.g. ``wrote out.wav (1.20 s of 24 kHz audio)``.

    Text goes to standard output unless ``out`` is a text file, also beside audio or an
    image written to ``out``.
    """
    suffix = out.suffix.lower() if out is not None else ""
    num_tokens = len(collected.token_ids)
    if out is not None and suffix in (".wav", ".png"):
        message = f"wrote {out} ({_write_media(collected, rate, out)})"
        if collected.has_text:  # beside speech or a picture (an omni model's answer)
            print(collected.text())
            message += f"; {num_tokens} tokens of text to standard output"
        return message
    if collected.others and not collected.audio and not collected.images and not num_tokens:
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            assert out is not None
            tensors = {
                f"{key}:{i}": t.contiguous()
                for key, ts in collected.others.items()
                for i, t in enumerate(ts)
            }
            save_file(tensors, str(out))
            return f"wrote {out} (safetensors: {collected.arrays()})"
        doc = {key: [t.tolist() for t in ts] for key, ts in collected.others.items()}
        if out is None:
            print(json.dumps(doc))
            return f"wrote JSON to standard output ({collected.arrays()})"
        out.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        return f"wrote {out} (JSON: {collected.arrays()})"
    media = "audio" if collected.audio else "an image" if collected.images else None
    media_out = f"--out FILE{'.wav' if collected.audio else '.png'}"
    if media is not None and not collected.has_text:
        raise RunArgumentError(f"the request produced {media}: pass {media_out}")
    keep = f" (and {media}: pass {media_out} to keep it)" if media else ""
    text = collected.text()
    if out is None:
        print(text)
        return f"wrote {num_tokens} tokens of text to standard output{keep}"
    out.write_text(text + "\n", encoding="utf-8")
    return f"wrote {out} ({num_tokens} tokens of text){keep}"


def _prepare(args: argparse.Namespace) -> tuple[Model, RunRequest, Placement | None]:
    """Read the flags, build the model (no weights yet) and check the request against it."""
    from mstar.zoo import resolve_model

    inputs = read_inputs(args)
    spec: ModelSpec = resolve_model(args.model, **model_kwargs(args))
    placement = Placement.from_yaml(args.config) if args.config else None
    # Building a model reads its config and tokenizer; its weights load with the engine.
    model = spec.build()
    request = build_request(args, model, inputs)
    check_request(request, model, args.model)
    return model, request, placement


def run_command(args: argparse.Namespace) -> int:
    """Run `mstar run`."""
    phases = _Phases()
    started = time.perf_counter()
    try:
        model, request, placement = _prepare(args)
    except (MStarError, ValueError) as exc:
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("warning")  # runtime logs go to stderr, so stdout holds only the answer
    try:
        collected, rate = asyncio.run(_run(args, model, request, placement, phases, started))
        written = time.perf_counter()
        message = _write(collected, rate, args.out)
        phases.write = time.perf_counter() - written
    except ValueError as exc:  # the model or the output refused the request
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MStarError as exc:
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return 1
    print(f"mstar run: {message}", file=sys.stderr)
    print(f"mstar run: {phases}", file=sys.stderr)
    return 0
