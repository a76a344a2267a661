"""A BAGEL request's inputs, and the three contexts classifier-free guidance reads.

A request is a list of items, text and images (upstream's ``interleave_inference``). Each
item extends the full context; the other two follow rules of their own:

```
full      (cond)      every item: text, then each image's VAE tokens and ViT tokens
                      (and, in think mode, the planning text after the items)
text-free (cfg_text)  the full context as it was before the last item, if that was text
image-free (cfg_img)  the text items alone
```

On the paged cache they are sequences of one request, sharing blocks wherever they agree::

    ""         [ text A | image | text B ]       the request's own sequence
    cfg_text   [ text A | image ]                a fork of "" at a mark (re-taken per step)
    cfg_img    [ text A ]+[ text B' ]            "" up to its first image, forked there once
                                                 text comes after it (B' at its own RoPE position)

`ContextState` is what the walks carry between them (a persisted value, small, read by every
node that follows a request's items): each context's extent and next RoPE position and which
item is next. The inputs the cache took (`Parts`: token ids, VAE latents, ViT embeddings, the
large part) persist apart, only to the nodes that need them: the prefilling nodes, which
append to them, and each CFG branch, which gets its own context's inputs (`branch_parts`) to
rebuild that context when it is placed on another rank. Every value here crosses processes as
plain data (`WireForm`) and is read back with ``of``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch

from mstar.zoo.bagel.weights import ImageInput, TextInput

__all__ = [
    "Context",
    "ContextState",
    "ImageItem",
    "Item",
    "Part",
    "Parts",
    "TextItem",
    "branch_items",
    "branch_parts",
    "item_of",
    "part_of",
]

Part = TextInput | ImageInput
"""One input of a context as the cache took it (its RoPE position included)."""


@dataclass(frozen=True, slots=True)
class TextItem:
    """A text segment's ids, already wrapped as ``[bos] + ids + [eos]``."""

    token_ids: torch.Tensor  # [n] int64


@dataclass(frozen=True, slots=True)
class ImageItem:
    """An input image, resized for each path it takes (None: not that path)."""

    vae: torch.Tensor | None  # [3, H, W] in [-1, 1], sides multiples of the latent downsample
    vit: torch.Tensor | None  # [3, h, w] in [-1, 1], sides multiples of the ViT patch
    # [z, H/8, W/8]: the noise of the VAE posterior's sample (None: the posterior mean)
    vae_noise: torch.Tensor | None = None

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of the image as the VAE sees it (an edit's output size)."""
        image = self.vae if self.vae is not None else self.vit
        assert image is not None
        return int(image.shape[1]), int(image.shape[2])


Item = TextItem | ImageItem


def item_form(item: Item) -> dict[str, Any]:
    """Return an item as plain data."""
    if isinstance(item, TextItem):
        return {"text": item.token_ids}
    return {"vae": item.vae, "vit": item.vit, "vae_noise": item.vae_noise}


def item_of(value: Item | Mapping[str, Any]) -> Item:
    """Read an item back (or pass one through)."""
    if isinstance(value, TextItem | ImageItem):
        return value
    if "text" in value:
        return TextItem(value["text"])
    return ImageItem(value["vae"], value["vit"], value.get("vae_noise"))


def part_form(part: Part) -> dict[str, Any]:
    """Return a context input as plain data."""
    if isinstance(part, TextInput):
        return {"kind": "text", "tokens": part.token_ids, "rope": part.rope}
    return {
        "kind": part.kind,
        "tokens": part.tokens,
        "rope": part.rope,
        "latent_positions": part.latent_positions,
        "timestep": part.timestep,
    }


def part_of(value: Part | Mapping[str, Any]) -> Part:
    """Read a context input back (or pass one through)."""
    if isinstance(value, TextInput | ImageInput):
        return value
    if value["kind"] == "text":
        return TextInput(value["tokens"], int(value["rope"]))
    return ImageInput(
        value["kind"],
        value["tokens"],
        int(value["rope"]),
        value["latent_positions"],
        float(value["timestep"]),
    )


def branch_items(items: list[Item], think: Item | None = None) -> dict[str, list[Item]]:
    """Return the items each context holds (the dense reference builds each from its own).

    ``think`` is the planning text of think mode: it goes into the full context alone.
    """
    text_free = items[:-1] if items and isinstance(items[-1], TextItem) else list(items)
    cond = [*items, think] if think is not None else list(items)
    return {
        "cond": cond,
        "cfg_text": text_free,
        "cfg_img": [i for i in items if isinstance(i, TextItem)],
    }


@dataclass(frozen=True, slots=True)
class Context:
    """One context on the paged cache: the first ``num_tokens`` of sequence ``seq``; RoPE goes on at
    ``rope``.

    ``seq`` "" is the request's own sequence (a context that is a prefix of it); another name
    is a sequence of the context's own.
    """

    seq: str = ""
    num_tokens: int = 0
    rope: int = 0


@dataclass(frozen=True, slots=True)
class ContextState:
    """The three contexts of a request and the index of its next item to prefill.

    Attributes:
        think_ids: The planning text decoded in think mode, until it is prefilled (the next
            text after the items).
        has_think: The full context ends with the planning text (no other context has it).
    """

    has_wire_form: ClassVar[Literal[True]] = True

    cursor: int = 0
    cond: Context = Context()
    cfg_text: Context = Context()
    cfg_img: Context = Context()
    think_ids: tuple[int, ...] | None = None
    has_think: bool = False

    def context(self, branch: str) -> Context:
        """Return a branch's context."""
        return {"cond": self.cond, "cfg_text": self.cfg_text, "cfg_img": self.cfg_img}[branch]

    @property
    def image_free_follows(self) -> bool:
        """Whether the image-free context is still the whole full one (no image came yet)."""
        return self.cfg_img.seq == "" and self.cfg_img.num_tokens == self.cond.num_tokens

    def after_text(self, payload: TextInput) -> ContextState:
        """Return the state after a text item (the image-free context gets it too)."""
        n = payload.num_tokens
        cond = Context("", self.cond.num_tokens + n, self.cond.rope + n)
        if self.image_free_follows:
            cfg_img = cond
        else:
            cfg_img = Context("cfg_img", self.cfg_img.num_tokens + n, self.cfg_img.rope + n)
        return ContextState(self.cursor + 1, cond, self.cond, cfg_img)

    def after_image(self, payload: ImageInput, *, is_last_part: bool) -> ContextState:
        """Return the state after one path of an image (its tokens with their markers, one RoPE
        position).

        The item is done after its last path (VAE then ViT); the text-free context takes it in.
        """
        cond = Context("", self.cond.num_tokens + payload.num_tokens, self.cond.rope + 1)
        return replace(self, cursor=self.cursor + int(is_last_part), cond=cond, cfg_text=cond)

    def with_think(self, token_ids: Sequence[int]) -> ContextState:
        """Return the state once the planning text is decoded (it is prefilled next)."""
        return replace(self, think_ids=tuple(int(t) for t in token_ids))

    def after_think(self, payload: TextInput) -> ContextState:
        """Return the state after the planning text: in the full context only."""
        n = payload.num_tokens
        cond = Context("", self.cond.num_tokens + n, self.cond.rope + n)
        return replace(self, cond=cond, think_ids=None, has_think=True)

    def wire_form(self) -> dict[str, Any]:
        """Return the state as plain data."""
        return {
            "cursor": self.cursor,
            "contexts": [
                [c.seq, c.num_tokens, c.rope] for c in (self.cond, self.cfg_text, self.cfg_img)
            ],
            "think_ids": list(self.think_ids) if self.think_ids is not None else None,
            "has_think": self.has_think,
        }

    @classmethod
    def of(cls, value: ContextState | Mapping[str, Any]) -> ContextState:
        """Read a state back (or pass one through)."""
        if isinstance(value, ContextState):
            return value
        cond, cfg_text, cfg_img = (
            Context(str(c[0]), int(c[1]), int(c[2])) for c in value["contexts"]
        )
        think = value.get("think_ids")
        return cls(
            int(value["cursor"]),
            cond,
            cfg_text,
            cfg_img,
            tuple(int(t) for t in think) if think is not None else None,
            bool(value.get("has_think", False)),
        )


@dataclass(frozen=True, slots=True)
class Parts:
    """Inputs of a context as the cache took them, in order (their RoPE positions included)."""

    has_wire_form: ClassVar[Literal[True]] = True

    parts: tuple[Part, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Count the cache positions the inputs take."""
        return sum(p.num_tokens for p in self.parts)

    def then(self, part: Part) -> Parts:
        """Return these inputs and one more."""
        return Parts((*self.parts, part))

    def wire_form(self) -> dict[str, Any]:
        """Return the inputs as plain data."""
        return {"parts": [part_form(p) for p in self.parts]}

    @classmethod
    def of(cls, value: Parts | Mapping[str, Any]) -> Parts:
        """Read inputs back (or pass them through)."""
        if isinstance(value, Parts):
            return value
        return cls(tuple(part_of(p) for p in value["parts"]))


def branch_parts(state: ContextState, parts: Parts, branch: str) -> Parts:
    """Return the inputs a branch's context is made of, at the RoPE positions that context gives
    them.

    ``parts`` are the full context's inputs (`ContextState` says how far each context goes).
    """
    if branch == "cond":
        return parts
    if branch == "cfg_text":  # a prefix of the full context
        out: list[Part] = []
        count = 0
        for part in parts.parts:
            if count >= state.cfg_text.num_tokens:
                break
            out.append(part)
            count += part.num_tokens
        assert count == state.cfg_text.num_tokens, (
            "the text-free context is a prefix of the full one"
        )
        return Parts(tuple(out))
    texts: list[Part] = []
    rope = 0
    for part in parts.parts[: len(parts.parts) - int(state.has_think)]:
        if isinstance(part, TextInput):
            texts.append(TextInput(part.token_ids, rope))
            rope = texts[-1].rope_end
    return Parts(tuple(texts))
