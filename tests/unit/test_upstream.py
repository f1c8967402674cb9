"""The supervisor's upstream HTTP client: head parsing, chunk splitting, and the protocol's states."""

from __future__ import annotations

import asyncio

import pytest

from mlxd.supervisor.engines.upstream import (
    HIGH_WATER,
    ChunkedBody,
    Upstream,
    UpstreamError,
    parse_head,
    request_bytes,
)

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def framed(*payloads: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in payloads)


class FakeTransport:
    """Records what is written; can be told it is closing or backed up."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.paused = False
        self.buffered = 0

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return self.buffered


def test_parse_head_lowercases_names_and_keeps_values() -> None:
    head = parse_head(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1")
    assert head.status == 503
    assert head.headers == {"content-type": "application/json", "retry-after": "1"}
    assert not head.is_event_stream
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8").is_event_stream


@pytest.mark.parametrize("raw", [b"SSH-2.0-OpenSSH", b"HTTP/1.1 abc OK", b"HTTP/1.1 200 OK\r\nno colon here"])
def test_parse_head_rejects_what_is_not_http(raw: bytes) -> None:
    with pytest.raises(UpstreamError):
        parse_head(raw)


def test_chunks_split_anywhere_come_out_whole_and_in_order() -> None:
    payloads = [b"data: one\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
    wire = framed(*payloads) + b"0\r\n\r\n"
    for step in (1, 2, 3, 7, 64, len(wire)):
        body = ChunkedBody()
        got: list[bytes] = []
        relayed = b""
        for i in range(0, len(wire), step):
            relayed += body.feed(wire[i:i + step], got)
        assert got == payloads, step
        assert relayed == framed(*payloads), step  # framing passed on as it came, minus the end
        assert body.done


def test_the_end_waits_for_the_blank_line_and_ignores_trailers() -> None:
    body = ChunkedBody()
    assert body.feed(framed(b"a") + b"0\r\n") == framed(b"a")
    assert not body.done
    assert body.feed(b"X-Trailer: 1\r\n\r\n") == b""
    assert body.done


@pytest.mark.parametrize("wire", [b"zz\r\nabc\r\n", b"-2\r\nab\r\n", b"0x1\r\na\r\n", b"1_0\r\n", b"3\r\nabcXY", b"1" * 2000])
def test_malformed_chunking_is_an_upstream_error(wire: bytes) -> None:
    with pytest.raises(UpstreamError):
        ChunkedBody().feed(wire)


def test_request_bytes_frame_the_body_and_refuse_header_injection() -> None:
    raw = request_bytes("/v1/completions?x=1", b'{"a":1}', {"X-MLXD-Lease": "abc"})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert body == b'{"a":1}'
    assert head.split(b"\r\n")[0] == b"POST /v1/completions?x=1 HTTP/1.1"
    assert b"Content-Length: 7" in head and b"Connection: close" in head and b"X-MLXD-Lease: abc" in head
    with pytest.raises(ValueError):
        request_bytes("/", b"", {"X-MLXD-Lease": "a\r\nEvil: 1"})


def test_whole_body_by_content_length_ends_and_closes() -> None:
    up = Upstream()
    transport = FakeTransport()
    up.connection_made(transport)  # type: ignore[arg-type]
    up.data_received(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"err")
    assert up.head is not None and up.head.status == 400 and not up.ended
    up.data_received(b'or":1}')
    assert up.ended and transport.closed
    assert b"".join(up.take_body()) == b"{\"error\":1}"


def test_stream_goes_to_the_sink_and_the_end_is_clean() -> None:
    up = Upstream()
    up.connection_made(FakeTransport())  # type: ignore[arg-type]
    up.data_received(SSE_HEAD + framed(b"first"))
    assert up.take_body() == [b"first"]
    sunk: list[bytes] = []
    up.sink = sunk.append
    up.data_received(framed(b"second", b"third"))
    up.data_received(b"0\r\n\r\n")
    up.connection_lost(None)
    assert sunk == [framed(b"second", b"third")]
    assert up.ended and not up.lost


def test_connection_lost_mid_body_is_lost_and_wakes_the_waiter() -> None:
    asyncio.run(_lost_mid_body())


async def _lost_mid_body() -> None:
    up = Upstream()
    up.connection_made(FakeTransport())  # type: ignore[arg-type]
    up.data_received(SSE_HEAD)
    up.sink = lambda _: None
    waiting = asyncio.ensure_future(up.changed())
    await asyncio.sleep(0)  # one turn of the loop: the task runs up to its wait
    assert not waiting.done()
    up.data_received(framed(b"token"))  # with a sink, data alone does not wake the task
    await asyncio.sleep(0)
    assert not waiting.done()
    up.connection_lost(ConnectionResetError())
    await asyncio.wait_for(waiting, 1)
    assert up.lost and not up.ended


def test_garbage_from_the_engine_closes_the_connection_with_an_error() -> None:
    up = Upstream()
    transport = FakeTransport()
    up.connection_made(transport)  # type: ignore[arg-type]
    up.data_received(SSE_HEAD + b"not-hex\r\n")
    assert transport.closed and up.error is not None and "chunk size" in up.error


def test_a_body_nobody_takes_pauses_reading_until_it_is_taken() -> None:
    up = Upstream()
    transport = FakeTransport()
    up.connection_made(transport)  # type: ignore[arg-type]
    up.data_received(SSE_HEAD)
    piece = b"x" * 60_000
    for _ in range(HIGH_WATER // len(piece)):
        up.data_received(framed(piece))
        assert not transport.paused
    up.data_received(framed(piece))
    assert transport.paused and up.paused
    assert len(up.take_body()) == HIGH_WATER // len(piece) + 1
    assert not transport.paused and not up.paused
