"""The request `mstar run`'s flags make, checked against the model before it loads.

Input flags are decoded here, once: ``--image`` and the files an ``--observation`` JSON names
are read, ``--param`` values parsed. The request is then dry-run through the model's own
preprocessing (its validation; no weights are needed) after its typed parameters are parsed
(`GenerationParams` and the task's declared options): a ``--param`` the task takes is one of
those fields or one the preprocessing reads. The model's errors speak of request fields
(``prompt``, ``messages``); they are worded again in the flags that gave those fields
(`explain`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.cli.model_args import key_value_pairs
from mstar.errors import RunArgumentError
from mstar.runtime.model import Model, Request, supports_action_policy, supports_text_output
from mstar.runtime.params import GenerationParams, parse_options

__all__ = [
    "ReadLog",
    "RunInputs",
    "RunRequest",
    "build_request",
    "check_request",
    "explain",
    "read_inputs",
]

# A string value of an --observation file naming one of these is a file to read (images, arrays).
_OBSERVATION_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".npy")
# The request fields `--text` may become; one of them stands for all in the model's errors.
_TEXT_FIELDS = ("text", "prompt", "messages")


@dataclass
class RunInputs:
    """The input flags, read and decoded (files opened) before anything is built."""

    params: dict[str, Any]
    image: torch.Tensor | None = None
    observation: dict[str, Any] | None = None


@dataclass
class RunRequest:
    """The request the flags make, and which flag gave each field (for error messages)."""

    task: str
    data: dict[str, Any]
    is_policy: bool = False  # a robot policy's task: its fields are observation keys
    flags: dict[str, str] = field(default_factory=dict)  # field -> the flag that gave it


def _params(pairs: list[str]) -> dict[str, Any]:
    return key_value_pairs(pairs, "--param", "max_tokens=64", RunArgumentError)


def _read_image(path: Path, flag: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return np.array(picture.convert("RGB"))
    except FileNotFoundError:
        raise RunArgumentError(f"{flag}: {str(path)!r} does not exist") from None
    except (OSError, UnidentifiedImageError) as exc:
        raise RunArgumentError(f"{flag}: cannot read {str(path)!r} as an image: {exc}") from None


def _read_observation(path: Path) -> dict[str, Any]:
    """Read an --observation file: a JSON object whose image/array values may name files."""
    flag = f"--observation {path}"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunArgumentError(f"{flag}: the file does not exist") from None
    except OSError as exc:
        raise RunArgumentError(f"{flag}: cannot read it: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunArgumentError(f"{flag}: not a JSON file: {exc}") from None
    if not isinstance(doc, dict):
        raise RunArgumentError(
            f"{flag}: write a JSON object of observation keys, not a {type(doc).__name__}"
        )
    observation: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, str) and value.lower().endswith(_OBSERVATION_FILE_SUFFIXES):
            file = path.parent / value  # relative to the JSON file (an absolute path stays)
            where = f"{flag}: key {key!r}"
            if value.lower().endswith(".npy"):
                try:
                    value = np.load(file, allow_pickle=False)
                except FileNotFoundError:
                    raise RunArgumentError(f"{where}: {str(file)!r} does not exist") from None
                except (OSError, ValueError) as exc:
                    raise RunArgumentError(
                        f"{where}: cannot read {str(file)!r} as a .npy array: {exc}"
                    ) from None
            else:
                value = _read_image(file, where)
        observation[key] = value
    return observation


def read_inputs(args: argparse.Namespace) -> RunInputs:
    """Decode every input flag and check the output folder (no model needed yet)."""
    inputs = RunInputs(_params(args.param))
    if args.image is not None:
        inputs.image = torch.from_numpy(_read_image(args.image, f"--image {args.image}"))
    if args.observation is not None:
        inputs.observation = _read_observation(args.observation)
    if args.out is not None and not args.out.parent.is_dir():
        raise RunArgumentError(f"--out {str(args.out)!r}: the folder does not exist")
    return inputs


def _is_chat_model(model: Model) -> bool:
    """Whether the model's prompts go through a chat template (an instruct model's tokenizer has
    one)."""
    return supports_text_output(model) and model.chat_prompts


def _task(args: argparse.Namespace, model: Model) -> str:
    tasks = tuple(model.tasks())
    if not tasks:
        raise RunArgumentError(f"model {args.model!r} declares no task")
    if args.task is None:
        return tasks[0]  # a model's first task is its default
    if args.task not in tasks:
        raise RunArgumentError(
            f"--task: model {args.model!r} has no task {args.task!r} "
            f"(its tasks: {', '.join(tasks)}; the default is {tasks[0]})"
        )
    return str(args.task)


def build_request(args: argparse.Namespace, model: Model, inputs: RunInputs) -> RunRequest:
    """Make the request from the flags; refuse flags the model's task cannot take."""
    task = _task(args, model)
    where = f"task {task!r} of {args.model}"
    is_policy = supports_action_policy(model) and task == model.policy_task
    request = RunRequest(task, {}, is_policy)
    if inputs.observation is not None:
        if not is_policy:
            raise RunArgumentError(
                f"{where} does not take --observation (only a robot policy's task does, e.g. "
                "pi05-* act)"
            )
        for key, value in inputs.observation.items():
            request.data[key] = value
            request.flags[key] = f"--observation {args.observation}"
    sends_chat = task == "generate" and _is_chat_model(model)
    if not args.chat_template and not sends_chat:
        raise RunArgumentError(
            f"{where} does not take --no-chat-template (it applies to an instruct model's "
            "'generate')"
        )
    if args.text is not None:
        text: Any = args.text
        if task != "generate":
            key = "text"
        elif args.chat_template and sends_chat:
            key, text = "messages", [{"role": "user", "content": args.text}]
        else:
            key = "prompt"
        request.data[key] = text
        request.flags[key] = "--text"
    if inputs.image is not None:
        request.data["image"] = inputs.image
        request.flags["image"] = "--image"
    if task == "generate":
        request.data["temperature"] = 0.0  # one answer, the same each run
    for key, value in inputs.params.items():
        request.data[key] = value
        request.flags[key] = f"--param {key}"
    return request


class ReadLog(dict[str, Any]):
    """Request data that records which fields the model's preprocessing looked up.

    A model reads its request with ``data[key]``, ``data.get(key)`` and ``key in data``; a
    field it never looks up is one its task does not take. A model that copies the whole
    dict (``dict(data)``, ``{**data}``) is taken to read every field: iterating marks them
    all, since then nothing tells which the copy's reader uses.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.looked_up: list[str] = []

    def __getitem__(self, key: str) -> Any:
        self.looked_up.append(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.append(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.looked_up.append(key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        # Overriding __iter__ also sends dict(self) and {**self} through keys() + __getitem__.
        self.looked_up.extend(super().keys())
        return super().__iter__()

    def keys(self) -> Any:
        self.looked_up.extend(super().keys())
        return super().keys()

    def items(self) -> Any:
        self.looked_up.extend(super().keys())
        return super().items()

    def values(self) -> Any:
        self.looked_up.extend(super().keys())
        return super().values()

    def copy(self) -> dict[str, Any]:
        self.looked_up.extend(super().keys())
        return dict(super().items())


def _named(message: str, keys: Iterable[str]) -> list[tuple[int, str]]:
    """Return ``(position, key)`` for each key the message names (as a whole word), in order."""
    found = []
    for key in set(keys):
        match = re.search(rf"(?<![\w/-]){re.escape(key)}(?![\w/-])", message)
        if match:
            found.append((match.start(), key))
    return sorted(found)


def explain(message: str, request: RunRequest, log: ReadLog, model: str) -> str:
    """Word a model's rejection of the request in the flags' terms, not the request's fields.

    The field it complains about is one its message names: a missing one first (a message
    that names a field the request lacks asks for it), else the first named. A missing field
    becomes "needs FLAG"; a bad one is prefixed with the flag that gave it.
    """
    where = f"task {request.task!r} of {model}"
    data = request.data
    given_text = [k for k in _TEXT_FIELDS if k in data]

    def is_given(key: str) -> bool:
        return key in data or (key in _TEXT_FIELDS and bool(given_text))

    def flag_of(key: str) -> str:
        if key in request.flags:
            return request.flags[key]
        if key in _TEXT_FIELDS:
            return request.flags.get(given_text[0], "--text") if given_text else "--text"
        if key in ("image", "images"):
            return "--image"
        if request.is_policy:  # a policy's observation key: the file's flag, if one was given
            return next(
                (f for f in request.flags.values() if f.startswith("--observation ")),
                "--observation",
            )
        return f"--param {key}"

    candidates = [*log.looked_up, *data, *_TEXT_FIELDS]
    if request.is_policy:
        # A policy that copied its observation names the keys it missed in quotes.
        candidates += re.findall(r"'([\w./-]+)'", message)
    named = _named(message, candidates)
    missing = [key for _, key in named if not is_given(key)]
    if missing:
        flag = flag_of(missing[0])
        if flag.startswith("--observation "):  # the file lacks a key
            return f"{flag}: {message}"
        if flag == "--observation":
            return f"{where} needs --observation FILE.json: {message}"
        if flag.startswith("--param"):
            return f"{where} needs {flag}=VALUE: {message}"
        return f"{where} needs {flag}"  # the model's message speaks of its fields: --text, --image
    if not named:
        return f"{where}: {message}"
    # A field given with --param is the one to change before --text (a message like "the
    # prompt plus max_tokens is too long" names both).
    params = [k for _, k in named if request.flags.get(k, "").startswith("--param")]
    key = params[0] if params else named[0][1]
    flag = flag_of(key)
    # data['text'] and a leading field name are the field itself: say the flag instead.
    worded = re.sub(rf"data\[(['\"]){re.escape(key)}\1\]", flag, message)
    worded = re.sub(rf"^{re.escape(key)}(?![\w/-])", flag, worded)
    return worded if worded.startswith(flag) else f"{flag}: {worded}"


def check_request(request: RunRequest, model: Model, name: str) -> None:
    """Dry-run the model's preprocessing: its validation, before any weights load.

    Raises:
        RunArgumentError: The model rejects the request, or does not read a field a flag gave.
    """
    log = ReadLog(request.data)
    try:
        # The typed parameters first, as the engine parses them: the generation settings and
        # the task's declared options (their errors name the field); then the inputs, which
        # only the model's preprocessing reads.
        declared = model.task_options(request.task)
        params = GenerationParams.from_data(request.data)
        options = parse_options(declared, request.data)
        model.preprocess(
            Request(request.task, log, request_id="mstar-run-check", params=params, options=options)
        )
    except (ValueError, TypeError) as exc:  # a model's preprocessing raises these for bad input
        raise RunArgumentError(explain(str(exc), request, log, name)) from None
    read = set(log.looked_up) | set(GenerationParams.__struct_fields__)
    if declared is not None:
        read |= set(declared.__struct_fields__)
    for key, flag in request.flags.items():
        if key not in read:
            what = f"its key {key!r}" if flag.startswith("--observation") else "it"
            raise RunArgumentError(
                f"{flag}: task {request.task!r} of {name} does not take {what} (it reads no "
                f"field {key!r})"
            )
