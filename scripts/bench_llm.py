"""Benchmark LLM decode through mstar against transformers' `generate` (and vLLM), on the bench
harness.

For each model, dtype and concurrency c, waves of c requests with random token prompts
decode `--new-tokens` greedy tokens each (end-of-sequence ignored, so every side does equal
work):

- `mstar`: the `llama` text model served by `AsyncEngine` (one rank, in process): prefill,
  then a `DynamicLoop` over the paged-KV node, continuous batching across requests.
- `transformers`: `LlamaForCausalLM.generate` on the same weights, the requests of a wave
  run as one batch (equal prompt lengths, so no padding), tokens streamed per step.
- `vllm` (with `--peer vllm`): vLLM's CPU build in its own virtual environment
  (`scripts/setup_vllm_peer.sh` makes `.venv-vllm`), run by `scripts/vllm_peer.py` in a
  subprocess on the same checkpoint directory (random weights for the tiny model, as
  `load_format="dummy"`; the real ones for SmolLM2), eager, token-id prompts, streaming each
  step's tokens back; it gets the same torch threads.

The transformers and vLLM sides and the floor arithmetic are `mstar.baselines.llm`; the
machine's limits `mstar.bench.machine`, the peak memory `mstar.bench.memory`.

The harness (`mstar.bench`) times every side identically on the client side and reports
throughput (output tokens/s), TTFT, TPOT, ITL and E2E (DESIGN §7), the ratios, a JSON file
and a PNG per model. Peak memory added while mstar or transformers runs a point (CPU: peak
RSS above the RSS before; CUDA: peak allocated above the allocation before; weights
excluded) is printed next to it.

The floor: a decode step must read every weight it multiplies (the embedding only for its
rows) and every cached key and value of the batch (at the mean context of a request's
decode). Those bytes over the memory bandwidth measured in the same run with the same
threads (a large tensor summed, best of five; measured again before every round, and the
best of the whole run taken: the machine's bandwidth drifts by tens of percent, and the
fastest it showed gives the strictest floor) give the fastest possible step; `% floor` is
that over mstar's TPOT. A step can also be bound by arithmetic instead: `flop ms` is its products'
floating-point work over the rate measured for a large matrix product, same threads. The
roofline floor is the larger of the two (a step can go no faster than either allows), and
`% roofline` is it over mstar's TPOT: on one thread the tiny model's step at c = 16 is
bound by arithmetic, not by bandwidth, so `% floor` alone cannot reach 100 %. Attention's
part of the step: `KV ms` is the floor of its keys and values alone (every layer's, each
read once, over the same bandwidth) and `KV share` their share of the step's bytes; with long
prompts they are most of the floor (`scripts/bench_decode_attention.py` times the kernel
alone against it).

A wave's TPOT also carries the prefill chunks of its later prompts (a request decodes while
the others' prompts are prefilled), so with long prompts `% floor` says little about decode
itself. The engine counts its decode-only steps apart, by rows (`PhaseTimes`): `dec ms` is
the mean of mstar's steps of c decode rows over the round (prepare to sampled tokens), and
`% dec floor` the bandwidth floor of such a step (its weights and the keys and values its rows
attended, at their mean context) over it.

Rounds (`--rounds R`): the whole sweep is measured R times, every side at every point in
each round (side after side within a point), and the table gives each figure's median over
the rounds; a ratio is the median of the rounds' own ratios, with its range in brackets. On
a shared machine whose speed drifts by tens of percent within minutes, a single round
compares sides measured under different conditions; the rounds show how far that goes.

mstar's KV cache takes blocks of `--block-size` tokens (16, the engine's default); vLLM's CPU
backend takes its own default, 128. Longer blocks are longer runs of memory read in order by
decode attention (`scripts/bench_decode_attention.py --block-sizes` times the kernel alone).

Models: `tiny` (Llama, hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512,
vocab 32000, random weights) and `smollm2` (SmolLM2-135M-Instruct, real weights).
With `--deterministic`, a second mstar engine serving deterministically
(`EngineConfig(deterministic=True)`: every row computed as it would be alone) runs beside
the default one as `mstar-det`; the table gives its TPOT and the ratio to the default's.

Targets: at concurrency 16, at least 1.5x transformers' throughput (issue #4); with the
peer, at least 1.3x vLLM's throughput at every concurrency and 80 % of the roofline floor
at concurrency 16 (issue #21); with `--deterministic`, a TPOT at most 1.3x the default's at
concurrency 16 (issue #35); with prompts of 1,536 tokens or more, decode-only steps at 60 %
of the bandwidth floor at concurrency 16 (issue #38).

    python scripts/bench_llm.py                      # the default sweep
    python scripts/bench_llm.py --models tiny --concurrency 1,16 --new-tokens 64
    python scripts/bench_llm.py --models tiny --concurrency 1,16 --dtypes float32,bfloat16 \
        --deterministic --rounds 3
    scripts/setup_vllm_peer.sh && python scripts/bench_llm.py --models tiny,smollm2 \
        --concurrency 1,4,16 --prompt-len 16 --dtypes float32,bfloat16 --peer vllm --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.llm import (
    PeerStartError,
    TransformersBatches,
    VllmPeer,
    add_floors,
    decode_step_cost,
    kv_cache_bytes,
)
from mstar.bench import (
    BenchRequest,
    CallableTarget,
    OfflineWaves,
    OutputEvent,
    plot_png,
    print_table,
    run_benchmark,
    write_json,
)
from mstar.bench.machine import measure_bandwidth, measure_machine
from mstar.bench.memory import PeakMemory
from mstar.runtime import AsyncEngine, EngineConfig, Output, Request
from mstar.server.encoding import token_ids
from mstar.zoo.hf_checkpoint import save_state_dict
from mstar.zoo.llm import TextLLM

TARGET_RATIO = 1.5
TARGET_CONCURRENCY = 16
PEER_TARGET_RATIO = 1.3  # mstar / vLLM throughput, at every concurrency
FLOOR_TARGET_PCT = 80.0  # of the roofline floor (bandwidth or arithmetic), at TARGET_CONCURRENCY
DETERMINISTIC_TARGET_RATIO = 1.3  # deterministic TPOT / default TPOT, at TARGET_CONCURRENCY
LONG_PROMPT = 1536  # from this many prompt tokens, decode is bound by its keys and values
DECODE_FLOOR_TARGET_PCT = 60.0  # of the bandwidth floor, decode-only steps at long prompts

REPO = Path(__file__).resolve().parents[1]
PEER_SCRIPT = REPO / "scripts" / "vllm_peer.py"
DEFAULT_PEER_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 16384,  # room for --prompt-len 8192 and its new tokens
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def make_tiny_checkpoint(directory: Path) -> Path:
    """Write a random-weight tiny Llama checkpoint (transformers' initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k != "model_type"})
    config.architectures = ["LlamaForCausalLM"]  # vLLM picks its model class from this
    model = LlamaForCausalLM(config)
    save_state_dict(model.state_dict(), directory, config.to_dict())
    return directory


def checkpoint_for(name: str, scratch: Path) -> Path:
    """Return the checkpoint directory of a benchmark model."""
    if name == "tiny":
        return make_tiny_checkpoint(scratch / "tiny")
    if name == "smollm2":
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        return smollm2_checkpoint_dir()
    raise SystemExit(f"unknown model {name!r} (choose tiny, smollm2)")


_ONE_TOKEN = (OutputEvent("text", num_tokens=1),)  # events are immutable: one serves every token


def _token_event(out: Any) -> Iterable[OutputEvent]:
    if isinstance(out, Output):
        if out.name != "tokens":
            return ()
        count = len(token_ids(out.data))
        return _ONE_TOKEN if count == 1 else (OutputEvent("text", num_tokens=count),)
    return _ONE_TOKEN


async def bench_model(
    name: str,
    dtype_name: str,
    args: argparse.Namespace,
    scratch: Path,
    console: Console,
    machine: dict[str, float],
) -> list[dict[str, Any]]:
    """Run the sweep of one model in one dtype; return its rows for the summary table."""
    device = torch.device(args.device)
    dtype = getattr(torch, dtype_name)
    checkpoint = checkpoint_for(name, scratch)
    small_cpu = device.type == "cpu" and not args.full and name == "smollm2"
    levels = args.smollm2_concurrency if small_cpu else args.concurrency
    new_tokens = args.smollm2_new_tokens if small_cpu else args.new_tokens
    block = args.block_size
    per_seq_blocks = -(-(args.prompt_len + new_tokens) // block)
    kv = {
        "block_size": block,
        "num_blocks": max(levels) * per_seq_blocks + 8,
        "max_num_seqs": max(levels),
        "max_num_batched_tokens": max(2048, args.prompt_len),
        "attention_backend": args.backend,
        "cuda_graphs": not args.no_cuda_graphs,
    }
    model = TextLLM(checkpoint, name=name, engine_config=kv, dtype=dtype_name)
    engine = await AsyncEngine.start(model, config=EngineConfig(devices={0: str(device)}))
    det_engine = (
        await AsyncEngine.start(
            model, config=EngineConfig(devices={0: str(device)}, deterministic=True)
        )
        if args.deterministic
        else None
    )
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
    baseline = TransformersBatches(hf, device)
    memory = PeakMemory(device)
    vocab = int(model.hf_config["vocab_size"])
    peer: VllmPeer | None = None
    if args.peer == "vllm":
        peer_config = {
            "model": str(checkpoint),
            "dtype": dtype_name,
            "load_format": "dummy" if name == "tiny" else "auto",
            "max_model_len": per_seq_blocks * block + block,
            "max_num_seqs": max(levels),
        }
        peer = VllmPeer(
            args.peer_python,
            PEER_SCRIPT,
            peer_config,
            threads=torch.get_num_threads(),
            log=args.out / f"vllm_peer_{name}_{dtype_name}.log",
        )
        try:
            await peer.start()
        except PeerStartError as exc:
            raise SystemExit(str(exc)) from exc

    def served_by(served: AsyncEngine, side: str) -> Any:
        async def mstar_fn(request: BenchRequest) -> AsyncIterator[Output]:
            memory.start(side)
            try:
                data = {
                    "prompt_token_ids": request.params["prompt_token_ids"],
                    "max_tokens": request.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0.0,
                }
                async for out in served.generate(Request("generate", data)):
                    yield out
            finally:
                memory.stop(side, request.request_id)

        return mstar_fn

    async def hf_fn(request: BenchRequest) -> AsyncIterator[int]:
        memory.start("transformers")
        try:
            assert request.max_tokens is not None
            async for token in baseline.generate(
                request.params["prompt_token_ids"], request.max_tokens
            ):
                yield token
        finally:
            memory.stop("transformers", request.request_id)

    async def vllm_fn(request: BenchRequest) -> AsyncIterator[int]:
        assert peer is not None and request.max_tokens is not None
        async for token in peer.generate(request.params["prompt_token_ids"], request.max_tokens):
            yield token

    targets = {
        "mstar": CallableTarget(served_by(engine, "mstar"), name="mstar", to_events=_token_event),
        "transformers": CallableTarget(hf_fn, name="transformers", to_events=_token_event),
    }
    if det_engine is not None:
        targets["mstar-det"] = CallableTarget(
            served_by(det_engine, "mstar-det"), name="mstar-det", to_events=_token_event
        )
    if peer is not None:
        targets["vllm"] = CallableTarget(vllm_fn, name="vllm", to_events=_token_event)
    gen = torch.Generator().manual_seed(1)
    requests = [
        BenchRequest(
            f"p{i}",
            "",
            new_tokens,
            True,
            {
                "prompt_token_ids": torch.randint(
                    0, vocab, (args.prompt_len,), generator=gen
                ).tolist()
            },
        )
        # A large pool, so that waves rarely repeat a prompt (repeats would share KV blocks).
        for i in range(2048)
    ]
    config = {
        "model": name,
        "checkpoint": checkpoint.name,
        "device": str(device),
        "dtype": dtype_name,
        "new_tokens": new_tokens,
        "prompt_len": args.prompt_len,
        "kv_cache": kv,
        "torch_threads": torch.get_num_threads(),
        "waves": args.waves,
        "rounds": args.rounds,
        "peer": peer.info if peer else None,
        **machine,
    }
    element_size = torch.empty(0, dtype=dtype).element_size()
    context = args.prompt_len + new_tokens / 2  # a request's mean context while it decodes
    rounds: list[list[dict[str, Any]]] = []
    load = OfflineWaves(tuple(levels), num_waves=args.waves)

    def point_row(result: Any, conc: int, decode: dict[int, list[float]]) -> dict[str, Any]:
        """Return one round's summary row of the point at concurrency `conc` (`decode`: the
        round's decode-only steps by rows, `decode_counters`)."""
        ours = result.result("mstar", float(conc)).summary
        theirs = result.result("transformers", float(conc)).summary
        key = f"{load.kind}-{conc}"
        step_bytes, step_flops = decode_step_cost(model.hf_config, element_size, conc, context)
        tpot_ms = ours.tpot_s.mean * 1e3 if ours.tpot_s else float("nan")
        row = {
            "model": name,
            "dtype": dtype_name,
            "concurrency": conc,
            "new_tokens": new_tokens,
            "block_size": block,
            "mstar_tokens_per_s": ours.output_tokens_per_s,
            "mstar_tpot_ms": tpot_ms,
            "mstar_ttft_ms": ours.ttft_s.p50 * 1e3 if ours.ttft_s else float("nan"),
            "mstar_peak_mib": memory.peaks.get(("mstar", key), float("nan")),
            "hf_tokens_per_s": theirs.output_tokens_per_s,
            "hf_tpot_ms": theirs.tpot_s.mean * 1e3 if theirs.tpot_s else float("nan"),
            "hf_ttft_ms": theirs.ttft_s.p50 * 1e3 if theirs.ttft_s else float("nan"),
            "hf_peak_mib": memory.peaks.get(("transformers", key), float("nan")),
            "ratio": ours.output_tokens_per_s / theirs.output_tokens_per_s,
            "failed": ours.num_failed + theirs.num_failed,
            "step_bytes": step_bytes,
            "kv_bytes": kv_cache_bytes(model.hf_config, element_size, conc, context),
            "flop_ms": step_flops / machine[f"{dtype_name}_flop_per_s"] * 1e3,
            "prompt_len": args.prompt_len,
        }
        steps, seconds, keys = decode.get(conc, (0.0, 0.0, 0.0))
        if steps > 0:  # its decode-only steps of c rows, at the context their rows attended
            attended = keys / (steps * conc)
            row["decode_step_ms"] = seconds / steps * 1e3
            row["decode_step_bytes"] = decode_step_cost(
                model.hf_config, element_size, conc, attended
            )[0]
            row["decode_context"] = attended
        if det_engine is not None:
            det = result.result("mstar-det", float(conc)).summary
            det_tpot_ms = det.tpot_s.mean * 1e3 if det.tpot_s else float("nan")
            row.update(
                {
                    "det_tokens_per_s": det.output_tokens_per_s,
                    "det_tpot_ms": det_tpot_ms,
                    "det_tpot_ratio": det_tpot_ms / tpot_ms,
                }
            )
            row["failed"] += det.num_failed
        if peer is not None:
            peer_summary = result.result("vllm", float(conc)).summary
            row.update(
                {
                    "vllm_tokens_per_s": peer_summary.output_tokens_per_s,
                    "vllm_tpot_ms": peer_summary.tpot_s.mean * 1e3
                    if peer_summary.tpot_s
                    else float("nan"),
                    "vllm_ttft_ms": peer_summary.ttft_s.p50 * 1e3
                    if peer_summary.ttft_s
                    else float("nan"),
                    "vllm_ratio": ours.output_tokens_per_s / peer_summary.output_tokens_per_s,
                }
            )
            row["failed"] += peer_summary.num_failed
        return row

    try:
        label = f"{name}_{dtype_name}"
        for index in range(args.rounds):
            # Each round measures every side at every point again (side after side within a
            # point), so a machine whose speed drifts shows up as spread across rounds
            # instead of as a ratio between sides measured minutes apart.
            suffix = f"_round{index + 1}" if args.rounds > 1 else ""
            machine["bandwidth_bytes_per_s"] = max(
                machine["bandwidth_bytes_per_s"], measure_bandwidth()
            )
            before = await decode_counters(engine)
            result = await run_benchmark(
                targets,
                requests,
                load,
                name=f"bench_llm {label}{suffix}",
                seed=index,
                progress=True,
                console=console,
                config=config,
            )
            print_table(result, console)
            write_json(result, args.out / f"bench_llm_{label}{suffix}.json")
            plot_png(result, args.out / f"bench_llm_{label}{suffix}.png")
            after = await decode_counters(engine)
            decode = {
                rows: [a - b for a, b in zip(counts, before.get(rows, [0.0] * 3), strict=True)]
                for rows, counts in after.items()
            }
            rounds.append([point_row(result, conc, decode) for conc in levels])
    finally:
        await engine.shutdown()
        if det_engine is not None:
            await det_engine.shutdown()
        baseline.executor.shutdown()
        if peer is not None:
            await peer.close()
    return [combine_rounds([points[i] for points in rounds]) for i in range(len(levels))]


async def decode_counters(engine: AsyncEngine) -> dict[int, list[float]]:
    """Return the engine's decode-only steps so far by rows: [steps, seconds, keys attended],
    summed over its ranks and nodes (`PhaseTimes`' ``decode<n>_*`` counters)."""
    counts: dict[int, list[float]] = {}
    for nodes in (await engine.stats()).values():
        for values in nodes.values():
            for key, value in values.items():
                rows, _, field = key.removeprefix("decode").partition("_")
                if key.startswith("decode") and rows.isdigit():
                    slot = ("steps", "seconds", "keys").index(field)
                    counts.setdefault(int(rows), [0.0] * 3)[slot] += value
    return counts


# Figures of a point that combine as a median over rounds (ratios: the median of each round's
# ratio, both sides measured back to back); the rest is the same every round or summed.
_MEDIAN_FIELDS = (
    "mstar_tokens_per_s",
    "mstar_tpot_ms",
    "mstar_ttft_ms",
    "hf_tokens_per_s",
    "hf_tpot_ms",
    "hf_ttft_ms",
    "ratio",
    "vllm_tokens_per_s",
    "vllm_tpot_ms",
    "vllm_ttft_ms",
    "vllm_ratio",
    "det_tokens_per_s",
    "det_tpot_ms",
    "det_tpot_ratio",
    "decode_step_ms",
)


def combine_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Return one point's row over its rounds: medians, the ratios' range, failures summed."""
    combined = dict(rows[0])
    for field in _MEDIAN_FIELDS:
        if field in combined:
            combined[field] = statistics.median(r[field] for r in rows)
    for field in ("mstar_peak_mib", "hf_peak_mib"):
        combined[field] = max(r[field] for r in rows)
    combined["failed"] = sum(r["failed"] for r in rows)
    combined["rounds"] = len(rows)
    for field in ("ratio", "vllm_ratio", "det_tpot_ratio"):
        if field in combined:
            combined[f"{field}_min"] = min(r[field] for r in rows)
            combined[f"{field}_max"] = max(r[field] for r in rows)
    return combined


def report(rows: list[dict[str, Any]], console: Console) -> bool:
    """Print the summary table and the target checks; return whether every target is met."""
    has_peer = any("vllm_tokens_per_s" in r for r in rows)
    has_det = any("det_tpot_ms" in r for r in rows)
    title = (
        "LLM decode: mstar vs transformers generate"
        + (" and vLLM" if has_peer else "")
        + " (waves of c requests)"
    )
    table = Table(title=title)
    columns = [
        "model",
        "dtype",
        "c",
        "new",
        "mstar tok/s",
        "TPOT ms",
        "TTFT ms",
        "+MiB",
        "hf tok/s",
    ]
    columns += ["vllm tok/s", "TPOT ms"] if has_peer else []
    columns += ["det TPOT ms", "det ÷ TPOT"] if has_det else []
    columns += (
        ["÷hf"]
        + (["÷vllm"] if has_peer else [])
        + ["floor ms", "% floor", "flop ms", "% roofline", "KV ms", "KV share"]
        + ["dec ms", "% dec floor"]
    )
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [
            r["model"],
            r["dtype"].replace("float", "fp").replace("bfloat", "bf"),
            str(r["concurrency"]),
            str(r["new_tokens"]),
            f"{r['mstar_tokens_per_s']:.1f}",
            f"{r['mstar_tpot_ms']:.2f}",
            f"{r['mstar_ttft_ms']:.1f}",
            f"{r['mstar_peak_mib']:.0f}",
            f"{r['hf_tokens_per_s']:.1f}",
        ]
        if has_peer:
            cells += [
                f"{r.get('vllm_tokens_per_s', float('nan')):.1f}",
                f"{r.get('vllm_tpot_ms', float('nan')):.2f}",
            ]
        if has_det:
            cells += [f"{r.get('det_tpot_ms', float('nan')):.2f}", _ratio_cell(r, "det_tpot_ratio")]
        cells.append(_ratio_cell(r, "ratio"))
        if has_peer:
            cells.append(_ratio_cell(r, "vllm_ratio"))
        cells += [
            f"{r['floor_ms']:.2f}",
            f"{r['floor_pct']:.0f}%",
            f"{r['flop_ms']:.2f}",
            f"{r['roofline_pct']:.0f}%",
            f"{r.get('kv_floor_ms', float('nan')):.2f}",
            f"{r.get('kv_share_pct', float('nan')):.0f}%",
            f"{r.get('decode_step_ms', float('nan')):.2f}",
            f"{r.get('decode_floor_pct', float('nan')):.0f}%",
        ]
        table.add_row(*cells)
    console.print(table)
    met = True

    def check(ok: bool, text: str) -> None:
        nonlocal met
        met = met and ok
        console.print(f"target {text}: {'MET' if ok else 'NOT MET'}")

    for r in rows:
        where = f"{r['model']} {r['dtype']} c={r['concurrency']}"
        if r["concurrency"] == TARGET_CONCURRENCY:
            check(
                r["ratio"] >= TARGET_RATIO and r["failed"] == 0,
                f"{where}: >= {TARGET_RATIO}x transformers' throughput -> {r['ratio']:.2f}x",
            )
        if "det_tpot_ratio" in r and r["concurrency"] == TARGET_CONCURRENCY:
            check(
                r["det_tpot_ratio"] <= DETERMINISTIC_TARGET_RATIO and r["failed"] == 0,
                f"{where}: deterministic TPOT <= {DETERMINISTIC_TARGET_RATIO}x the default's -> "
                f"{r['det_tpot_ratio']:.2f}x",
            )
        if (
            r["concurrency"] == TARGET_CONCURRENCY
            and r["prompt_len"] >= LONG_PROMPT
            and "decode_floor_pct" in r
        ):
            check(
                r["decode_floor_pct"] >= DECODE_FLOOR_TARGET_PCT,
                f"{where}: decode steps >= {DECODE_FLOOR_TARGET_PCT:.0f}% of the bandwidth floor "
                f"-> {r['decode_floor_pct']:.0f}% ({r['decode_step_ms']:.2f} ms a step at "
                f"{r['decode_context']:.0f} keys a row)",
            )
        if "vllm_ratio" in r:
            check(
                r["vllm_ratio"] >= PEER_TARGET_RATIO and r["failed"] == 0,
                f"{where}: >= {PEER_TARGET_RATIO}x vLLM's throughput -> {r['vllm_ratio']:.2f}x",
            )
            if r["concurrency"] == TARGET_CONCURRENCY:
                check(
                    r["roofline_pct"] >= FLOOR_TARGET_PCT,
                    f"{where}: >= {FLOOR_TARGET_PCT:.0f}% of the roofline floor -> "
                    f"{r['roofline_pct']:.0f}%"
                    f" (bandwidth floor {r['floor_pct']:.0f}%)",
                )
    return met


def _ratio_cell(row: dict[str, Any], field: str) -> str:
    """A ratio, with its range over the rounds when there were several."""
    if field not in row:
        return "nan"
    text = f"{row[field]:.2f}x"
    if row.get("rounds", 1) > 1:
        text += f" ({row[field + '_min']:.2f}-{row[field + '_max']:.2f})"
    return text


def _levels(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the sweep, print and write the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    # SmolLM2 is ~30x the tiny model's compute: on a CPU its default sweep is cut so the
    # whole default run takes minutes; --full runs the complete sweep for both.
    parser.add_argument("--smollm2-concurrency", type=_levels, default=[1, 4, 16])
    parser.add_argument("--smollm2-new-tokens", type=int, default=64)
    parser.add_argument(
        "--full", action="store_true", help="smollm2 uses --concurrency/--new-tokens"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2, help="measured waves per point")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every side at every point this many times; report medians",
    )
    # One thread by default on CPU: on shared cores, multi-threaded GEMMs spin-wait on busy
    # siblings and slow down by an order of magnitude, which says nothing about the engines.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    parser.add_argument("--block-size", type=int, default=16, help="mstar's KV block size (tokens)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--peer",
        default="none",
        choices=["none", "vllm"],
        help="also run vLLM's CPU build (see scripts/setup_vllm_peer.sh)",
    )
    parser.add_argument(
        "--peer-python",
        type=Path,
        default=DEFAULT_PEER_PYTHON,
        help="the interpreter of the vLLM environment",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="also run a deterministic mstar engine beside the default one (mstar-det)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/llm"))
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        parser.error(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.peer == "vllm" and not args.peer_python.exists():
        raise SystemExit(
            f"--peer vllm needs {args.peer_python}: run scripts/setup_vllm_peer.sh first"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print("bench_llm", json.dumps({k: str(v) for k, v in vars(args).items()}))
    start = time.perf_counter()
    machine = measure_machine(dtypes)
    console.print(
        f"memory bandwidth {machine['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, matrix product "
        + ", ".join(f"{d} {machine[f'{d}_flop_per_s'] / 1e9:.0f} GFLOP/s" for d in dtypes)
        + f" ({torch.get_num_threads()} torch threads)"
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            for dtype_name in dtypes:
                rows += asyncio.run(
                    bench_model(name, dtype_name, args, Path(scratch), console, machine)
                )
    bandwidth = machine["bandwidth_bytes_per_s"]
    console.print(f"floors at the best memory bandwidth of the run: {bandwidth / 1e9:.1f} GB/s")
    for row in rows:
        add_floors(row, bandwidth)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_llm_summary.json").write_text(json.dumps(rows, indent=1))
    met = report(rows, console)
    console.print(
        f"wrote {args.out}/ (harness JSON and PNG per model and dtype, bench_llm_summary.json); "
        f"total {time.perf_counter() - start:.0f} s"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
