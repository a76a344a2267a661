"""`KVCacheEngine`: the synchronous core of a node that owns a paged KV cache.

`step()` is schedule, run, postprocess. The engine keeps a request's sequence across
walks: a walk ends when a stop rule fires, and with `keep_alive=True` the sequence is
paused with its blocks (e.g. `prefill` then a `decode` `DynamicLoop`) until `resume`d
for the next walk, `release`d, or aborted.

Every attention pattern the zoo needs is data on the inputs, not another engine:

- a walk's inputs are token ids, or a *payload* the model embeds itself (image patches,
  latents, frames), run by an expert of the model (`expert`);
- `mask` says how they attend to each other (causal, full, block-causal);
- `output_mode` says what the walk returns: sampled tokens, the inputs' rows ("hidden"),
  or nothing (a context prefill);
- `fork` (copy-on-write, at any point) and `truncate` (back to a mark) branch and roll
  back a sequence's cache; `query` runs read-only tokens over a sequence's cache
  (denoising steps over a context, action tokens over a prefix) without writing to it.

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
import time
from dataclasses import dataclass
from typing import Literal, cast

import structlog
import torch

from mstar.engines.attention.base import AttentionBackend
from mstar.engines.attention.torch_paged import TorchPagedAttention
from mstar.engines.block_manager import BlockManager
from mstar.engines.interfaces import PagedModel
from mstar.engines.kv_cache import allocate_kv_cache, budget_bytes, num_blocks_for_budget
from mstar.engines.masks import AttentionMask
from mstar.engines.model_runner import ModelRunner, StepResult
from mstar.engines.parallel import TensorParallelGroup, TensorParallelLeader
from mstar.engines.sampler import Sampler
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.scheduler import (
    BatchScheduler,
    RequestOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from mstar.engines.sequence import (
    PLACEHOLDER_TOKEN,
    FinishReason,
    LogitsProcessor,
    OutputMode,
    Sequence,
    SequenceStatus,
    StopCheck,
)
from mstar.errors import (
    DuplicateRequestError,
    KVCacheCapacityError,
    MStarError,
    RequestNotFoundError,
)

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
        deterministic: compute each row of a step as it would be computed alone (attention
            per row, sampling per row, no batched greedy head; see `EngineConfig.deterministic`
            for what it guarantees). CPU only; the model's weights are fused for it when it
            loads under `deterministic_products`.
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
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise KVCacheCapacityError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise KVCacheCapacityError(f"num_blocks must be >= 1, got {self.num_blocks}")


StepOutput = RequestOutput
"""One request's result of a step (see `RequestOutput`)."""


_MASK64 = (1 << 64) - 1


def _walk_seed(seed: int, position: int) -> int:
    """Return a 64-bit seed mixing a request's seed with a position (SplitMix64's finaliser)."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The attention backend ``name`` ("torch", "flashinfer", "auto") on ``device``."""
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
        device: torch.device | str = "cpu",
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        """Size and allocate the cache on ``device`` (where the model's weights are), pick the
        attention backend, and get ready.

        ``tensor_parallel``: `model` is the leader's shard of that group (rank 0), whose
        followers run every step beside this engine (see `mstar.engines.parallel`).
        """
        self.config = config = config or KVCacheEngineConfig()
        self.device = torch.device(device)
        spec = model.kv_cache_spec
        self.max_model_len = min(config.max_model_len or model.max_position, model.max_position)
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = budget_bytes(config.kv_cache_memory, self.device)
            num_blocks = num_blocks_for_budget(spec, config.block_size, budget, self.device)
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
        if config.deterministic and self.device.type != "cpu":
            raise MStarError(
                f"deterministic serving runs on CPU devices only for now, not {self.device}"
            )
        backend: AttentionBackend = (
            TorchPagedAttention(self.device, deterministic=True)
            if config.deterministic
            else make_attention_backend(config.attention_backend, self.device)
        )
        if config.compile_backend is not None:
            # Attention calls stay outside the compiled graphs (graph breaks): the
            # projections, norms and MLPs around them are what gets fused.
            model = cast(
                PagedModel, torch.compile(model, backend=config.compile_backend, dynamic=True)
            )
        leader = None
        if tensor_parallel is not None and tensor_parallel.world > 1:
            leader = TensorParallelLeader(tensor_parallel)
            leader.init_cache(
                num_blocks, config.block_size, config.deterministic, config.attention_backend
            )
        self.runner = ModelRunner(
            model,
            kv_cache,
            backend,
            block_size=config.block_size,
            device=self.device,
            sampler=Sampler(deterministic=config.deterministic),
            tensor_parallel=leader,
        )
        if config.cuda_graphs and self.device.type == "cuda":
            self.runner.enable_cuda_graphs(
                max_batch_size=config.max_num_seqs,
                max_len=min(self.max_model_len, config.cuda_graph_max_len),
            )
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.return_logits = False
        # The last step scheduled nothing although work waits: it waits for room (blocks
        # that a paused pinned walk frees later), and stepping again before a call changes
        # anything would only spin.
        self.is_stalled = False
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
        payload: object = None,
        num_tokens: int | None = None,
        expert: int = 0,
        output_mode: OutputMode = "sample",
        reserve_tokens: int = 0,
        return_rows: bool = False,
    ) -> None:
        """Queue a new request.

        Args:
            request_id: unique among the requests this engine holds.
            prompt_token_ids: the input tokens (at least one); ignored with a `payload`.
            sampling_params: how to pick tokens; default greedy, 16 tokens.
            mask: attention among the prompt tokens (default causal).
            keep_alive: keep the sequence and its blocks when the walk ends (paused),
                for a later `resume`; the caller must then `release` or `abort` it.
            logits_processor: per-step hook on this request's logits row.
            stop_check: per-step hook; True ends the walk (`DynamicLoop` stop).
            payload: model input of `num_tokens` positions instead of token ids (the
                sequence is then pinned: its cache cannot be rebuilt from ids).
            num_tokens: positions of the payload.
            expert: the model's weight set for these inputs.
            output_mode: what the walk returns (`OutputMode`).
            reserve_tokens: admit the request only once blocks for this many tokens can
                be held back for it (a walk that must never stall half way).
            return_rows: a sampling walk also returns its inputs' rows, with its first
                token (`RequestOutput.hidden`).
        """
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request {request_id!r} is already in the engine")
        params = sampling_params or SamplingParams.greedy()
        seq = Sequence(
            request_id,
            [],
            params,
            arrival=next(self._arrivals),
            keep_alive=keep_alive,
            logits_processor=logits_processor,
            stop_check=stop_check,
        )
        self._extend(seq, prompt_token_ids, mask, payload, num_tokens, expert, output_mode)
        seq.rows_wanted = return_rows and output_mode == "sample"
        seq.generator = self._make_generator(params, seq.num_tokens)
        seq.walk_start = seq.num_tokens
        seq.reserve_tokens = reserve_tokens
        self._check_fits(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _extend(
        self,
        seq: Sequence,
        token_ids: list[int] | None,
        mask: AttentionMask | None,
        payload: object,
        num_tokens: int | None,
        expert: int,
        output_mode: OutputMode,
    ) -> None:
        """Append a walk's inputs to `seq` (checked) and set what the walk returns."""
        if payload is not None:
            if num_tokens is None or num_tokens < 1:
                raise KVCacheCapacityError(
                    f"request {seq.request_id!r}: a payload needs num_tokens >= 1, got {num_tokens}"
                )
            token_ids = [PLACEHOLDER_TOKEN] * num_tokens
            seq.is_pinned = True
        token_ids = list(token_ids or [])
        if not token_ids and seq.num_tokens == 0:
            raise KVCacheCapacityError(f"request {seq.request_id!r} has an empty prompt")
        if output_mode != "sample" and not token_ids:
            raise KVCacheCapacityError(
                f"request {seq.request_id!r}: a walk in {output_mode!r} mode needs new inputs"
            )
        seq.extend(token_ids, mask, payload=payload, expert=expert)
        seq.output_mode = output_mode
        if output_mode == "sample" and seq.num_uncomputed_tokens == 0:
            raise KVCacheCapacityError(
                f"request {seq.request_id!r} has no input left to sample from (its cache "
                "ends at a mark): give new tokens"
            )

    def resume(
        self,
        request_id: str,
        new_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        mask: AttentionMask | None = None,
        keep_alive: bool | None = None,
        payload: object = None,
        num_tokens: int | None = None,
        expert: int = 0,
        output_mode: OutputMode = "sample",
        logits_processor: LogitsProcessor | None = None,
        return_rows: bool = False,
    ) -> None:
        """Start the next walk of a paused request, optionally with new inputs.

        Without new tokens the sequence continues from its last sampled token (a decode
        walk after a prefill walk). `sampling_params` replace the old ones (and reseed), a
        `logits_processor` the old one. The other arguments are `add_request`'s.
        """
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.PAUSED:
            raise RequestNotFoundError(
                f"request {request_id!r} is {seq.status.value}, only a paused one can resume"
            )
        self._extend(seq, new_token_ids, mask, payload, num_tokens, expert, output_mode)
        seq.rows_wanted = return_rows and output_mode == "sample"
        if logits_processor is not None:
            seq.logits_processor = logits_processor
        if sampling_params is not None:
            seq.params = sampling_params
            seq.generator = self._make_generator(sampling_params, seq.num_tokens)
        if keep_alive is not None:
            seq.keep_alive = keep_alive
        self._check_fits(seq)
        del self.scheduler.paused[request_id]
        self.scheduler.add(seq)

    def extend(
        self,
        request_id: str,
        new_token_ids: list[int] | None = None,
        *,
        mask: AttentionMask | None = None,
        payload: object = None,
        num_tokens: int | None = None,
        expert: int = 0,
        output_mode: OutputMode = "sample",
    ) -> None:
        """Append more inputs to a request's walk that has not ended (added or resumed this step).

        One walk may so append several inputs, each with its own mask, payload and expert
        (a context of text and images built at once); they run in order, and the walk
        returns what `output_mode` says of the last ones. The arguments are `resume`'s.
        """
        seq = self._get(request_id)
        if seq.status not in (SequenceStatus.WAITING, SequenceStatus.RUNNING) or seq.is_read_only:
            raise RequestNotFoundError(
                f"request {request_id!r} is {seq.status.value}; only a running walk can be extended"
            )
        self._extend(seq, new_token_ids, mask, payload, num_tokens, expert, output_mode)
        self._check_fits(seq)

    def fork(
        self,
        parent_id: str,
        child_id: str,
        sampling_params: SamplingParams | None = None,
        *,
        keep_alive: bool | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Create `child_id` sharing `parent_id`'s first `num_tokens` cached tokens copy-on-write.

        Default: all of them. The parent must be paused with its cache complete (between
        walks, e.g. after a shared context prefill); the child is paused too and starts
        with `resume`. A fork taken before the parent's latest inputs is a context without
        them (a CFG branch without the latest text).
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateRequestError(f"request {child_id!r} is already in the engine")
        self._check_complete(parent, "fork")
        count = parent.num_computed_tokens if num_tokens is None else num_tokens
        if not 0 < count <= parent.num_computed_tokens:
            raise KVCacheCapacityError(
                f"request {parent_id!r} holds {parent.num_computed_tokens} tokens; cannot "
                f"fork at {count}"
            )
        params = sampling_params or parent.params
        # A whole fork keeps the parent's last sampled token (uncomputed yet) to go on from.
        child = Sequence(
            child_id,
            parent.token_ids if num_tokens is None else parent.token_ids[:count],
            params,
            arrival=next(self._arrivals),
            keep_alive=parent.keep_alive if keep_alive is None else keep_alive,
            logits_processor=parent.logits_processor,
            stop_check=parent.stop_check,
        )
        child.generator = self._make_generator(params, child.num_tokens)
        child.inherit_segments(parent)
        if num_tokens is not None:
            child.truncate(count)
        child.is_pinned = parent.is_pinned
        self.block_manager.fork(parent, child, count)
        child.status = SequenceStatus.PAUSED
        self._seqs[child_id] = child
        self.scheduler.paused[child_id] = child

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll a paused request back to its first `num_tokens` tokens (a mark taken earlier).

        Its blocks past the mark are released; the next walk continues from the mark.
        """
        seq = self._get(request_id)
        self._check_complete(seq, "truncate")
        if not 0 < num_tokens <= seq.num_computed_tokens:
            raise KVCacheCapacityError(
                f"request {request_id!r} holds {seq.num_computed_tokens} tokens; cannot "
                f"truncate to {num_tokens}"
            )
        seq.truncate(num_tokens)
        self.block_manager.truncate(seq, num_tokens)

    def query(
        self,
        parent_id: str,
        query_id: str,
        *,
        token_ids: list[int] | None = None,
        payload: object = None,
        num_tokens: int | None = None,
        mask: AttentionMask | None = None,
        expert: int = 0,
    ) -> None:
        """Run read-only inputs over a paused request's cache in the next step; write nothing.

        The query's tokens attend to all of the parent's cached tokens and to each other
        (by `mask`: full for denoising or action tokens, default causal); their K/V are
        not kept. The query ends after its step with a `COMPUTED` output of its rows
        ("hidden"). Queries of one context (CFG branches) or of many batch into one step.
        The parent is pinned from now on (never evicted: its cache is read again).
        """
        parent = self._get(parent_id)
        if query_id in self._seqs:
            raise DuplicateRequestError(f"request {query_id!r} is already in the engine")
        self._check_complete(parent, "be queried")
        # The parent's arrival: to the backends, queries over one context are one sequence
        # from step to step (its keys can stay staged).
        seq = Sequence(
            query_id,
            parent.token_ids[: parent.num_computed_tokens],
            parent.params,
            arrival=parent.arrival,
        )
        seq.inherit_segments(parent)
        self._extend(seq, token_ids, mask, payload, num_tokens, expert, "hidden")
        seq.is_read_only = True
        if seq.num_tokens > self.max_model_len:
            raise KVCacheCapacityError(
                f"query {query_id!r} reaches {seq.num_tokens} tokens but max_model_len is "
                f"{self.max_model_len}"
            )
        parent.is_pinned = True
        self.block_manager.fork(parent, seq)
        self._seqs[query_id] = seq
        self.scheduler.add(seq)

    def _check_complete(self, seq: Sequence, verb: str) -> None:
        """Require a paused sequence whose inputs are all in the cache."""
        if seq.status is not SequenceStatus.PAUSED:
            raise RequestNotFoundError(
                f"request {seq.request_id!r} is {seq.status.value}; only a paused one can {verb}"
            )
        if not seq.block_table:
            raise RequestNotFoundError(
                f"request {seq.request_id!r} holds no cache (it was evicted); run its inputs "
                f"again to {verb}"
            )

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
        phases = self.runner.phases
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        phases.add("schedule", time.perf_counter() - t0)
        self.is_stalled = out.is_empty and self.scheduler.has_unfinished()
        if out.is_empty:
            if self.is_stalled and not self._room_may_come():
                pending = self.scheduler.running or list(self.scheduler.waiting)
                raise KVCacheCapacityError(
                    f"request {pending[0].request_id!r} cannot be scheduled: the KV cache "
                    "cannot hold "
                    f"its next chunk even alone; raise the KV-cache budget"
                )
            return []
        failed: list[RequestOutput] = []
        try:
            result = self.runner.execute(out, return_logits=self.return_logits)
        except Exception:
            if len(out.scheduled) == 1:
                raise
            out, result, failed = self._isolate_failures(out)
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, result.tokens, result.hidden)
        if result.logits is not None:
            rows = iter(result.logits)
            outputs = [
                RequestOutput(
                    o.request_id, o.new_token_ids, o.finished, o.finish_reason, next(rows), o.hidden
                )
                if o.new_token_ids
                else o
                for o in outputs
            ]
        for o in outputs:
            if o.finished:
                seq = self._seqs[o.request_id]
                if seq.status is SequenceStatus.FINISHED:
                    del self._seqs[o.request_id]
        phases.add("update", time.perf_counter() - t1)
        return outputs + failed

    def _isolate_failures(
        self, out: SchedulerOutput
    ) -> tuple[SchedulerOutput, StepResult, list[RequestOutput]]:
        """Rerun a failed step one sequence at a time: only the sequences that fail alone fail.

        A failing sequence is dropped and reported by an output carrying its error; the
        others' results make one step as if they had run together.
        """
        tokens: list[int] = []
        hidden: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        ok: list[ScheduledSequence] = []
        failed: list[RequestOutput] = []
        for item in out.scheduled:
            single = SchedulerOutput([item], out.block_copies)  # re-copying a block is harmless
            try:
                part = self.runner.execute(single, return_logits=self.return_logits)
            except Exception as exc:
                key = item.seq.request_id
                self.scheduler.remove(item.seq)
                self._seqs.pop(key, None)
                failed.append(RequestOutput(key, [], True, FinishReason.ABORT, error=exc))
                continue
            ok.append(item)
            tokens += part.tokens
            hidden += part.hidden
            if part.logits is not None:
                logits.append(part.logits)
        merged = StepResult(tokens, torch.cat(logits) if logits else None, hidden)
        return SchedulerOutput(ok, [], out.preempted_ids), merged, failed

    def _room_may_come(self) -> bool:
        """Whether blocks held now may still be freed without a step (a paused pinned walk goes on
        later)."""
        return any(seq.is_pinned and seq.block_table for seq in self.scheduler.paused.values())

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

    def has_request(self, request_id: str) -> bool:
        """Whether the engine holds a request (waiting, running or paused)."""
        return request_id in self._seqs

    @property
    def max_seq_len(self) -> int:
        """Return the longest sequence that fits, alone: `max_model_len`, or the whole cache if
        smaller."""
        return min(self.max_model_len, self.num_blocks * self.config.block_size)

    def check_length(
        self, request_id: str, num_input_tokens: int, max_tokens: int, reserve_tokens: int = 0
    ) -> None:
        """Reject a request of ``num_input_tokens`` inputs sampling up to ``max_tokens`` that could
        never fit.

        The engine's one length check: a node asks it for a whole request before its first
        walk, and every sequence added is checked by it (``reserve_tokens``: how many tokens'
        blocks the sequence must hold at once).

        Raises:
            KVCacheCapacityError: Inputs and tokens to generate exceed `max_seq_len`.
        """
        longest = max(num_input_tokens + max_tokens, reserve_tokens)
        if longest > self.max_seq_len:
            needs = (
                f"request {request_id!r} needs up to {longest} tokens "
                f"({num_input_tokens} input + max_tokens {max_tokens})"
            )
            if longest > self.max_model_len:
                raise KVCacheCapacityError(
                    f"{needs} but max_model_len is {self.max_model_len} tokens; shorten it "
                    "or lower max_tokens"
                )
            raise KVCacheCapacityError(
                f"{needs} but the KV cache's capacity is {self.max_seq_len} tokens "
                f"({self.num_blocks} blocks); "
                "raise the KV-cache budget, shorten it or lower max_tokens"
            )

    @property
    def num_requests(self) -> int:
        """Count the requests held (waiting, running or paused)."""
        return len(self._seqs)

    def _get(self, request_id: str) -> Sequence:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise RequestNotFoundError(f"no request {request_id!r} in this engine") from None

    def _make_generator(self, params: SamplingParams, position: int) -> torch.Generator | None:
        """Return the generator of a walk whose first draw samples the token after ``position``
        tokens.

        Seeded by the request's seed and that position: the walks of one request (prefill,
        then decode) draw different numbers, and a walk draws the same ones on any rank (a
        decode rank rebuilding the sequence from its history) and in any batch.
        """
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(_walk_seed(params.seed, position))
        return generator

    def _check_fits(self, seq: Sequence) -> None:
        """Reject a walk that could never run, even alone in the cache."""
        sampled = seq.params.max_tokens if seq.output_mode == "sample" else 0
        self.check_length(seq.request_id, seq.num_tokens, sampled, seq.reserve_tokens)
