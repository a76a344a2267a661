"""Overload and disconnects against a server whose speech never ends on its own.

The server admits one running and one waiting request. A client that goes away (mid-stream,
while its answer is computed, or while it waits for admission) must abort its request and
leave nothing held in the engine.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import RunningServer

ENDLESS = {"input": "go on forever", "response_format": "pcm", "stream": True}


async def until(predicate: object, timeout: float = 20.0) -> None:
    """Poll a condition (bounded), for states only the server can see."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def assert_nothing_held(server: RunningServer) -> None:
    held = server.wait_idle()
    assert all(v == 0 for counts in held.values() for v in counts.values()), held
    assert (server.state.admission.num_running, server.state.admission.num_waiting) == (0, 0)


async def test_disconnect_mid_stream_aborts_and_frees_everything(
    endless_server: RunningServer,
) -> None:
    aborted = endless_server.metric(
        "mstar_requests_finished_total", task="speech", status="aborted"
    )
    async with (
        httpx.AsyncClient(base_url=endless_server.url) as http,
        http.stream("POST", "/v1/audio/speech", json=ENDLESS) as response,
    ):
        assert response.status_code == 200
        received = 0
        async for chunk in response.aiter_bytes():
            received += len(chunk)
            if received >= 4 * 160:  # several chunks of the endless tone arrived
                break
    # Leaving the block closed the connection mid-stream.
    assert_nothing_held(endless_server)
    assert (
        endless_server.metric("mstar_requests_finished_total", task="speech", status="aborted")
        == aborted + 1
    )


async def test_disconnect_before_the_answer_aborts_too(endless_server: RunningServer) -> None:
    aborted = endless_server.metric(
        "mstar_requests_finished_total", task="speech", status="aborted"
    )
    async with httpx.AsyncClient(base_url=endless_server.url) as http:
        # Not streamed: the answer would come when the (endless) request ends.
        pending = asyncio.create_task(http.post("/v1/audio/speech", json={"input": "x"}))
        await until(
            lambda: (
                endless_server.metric("mstar_generated_audio_seconds_total") > 0
                and endless_server.state.admission.num_running == 1
            )
        )
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
    assert_nothing_held(endless_server)
    assert (
        endless_server.metric("mstar_requests_finished_total", task="speech", status="aborted")
        == aborted + 1
    )


async def test_overload_answers_503_with_retry_after(endless_server: RunningServer) -> None:
    admission = endless_server.state.admission
    rejected = endless_server.metric(
        "mstar_requests_finished_total", task="speech", status="rejected"
    )
    async with httpx.AsyncClient(base_url=endless_server.url) as http:
        async with http.stream("POST", "/v1/audio/speech", json=ENDLESS) as running:
            chunks = running.aiter_bytes()  # kept open (not abandoned) until the block ends
            await anext(chunks)  # admitted and producing: the one running slot is taken
            # The second request waits for the slot (a finite one, answered as a whole).
            waiting = asyncio.create_task(
                http.post("/generate", json={"num_chunks": 3, "text": "x"})
            )
            await until(lambda: admission.num_waiting == 1)
            assert endless_server.metric("mstar_requests_waiting") == 1
            refused = await http.post("/v1/audio/speech", json=ENDLESS)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "2"
            assert refused.json()["error"]["type"] == "overloaded_error"
            assert not waiting.done()
        # The stream closed: its slot goes to the waiting request, which completes.
        answer = await waiting
    assert answer.status_code == 200
    lines = answer.text.splitlines()
    assert sum('"modality":"audio"' in line for line in lines) == 3 and lines[-1].startswith(
        '{"usage"'
    )
    assert (
        endless_server.metric("mstar_requests_finished_total", task="speech", status="rejected")
        == rejected + 1
    )
    assert_nothing_held(endless_server)


async def test_a_client_that_leaves_the_line_frees_its_place(endless_server: RunningServer) -> None:
    admission = endless_server.state.admission
    async with (
        httpx.AsyncClient(base_url=endless_server.url) as http,
        http.stream("POST", "/v1/audio/speech", json=ENDLESS) as running,
    ):
        chunks = running.aiter_bytes()
        await anext(chunks)
        waiting = asyncio.create_task(http.post("/v1/audio/speech", json=ENDLESS))
        await until(lambda: admission.num_waiting == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await until(lambda: admission.num_waiting == 0)
        assert admission.num_running == 1
    assert_nothing_held(endless_server)
