"""Transports chosen by address scheme: inproc, ipc, tcp, shared memory, CUDA IPC."""

from __future__ import annotations

__all__: list[str] = []
