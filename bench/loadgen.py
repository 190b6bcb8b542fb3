"""A lean HTTP/1.1 load generator: raw asyncio Protocols on keep-alive connections, no HTTP
library, so that it costs far less per request than any server it measures.

Measures what `wrk` cannot: the time to the first byte of the response and to the first
token, and holds thousands of slow streams open at once. "First token" is when the received
bytes first contain `delta` (nothing finer is parsed): from the floor, the first
`content_block_delta` event (`message_start` and `content_block_start` have none); from the
gateway, its first chunk, since every chunk with a choice has a `"delta"` (bench/README.md
says why that is its first token too). Prints one JSON object on stdout; its own CPU time
covers the load phase only.

    python bench/loadgen.py --port 8080 --path /v1/chat/completions --body-file req.json \
        -H "authorization: Bearer sk-..." --concurrency 64 --duration 3
    python bench/loadgen.py ... --streams 2000        # each connection: one request, all at once
    python bench/loadgen.py ... --streams 2000 --ramp 8   # the requests spread evenly over 8 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time

TOKEN_MARK = b"delta"  # in the first event or chunk that carries output, in both formats


class Failed(Exception):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive connection; `request()` sends the pre-encoded request and waits for the
    whole response (Content-Length or chunked)."""

    def __init__(self, request: bytes, expect: bytes) -> None:
        self._request = request
        self._expect = expect
        self.transport: asyncio.Transport | None = None
        self._done: asyncio.Future | None = None
        self.closed = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._done is not None and not self._done.done():
            self._done.set_exception(Failed("connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.first_byte is None:
            self.first_byte = now
        if self.first_token is None and TOKEN_MARK in self._carry + data:
            self.first_token = now
        self._carry = data[-8:]
        self._buffer += data
        try:
            finished = self._parse()
        except Failed as exc:
            self._done.set_exception(exc)
            self.transport.close()
            return
        if finished and not self._done.done():
            self._done.set_result(now)

    # -- one request

    async def request(self, timeout: float) -> tuple[float, float, float, float]:
        """(start, first byte, first token or end, end) in perf_counter seconds."""
        self.first_byte = self.first_token = None
        self._carry = b""
        self._buffer = bytearray()
        self._status = None
        self._length = None  # body bytes still to come (Content-Length), None when chunked
        self._chunked = False
        self._close_after = False
        self._tail = b""
        self._done = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        self.transport.write(self._request)
        end = await asyncio.wait_for(self._done, timeout)
        if self._close_after:
            self.transport.close()
        if self._status != 200:
            raise Failed(f"status {self._status}")
        if self._expect and self._expect not in self._tail:
            raise Failed("body without its closing marker")
        return start, self.first_byte, self.first_token or end, end

    def _parse(self) -> bool:
        buf = self._buffer
        if self._status is None:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                return False
            head = bytes(buf[:head_end]).decode("latin-1").split("\r\n")
            self._status = int(head[0].split(" ", 2)[1])
            for line in head[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    self._length = int(value)
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self._chunked = True
                elif name == "connection" and "close" in value.lower():
                    self._close_after = True
            del buf[: head_end + 4]
            if not self._chunked and self._length is None:
                raise Failed("response without Content-Length or chunked encoding")
        if not self._chunked:
            if len(buf) >= self._length:
                self._tail = bytes(buf[-64:])
                del buf[:]
                return True
            return False
        # chunked: <hex size>\r\n<data>\r\n ... 0\r\n\r\n
        pos = 0
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                break
            size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
            if size == 0:
                if len(buf) < line_end + 4:
                    break
                del buf[:]
                return True
            if len(buf) < line_end + 2 + size + 2:
                break
            self._tail = (self._tail + bytes(buf[line_end + 2 + max(0, size - 64) : line_end + 2 + size]))[-64:]
            pos = line_end + 2 + size + 2
        del buf[:pos]
        return False


def encode_request(host: str, port: int, path: str, body: bytes, headers: list[str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def connect(args, request: bytes, gate: asyncio.Semaphore) -> Connection:
    loop = asyncio.get_running_loop()
    async with gate:
        _, conn = await loop.create_connection(lambda: Connection(request, args.expect.encode()), args.host, args.port)
    return conn


class Stats:
    def __init__(self) -> None:
        self.latency: list[float] = []
        self.first_byte: list[float] = []
        self.first_token: list[float] = []
        self.errors: dict[str, int] = {}
        self.last_end = 0.0
        self.in_flight = 0
        self.max_in_flight = 0

    def error(self, exc: BaseException) -> None:
        kind = type(exc).__name__ if not isinstance(exc, Failed) else str(exc)
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def add(self, start: float, first_byte: float, first_token: float, end: float) -> None:
        self.latency.append(end - start)
        self.first_byte.append(first_byte - start)
        self.first_token.append(first_token - start)
        self.last_end = max(self.last_end, end)


async def one(conn: Connection, stats: Stats, timeout: float) -> bool:
    stats.in_flight += 1
    stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
    try:
        stats.add(*await conn.request(timeout))
        return True
    except (TimeoutError, Failed, OSError) as exc:
        stats.error(exc)
        conn.transport.close()
        return False
    finally:
        stats.in_flight -= 1


async def run_duration(args, request: bytes, stats: Stats) -> float:
    """`concurrency` connections, each sending requests back to back for `duration` seconds."""
    gate = asyncio.Semaphore(64)
    conns = await asyncio.gather(*(connect(args, request, gate) for _ in range(args.concurrency)))
    start = time.perf_counter()
    deadline = start + args.duration

    async def worker(conn: Connection) -> None:
        while time.perf_counter() < deadline:
            if conn.closed.done():
                conn = await connect(args, request, gate)
            await one(conn, stats, args.timeout)
        conn.transport.close()

    await asyncio.gather(*(worker(c) for c in conns))
    return start


async def run_streams(args, request: bytes, stats: Stats) -> float:
    """`streams` connections opened first, then one request on each: all at once, or spread
    evenly over `ramp` seconds."""
    gate = asyncio.Semaphore(128)  # connecting, far fewer at once than the servers' listen backlog
    conns = await asyncio.gather(*(connect(args, request, gate) for _ in range(args.streams)), return_exceptions=True)
    opened = [c for c in conns if isinstance(c, Connection)]
    for exc in conns:
        if not isinstance(exc, Connection):
            stats.error(exc)
    start = time.perf_counter()

    async def at(i: int, conn: Connection) -> bool:
        if args.ramp:
            await asyncio.sleep(start + i * args.ramp / len(opened) - time.perf_counter())
        return await one(conn, stats, args.timeout)

    await asyncio.gather(*(at(i, c) for i, c in enumerate(opened)))
    for c in opened:
        c.transport.close()
    return start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--body-file", required=True)
    parser.add_argument("-H", "--header", action="append", default=[])
    parser.add_argument("--expect", default="", help="bytes the end of each response body must contain")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument(
        "--streams", type=int, help="open this many connections, then one request on each (at once, unless --ramp)"
    )
    parser.add_argument(
        "--ramp",
        type=float,
        default=0.0,
        help="with --streams: send the requests evenly over this many seconds, not all at once",
    )
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()

    with open(args.body_file, "rb") as f:
        body = f.read()
    request = encode_request(args.host, args.port, args.path, body, args.header)
    stats = Stats()

    async def go() -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = await (run_streams if args.streams else run_duration)(args, request, stats)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return start, cpu

    start, cpu = asyncio.run(go())
    elapsed = (stats.last_end - start) if stats.latency else 0.0
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    json.dump(
        {
            "requests": len(stats.latency),
            "errors": stats.errors,
            "elapsed_s": round(elapsed, 4),
            "rps": round(len(stats.latency) / elapsed, 1) if elapsed else 0.0,
            "latency_ms": {q: ms(percentile(stats.latency, float(q[1:]))) for q in ("p50", "p99")}
            | {"max": ms(max(stats.latency, default=None))},
            "first_byte_ms": {q: ms(percentile(stats.first_byte, float(q[1:]))) for q in ("p50", "p99")},
            "first_token_ms": {q: ms(percentile(stats.first_token, float(q[1:]))) for q in ("p50", "p99")},
            "max_in_flight": stats.max_in_flight,
            "client_cpu_s": round(cpu, 4),
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
