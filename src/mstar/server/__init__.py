"""The HTTP serving surface: an OpenAI-compatible server plus a native NDJSON endpoint.

One server hosts one model (as vLLM does): `make_app` builds the FastAPI application, which
starts the `AsyncEngine` in its lifespan; `run_server` serves it with uvicorn.
"""

from __future__ import annotations

from mstar.server.admission import AdmissionLimits, AdmissionQueue
from mstar.server.app import make_app
from mstar.server.audio import pcm16_bytes, wav_header
from mstar.server.config import ServerConfig, is_loopback
from mstar.server.detokenize import IncrementalDetokenizer, StopStringMatcher
from mstar.server.images import png_bytes
from mstar.server.logging import SecretRedactor, configure_logging
from mstar.server.metrics import RequestTracker, ServerMetrics
from mstar.server.runner import run_server

__all__ = [
    "AdmissionLimits",
    "AdmissionQueue",
    "IncrementalDetokenizer",
    "RequestTracker",
    "SecretRedactor",
    "ServerConfig",
    "ServerMetrics",
    "StopStringMatcher",
    "configure_logging",
    "is_loopback",
    "make_app",
    "pcm16_bytes",
    "png_bytes",
    "run_server",
    "wav_header",
]
