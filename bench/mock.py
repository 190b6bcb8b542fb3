"""The benchmarks' upstream in a process of its own: `MockUpstream(fast=True)`, which answers
from pre-encoded bytes chosen by the request's `model` (gateway.mock_upstream.FAST_MODELS).

    python bench/mock.py --port 8081
"""

from __future__ import annotations

import argparse

from gateway.mock_upstream import MockUpstream
from gateway.runtime import run, until_stopped


async def serve(host: str, port: int) -> None:
    mock = MockUpstream(fast=True)
    url = await mock.start(host, port)
    print(f"fast mock upstream on {url}", flush=True)
    await until_stopped()
    await mock.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    run(serve(args.host, args.port))
