"""Actors: mailboxes, refs, supervision."""

from __future__ import annotations

__all__: list[str] = []
