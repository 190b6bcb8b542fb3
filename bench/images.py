"""The images a benchmark request points at, served from a process of its own on loopback:
two PNGs of about 100 KB each (random pixels, so compression leaves them that size), the
same bytes every run. The gateway downloads them for the `images` scenario
(bench/scenarios.py); the floor is sent them inline, as the gateway sends them upstream.

    python bench/images.py --port 8082
"""

from __future__ import annotations

import argparse
import random
import struct
import zlib

from aiohttp import web

from gateway import runtime

SIDE = 184  # pixels: 184 × 184 RGB is about 100 KB


def png(seed: int, side: int = SIDE) -> bytes:
    """A PNG of random RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = random.Random(seed).randbytes(side * side * 3)
    rows = b"".join(b"\0" + pixels[y * side * 3 : (y + 1) * side * 3] for y in range(side))  # filter 0 per row
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def app(names: tuple[str, ...]) -> web.Application:
    images = {name: png(seed) for seed, name in enumerate(names)}

    async def image(request: web.Request) -> web.Response:
        data = images.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="image/png")

    application = web.Application()
    application.router.add_get("/{name}", image)
    return application


if __name__ == "__main__":
    from scenarios import IMAGE_NAMES

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    async def serve() -> None:
        runner = web.AppRunner(app(IMAGE_NAMES), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        runtime.tune_garbage_collector()
        await runtime.until_stopped()
        await runner.cleanup()

    runtime.run(serve())
