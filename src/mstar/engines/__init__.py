"""Engines that run nodes: KV-cache engines and stateless engines."""

from __future__ import annotations

from mstar.engines.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar.engines.block_manager import BlockManager
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.kv_engine import KVCacheEngine, KVCacheEngineConfig, StepOutput
from mstar.engines.masks import AttentionMask
from mstar.engines.model_runner import ModelRunner
from mstar.engines.paged_model import PagedKVContext, PagedModel
from mstar.engines.sampler import Sampler
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.scheduler import BatchScheduler, RequestOutput, SchedulerOutput
from mstar.engines.sequence import FinishReason, Sequence, SequenceStatus
from mstar.engines.step_times import STEP_TIME_BUCKETS, StepTimes, WalkStepTimes

__all__ = [
    "AttentionBackend",
    "AttentionMask",
    "AttentionMetadata",
    "BatchScheduler",
    "BlockManager",
    "FinishReason",
    "KVCacheEngine",
    "KVCacheEngineConfig",
    "KVCacheSpec",
    "ModelRunner",
    "PagedKVContext",
    "PagedModel",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "STEP_TIME_BUCKETS",
    "StepOutput",
    "StepTimes",
    "TorchPagedAttention",
    "WalkStepTimes",
]
