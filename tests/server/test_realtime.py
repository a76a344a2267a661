"""`/v1/realtime` with the official `openai` client: a conversation that hears and speaks.

Qwen3-Omni (tiny, random weights) answers text and audio turns in speech and in text; a
cancel stops an answer and frees what it held; bad events get error events naming them and
the session goes on. (A session idle past every timer on its path still answers:
`test_openpi_sessions.py`, beside the robots' minute.)
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets

from mstar.runtime import ModelSpec
from mstar.server.config import ServerConfig
from mstar.zoo import resolve_model
from tests.helpers import wait_until_idle
from tests.server.conftest import RunningServer, qwen3_omni_tiny_spec, running_server

NAME = "qwen3-omni-tiny"
RATE = 24_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    spec = qwen3_omni_tiny_spec(tmp_path_factory.mktemp("qwen3_omni") / "tiny", 30)
    with running_server(spec, names=(NAME,)) as running:
        yield running


def _client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


async def _until(conn: Any, kind: str) -> list[Any]:
    """Every event up to and including the first of ``kind``."""
    events = []
    async for event in conn:
        events.append(event)
        if event.type == kind:
            return events
    raise AssertionError(f"the session ended before {kind}")


LONG = "Tell me a long story about the sea"
"""The tiny random weights answer this one with 900 tokens and no end of turn."""


async def _say(conn: Any, text: str) -> None:
    """Add a user text turn to the conversation."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await conn.conversation.item.create(item=item)


def _tone(seconds: float) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def _b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode("ascii")


async def test_a_spoken_answer_to_a_text_turn(server: RunningServer) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.model == NAME
        await conn.session.update(
            session={"type": "realtime", "instructions": "Be brief.", "max_output_tokens": 6}
        )
        updated = (await _until(conn, "session.updated"))[-1]
        assert updated.session.instructions == "Be brief."
        assert updated.session.output_modalities == ["audio"]
        await _say(conn, "Hi")
        added = await _until(conn, "conversation.item.done")
        assert [e.type for e in added] == ["conversation.item.added", "conversation.item.done"]
        await conn.response.create()
        events = await _until(conn, "response.done")
        # The talker samples (transformers' defaults) from random weights: it may draw the
        # codec's end at once and say nothing. Ask again until it speaks (1 in 3 say nothing).
        spoken = events
        for _ in range(12):
            if any(e.type == "response.output_audio.delta" for e in spoken):
                break
            await conn.response.create()
            spoken = await _until(conn, "response.done")
    kinds = [e.type for e in events]
    assert kinds[:3] == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    audio = b"".join(
        base64.b64decode(e.delta) for e in spoken if e.type == "response.output_audio.delta"
    )
    transcript = "".join(
        e.delta for e in events if e.type == "response.output_audio_transcript.delta"
    )
    done = events[-1].response
    assert done.status == "completed" and 1 <= done.usage.output_tokens <= 6
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert done.output[0].content[0].transcript == transcript
    # The same conversation through chat completions (greedy both): the same words.
    chat = await _client(server).chat.completions.create(
        model=NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
    )
    assert chat.choices[0].message.content == transcript


async def test_an_audio_turn_answered_in_text(server: RunningServer) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await _until(conn, "session.updated")
        for start in range(0, RATE * 2, RATE // 2):  # one second of audio in 250 ms appends
            await conn.input_audio_buffer.append(audio=_b64(_tone(1.0)[start : start + RATE // 2]))
        await conn.input_audio_buffer.commit()
        committed = await _until(conn, "conversation.item.done")
        assert committed[0].type == "input_audio_buffer.committed"
        assert committed[-1].item.content[0].type == "input_audio"
        await conn.response.create(response={"max_output_tokens": 4})
        events = await _until(conn, "response.done")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert not any(e.type == "response.output_audio.delta" for e in events)
    done = events[-1].response
    assert done.status == "completed" and done.output[0].content[0].text == text


async def test_a_cancel_stops_the_answer_and_frees_it(server: RunningServer) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        await _say(conn, LONG)
        await conn.response.create(response={"max_output_tokens": 4096})  # past the model's length
        error = (await _until(conn, "error"))[-1].error
        assert error.param == "response.max_output_tokens" and "holds 1024 tokens" in error.message
        await conn.response.create(
            response={"max_output_tokens": 900, "output_modalities": ["text"]}
        )
        first = await _until(conn, "response.output_text.delta")
        assert first[-1].delta
        await conn.response.cancel()
        events = await _until(conn, "response.done")
        done = events[-1].response
        assert done.status == "cancelled" and done.usage.output_tokens < 900
        idle = asyncio.run_coroutine_threadsafe(wait_until_idle(server.state.engine), server.loop)
        await asyncio.wrap_future(idle)  # the cancelled request holds nothing
        # The session goes on: the partial answer is in the conversation, a new one starts.
        await conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
        again = (await _until(conn, "response.done"))[-1].response
        assert again.status == "completed" and again.usage.output_tokens == 2


BAD_FORMAT = {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}
BAD_EVENTS = [
    ({"type": "session.bogus"}, "type", "unknown event type"),
    (
        {"type": "session.update", "session": {"output_modalities": ["video"]}},
        "session.output_modalities",
        "output_modalities",
    ),
    ({"type": "input_audio_buffer.append", "audio": "%%%"}, "audio", "base64"),
    ({"type": "session.update", "session": BAD_FORMAT}, "session.audio.input.format", "PCM16"),
    (
        {"type": "conversation.item.create", "item": {"type": "message", "role": "robot"}},
        "item.role",
        "role",
    ),
    ({"type": "response.cancel"}, None, "no active response"),
]


@pytest.mark.parametrize(("event", "param", "words"), BAD_EVENTS)
async def test_a_bad_event_gets_an_error_and_the_session_goes_on(
    server: RunningServer, event: dict[str, Any], param: str | None, words: str
) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        await conn.send({**event, "event_id": "evt_bad"})  # type: ignore[arg-type]
        error = (await _until(conn, "error"))[-1].error
        assert error.event_id == "evt_bad" and error.param == param and words in error.message
        await conn.input_audio_buffer.commit()  # too short: an error too, and still no close
        assert "100 ms" in (await _until(conn, "error"))[-1].error.message
        await conn.session.update(session={"type": "realtime", "instructions": "ok"})
        assert (await _until(conn, "session.updated"))[-1].session.instructions == "ok"


async def test_a_model_this_server_does_not_serve_is_refused(server: RunningServer) -> None:
    async with _client(server).realtime.connect(model="gpt-4o-realtime") as conn:
        error = await conn.recv()
        assert error.type == "error" and error.error.param == "model"
        assert "does not exist here" in error.error.message
        with pytest.raises(websockets.ConnectionClosedError, match="1008"):
            await conn.recv()


def test_the_servers_key_is_required_and_a_text_model_answers_in_text(tiny_llama_dir: Path) -> None:
    """A text-only model (the tiny chat Llama) behind a key: no key, no session; with it, the
    session answers in text only (its chat template makes the prompt)."""
    spec = ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "chat"})
    with running_server(spec, ServerConfig(port=0, api_key="sesame"), names=("chat",)) as server:

        async def session(key: str) -> list[Any]:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            async with client.realtime.connect(model="chat") as conn:
                created = await conn.recv()
                assert created.session.output_modalities == ["text"]
                await conn.session.update(
                    session={"type": "realtime", "output_modalities": ["audio"]}
                )
                refused = (await _until(conn, "error"))[-1].error
                assert (
                    refused.param == "session.output_modalities"
                    and "does not speak" in refused.message
                )
                await _say(conn, "Hi")
                await conn.response.create(response={"max_output_tokens": 3})
                return await _until(conn, "response.done")

        with pytest.raises(Exception, match="403"):
            asyncio.run(session("wrong"))
        events = asyncio.run(session("sesame"))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.status == "completed"
        usage = events[-1].response.usage
        assert usage.input_tokens > 2 and usage.total_tokens == usage.input_tokens + 3
        assert events[-1].response.output[0].content[0].text == text


def _spoken(text: str) -> bytes:
    """Real speech (the assistant's Piper voice) as PCM16 at 24 kHz."""
    import soxr

    from mstar.zoo.assistant.voice import PiperSpeaker

    speaker = PiperSpeaker()
    speech = soxr.resample(speaker.speak(text), speaker.sample_rate, RATE)
    return (np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()


async def _stream_audio(conn: Any, pcm: bytes, chunk_ms: int = 100) -> None:
    step = RATE * chunk_ms // 1000 * 2
    for start in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=_b64(pcm[start : start + step]))


async def test_server_vad_hears_a_turn_and_answers_it(server: RunningServer) -> None:
    speech = _spoken("Hello there. How are you today?")
    silence = bytes(RATE * 2)  # one second
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        detection = {"type": "server_vad", "silence_duration_ms": 400, "prefix_padding_ms": 200}
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "max_output_tokens": 3,
                "audio": {"input": {"turn_detection": detection}},
            }
        )
        updated = (await _until(conn, "session.updated"))[-1].session
        assert updated.audio.input.turn_detection.type == "server_vad"
        await _stream_audio(conn, silence[: len(silence) // 2] + speech + silence)
        events = await _until(conn, "response.done")
    kinds = [e.type for e in events]
    started = events[kinds.index("input_audio_buffer.speech_started")]
    stopped = events[kinds.index("input_audio_buffer.speech_stopped")]
    speech_ms = len(speech) // 2 * 1000 // RATE
    # Speech starts after the 500 ms of silence (reported 200 ms early, the padding) and stops
    # 400 ms into the silence after it (Piper's own trailing quiet included).
    assert 500 - 200 <= started.audio_start_ms <= 500 + 300
    assert 500 + speech_ms // 2 + 400 <= stopped.audio_end_ms <= 500 + speech_ms + 400 + 100
    assert stopped.item_id == started.item_id
    assert kinds.index("input_audio_buffer.committed") > kinds.index(
        "input_audio_buffer.speech_stopped"
    )
    committed = events[kinds.index("input_audio_buffer.committed")]
    assert committed.item_id == started.item_id
    assert events[-1].response.status == "completed"


async def test_speech_over_an_answer_interrupts_it(server: RunningServer) -> None:
    speech = _spoken("Wait, stop please.")
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        detection = {"type": "server_vad", "silence_duration_ms": 400, "create_response": False}
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        )
        await _until(conn, "session.updated")
        await _say(conn, LONG)
        await conn.response.create(
            response={"output_modalities": ["text"], "max_output_tokens": 900}
        )
        await _until(conn, "response.output_text.delta")
        await _stream_audio(conn, speech + bytes(RATE * 2))
        events = await _until(conn, "response.done")
        done = events[-1].response
        assert done.status == "cancelled" and done.status_details.reason == "turn_detected"
        assert "input_audio_buffer.speech_started" in [e.type for e in events]
        committed = await _until(conn, "conversation.item.done")
        assert committed[-1].item.content[0].type == "input_audio"


async def test_a_socket_dropped_mid_answer_frees_everything(server: RunningServer) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        await _say(conn, LONG)
        await conn.response.create(
            response={"output_modalities": ["text"], "max_output_tokens": 900}
        )
        await _until(conn, "response.output_text.delta")
    # The client left mid-answer: the response stops and the engine holds nothing.
    idle = asyncio.run_coroutine_threadsafe(wait_until_idle(server.state.engine), server.loop)
    await asyncio.wrap_future(idle)
    assert server.state.running == set()


def test_sessions_past_the_servers_limit_are_refused(tiny_llama_dir: Path) -> None:
    spec = ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "chat"})
    config = ServerConfig(port=0, max_realtime_sessions=1)
    with running_server(spec, config, names=("chat",)) as server:

        async def main() -> None:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            async with client.realtime.connect(model="chat") as first:
                assert (await first.recv()).type == "session.created"
                async with client.realtime.connect(model="chat") as second:
                    error = await second.recv()
                    assert error.type == "error" and error.error.code == "session_limit_reached"
                    with pytest.raises(websockets.ConnectionClosedError, match="1013"):
                        await second.recv()
            async with client.realtime.connect(model="chat") as third:  # the first one left
                assert (await third.recv()).type == "session.created"

        asyncio.run(main())


def test_an_idle_session_and_a_too_large_event_get_an_error_then_the_close(
    tiny_llama_dir: Path,
) -> None:
    spec = ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "chat"})
    config = ServerConfig(port=0, realtime_idle_timeout_s=2.0, max_realtime_event_bytes=4096)
    with running_server(spec, config, names=("chat",)) as server:

        async def main() -> None:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            async with client.realtime.connect(model="chat") as idle:
                assert (await idle.recv()).type == "session.created"
                error = await idle.recv()  # nothing sent for 2 s
                assert error.type == "error" and error.error.code == "session_idle_timeout"
                with pytest.raises(websockets.ConnectionClosedOK):
                    await idle.recv()
            async with client.realtime.connect(model="chat") as big:
                assert (await big.recv()).type == "session.created"
                await _say(big, "hello")  # a small event is served
                assert (await big.recv()).type == "conversation.item.added"
                assert (await big.recv()).type == "conversation.item.done"
                await big.input_audio_buffer.append(audio=_b64(_tone(0.2)))  # 12.8 kB
                error = await big.recv()
                assert error.type == "error" and error.error.code == "event_too_large"
                with pytest.raises(websockets.ConnectionClosedError, match="1009"):
                    await big.recv()
            assert server.state.num_realtime_sessions == 0

        asyncio.run(main())


async def test_a_spoken_answer_is_truncated_where_the_client_stopped_playing(
    server: RunningServer,
) -> None:
    async with _client(server).realtime.connect(model=NAME) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8})
        await _until(conn, "session.updated")
        await _say(conn, "Hi")
        user = (await _until(conn, "conversation.item.done"))[-1].item.id
        for _ in range(12):  # until the random talker says something (see above)
            await conn.response.create()
            events = await _until(conn, "response.done")
            audio = sum(
                len(base64.b64decode(e.delta))
                for e in events
                if e.type == "response.output_audio.delta"
            )
            if audio:
                break
        answer = events[-1].response.output[0].id
        spoken_ms = audio * 1000 // (2 * RATE)
        await conn.conversation.item.truncate(item_id=answer, content_index=0, audio_end_ms=1)
        truncated = await conn.recv()
        assert truncated.type == "conversation.item.truncated"
        assert (truncated.item_id, truncated.audio_end_ms) == (answer, 1)
        bad = [
            {"item_id": answer, "content_index": 0, "audio_end_ms": spoken_ms + 1},  # past it
            {"item_id": user, "content_index": 0, "audio_end_ms": 0},  # not an answer
            {"item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
        ]
        for event in bad:
            await conn.conversation.item.truncate(**event)
            error = await conn.recv()
            assert error.type == "error"
            assert error.error.param == (
                "audio_end_ms" if event["item_id"] == answer else "item_id"
            )
        # The truncated answer's transcript left the conversation; the session answers on.
        await _say(conn, "And then?")
        await _until(conn, "conversation.item.done")
        await conn.response.create()
        assert (await _until(conn, "response.done"))[-1].response.status == "completed"


def test_a_text_to_speech_model_reads_each_turn_aloud_and_takes_no_audio() -> None:
    """Orpheus answers nothing: a response speaks the latest user text (its transcript is that
    text). Audio input gets an error event naming the missing audio encoder, and so does
    server VAD; text output is refused."""
    with running_server(resolve_model("orpheus-tiny"), names=("orpheus-tiny",)) as server:

        async def main() -> None:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            async with client.realtime.connect(model="orpheus-tiny") as conn:
                created = await conn.recv()
                assert created.session.output_modalities == ["audio"]
                await conn.input_audio_buffer.append(audio=_b64(_tone(0.2)))
                error = await conn.recv()
                assert error.error.code == "audio_input_not_supported"
                assert "audio encoder" in error.error.message
                vad = {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
                await conn.session.update(session={"type": "realtime", **vad})
                assert (await conn.recv()).error.code == "audio_input_not_supported"
                await conn.session.update(
                    session={"type": "realtime", "output_modalities": ["text"]}
                )
                assert (await conn.recv()).error.param == "session.output_modalities"
                await _say(conn, "Hello from the realtime route")
                await _until(conn, "conversation.item.done")
                await conn.response.create()
                events = await _until(conn, "response.done")
            audio = b"".join(
                base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
            )
            transcript = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert events[-1].response.status == "completed"
            assert transcript == "Hello from the realtime route"
            assert len(audio) > 2 * RATE // 10  # speech, at 24 kHz

        asyncio.run(main())


def test_a_model_that_neither_answers_nor_speaks_is_refused_with_400() -> None:
    with running_server(resolve_model("vjepa2-tiny"), names=("vjepa2-tiny",)) as server:

        async def main() -> None:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with client.realtime.connect(model="vjepa2-tiny") as conn:
                    await conn.recv()
            response = refused.value.response
            assert response.status_code == 400
            assert b"does not serve it" in response.body

        asyncio.run(main())


def _prefix_hits(server: RunningServer) -> float:
    stats = asyncio.run_coroutine_threadsafe(server.state.engine.engine_stats(), server.loop)
    return sum(
        n.get("prefix_hit_tokens", 0.0) for r in stats.result().nodes.values() for n in r.values()
    )


def test_each_turn_reuses_the_conversations_cached_prefix(tiny_llama_dir: Path) -> None:
    """A response's request holds the whole conversation; the turns before it are found in
    the prefix cache (not computed again), and the metrics count them."""
    spec = ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "chat"})
    with running_server(spec, names=("chat",)) as server:

        async def main() -> list[float]:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            hits = [_prefix_hits(server)]
            async with client.realtime.connect(model="chat") as conn:
                await conn.recv()
                await conn.session.update(
                    session={"type": "realtime", "instructions": "You are terse. " * 20}
                )
                for turn in ("Hi", "Tell me more", "And then?"):
                    await _say(conn, turn)
                    await conn.response.create(response={"max_output_tokens": 8})
                    await _until(conn, "response.done")
                    hits.append(_prefix_hits(server))
            return hits

        hits = asyncio.run(main())
        # The second and third turns find at least the instructions (80 tokens, 5 blocks).
        assert hits[2] - hits[1] >= 64 and hits[3] - hits[2] >= hits[2] - hits[1]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "mstar_prefix_cache_hit_tokens" in metrics
