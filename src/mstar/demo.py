"""The demo behind `mstar demo`: a composite model declared as a graph, run end to end.

It builds the `toy-composite` model, prints its text IR, then runs one request per task
through the reference interpreter and reports what each partition emitted.
"""

from __future__ import annotations

import time
import wave
from collections import Counter
from pathlib import Path

import torch

from mstar.graph import Emission, run_reference
from mstar.zoo.toy import ToyConfig, ToyPlan, make_toy_graph, make_toy_inputs, make_toy_nodes

__all__ = ["run_demo"]


def _write_wav(path: Path, audio: torch.Tensor, sample_rate: int) -> None:
    pcm = (audio.clamp(-1, 1) * 32767).to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm)


def _summarise(emissions: list[Emission]) -> str:
    counts = Counter((e.partition, e.walk, e.name, e.modality) for e in emissions)
    return "\n".join(
        f"    {part:8s} {walk:10s} {name:6s} [{modality}] x{n}" for (part, walk, name, modality), n in counts.items()
    )


def run_demo(text: str = "Hello from mstar!", out: Path | None = None, seed: int = 0) -> int:
    """Build, print and run the toy composite model; write its audio to ``out`` if given."""
    cfg = ToyConfig()
    graph = make_toy_graph(cfg)
    nodes = make_toy_nodes(cfg, seed=seed)
    inputs = make_toy_inputs(text, cfg, seed=seed)
    print(graph)
    print()
    for task in ("speech", "image"):
        start = time.perf_counter()
        emissions = run_reference(graph, nodes, inputs, ToyPlan(), state=task, request_id=f"demo-{task}")
        took_ms = (time.perf_counter() - start) * 1e3
        print(f"request {task!r} ({took_ms:.1f} ms, reference interpreter): {len(emissions)} outputs")
        print(_summarise(emissions))
        if task == "speech":
            tokens = [int(e.value) for e in emissions if e.name == "token"]
            audio = torch.cat([e.value for e in emissions if e.name == "audio"])
            first_audio = next(i for i, e in enumerate(emissions) if e.name == "audio")
            print(f"    tokens: {tokens}")
            print(
                f"    audio: {audio.numel()} samples = {audio.numel() / cfg.sample_rate:.3f} s at "
                f"{cfg.sample_rate} Hz; first audio chunk after {first_audio} of {len(emissions)} outputs (streamed)"
            )
            if out is not None:
                _write_wav(out, audio, cfg.sample_rate)
                print(f"    wrote {out}")
        else:
            image = next(e.value for e in emissions if e.name == "image")
            norms = next(e.value for e in emissions if e.name == "norm")
            print(f"    image: {tuple(image.shape)} {image.dtype}; latent norm per flow step: {[round(float(v), 3) for v in norms]}")
        print()
    return 0
