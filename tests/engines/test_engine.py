"""KVCacheEngine behaviour: walks, forks, hooks, masks, limits and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.engines import (
    AttentionMask,
    FinishReason,
    KVCacheEngine,
    KVCacheEngineConfig,
    SamplingParams,
    Sequence,
)
from mstar.engines.scheduler import SchedulerOutput
from mstar.errors import (
    DuplicateRequestError,
    InvalidSamplingParamsError,
    KVCacheCapacityError,
    RequestNotFoundError,
)
from mstar.zoo.llama import LlamaCausalLM

from .conftest import make_tiny_llama, run_join_leave_schedule


def _engine(model: LlamaCausalLM, **kwargs: object) -> KVCacheEngine:
    fields: dict[str, object] = {"block_size": 4, "num_blocks": 64}
    fields.update(kwargs)
    return KVCacheEngine(model, KVCacheEngineConfig(**fields))  # type: ignore[arg-type]


def _drain(engine: KVCacheEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_prefill_walk_then_decode_walk_equals_one_generation(tiny_llama: LlamaCausalLM) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    whole = _engine(tiny_llama).generate([prompt], SamplingParams.greedy(12))[0]
    engine = _engine(tiny_llama)
    engine.add_request("r", prompt, SamplingParams.greedy(1), keep_alive=True)
    first = _drain(engine)["r"]
    assert engine.num_requests == 1 and not engine.has_unfinished()
    held = engine.num_blocks - engine.block_manager.num_free_blocks
    assert held == 2  # 8 prompt tokens in 4-slot blocks stay cached while paused
    engine.resume("r", sampling_params=SamplingParams.greedy(11))
    rest = _drain(engine)["r"]
    assert first + rest == whole
    engine.release("r")
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.num_requests == 0


def test_stop_tokens_stop_check_and_finish_reasons(tiny_llama: LlamaCausalLM) -> None:
    prompt = [7, 7, 1]
    reference = _engine(tiny_llama).generate([prompt], SamplingParams.greedy(10))[0]
    engine = _engine(tiny_llama)
    engine.add_request("stop", prompt, SamplingParams.greedy(10, stop_token_ids=(reference[3],)))
    engine.add_request(
        "check", prompt, SamplingParams.greedy(10), stop_check=lambda s: s.num_output_tokens == 2
    )
    engine.add_request("length", prompt, SamplingParams.greedy(5))
    reasons: dict[str, FinishReason | None] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    first_stop = reference.index(reference[3])
    assert tokens["stop"] == reference[: first_stop + 1]
    assert reasons == {
        "stop": FinishReason.STOP,
        "check": FinishReason.STOP_CHECK,
        "length": FinishReason.LENGTH,
    }
    assert tokens["check"] == reference[:2] and tokens["length"] == reference[:5]


def test_logits_processor_constrains_each_position(tiny_llama: LlamaCausalLM) -> None:
    allowed = [[5, 6], [7], [8, 9, 10]]

    def constrain(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(token_ids) - 3
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed[step % 3]] = 0.0
        return logits + mask

    engine = _engine(tiny_llama)
    engine.add_request(
        "r",
        [1, 2, 3],
        SamplingParams(temperature=1.0, max_tokens=9, seed=3),
        logits_processor=constrain,
    )
    got = _drain(engine)["r"]
    assert all(tok in allowed[i % 3] for i, tok in enumerate(got))


def test_fork_shares_blocks_and_branches_diverge_copy_on_write(tiny_llama: LlamaCausalLM) -> None:
    prompt = [1, 2, 3, 4, 5, 6]  # 6 tokens: the second block is partial and shared
    engine = _engine(tiny_llama)
    engine.add_request("ctx", prompt, SamplingParams.greedy(1), keep_alive=True)
    _drain(engine)
    before = engine.block_manager.num_free_blocks
    engine.fork("ctx", "a", keep_alive=False)
    engine.fork("ctx", "b", keep_alive=False)
    assert engine.block_manager.num_free_blocks == before  # sharing, no copies yet
    context = engine.get_sequence("ctx").token_ids
    engine.resume("a", sampling_params=SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    engine.resume("b", sampling_params=SamplingParams(temperature=1.0, max_tokens=8, seed=2))
    got = _drain(engine)
    for name, seed in (("a", 1), ("b", 2)):
        alone = _engine(tiny_llama).generate(
            [context], SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
        )[0]
        assert got[name] == alone
    engine.release("ctx")
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_prefix_cache_reuses_blocks_and_keeps_outputs(tiny_llama: LlamaCausalLM) -> None:
    prompt = list(range(1, 18))
    engine = _engine(tiny_llama)
    first = engine.generate([prompt], SamplingParams.greedy(4))[0]
    engine.add_request("again", prompt, SamplingParams.greedy(4))
    out = engine.scheduler.schedule()
    assert out.scheduled[0].start == 16  # four full blocks found, one token left to compute
    tokens = engine.runner.execute(out).tokens
    engine.scheduler.update_from_output(out, tokens)
    rest = _drain(engine).get("again", [])
    assert tokens + rest == first


def _dense_reference(model: LlamaCausalLM, ids: list[int], limits: list[int]) -> torch.Tensor:
    """Full-recompute logits of the last token with an explicit prefix mask."""
    cfg = model.config
    x = model.model.embed_tokens(torch.tensor(ids))
    n = len(ids)
    pos = torch.arange(n)
    cos = model.rope_cos[pos].unsqueeze(1)
    sin = model.rope_sin[pos].unsqueeze(1)
    mask = torch.arange(n)[None, :] < torch.tensor(limits)[:, None]
    from mstar.engines.layers import apply_rotary

    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        att = layer.self_attn
        q = apply_rotary(att.q_proj(h).view(n, cfg.num_attention_heads, -1), cos, sin)
        k = apply_rotary(att.k_proj(h).view(n, cfg.num_key_value_heads, -1), cos, sin)
        v = att.v_proj(h).view(n, cfg.num_key_value_heads, -1)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = x + att.o_proj(o.transpose(0, 1).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(model.model.norm(x))


@pytest.mark.parametrize(
    ("mask", "limits"),
    [
        (AttentionMask.full(), lambda n: [n] * n),
        (AttentionMask.block_causal(3), lambda n: [min((i // 3 + 1) * 3, n) for i in range(n)]),
    ],
    ids=["full", "block_causal"],
)
@pytest.mark.parametrize("budget", [4, 64], ids=["chunked", "one-step"])
def test_non_causal_prompt_masks_match_dense_attention(
    tiny_llama64: LlamaCausalLM,
    mask: AttentionMask,
    limits,
    budget: int,  # type: ignore[no-untyped-def]
) -> None:
    prompt = [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 12]
    n = len(prompt)
    engine = _engine(tiny_llama64, max_num_batched_tokens=budget)
    engine.return_logits = True
    engine.add_request("m", prompt, SamplingParams.greedy(3), mask=mask)
    # A causal neighbour in the same batches.
    engine.add_request("c", [1, 2, 3, 4, 5], SamplingParams.greedy(3))
    logits: dict[str, list[torch.Tensor]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.logits is not None
            logits.setdefault(out.request_id, []).append(out.logits)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    with torch.inference_mode():
        for step in range(3):
            ids = prompt + tokens["m"][:step]
            lim = limits(n) + list(range(n + 1, n + step + 1))
            ref = _dense_reference(tiny_llama64, ids, lim)[-1]
            torch.testing.assert_close(logits["m"][step], ref)
        causal = [1, 2, 3, 4, 5, *tokens["c"][:2]]
        ref_c = _dense_reference(tiny_llama64, causal, list(range(1, 8)))[-1]
        torch.testing.assert_close(logits["c"][2], ref_c)


def test_chunk_cuts_respect_mask_segments() -> None:
    seq = Sequence("s", list(range(20)), SamplingParams(), arrival=0, mask=AttentionMask.full())
    assert seq.max_chunk(8) == 20  # a bidirectional prompt cannot be cut
    blocky = Sequence(
        "b", list(range(20)), SamplingParams(), arrival=0, mask=AttentionMask.block_causal(6)
    )
    assert blocky.max_chunk(8) == 6 and blocky.max_chunk(13) == 12 and blocky.max_chunk(4) == 6
    blocky.num_computed_tokens = 18
    assert blocky.max_chunk(1) == 2 and blocky.kv_limit(18) == 20


def test_prompts_are_not_cut_to_fill_a_step_that_holds_other_prompts(
    tiny_llama: LlamaCausalLM,
) -> None:
    """A prompt that fits a step of its own starts whole in the next step instead of being
    cut beside another prompt (which would only delay both first tokens); a prompt longer
    than a step is still cut, and decode rows do not hold a prompt back."""
    prompts = {"a": [1] * 12, "b": [2] * 12, "c": [3] * 3, "long": [4] * 40}
    engine = _engine(tiny_llama, max_num_batched_tokens=16)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, SamplingParams.greedy(4))
    chunks: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        step = schedule()
        chunks.append([(s.seq.request_id, s.num_tokens) for s in step.scheduled])
        return step

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    got = _drain(engine)
    assert chunks[:3] == [
        [("a", 12)],  # b would be cut to 4 beside a: it waits, and c behind it
        [("a", 1), ("b", 12), ("c", 3)],
        [("a", 1), ("b", 1), ("c", 1), ("long", 13)],  # beside decode rows only: cut
    ]
    for name, prompt in prompts.items():
        alone = _engine(tiny_llama, max_num_batched_tokens=16)
        alone.add_request(name, prompt, SamplingParams.greedy(4))
        assert got[name] == _drain(alone)[name]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama: LlamaCausalLM) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, seed=42)
    alone = _engine(tiny_llama).generate([[1, 2, 3]], params)[0]
    others = [[4, 5, 6, 7], [9], [3, 3, 3, 3, 3, 3]]
    batched = _engine(tiny_llama).generate([*others, [1, 2, 3]], params)[-1]
    assert batched == alone
    reseeded = _engine(tiny_llama).generate(
        [[1, 2, 3]], SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, seed=7)
    )[0]
    assert reseeded != alone


def test_errors_for_bad_requests(tiny_llama: LlamaCausalLM) -> None:
    engine = _engine(tiny_llama, num_blocks=8)
    engine.add_request("a", [1, 2], SamplingParams.greedy(2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1], SamplingParams.greedy(2))
    with pytest.raises(
        KVCacheCapacityError,
        match=r"KV cache's capacity is 32 tokens \(8 blocks\); raise the KV-cache budget",
    ):
        engine.add_request("long", [1] * 30, SamplingParams.greedy(10))
    with pytest.raises(KVCacheCapacityError, match="max_model_len"):
        engine.add_request("huge", [1] * 250, SamplingParams.greedy(10))
    with pytest.raises(KVCacheCapacityError, match="empty"):
        engine.add_request("empty", [], SamplingParams.greedy(1))
    with pytest.raises(RequestNotFoundError):
        engine.resume("nope")
    with pytest.raises(RequestNotFoundError, match="paused"):
        engine.release("a")
    assert engine.abort("a") and not engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidSamplingParamsError):
        AttentionMask.block_causal(0)


def test_cache_sized_from_a_byte_budget() -> None:
    model = make_tiny_llama()
    spec = model.kv_cache_spec
    per_block = spec.bytes_per_block(8)
    engine = KVCacheEngine(model, KVCacheEngineConfig(block_size=8, kv_cache_memory=per_block * 11))
    assert engine.num_blocks == 10  # one block's worth is the padding sink
    assert engine.kv_cache_bytes == per_block * 11
    with pytest.raises(KVCacheCapacityError, match="budget"):
        KVCacheEngine(model, KVCacheEngineConfig(block_size=8, kv_cache_memory=per_block))
    fraction = KVCacheEngine(model, KVCacheEngineConfig(block_size=8, kv_cache_memory=0.01))
    assert fraction.num_blocks >= 1


def test_decode_staging_matches_plain_gather(tiny_llama: LlamaCausalLM) -> None:
    """The staged decode copies give the same logits as gathering from blocks every step."""
    from mstar.engines import TorchPagedAttention

    def run(staging: bool) -> dict[str, list[torch.Tensor]]:
        engine = _engine(tiny_llama, num_blocks=12, max_num_batched_tokens=16)
        backend = TorchPagedAttention(decode_staging=staging, native=False)
        engine.runner.backend = backend
        engine.runner.ctx.backend = backend
        engine.return_logits = True
        _, logits = run_join_leave_schedule(engine)
        assert engine.scheduler.num_preemptions > 0  # 12 blocks force recomputes too
        return logits

    staged, plain = run(True), run(False)
    assert staged.keys() == plain.keys()
    for name in staged:
        torch.testing.assert_close(torch.stack(staged[name]), torch.stack(plain[name]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_length_decode_staging_matches_plain_gather(dtype: torch.dtype) -> None:
    """A wave of equal-length sequences (one append column per step) decodes as gathering does;
    a bfloat16 cache is staged as exact float32 copies (the same tokens up to a near-tie)."""
    from mstar.engines import TorchPagedAttention

    model = make_tiny_llama(dtype=dtype)
    prompts = [[(7 * r + i) % 64 for i in range(6)] for r in range(4)]

    def run(
        staging: bool,
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], TorchPagedAttention]:
        engine = _engine(model)
        backend = TorchPagedAttention(decode_staging=staging, native=False)
        engine.runner.backend = backend
        engine.runner.ctx.backend = backend
        engine.return_logits = True
        for r, prompt in enumerate(prompts):
            engine.add_request(f"r{r}", prompt, SamplingParams.greedy(12))
        tokens: dict[str, list[int]] = {}
        logits: dict[str, list[torch.Tensor]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.logits is not None
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logits.setdefault(out.request_id, []).append(out.logits.float())
        return tokens, {k: torch.stack(v) for k, v in logits.items()}, backend

    (staged_tokens, staged, backend), (plain_tokens, plain, _) = run(True), run(False)
    assert backend._staging is not None
    buffers = list(backend._staging.buffers.values())
    assert len(buffers) == 2 and all(b.dtype == torch.float32 for pair in buffers for b in pair)
    if dtype == torch.float32:
        assert staged_tokens == plain_tokens
        for name in staged:
            torch.testing.assert_close(staged[name], plain[name])
        return
    # bfloat16: float32 attention rounds differently, so a step whose two best logits are
    # closer than that rounding may pick the other one; until then everything agrees.
    for name in staged:
        for step, (ours, theirs) in enumerate(zip(staged[name], plain[name], strict=True)):
            torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.1)
            if staged_tokens[name][step] != plain_tokens[name][step]:
                best = theirs.topk(2).values
                assert float(best[0] - best[1]) <= 0.1
                break


def test_torch_compile_option_keeps_outputs(tiny_llama: LlamaCausalLM) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    eager = _engine(tiny_llama).generate(prompts, SamplingParams.greedy(6))
    compiled = _engine(tiny_llama, compile_backend="eager").generate(
        prompts, SamplingParams.greedy(6)
    )
    assert compiled == eager
