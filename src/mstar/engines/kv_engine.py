"""`KVCacheEngine`: the synchronous core of a node that owns a paged KV cache.

`step()` is schedule, run, postprocess. The engine keeps a request's sequence across
walks: a walk ends when a stop rule fires, and with `keep_alive=True` the sequence is
paused with its blocks (e.g. `prefill` then a `decode` `DynamicLoop`) until `resume`d
for the next walk, `release`d, or aborted.

```python
engine = KVCacheEngine(model, KVCacheEngineConfig(num_blocks=256))
engine.add_request("r1", prompt_ids, SamplingParams.greedy(max_tokens=32))
while engine.has_unfinished():
    for out in engine.step():
        print(out.request_id, out.new_token_ids, out.finished)
```
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, cast

import structlog
import torch

from mstar.engines.attention.base import AttentionBackend
from mstar.engines.attention.torch_paged import TorchPagedAttention
from mstar.engines.block_manager import BlockManager
from mstar.engines.kv_cache import allocate_kv_cache, num_blocks_for_budget
from mstar.engines.masks import AttentionMask
from mstar.engines.model_runner import ModelRunner
from mstar.engines.paged_model import PagedModel
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.scheduler import BatchScheduler, RequestOutput
from mstar.engines.sequence import LogitsProcessor, Sequence, SequenceStatus, StopCheck
from mstar.errors import DuplicateRequestError, KVCacheCapacityError, RequestNotFoundError

__all__ = ["KVCacheEngine", "KVCacheEngineConfig", "StepOutput"]

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheEngineConfig:
    """Sizing and features of a `KVCacheEngine`.

    Attributes:
        block_size: token slots per cache block.
        num_blocks: exact number of blocks (overrides `kv_cache_memory`).
        kv_cache_memory: cache budget: bytes (int) or a fraction of free device memory
            (float). None: 0.8 of free memory on CUDA, min(1 GiB, 0.25 of free) on CPU;
            never more blocks than `max_num_seqs` full-length sequences need.
        max_num_seqs: sequences per step.
        max_num_batched_tokens: tokens per step (longer prompts are chunked).
        max_model_len: longest sequence accepted (default: the model's).
        enable_prefix_caching: share full blocks of identical prefixes.
        attention_backend: "torch", "flashinfer" or "auto" (FlashInfer on CUDA if importable).
        cuda_graphs: replay decode steps from CUDA graphs (CUDA only).
        cuda_graph_max_len: longest sequence a graph-replayed decode step may hold (the
            graph attends over this many key positions; longer steps run eagerly).
        compile_backend: run the model through `torch.compile` with this backend
            (e.g. "inductor"); None runs it eagerly.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    cuda_graphs: bool = True
    cuda_graph_max_len: int = 4096
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise KVCacheCapacityError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise KVCacheCapacityError(f"num_blocks must be >= 1, got {self.num_blocks}")


StepOutput = RequestOutput
"""One request's result of a step (see `RequestOutput`)."""


def _make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchPagedAttention(device)
    try:
        from mstar.engines.attention.flashinfer_backend import FlashInferAttention
    except ImportError:
        if name == "flashinfer":
            raise
        return TorchPagedAttention(device)
    return FlashInferAttention(device)


class KVCacheEngine:
    """Continuous-batching engine over a paged KV cache for one `PagedModel`."""

    def __init__(
        self,
        model: PagedModel,
        config: KVCacheEngineConfig | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        """Size and allocate the cache, pick the attention backend, and get ready."""
        self.config = config = config or KVCacheEngineConfig()
        if device is None:
            param = next(iter(getattr(model, "parameters", lambda: iter([]))()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        spec = model.kv_cache_spec
        self.max_model_len = min(config.max_model_len or model.max_position, model.max_position)
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_cache_memory
            if budget is None:
                budget = 0.8 if self.device.type == "cuda" else 0.25
            num_blocks = num_blocks_for_budget(spec, config.block_size, budget, self.device)
            if config.kv_cache_memory is None and self.device.type != "cuda":
                cap = (1 << 30) // spec.bytes_per_block(config.block_size)
                num_blocks = max(1, min(num_blocks, cap))
            num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
        self.num_blocks = num_blocks
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = BatchScheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        kv_cache = allocate_kv_cache(spec, num_blocks, config.block_size, self.device)
        self.kv_cache_bytes = kv_cache.numel() * kv_cache.element_size()
        backend = _make_backend(config.attention_backend, self.device)
        if config.compile_backend is not None:
            # Attention calls stay outside the compiled graphs (graph breaks): the
            # projections, norms and MLPs around them are what gets fused.
            model = cast(PagedModel, torch.compile(model, backend=config.compile_backend, dynamic=True))
        self.runner = ModelRunner(
            model, kv_cache, backend, block_size=config.block_size, device=self.device
        )
        if config.cuda_graphs and self.device.type == "cuda":
            self.runner.enable_cuda_graphs(
                max_batch_size=config.max_num_seqs,
                max_len=min(self.max_model_len, config.cuda_graph_max_len),
            )
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.return_logits = False
        _log.info(
            "kv_cache_ready",
            device=str(self.device),
            backend=type(backend).__name__,
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_cache_mib=round(self.kv_cache_bytes / 2**20, 1),
            max_model_len=self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        mask: AttentionMask | None = None,
        keep_alive: bool = False,
        logits_processor: LogitsProcessor | None = None,
        stop_check: StopCheck | None = None,
    ) -> None:
        """Queue a new request.

        Args:
            request_id: unique among the requests this engine holds.
            prompt_token_ids: the input tokens (at least one).
            sampling_params: how to pick tokens; default greedy, 16 tokens.
            mask: attention among the prompt tokens (default causal).
            keep_alive: keep the sequence and its blocks when the walk ends (paused),
                for a later `resume`; the caller must then `release` or `abort` it.
            logits_processor: per-step hook on this request's logits row.
            stop_check: per-step hook; True ends the walk (`DynamicLoop` stop).
        """
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise KVCacheCapacityError(f"request {request_id!r} has an empty prompt")
        params = sampling_params or SamplingParams.greedy()
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            arrival=next(self._arrivals),
            mask=mask,
            keep_alive=keep_alive,
            logits_processor=logits_processor,
            stop_check=stop_check,
            generator=self._make_generator(params),
        )
        self._check_fits(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def resume(
        self,
        request_id: str,
        new_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        mask: AttentionMask | None = None,
        keep_alive: bool | None = None,
    ) -> None:
        """Start the next walk of a paused request, optionally with new input tokens.

        Without new tokens the sequence continues from its last sampled token (a decode
        walk after a prefill walk). `sampling_params` replace the old ones (and reseed).
        """
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.PAUSED:
            raise RequestNotFoundError(
                f"request {request_id!r} is {seq.status.value}, only a paused one can resume"
            )
        seq.extend(list(new_token_ids or []), mask)
        if sampling_params is not None:
            seq.params = sampling_params
            seq.generator = self._make_generator(sampling_params)
        if keep_alive is not None:
            seq.keep_alive = keep_alive
        self._check_fits(seq)
        del self.scheduler.paused[request_id]
        self.scheduler.add(seq)

    def fork(
        self,
        parent_id: str,
        child_id: str,
        sampling_params: SamplingParams | None = None,
        *,
        keep_alive: bool | None = None,
    ) -> None:
        """Create `child_id` sharing `parent_id`'s cached tokens copy-on-write.

        The parent must be paused (between walks, e.g. after a shared context
        prefill); the child is paused too and starts with `resume`.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateRequestError(f"request {child_id!r} is already in the engine")
        if parent.status is not SequenceStatus.PAUSED:
            raise RequestNotFoundError(
                f"request {parent_id!r} is {parent.status.value}; only a paused one can fork"
            )
        params = sampling_params or parent.params
        child = Sequence(
            child_id,
            parent.token_ids,
            params,
            arrival=next(self._arrivals),
            keep_alive=parent.keep_alive if keep_alive is None else keep_alive,
            logits_processor=parent.logits_processor,
            stop_check=parent.stop_check,
            generator=self._make_generator(params),
        )
        child.mask_segments = list(parent.mask_segments)
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.PAUSED
        self._seqs[child_id] = child
        self.scheduler.paused[child_id] = child

    def release(self, request_id: str) -> None:
        """Free a paused request's blocks and forget it (its partition is done)."""
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.PAUSED:
            raise RequestNotFoundError(
                f"request {request_id!r} is {seq.status.value}; only a paused one is released"
            )
        self.scheduler.remove(seq)
        del self._seqs[request_id]

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; return whether it was held."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.remove(seq)
        return True

    # -- stepping ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running (paused ones wait for `resume`)."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Schedule, run and postprocess one batch; return per-request new tokens."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                head = self.scheduler.waiting[0]
                raise KVCacheCapacityError(
                    f"request {head.request_id!r} cannot be scheduled: the KV cache cannot hold "
                    f"its next chunk even alone; raise the KV-cache budget"
                )
            return []
        tokens, logits = self.runner.execute(out, return_logits=self.return_logits)
        outputs = self.scheduler.update_from_output(out, tokens)
        if logits is not None:
            outputs = [
                RequestOutput(o.request_id, o.new_token_ids, o.finished, o.finish_reason, row)
                for o, row in zip(outputs, logits, strict=True)
            ]
        for o in outputs:
            if o.finished:
                seq = self._seqs[o.request_id]
                if seq.status is SequenceStatus.FINISHED:
                    del self._seqs[o.request_id]
        return outputs

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion and return each one's generated tokens (blocking)."""
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, sampling_params)
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id].extend(o.new_token_ids)
        return [results[request_id] for request_id in ids]

    # -- introspection -------------------------------------------------------------------

    def get_sequence(self, request_id: str) -> Sequence:
        """Return the live sequence of a request (read-only use)."""
        return self._get(request_id)

    @property
    def num_requests(self) -> int:
        """Count the requests held (waiting, running or paused)."""
        return len(self._seqs)

    def _get(self, request_id: str) -> Sequence:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise RequestNotFoundError(f"no request {request_id!r} in this engine") from None

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator

    def _check_fits(self, seq: Sequence) -> None:
        """Reject a walk that could never run, even alone in the cache."""
        longest = seq.num_tokens + seq.params.max_tokens
        if longest > self.max_model_len:
            raise KVCacheCapacityError(
                f"request {seq.request_id!r} needs up to {longest} tokens "
                f"({seq.num_tokens} input + max_tokens {seq.params.max_tokens}) but "
                f"max_model_len is {self.max_model_len}; shorten it or lower max_tokens"
            )
        blocks = -(-longest // self.config.block_size)
        if blocks > self.num_blocks:
            raise KVCacheCapacityError(
                f"request {seq.request_id!r} needs up to {blocks} blocks but the cache has "
                f"{self.num_blocks}; raise the KV-cache budget or shorten the request"
            )
