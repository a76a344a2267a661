"""Engines that run nodes: KV-cache engines and stateless engines."""

from __future__ import annotations

from mstar.engines.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar.engines.block_manager import BlockManager
from mstar.engines.interfaces import (
    FiringRows,
    ForwardKVNode,
    KVChunk,
    KVForward,
    KVNode,
    KVTurn,
    PagedKVContext,
    PagedModel,
    StepChunk,
    StepInputs,
    SupportsNarrowLogits,
    supports_forward_walks,
    supports_narrow_logits,
    supports_token_walks,
)
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.kv_engine import KVCacheEngine, KVCacheEngineConfig, StepOutput
from mstar.engines.kv_node import KVNodeEngine
from mstar.engines.masks import AttentionMask
from mstar.engines.model_runner import ModelRunner
from mstar.engines.sampler import Sampler
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.scheduler import BatchScheduler, RequestOutput, SchedulerOutput
from mstar.engines.sequence import FinishReason, InputSegment, OutputMode, Sequence, SequenceStatus
from mstar.engines.stateless import BatchedNode, StatelessEngine, StatelessEngineConfig, batched
from mstar.engines.step_overlap import OverlappedSteps
from mstar.engines.step_times import PHASES, STEP_TIME_BUCKETS, PhaseTimes, StepTimes, WalkStepTimes

__all__ = [
    "PHASES",
    "AttentionBackend",
    "AttentionMask",
    "AttentionMetadata",
    "BatchScheduler",
    "BatchedNode",
    "BlockManager",
    "FinishReason",
    "FiringRows",
    "ForwardKVNode",
    "InputSegment",
    "KVCacheEngine",
    "KVCacheEngineConfig",
    "KVCacheSpec",
    "KVChunk",
    "KVForward",
    "KVNode",
    "KVNodeEngine",
    "KVTurn",
    "ModelRunner",
    "OutputMode",
    "OverlappedSteps",
    "PagedKVContext",
    "PagedModel",
    "PhaseTimes",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StatelessEngine",
    "StatelessEngineConfig",
    "STEP_TIME_BUCKETS",
    "StepChunk",
    "StepInputs",
    "StepOutput",
    "StepTimes",
    "SupportsNarrowLogits",
    "TorchPagedAttention",
    "WalkStepTimes",
    "batched",
    "supports_forward_walks",
    "supports_narrow_logits",
    "supports_token_walks",
]
