"""The benchmarks' upstream in a process of its own: `MockUpstream(fast=True)`, which answers
from pre-encoded bytes chosen by the request's `model` (gateway.mock.upstream.FAST_MODELS), run
as `ezat-gateway mock-upstream` runs the mock (uvloop, the gateway's garbage-collector tuning).
With `--provider bedrock`, `BedrockMock(fast=True)`: the same answers as Bedrock's event-stream
frames, chosen by the model id in the path (`anthropic.bench-stream50`), no credential checked.

    python bench/mock.py --port 8081 [--provider bedrock]
"""

from __future__ import annotations

import argparse

from gateway.mock import bedrock, upstream

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--provider", choices=("anthropic", "bedrock"), default="anthropic")
    args = parser.parse_args()
    (bedrock if args.provider == "bedrock" else upstream).run(args.host, args.port, fast=True)
