"""The benchmarks' upstream in a process of its own: `MockUpstream(fast=True)`, which answers
from pre-encoded bytes chosen by the request's `model` (gateway.mock.upstream.FAST_MODELS), run
as `ezat-gateway mock-upstream` runs the mock (uvloop, the gateway's garbage-collector tuning).

    python bench/mock.py --port 8081
"""

from __future__ import annotations

import argparse

from gateway.mock.upstream import run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    run(args.host, args.port, fast=True)
