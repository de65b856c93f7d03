"""How :class:`Upstream` times a replica's silence: a gap between events longer than the timeout is a
``stall``; gaps that add up to more than the timeout are not, and neither is time the reader spends away
from the stream (writing to a slow client). Events that arrive in one piece, or split across pieces,
come out one by one. The replica side is an in-memory response fed by the test: timing is the subject,
and a socket would add nothing to what is timed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

import pytest

from controlplane.gateway.errors import UpstreamError
from controlplane.gateway.upstream import Upstream
from controlplane.replicas import ReplicaEndpoint, ReplicaState

TIMEOUT_S = 0.3
ENDPOINT = ReplicaEndpoint("r0", "az-a", "127.0.0.1", 1, ReplicaState.READY, "default")


class FedResponse:
    """A streamed body whose pieces the test puts in a queue (None ends it)."""

    def __init__(self) -> None:
        self.pieces: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closed_with: bool | None = None

    @property
    def status_code(self) -> int:
        return 200

    @property
    def headers(self) -> Mapping[str, str]:
        return {}

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while (piece := await self.pieces.get()) is not None:
            yield piece

    async def aread(self) -> bytes:
        return b""

    async def aclose(self, *, reuse: bool = False) -> None:
        self.closed_with = reuse


def event(n: int) -> bytes:
    return b'data: {"n": %d}\n\n' % n


async def feed(response: FedResponse, pieces: list[tuple[float, bytes | None]]) -> None:
    for delay, piece in pieces:
        await asyncio.sleep(delay)
        response.pieces.put_nowait(piece)


async def read_all(upstream: Upstream) -> list[int]:
    seen = []
    while (payload := await upstream.next_event(TIMEOUT_S)) is not None:
        seen.append(payload["n"])
    return seen


def test_events_split_and_joined_across_pieces_come_out_one_by_one() -> None:
    async def scenario() -> tuple[list[int], bool | None]:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        whole = event(1) + event(2) + event(3)
        feeder = asyncio.create_task(feed(response, [(0, whole[:7]), (0, whole[7:30]),
                                                     (0, whole[30:] + event(4)), (0, b"data: [DONE]\n\n")]))
        seen = await read_all(upstream)
        await feeder
        await upstream.aclose()
        return seen, response.closed_with

    seen, reused = asyncio.run(scenario())
    assert seen == [1, 2, 3, 4]
    assert reused is True  # [DONE] was read: the connection may serve the next request


def test_short_gaps_adding_up_to_more_than_the_timeout_are_not_a_stall() -> None:
    async def scenario() -> list[int]:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        gap = TIMEOUT_S * 0.6
        pieces = [(gap, event(n)) for n in range(5)] + [(gap, b"data: [DONE]\n\n")]
        feeder = asyncio.create_task(feed(response, pieces))
        seen = await read_all(upstream)
        await feeder
        return seen

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_a_gap_longer_than_the_timeout_is_a_stall_at_the_timeout() -> None:
    async def scenario() -> tuple[list[int], UpstreamError, float]:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        feeder = asyncio.create_task(feed(response, [(0, event(1)), (TIMEOUT_S * 4, event(2))]))
        assert await upstream.next_event(TIMEOUT_S) == {"n": 1}
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            await upstream.next_event(TIMEOUT_S)
        waited = time.monotonic() - started
        feeder.cancel()
        await upstream.aclose()
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the timer's cancellation was taken back
        return [1], caught.value, waited

    _, error, waited = asyncio.run(scenario())
    assert error.reason == "stall" and error.replica_id == "r0"
    assert TIMEOUT_S <= waited < TIMEOUT_S + 0.2


def test_time_the_reader_spends_away_from_the_stream_is_not_silence() -> None:
    async def scenario() -> list[int]:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        for n in range(3):
            response.pieces.put_nowait(event(n))
        response.pieces.put_nowait(b"data: [DONE]\n\n")
        seen = []
        while (payload := await upstream.next_event(TIMEOUT_S)) is not None:
            seen.append(payload["n"])
            await asyncio.sleep(TIMEOUT_S * 1.5)  # a slow client: the relay waits to write
        return seen

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_another_cancellation_during_a_read_is_not_turned_into_a_stall() -> None:
    async def scenario() -> None:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        reader = asyncio.create_task(upstream.next_event(TIMEOUT_S))
        await asyncio.sleep(TIMEOUT_S / 3)
        reader.cancel()  # the client left, the gateway stops
        with pytest.raises(asyncio.CancelledError):
            await reader
        await upstream.aclose()

    asyncio.run(scenario())


def test_a_shorter_timeout_after_a_long_first_wait_is_kept() -> None:
    """The first token may take long (the first-byte timeout); once streaming, the stall timeout holds."""
    async def scenario() -> tuple[UpstreamError, float]:
        response = FedResponse()
        upstream = Upstream(ENDPOINT, response, lambda _: None)
        response.pieces.put_nowait(event(1))
        await upstream.prime(TIMEOUT_S * 20)
        assert await upstream.next_event(TIMEOUT_S) == {"n": 1}
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            await upstream.next_event(TIMEOUT_S)
        waited = time.monotonic() - started
        await upstream.aclose()
        return caught.value, waited

    error, waited = asyncio.run(scenario())
    assert error.reason == "stall"
    assert TIMEOUT_S <= waited < TIMEOUT_S + 0.2
