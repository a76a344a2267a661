"""The model zoo: composite models declared as graphs plus walks."""

from __future__ import annotations

__all__: list[str] = []
