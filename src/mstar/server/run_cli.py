"""`mstar run MODEL [--task ...]`: one request through `AsyncEngine`, written to a file.

    mstar run toy-composite --task speech --text "Hello" --out hello.wav     # audio -> WAV
    mstar run toy-composite --task image --text "a lighthouse" --out lh.png  # image -> PNG
    mstar run smollm2-135m --text "Why is the sky blue?" --param max_tokens=64

`--task` may be left out when the model has one task. For a text model whose tokenizer has
a chat template (an instruct model), `--text` is sent as the user's message of a chat, as
the chat API would; `--no-chat-template` sends it as a raw prompt instead. Text is decoded
greedily (one answer, the same each run) unless ``--param temperature=...`` says otherwise,
up to the model's default length unless ``--param max_tokens=...``. Text goes to
standard output (or to --out). Extra request fields are ``--param KEY=VALUE`` (VALUE is
read as JSON when it parses, else as a string).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.errors import MStarError
from mstar.progress import progress
from mstar.runtime.async_engine import AsyncEngine, EngineConfig
from mstar.runtime.model import Model, Output, Request, supports_audio_output, supports_text_output
from mstar.runtime.placement import Placement
from mstar.server.audio import pcm16_bytes, wav_header
from mstar.server.encoding import token_ids
from mstar.server.images import png_bytes
from mstar.server.logging import configure_logging
from mstar.server.serve_cli import loading_display

__all__ = ["add_run_arguments", "run_command"]

EXIT_USAGE = 2


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `mstar run` to ``parser``."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a zoo model name (see `mstar models`) or a checkpoint directory",
    )
    parser.add_argument(
        "--task",
        default=None,
        help="the task to run (e.g. speech, image, generate); default: the model's only task",
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
        help="output file: .wav for audio, .png for an image, else text",
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


def _params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {pair!r}: write KEY=VALUE, e.g. max_tokens=64")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _is_chat_model(model: Model) -> bool:
    """Whether the model's prompts go through a chat template (an instruct model's tokenizer has one)."""
    return supports_text_output(model) and model.chat_prompts


def _task(args: argparse.Namespace, model: Model) -> str:
    tasks = tuple(model.tasks())
    if args.task is None:
        if len(tasks) != 1:
            raise ValueError(
                f"model {args.model!r} has several tasks: choose one with --task ({', '.join(tasks)})"
            )
        return tasks[0]
    if args.task not in tasks:
        raise ValueError(
            f"model {args.model!r} has no task {args.task!r} (its tasks: {', '.join(tasks)})"
        )
    return str(args.task)


def _request_data(args: argparse.Namespace, model: Model, task: str) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if args.text is not None:
        if task != "generate":
            data["text"] = args.text
        elif args.chat_template and _is_chat_model(model):
            data["messages"] = [{"role": "user", "content": args.text}]
        else:
            data["prompt"] = args.text
    if args.image is not None:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(args.image) as picture:
                data["image"] = torch.from_numpy(np.array(picture.convert("RGB")))
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"--image {str(args.image)!r}: {exc}") from None
    if task == "generate":
        data["temperature"] = 0.0
    data.update(_params(args.param))
    return data


class _Collected:
    """Everything a request produced, by modality."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.token_ids: list[int] = []
        self.audio: list[bytes] = []
        self.num_samples = 0
        self.images: list[Any] = []
        self.others: dict[
            str, list[torch.Tensor]
        ] = {}  # "modality:name" -> outputs (actions, latents)

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

    def text(self) -> str:
        model = self.model
        if supports_text_output(model) and model.tokenizer is not None:
            return model.detokenize(self.token_ids)
        return " ".join(map(str, self.token_ids))  # no tokenizer: the ids themselves


async def _run(
    args: argparse.Namespace, spec: Any, placement: Placement | None
) -> tuple[_Collected, int | None]:
    devices = (
        {r: args.device for r in (placement.ranks if placement else (0,))} if args.device else {}
    )
    with loading_display(args.model):
        engine = await AsyncEngine.start(
            spec, placement, EngineConfig(worker_processes=args.worker_processes, devices=devices)
        )
    try:
        task = _task(args, engine.model)
        rate = engine.model.audio_sample_rate if supports_audio_output(engine.model) else None
        collected = _Collected(engine.model)
        request = Request(task, _request_data(args, engine.model, task))
        with progress(task) as update:
            async for out in engine.generate(request):
                collected.add(out)
                update(collected.summary(rate))
        return collected, rate
    finally:
        await engine.shutdown()


def _write(collected: _Collected, rate: int | None, out: Path | None) -> str:
    suffix = out.suffix.lower() if out is not None else ""
    if suffix == ".wav":
        if not collected.audio or not rate:
            raise ValueError("the request produced no audio: choose another --out (.png, .txt)")
        pcm = b"".join(collected.audio)
        assert out is not None
        out.write_bytes(wav_header(rate, num_data_bytes=len(pcm)) + pcm)
        return f"wrote {out} ({collected.num_samples / rate:.2f} s of audio at {rate} Hz)"
    if suffix == ".png":
        if not collected.images:
            raise ValueError("the request produced no image: choose another --out (.wav, .txt)")
        assert out is not None
        image = collected.images[-1]
        if isinstance(image, bytes | bytearray):  # PNG bytes from the model itself
            out.write_bytes(image)
            from PIL import Image

            with Image.open(out) as written:
                return f"wrote {out} (image {[written.height, written.width, len(written.getbands())]})"
        out.write_bytes(png_bytes(image))
        return f"wrote {out} (image {list(torch.as_tensor(image).shape)})"
    if (
        collected.others
        and not collected.audio
        and not collected.images
        and not collected.token_ids
    ):
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            assert out is not None
            tensors = {
                f"{key}:{i}": t.contiguous()
                for key, ts in collected.others.items()
                for i, t in enumerate(ts)
            }
            save_file(tensors, str(out))
            return f"wrote {out} ({len(tensors)} tensors)"
        doc = {key: [t.tolist() for t in ts] for key, ts in collected.others.items()}
        if out is None:
            print(json.dumps(doc))
            return ", ".join(f"{len(v)} {k}" for k, v in collected.others.items())
        out.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        return (
            f"wrote {out} (JSON: {', '.join(f'{len(v)} {k}' for k, v in collected.others.items())})"
        )
    if out is None and (collected.audio or collected.images):
        kind = "audio" if collected.audio else "an image"
        raise ValueError(
            f"the request produced {kind}: pass --out FILE{'.wav' if collected.audio else '.png'}"
        )
    text = collected.text()
    if out is None:
        print(text)
        return f"{len(collected.token_ids)} tokens"
    out.write_text(text + "\n", encoding="utf-8")
    return f"wrote {out} ({len(collected.token_ids)} tokens)"


def run_command(args: argparse.Namespace) -> int:
    """Run `mstar run`."""
    from mstar.zoo import resolve_model

    try:
        spec = resolve_model(args.model)
        placement = Placement.from_yaml(args.config) if args.config else None
        if args.image is not None and not args.image.is_file():
            raise ValueError(f"--image {str(args.image)!r} does not exist")
        _params(args.param)
        if args.out is not None and not args.out.parent.is_dir():
            raise ValueError(f"--out {str(args.out)!r}: the folder does not exist")
    except (MStarError, ValueError) as exc:
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("warning")  # runtime logs go to stderr, so stdout holds only the answer
    start = time.perf_counter()
    try:
        collected, rate = asyncio.run(_run(args, spec, placement))
        message = _write(collected, rate, args.out)
    except ValueError as exc:  # the model or the output refused the request
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MStarError as exc:
        print(f"mstar run: error: {exc}", file=sys.stderr)
        return 1
    print(f"mstar run: {message} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return 0
