"""mstar: serve composite multimodal models declared as a graph of components plus walks."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
