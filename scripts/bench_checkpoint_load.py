"""Benchmark loading a checkpoint: time, and peak memory over the bytes of the weights kept.

PATH is a checkpoint directory; `mstar.zoo.resolve_model` picks its model. Each measurement
runs in a fresh Python process (so no earlier load's pages or allocator caches count): the
process builds the model (config, tokenizer: not timed), then loads the submodule of every
node (or of ``--nodes``) onto the CPU, the way a worker does. Columns:

- ``checkpoint``: bytes of tensor data in the directory's safetensors files;
- ``loaded``: bytes of the parameters and buffers the nodes hold after the load, in their dtype;
- ``seconds``: wall time of the load;
- ``peak +RSS``: the process's peak resident memory during the load above its resident memory
  before (Linux: the peak counter ``VmHWM`` reset through ``/proc/self/clear_refs`` just
  before; elsewhere ``ru_maxrss``, which also counts the build's peak). File pages mapped
  and touched count, as the kernel counts them;
- ``peak / loaded``: the ratio; the lazy loader aims at 1.3 at most;
- ``kept +RSS``: resident memory after the load above before.

The files are read once first, so every loader finds them in the page cache: the table
measures the loaders, not the disk. With ``--baseline`` (Qwen3-Omni only) the old path runs too, in
its own process: the whole
model built in float32, every tensor copied in through safetensors handles held open to the
end, then cast to the dtype. It always loads every node. Ratios against it come last.

    python scripts/bench_checkpoint_load.py /tmp/qwen3-omni-small-bf16 --dtype bfloat16 --baseline
    python scripts/bench_checkpoint_load.py /tmp/qwen3-omni-small-bf16 --nodes talker,code2wav
    python scripts/bench_checkpoint_load.py ~/.cache/mstar/smollm2-135m-instruct-q4_1
    python scripts/bench_checkpoint_load.py --make-qwen3-omni 30b-widths --dtype bfloat16 /tmp/q
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODES = ("lazy", "baseline")


def _status_kib(key: str) -> int | None:
    """Return a ``/proc/self/status`` field in KiB (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter of this process; return whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _peak_bytes(has_reset: bool) -> int:
    kib = _status_kib("VmHWM") if has_reset else None
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _held_bytes(objects: list[Any]) -> int:
    """Return the bytes of the distinct tensors (not on meta) of the modules ``objects`` hold."""
    modules: list[nn.Module] = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            modules.append(obj)
        else:  # a node: its modules are attributes (one level down is enough for the zoo's)
            modules.extend(v for v in vars(obj).values() if isinstance(v, nn.Module))
    seen: dict[tuple[int, int], int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                storage = tensor.untyped_storage()
                seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def _spec(path: str, dtype: str | None) -> Any:
    from mstar.zoo import resolve_model

    return resolve_model(path, **({} if dtype is None else {"dtype": dtype}))


def _lazy(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """Load the nodes' submodules as a worker would; return them and the nodes."""
    from mstar.runtime.model import supports_shared_engines

    model = _spec(args.path, args.dtype).build()
    _warm_up(model)
    nodes = sorted(model.graph().nodes)
    if args.nodes:
        unknown = sorted(set(args.nodes) - set(nodes))
        if unknown:
            raise SystemExit(
                f"{model.name} has no node {', '.join(unknown)}; its nodes: {', '.join(nodes)}"
            )
        nodes = [n for n in nodes if n in args.nodes]
    if supports_shared_engines(model):  # a hosted node runs in its host's engine
        hosts = model.engine_hosts()
        nodes = [n for n in nodes if n not in hosts or hosts[n] not in nodes]
    return _measure(lambda: [model.submodule(n, torch.device("cpu")) for n in nodes]), nodes


def _baseline(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The old Qwen3-Omni load: float32 model, every tensor copied in (handles kept), then cast."""
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    from mstar.zoo.hf_checkpoint import safetensors_files
    from mstar.zoo.qwen3_omni.checkpoint import _plan
    from mstar.zoo.qwen3_omni.model import Qwen3OmniModel
    from mstar.zoo.qwen3_omni.modules.weights import NODE_WEIGHTS, Qwen3OmniWeights

    model = _spec(args.path, args.dtype).build()
    if not isinstance(model, Qwen3OmniModel):
        raise SystemExit("--baseline measures the old Qwen3-Omni loader only")
    _warm_up(model)
    cpu = torch.device("cpu")

    def load() -> list[Any]:
        files = safetensors_files(model.checkpoint)
        with no_init_weights():
            weights = Qwen3OmniWeights(model.config)
        state = weights.state_dict()
        sources, stacked, _, _ = _plan(files, {n: t.shape for n, t in state.items()})
        handles: dict[Path, Any] = {}
        with torch.no_grad():
            for mine, names in sources.items():
                parts = []
                for name in names:
                    handle = handles.get(files[name])
                    if handle is None:
                        handle = handles[files[name]] = safe_open(str(files[name]), framework="pt")
                    parts.append(handle.get_tensor(name))
                if mine not in stacked:
                    tensor = parts[0]
                elif mine.endswith("gate_up_proj"):
                    tensor = torch.stack(
                        [torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)]
                    )
                else:
                    tensor = torch.stack(parts)
                state[mine].copy_(tensor.to(state[mine].dtype))
        handles.clear()
        weights = weights.to(dtype=model.dtype).requires_grad_(False).to_device_tables().eval()
        # The nodes are built from these weights as the lazy run builds them (nothing left to read).
        model._weights[cpu] = weights
        return [model.submodule(n, cpu) for n in NODE_WEIGHTS]

    return _measure(load), list(NODE_WEIGHTS)


_RESULT: dict[str, Any] = {}


def _warm_up(model: Any) -> None:
    """Import what the first load would import (transformers' Qwen3-Omni modules): not load work."""
    from mstar.zoo.qwen3_omni.checkpoint import make_empty_weights
    from mstar.zoo.qwen3_omni.model import Qwen3OmniModel

    if isinstance(model, Qwen3OmniModel):
        make_empty_weights(model.config, device="meta")


def _measure(load: Any) -> list[Any]:
    gc.collect()
    has_reset = _reset_peak()
    before = _rss_bytes()
    started = time.perf_counter()
    held = load()
    seconds = time.perf_counter() - started
    peak = _peak_bytes(has_reset)
    gc.collect()
    _RESULT.update(
        seconds=seconds, peak_increase=peak - before, kept_increase=_rss_bytes() - before,
        loaded=_held_bytes(held), peak_is_reset=has_reset,
    )  # fmt: skip
    return held


def _child(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    held, nodes = (_lazy if args.child == "lazy" else _baseline)(args)
    _RESULT["nodes"] = nodes
    print("RESULT " + json.dumps(_RESULT), flush=True)
    del held


def _run_child(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    command = [sys.executable, __file__, args.path, "--child", mode, "--threads", str(args.threads)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if args.nodes and mode == "lazy":
        command += ["--nodes", ",".join(args.nodes)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the {mode} load failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _warm_page_cache(path: str) -> None:
    """Read every shard once, so each loader finds the files in the page cache (not the disk)."""
    from mstar.zoo.hf_checkpoint import safetensors_files

    buffer = bytearray(16 << 20)
    for shard in sorted(set(safetensors_files(path).values())):
        with shard.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


WIDE = "30b-widths"
"""A random config with the published widths, few layers: 1.6 B parameters (3.2 GB in bfloat16)."""


def _wide_config() -> Any:
    """Return `WIDE`: qwen3-omni-30b-a3b's widths and vocabularies; 2 thinker and talker layers of
    32 experts, 1 code-predictor layer, 2 audio and 3 vision layers, the whole Code2Wav."""
    import copy

    from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig, get_qwen3_omni_config

    hf = copy.deepcopy(get_qwen3_omni_config("qwen3-omni-30b-a3b").hf)
    thinker, talker = hf["thinker_config"], hf["talker_config"]
    thinker["text_config"].update(num_hidden_layers=2, num_experts=32)
    thinker["audio_config"].update(encoder_layers=2)
    thinker["vision_config"].update(depth=3, deepstack_visual_indexes=[0, 1, 2])
    talker["text_config"].update(num_hidden_layers=2, num_experts=32)
    talker["code_predictor_config"].update(num_hidden_layers=1)
    talker["accept_hidden_layer"] = 1
    return Qwen3OmniConfig(f"qwen3-omni-{WIDE}", hf)


def _make_qwen3_omni(args: argparse.Namespace) -> None:
    """Write a random Qwen3-Omni checkpoint of a named config (or `WIDE`) to PATH, in
    ``--dtype``."""
    from mstar.zoo.qwen3_omni.checkpoint import make_random_checkpoint
    from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
    name = args.make_qwen3_omni
    config = _wide_config() if name == WIDE else get_qwen3_omni_config(name)
    started = time.perf_counter()
    make_random_checkpoint(
        config, args.path, seed=0, dtype=dtype, max_shard_size=args.max_shard_size
    )
    print(
        f"wrote {args.make_qwen3_omni} ({args.dtype or 'float32'}) to {args.path} in "
        f"{time.perf_counter() - started:.1f} s"
    )


def print_configuration(
    args: argparse.Namespace, spec: Any, config: dict[str, Any], checkpoint: int
) -> None:
    """Print what is measured, and where."""
    files_dtype = config.get("torch_dtype") or config.get("dtype") or "?"
    print(f"checkpoint  {args.path}")
    print(f"model       {spec.factory}  {dict(spec.kwargs)}")
    print(f"dtype       files {files_dtype}; load {args.dtype or 'the model default'}")
    print(f"nodes       {','.join(args.nodes) if args.nodes else 'all'}")
    from mstar.bench.runner import cpu_model

    print(
        f"machine     {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
        f"{args.threads} threads"
    )
    print(f"weights     {_mib(checkpoint)} of tensors in the safetensors files")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", help="a checkpoint directory")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the weights' dtype (default: the model's default)",
    )
    parser.add_argument(
        "--nodes",
        type=lambda s: [n for n in s.split(",") if n],
        default=None,
        help="comma-separated nodes to load (default: every node)",
    )
    parser.add_argument("--baseline", action="store_true", help="also the old Qwen3-Omni loader")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--make-qwen3-omni",
        metavar="CONFIG",
        default=None,
        help=f"first write random weights of this Qwen3-Omni config (or {WIDE}) to PATH",
    )
    parser.add_argument("--max-shard-size", default="2GB", help="with --make-qwen3-omni")
    parser.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()  # fmt: skip
    if args.child:
        _child(args)
        return
    if args.make_qwen3_omni:
        _make_qwen3_omni(args)
    from mstar.zoo.hf_checkpoint import checkpoint_nbytes, load_hf_config

    spec = _spec(args.path, args.dtype)
    config = load_hf_config(args.path)
    checkpoint = checkpoint_nbytes(args.path)
    print_configuration(args, spec, config, checkpoint)
    _warm_page_cache(args.path)
    rows = {"lazy": _run_child(args, "lazy")}
    if args.baseline:
        rows["baseline"] = _run_child(args, "baseline")
    head = (
        f"{'loader':<9} {'nodes':<32} {'checkpoint':>13} {'loaded':>13} {'seconds':>8} "
        f"{'peak +RSS':>13} {'peak/loaded':>11} {'kept +RSS':>13}"
    )
    print()
    print(head)
    print("-" * len(head))
    for mode, r in rows.items():
        nodes = ",".join(r["nodes"])
        print(
            f"{mode:<9} {nodes[:32]:<32} {_mib(checkpoint):>13} {_mib(r['loaded']):>13} "
            f"{r['seconds']:>8.2f} "
            f"{_mib(r['peak_increase']):>13} "
            f"{r['peak_increase'] / max(1, r['loaded']):>11.2f} "
            f"{_mib(r['kept_increase']):>13}"
        )
    if not rows["lazy"]["peak_is_reset"]:
        print("(peak from ru_maxrss: it includes the model build's peak)")
    if "baseline" in rows:
        lazy, old = rows["lazy"], rows["baseline"]
        print(
            f"\nlazy / old: time {lazy['seconds'] / old['seconds']:.2f}x, peak +RSS "
            f"{lazy['peak_increase'] / max(1, old['peak_increase']):.2f}x"
            + ("" if not args.nodes else " (old loads every node)")
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "path": args.path,
                    "dtype": args.dtype,
                    "checkpoint_bytes": checkpoint,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
