"""A BAGEL request's inputs, and the three contexts classifier-free guidance reads.

A request is a list of items, text and images (upstream's ``interleave_inference``). Each
item extends the full context; the other two follow rules of their own:

```
full      (cond)      every item: text, then each image's VAE tokens and ViT tokens
text-free (cfg_text)  the full context as it was before the last item, if that was text
image-free (cfg_img)  the text items alone
```

On the paged cache they are sequences of one request, sharing blocks wherever they agree::

    ""         [ text A | image | text B ]       the request's own sequence
    cfg_text   [ text A | image ]                a fork of "" at a mark (re-taken per step)
    cfg_img    [ text A ]+[ text B' ]            "" up to its first image, forked there once
                                                 text comes after it (B' at its own RoPE position)

`ContextState` is what the walks carry between them (a persisted value): each context's
extent and next RoPE position, and which item is next.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["Context", "ContextState", "ImageItem", "Item", "TextItem", "branch_items"]


@dataclass(frozen=True, slots=True)
class TextItem:
    """A text segment's ids, already wrapped as ``[bos] + ids + [eos]``."""

    token_ids: torch.Tensor  # [n] int64


@dataclass(frozen=True, slots=True)
class ImageItem:
    """An input image, resized for each path it takes (None: not that path)."""

    vae: torch.Tensor | None  # [3, H, W] in [-1, 1], sides multiples of the latent downsample
    vit: torch.Tensor | None  # [3, h, w] in [-1, 1], sides multiples of the ViT patch

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of the image as the VAE sees it (an edit's output size)."""
        image = self.vae if self.vae is not None else self.vit
        assert image is not None
        return int(image.shape[1]), int(image.shape[2])


Item = TextItem | ImageItem


def branch_items(items: list[Item]) -> dict[str, list[Item]]:
    """Return the items each context holds (the dense reference builds each from its own)."""
    text_free = items[:-1] if items and isinstance(items[-1], TextItem) else list(items)
    return {"cond": list(items), "cfg_text": text_free, "cfg_img": [i for i in items if isinstance(i, TextItem)]}


@dataclass(frozen=True, slots=True)
class Context:
    """One context on the paged cache: the first ``num_tokens`` of sequence ``seq``; RoPE goes on at ``rope``.

    ``seq`` "" is the request's own sequence (a context that is a prefix of it); another name
    is a sequence of the context's own.
    """

    seq: str = ""
    num_tokens: int = 0
    rope: int = 0


@dataclass(frozen=True, slots=True)
class ContextState:
    """The three contexts of a request, and the index of its next item to prefill."""

    cursor: int = 0
    cond: Context = Context()
    cfg_text: Context = Context()
    cfg_img: Context = Context()

    def context(self, branch: str) -> Context:
        """Return a branch's context."""
        return {"cond": self.cond, "cfg_text": self.cfg_text, "cfg_img": self.cfg_img}[branch]

    @property
    def image_free_follows(self) -> bool:
        """Whether the image-free context is still the whole full one (no image came yet)."""
        return self.cfg_img.seq == "" and self.cfg_img.num_tokens == self.cond.num_tokens

    def after_text(self, num_tokens: int) -> ContextState:
        """Return the state after a text item of ``num_tokens`` (the image-free context gets it too)."""
        cond = Context("", self.cond.num_tokens + num_tokens, self.cond.rope + num_tokens)
        if self.image_free_follows:
            cfg_img = cond
        else:
            cfg_img = Context("cfg_img", self.cfg_img.num_tokens + num_tokens, self.cfg_img.rope + num_tokens)
        return ContextState(self.cursor + 1, cond, self.cond, cfg_img)

    def after_image(self, num_tokens: int, *, is_last_part: bool) -> ContextState:
        """Return the state after one path of an image (``num_tokens`` with its markers, one RoPE position).

        The item is done after its last path (VAE then ViT); the text-free context takes it in.
        """
        cond = Context("", self.cond.num_tokens + num_tokens, self.cond.rope + 1)
        return replace(self, cursor=self.cursor + int(is_last_part), cond=cond, cfg_text=cond)
