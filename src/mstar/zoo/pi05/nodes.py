"""pi0.5's two nodes: the SigLIP ``vision`` encoder and the ``llm`` (both Gemma experts on one
cache).

``vision`` (stateless, batched across robots) turns each request's camera images into projected
image tokens, keeping only the cameras present. ``llm`` is a forward-fired KV-cache node:

- its ``prefill`` firing appends the request's prefix (image tokens, then prompt tokens; one
  payload chunk with a full mask: bidirectional) to the paged cache through the VLM expert;
- each ``action_gen`` firing is one Euler step: the noisy actions at flow time ``t`` query the
  cached prefix read-only through the action expert (full mask among themselves), and the node
  integrates ``x <- x + dt * v``. Every robot's step at that moment runs in one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar.engines.interfaces import FiringRows, KVChunk, KVForward
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.masks import AttentionMask
from mstar.zoo.pi05.modules import ACTION_EXPERT, ActionInput, Pi05Weights, PrefixInput, flow_times

__all__ = ["CACHED", "LLMNode", "VisionNode"]

CACHED = {"cached": True}
"""The ``prefix`` input of ``action_gen`` firings: the prefix is in this request's cache."""


class VisionNode:
    """The ``vision`` node: every request's images through SigLIP in one call.

    Inputs: ``images`` ``[cameras, 3, S, S]`` in [-1, 1], ``image_mask`` ``[cameras]`` bool and
    ``token_ids`` ``[n]`` (the prompt, passed on). Output: ``prefix`` (the ``llm``'s prefill input).
    """

    def __init__(self, weights: Pi05Weights) -> None:
        self.weights = weights

    @torch.inference_mode()
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Encode the present cameras of every request at once."""
        device = self.weights.multi_modal_projector.linear.weight.device
        present = [
            torch.as_tensor(x["images"])[torch.as_tensor(x["image_mask"], dtype=torch.bool)]
            for x in batch
        ]
        counts = [int(p.shape[0]) for p in present]
        out: list[Mapping[str, Any]] = []
        tokens = self.weights.embed_images(torch.cat(present).to(device)) if sum(counts) else None
        start = 0
        for x, n in zip(batch, counts, strict=True):
            embeds = tokens[start : start + n].flatten(0, 1) if tokens is not None and n else None
            start += n
            if embeds is None:
                width = self.weights.config.vlm.width
                embeds = torch.zeros(0, width, dtype=self.weights.compute_dtype, device=device)
            out.append(
                {
                    "prefix": {
                        "image_embeds": embeds,
                        "token_ids": torch.as_tensor(x["token_ids"], dtype=torch.long),
                    }
                }
            )
        return out


class LLMNode:
    """The ``llm`` node (`ForwardKVNode`): prefix prefill, then one Euler step per firing.

    Inputs: ``prefix`` (``{"image_embeds", "token_ids"}`` on the prefill firing, `CACHED` after)
    and ``flow`` ``{"x": [H, action_dim], "step": k}``, optionally with ``"offset"``
    ``[action_dim]``. Outputs: ``prefix`` (`CACHED`), ``flow`` (the next step's) and, after the
    last step, ``actions`` ``[H, action_dim]`` (normalized; ``x + offset`` with an offset: a
    robot whose model predicts actions relative to its state gets them made absolute here, in
    normalized units, see `mstar.zoo.pi05.policy.quantile_shift`).
    """

    forward_walks = True

    def __init__(
        self, weights: Pi05Weights, engine_config: KVCacheEngineConfig | None = None
    ) -> None:
        cfg = weights.config
        self.model = weights
        self.config = cfg
        rows = 64
        self.engine_config = engine_config or KVCacheEngineConfig(
            block_size=16,
            max_num_seqs=rows,
            max_num_batched_tokens=rows * max(cfg.action_horizon, 16) + cfg.prefix_len,
            max_model_len=cfg.prefix_len + cfg.action_horizon,
            # prefixes are payloads (images), never shared by token hash
            enable_prefix_caching=False,
            cuda_graphs=False,
        )
        self._times = flow_times(cfg.num_steps)
        self._dt = -1.0 / cfg.num_steps
        self._full = AttentionMask.full()

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Return the firing's chunk: the prefix, or the actions' read-only query.

        Raises:
            ValueError: Malformed inputs.
        """
        prefix, flow = inputs["prefix"], inputs["flow"]
        if not isinstance(prefix, Mapping):
            raise ValueError(f"llm input 'prefix' must be a mapping, got {type(prefix).__name__}")
        if not prefix.get("cached"):
            payload = PrefixInput(
                torch.as_tensor(prefix["image_embeds"]),
                torch.as_tensor(prefix["token_ids"], dtype=torch.long),
            )
            if payload.num_tokens + self.config.action_horizon > self.engine_config.max_model_len:  # type: ignore[operator]
                raise ValueError(
                    f"a prefix of {payload.num_tokens} tokens is longer than the model's "
                    f"{self.config.prefix_len}"
                )
            # reset: a request's prefix is built once; a retried prefill starts clean.
            return KVForward(
                [
                    KVChunk(
                        payload=payload,
                        num_tokens=payload.num_tokens,
                        mask=self._full,
                        output="none",
                        reset=True,
                    )
                ]
            )
        x, step = self._flow(flow)
        action = ActionInput(x, self._times[step])
        return KVForward(
            [
                KVChunk(
                    read_only=True,
                    payload=action,
                    num_tokens=x.shape[0],
                    mask=self._full,
                    expert=ACTION_EXPERT,
                )
            ]
        )

    def _flow(self, flow: Any) -> tuple[torch.Tensor, int]:
        cfg = self.config
        if not isinstance(flow, Mapping) or "x" not in flow or "step" not in flow:
            raise ValueError("llm input 'flow' must be {'x': [horizon, action_dim], 'step': int}")
        x = torch.as_tensor(flow["x"], dtype=torch.float32)
        if tuple(x.shape) != (cfg.action_horizon, cfg.action_dim):
            raise ValueError(
                f"flow 'x' must have shape [{cfg.action_horizon}, {cfg.action_dim}], got "
                f"{list(x.shape)}"
            )
        step = int(flow["step"])
        if not 0 <= step < cfg.num_steps:
            raise ValueError(f"flow 'step' must be in [0, {cfg.num_steps}), got {step}")
        if "offset" in flow and tuple(torch.as_tensor(flow["offset"]).shape) != (cfg.action_dim,):
            raise ValueError(
                f"flow 'offset' must have shape [{cfg.action_dim}], got "
                f"{list(torch.as_tensor(flow['offset']).shape)}"
            )
        return x, step

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Pass the flow on after a prefill; integrate one Euler step of every robot at once."""
        results: list[Mapping[str, Any] | BaseException] = []
        flows = [f for f in firings if f.inputs["prefix"].get("cached")]
        updated: dict[int, tuple[torch.Tensor, int]] = {}
        if flows:
            # `forward` checked these inputs when the firing was made.
            xs = torch.stack(
                [torch.as_tensor(f.inputs["flow"]["x"], dtype=torch.float32) for f in flows]
            )
            vs = torch.stack([f.rows[0] for f in flows if f.rows[0] is not None]).to(xs.device)
            nxt = xs + self._dt * vs
            for i, f in enumerate(flows):
                updated[id(f)] = (nxt[i], int(f.inputs["flow"]["step"]) + 1)
        for f in firings:
            if id(f) not in updated:
                results.append({"prefix": CACHED, "flow": f.inputs["flow"]})
                continue
            x, step = updated[id(f)]
            flow = {"x": x, "step": step}
            offset = f.inputs["flow"].get("offset")
            if offset is not None:
                flow["offset"] = offset
            out: dict[str, Any] = {"prefix": CACHED, "flow": flow}
            if step == self.config.num_steps:
                actions = x.cpu()
                out["actions"] = (
                    actions
                    if offset is None
                    else actions + torch.as_tensor(offset, dtype=actions.dtype)
                )
            results.append(out)
        return results

    def release(self, request_id: str) -> None:
        """Nothing is kept per request outside the cache."""
