"""Engines that run nodes: KV-cache engines and stateless engines."""

from __future__ import annotations

__all__: list[str] = []
