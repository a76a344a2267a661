"""A request's options, typed once where the request enters.

Every model reads the same generation settings (`GenerationParams`: sampling, ``max_tokens``,
penalties, seed, log-probabilities, ``ignore_eos``, the prefix group) and, per task, options
of its own, which it declares as a `TaskOptions` Struct (fields, ranges, defaults)::

    class ImageOptions(TaskOptions):
        num_timesteps: Annotated[int, Meta(ge=1, le=1000)] = 50
        vae_posterior: Literal["sample", "mean"] = "sample"

    class MyModel(Model):
        def task_options(self, task): return ImageOptions if task == "image" else None

A `Request`'s ``params`` are parsed as it is made, its ``options`` where the engine takes it
(`parse_options`); a bad value is an `InvalidRequestError` naming the field, and ``preprocess``
reads typed values, never the dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Meta

from mstar.engines.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from mstar.errors import InvalidRequestError

__all__ = ["GenerationParams", "TaskOptions", "parse_options", "parse_struct"]

T = TypeVar("T", bound=msgspec.Struct)

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class TaskOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the options a model declares for a task (`mstar.runtime.Model.task_options`).

    Fields not named in the request take their defaults; keys the Struct does not name are
    left to ``preprocess`` (prompts, images, ...).
    """


class GenerationParams(msgspec.Struct, frozen=True, kw_only=True):
    """The generation settings of one request, as every model reads them.

    None is "not given": the model's (or its checkpoint's ``generation_config.json``) default
    applies (`with_defaults`). Ranges are OpenAI's and vLLM's.

    Attributes:
        max_tokens: Tokens to generate at most.
        temperature: 0 is greedy.
        top_p: Nucleus mass in (0, 1].
        top_k: Keep the k most likely tokens (0: all).
        repetition_penalty: > 0; 1 disables.
        presence_penalty: In [-2, 2].
        frequency_penalty: In [-2, 2].
        seed: Seeds the request's own generator (64-bit).
        logprobs: Report each token's log-probability and this many alternatives.
        ignore_eos: Keep generating past end-of-sequence tokens.
        prefix_group: Requests sharing a long prefix name it, to share its KV blocks.
        prefix_group_size: How many requests of the group to expect (0: unknown).
    """

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # 64-bit, signed or not: checked by `SamplingParams` (msgspec bounds stop at int64)
    seed: int | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    ignore_eos: bool = False
    prefix_group: str | None = None
    prefix_group_size: Annotated[int, Meta(ge=0, le=1024)] = 0

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> GenerationParams:
        """Parse the generation settings among a request's data (other keys are not looked at).

        Raises:
            InvalidRequestError: A setting has the wrong type or is out of range (names it).
        """
        params = parse_struct(cls, data)
        if params.seed is not None and not SEED_RANGE[0] <= params.seed < SEED_RANGE[1]:
            raise InvalidRequestError(f"seed: must fit in 64 bits, got {params.seed}", param="seed")
        return params

    def with_defaults(self, defaults: Mapping[str, Any]) -> GenerationParams:
        """Return these settings with the ones not given taken from ``defaults`` (by field name)."""
        unset = {
            k: v
            for k, v in defaults.items()
            if k in self.__struct_fields__ and getattr(self, k) is None
        }
        return msgspec.structs.replace(self, **unset) if unset else self

    def sampling(
        self,
        *,
        max_tokens: int,
        stop_token_ids: tuple[int, ...] = (),
        prompt_len: int | None = None,
    ) -> SamplingParams:
        """Return the engine's `SamplingParams` for these settings (unset ones at the engine's
        defaults)."""
        given = {
            name: value for name in _SAMPLING_FIELDS if (value := getattr(self, name)) is not None
        }
        stops = () if self.ignore_eos else stop_token_ids
        return SamplingParams(
            max_tokens=max_tokens, stop_token_ids=stops, prompt_len=prompt_len, **given
        )


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
)
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def parse_struct(cls: type[T], data: Mapping[str, Any]) -> T:
    """Convert the keys of ``data`` that ``cls`` names into a ``cls``.

    Raises:
        InvalidRequestError: A value has the wrong type or is out of range; ``param`` names it.
    """
    # looks up only the fields it has
    given = {k: data[k] for k in cls.__struct_fields__ if k in data}
    try:
        return msgspec.convert(given, cls, strict=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        path = match["path"].replace("[", ".").replace("]", "") if match else None
        reason = _plain(message[: match.start()] if match else message)
        choices = _choices(cls, path)
        if choices and path in given:
            reason = f"must be one of {', '.join(map(repr, choices))}"
        if path in given and "got" not in reason:
            reason += f", got {given[path]!r}"
        raise InvalidRequestError(f"{path}: {reason}" if path else reason, param=path) from None


def parse_options(cls: type[T] | None, data: Mapping[str, Any]) -> T | None:
    """Parse a task's declared options from a request's data (None where the task declares none)."""
    return None if cls is None else parse_struct(cls, data)


def _choices(cls: type[msgspec.Struct], name: str | None) -> tuple[Any, ...]:
    """Return the values a ``Literal`` field allows (empty for other fields)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        if field.name == name:
            kinds = (
                field.type.types
                if isinstance(field.type, msgspec.inspect.UnionType)
                else (field.type,)
            )
            return tuple(
                v
                for kind in kinds
                if isinstance(kind, msgspec.inspect.LiteralType)
                for v in kind.values
            )
    return ()


_KINDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "array": "a list",
    "object": "an object",
}
_EXPECTED = re.compile(r"^Expected `(?P<kind>[^`]*)`(?P<rest>.*?)(, got `[^`]*`)?$")


def _plain(reason: str) -> str:
    """Word msgspec's "Expected `int | null` >= 1, got `str`" as "must be an integer >= 1"."""
    match = _EXPECTED.match(reason)
    if match is None:
        return reason
    kinds = [k.strip() for k in match["kind"].split("|") if k.strip() != "null"]
    kind = " or ".join(_KINDS.get(k, k) for k in kinds)
    return f"must be {kind}{match['rest']}"
