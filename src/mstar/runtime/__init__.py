"""The serving runtime: the model contract, placement, conductor, workers and `AsyncEngine`."""

from __future__ import annotations

from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.conductor import Conductor
from mstar.runtime.conductor_core import ConductorCore
from mstar.runtime.engine_config import EngineConfig, EngineStats
from mstar.runtime.model import (
    EngineType,
    Model,
    ModelSpec,
    Output,
    PreparedRequest,
    Request,
    SupportsActionPolicy,
    SupportsAudioInput,
    SupportsAudioOutput,
    SupportsTextOutput,
    supports_action_policy,
    supports_audio_input,
    supports_audio_output,
    supports_text_output,
)
from mstar.runtime.params import GenerationParams, TaskOptions, parse_options
from mstar.runtime.placement import NodeGroup, Placement
from mstar.runtime.walk_runner import WalkRunner
from mstar.runtime.worker import Worker
from mstar.runtime.worker_core import WorkerConfig, WorkerCore

__all__ = [
    "AsyncEngine",
    "Conductor",
    "ConductorCore",
    "EngineConfig",
    "EngineStats",
    "EngineType",
    "GenerationParams",
    "Model",
    "ModelSpec",
    "NodeGroup",
    "Output",
    "Placement",
    "PreparedRequest",
    "Request",
    "SupportsActionPolicy",
    "SupportsAudioInput",
    "SupportsAudioOutput",
    "SupportsTextOutput",
    "TaskOptions",
    "WalkRunner",
    "Worker",
    "WorkerConfig",
    "WorkerCore",
    "parse_options",
    "supports_action_policy",
    "supports_audio_input",
    "supports_audio_output",
    "supports_text_output",
]
