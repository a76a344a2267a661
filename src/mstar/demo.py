"""The demo behind `mstar demo`: composite models declared as graphs, served end to end.

The default, `assistant`: starts `mstar serve assistant` (SmolLM2-135M-Instruct streaming its
answer, a sentence at a time, to a Piper voice), asks it a question through the official
`openai` client with ``modalities=["text", "audio"]``, prints the answer as it streams and
writes the spoken answer to a WAV file.

``--model toy-composite`` instead:

1. `toy-composite`: prints its text IR, serves one request per task through `AsyncEngine`
   (conductor and worker actors; nodes spread over two worker ranks), streams the outputs
   and checks them against the reference interpreter.
2. `orpheus-tiny`: the Orpheus TTS graph (a Llama speech LM on the paged KV cache streaming
   28/7 token windows into the SNAC codec) with tiny random weights; streams 24 kHz audio
   chunks as they are decoded and writes them to a WAV file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import wave
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from mstar.graph import run_reference
from mstar.runtime import AsyncEngine, Output, Placement, Request
from mstar.zoo.toy import ToyModel, ToyPlan, make_toy_inputs

__all__ = ["run_assistant_demo", "run_demo"]

DEMO_MODELS = ("assistant", "toy-composite")
QUESTION = "Why do we need sleep?"
_STARTUP_TIMEOUT_S = 600.0  # the first start converts SmolLM2's GGUF file (tens of seconds)

PLACEMENT = """
node_groups:
  - {node_names: [encoder, lm, init, image_encoder, cond, uncond], ranks: [0]}
  - {node_names: [vocoder, combine, vae], ranks: [1]}
"""


def _write_wav(path: Path, audio: torch.Tensor, sample_rate: int) -> None:
    pcm = (audio.clamp(-1, 1) * 32767).to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm)


def _same(outputs: list[Output], model: ToyModel, request: Request) -> bool:
    inputs = make_toy_inputs(request.data["text"], model.config, request.data.get("seed", 0))
    want = run_reference(model.graph(), model._nodes, inputs, ToyPlan(), state=request.task)
    got = [(o.node, o.name) for o in outputs]
    if sorted(got) != sorted((e.node, e.name) for e in want):
        return False
    by_key: dict[tuple[str, str], list[torch.Tensor]] = {}
    for o in outputs:
        by_key.setdefault((o.node, o.name), []).append(torch.as_tensor(o.data))
    return all(torch.equal(by_key[(e.node, e.name)].pop(0), torch.as_tensor(e.value)) for e in want)


async def _serve(model: ToyModel, text: str, out: Path | None, seed: int) -> int:
    placement = Placement.from_yaml(PLACEMENT)
    print("placement:", "; ".join(f"{g.node_names} -> ranks {g.ranks}" for g in placement.groups))
    async with await AsyncEngine.start(model, placement) as engine:
        for task in ("speech", "image"):
            request = Request(task, {"text": text, "seed": seed}, request_id=f"demo-{task}")
            start = time.perf_counter()
            outputs: list[Output] = []
            first_ms = None
            async for output in engine.generate(request):
                if first_ms is None:
                    first_ms = (time.perf_counter() - start) * 1e3
                outputs.append(output)
            took_ms = (time.perf_counter() - start) * 1e3
            counts = Counter((o.walk, o.name, o.modality) for o in outputs)
            print(
                f"request {task!r}: {len(outputs)} outputs in {took_ms:.1f} ms (first after "
                f"{first_ms:.1f} ms)"
            )
            for (walk, name, modality), n in counts.items():
                print(f"    {walk:10s} {name:6s} [{modality}] x{n}")
            if task == "speech":
                audio = torch.cat([o.data for o in outputs if o.name == "audio"])
                print(
                    f"    audio: {audio.numel() / model.audio_sample_rate:.3f} s at "
                    f"{model.audio_sample_rate} Hz"
                )
            else:
                image = next(o.data for o in outputs if o.name == "image")
                print(f"    image: {tuple(image.shape)} {image.dtype}")
            verdict = "identical to" if _same(outputs, model, request) else "DIFFERENT FROM"
            print(f"    outputs are {verdict} the reference interpreter's")
            print()
    return 0


async def _speak(text: str, out: Path | None, seed: int) -> int:
    from mstar.zoo import make_model

    model = make_model("orpheus-tiny")
    print(model.graph())
    print()
    sample_rate: int = model.audio_sample_rate  # type: ignore[attr-defined]
    async with await AsyncEngine.start(model) as engine:
        request = Request(
            "speech", {"text": text, "voice": "tara", "max_tokens": 280, "seed": seed}
        )
        start = time.perf_counter()
        chunks: list[torch.Tensor] = []
        ttfa = None
        async for output in engine.generate(request):
            if ttfa is None:
                ttfa = time.perf_counter() - start
            chunks.append(output.data)
        e2e = time.perf_counter() - start
    audio = torch.cat(chunks)
    seconds = audio.numel() / sample_rate
    print(
        f"request 'speech' on orpheus-tiny: {len(chunks)} audio chunks, {seconds:.2f} s of "
        f"{sample_rate} Hz audio; "
        f"first audio after {(ttfa or 0) * 1e3:.0f} ms, done after {e2e * 1e3:.0f} ms (RTF "
        f"{e2e / seconds:.2f})"
    )
    if out is not None:
        _write_wav(out, audio, sample_rate)
        print(f"    wrote {out} (random weights: it sounds like noise, by design)")
    return 0


@contextlib.contextmanager
def _served(model: str) -> Iterator[str]:
    """Run `mstar serve MODEL` on a free port; yield its URL once it answers /health."""
    import httpx

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "mstar.cli", "serve", model, "--port", "0", "--log-format", "json"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    bound: list[str] = []
    errors: list[str] = []

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                errors.append(line.rstrip())
                continue
            if event.get("event") == "server_bound":
                bound.append(str(event["url"]))
            elif event.get("level") in ("error", "critical"):
                errors.append(str(event.get("error") or event.get("event")))

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                detail = "; ".join(errors[-5:]) or f"exit code {proc.returncode}"
                raise RuntimeError(f"`mstar serve {model}` stopped before it was ready: {detail}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"`mstar serve {model}` was not ready within {_STARTUP_TIMEOUT_S:.0f} s"
                )
            if bound:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{bound[0]}/health", timeout=2.0).status_code == 200:
                        break
            time.sleep(0.2)
        yield bound[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_assistant_demo(question: str = QUESTION, out: Path | None = Path("answer.wav")) -> int:
    """Serve `assistant`, ask ``question`` with the openai client, stream the answer, write
    ``out``."""
    from openai import OpenAI

    print(
        "starting `mstar serve assistant`: SmolLM2-135M-Instruct -> sentences -> Piper voice "
        "(22,050 Hz)"
    )
    with _served("assistant") as url:
        print(f"serving at {url}")
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        print(f"question: {question}")
        print("answer:   ", end="", flush=True)
        start = time.perf_counter()
        first_text = first_audio = None
        rate = 24000  # OpenAI's pcm16 rate; mstar says its model's own in the first audio delta
        pcm = bytearray()
        stream = client.chat.completions.create(
            model="assistant",
            messages=[{"role": "user", "content": question}],
            modalities=["text", "audio"],
            audio={"voice": "joe", "format": "pcm16"},
            max_tokens=200,
            stream=True,
        )
        for chunk in stream:
            if not chunk.choices:
                continue
            audio = chunk.choices[0].delta.audio
            if audio is None:
                continue
            if audio.transcript:
                first_text = first_text or time.perf_counter() - start
                print(audio.transcript, end="", flush=True)
            if audio.data:
                first_audio = first_audio or time.perf_counter() - start
                pcm += base64.b64decode(audio.data)
                rate = int(getattr(audio, "sample_rate", rate))
        took = time.perf_counter() - start
    print()
    seconds = len(pcm) / 2 / rate
    print(
        f"first text after {(first_text or 0) * 1e3:.0f} ms, first audio after "
        f"{(first_audio or 0) * 1e3:.0f} ms, "
        f"done after {took * 1e3:.0f} ms; {seconds:.1f} s of speech"
    )
    if out is not None:
        with wave.open(str(out), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(rate)
            f.writeframes(bytes(pcm))
        print(f"wrote {out}: the spoken answer, {rate} Hz")
    return 0 if pcm else 1


def run_demo(text: str = "Hello from mstar!", out: Path | None = None, seed: int = 0) -> int:
    """Serve the toy model (checked against the reference), then Orpheus-tiny to ``out``."""
    model = ToyModel(seed=seed)
    print(model.graph())
    print()
    code = asyncio.run(_serve(model, text, None, seed))
    return code or asyncio.run(_speak(text, out, seed))
