"""What the non-streaming target would read if billing's ledger cost nothing.

Three systems, driven in turns with wrk (non-streaming requests, concurrency 1 and 64): the
floor, the gateway, and the same gateway with `Ledger.record` made a no-op (this file run with
`--serve` in front of `ezat-gateway serve`'s arguments, so the ledger is all that differs).
Both gateways' key has no spend limit: a row never written would never end its request's spend
reservation, and the reservations left over would slow every later admission. Prints each
one's CPU per request and its ratio to the floor, with the rounds' range.

It is the evidence behind issue 5's non-streaming target: at concurrency 1 every request
commits its own ledger row before its reply ends (docs/architecture.md, billing), and that
commit alone is about as large as what the target allows the gateway over the floor; at concurrency 64 the
rows share commits and the ledger costs little. Not a test of the gateway: never serve with
`--serve`.

    python bench/unbilled.py [--rounds 5] [--duration 2] [--concurrency 1,64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

from drive import nonstream_in_turns
from environment import ensure_wrk
from scenarios import SCENARIOS
from systems import PYTHON, floor_system, gateway_system, mock_system

NONSTREAM = SCENARIOS["nonstream"]


def serve_unbilled(argv: list[str]) -> int:
    from gateway.accounting import ledger
    from gateway.cli import main

    async def record(self, row) -> None:
        return None

    ledger.Ledger.record = record
    return main(argv)


def compare(rounds: int, duration: float, levels: list[int]) -> str:
    wrk = ensure_wrk()
    if wrk is None:
        raise SystemExit("bench/unbilled.py needs wrk")
    workdir = Path(tempfile.mkdtemp(prefix="ezat-unbilled-"))
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    unbilled = gateway_system(upstream, workdir, [NONSTREAM.model], name="gateway-unbilled", limits=False)
    unbilled.argv = [PYTHON, __file__, "--serve", *unbilled.argv[1:]]
    systems = [floor_system(upstream), gateway_system(upstream, workdir, [NONSTREAM.model], limits=False), unbilled]
    lines = [
        "| conc. | system | req/s | CPU µs/req | ÷ floor | rounds' range |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for concurrency, runs in nonstream_in_turns(wrk, mock, systems, workdir, levels, rounds, duration):
        floor = runs["floor"]
        for system in systems:
            mine = runs[system.name]
            cpu = median(r["cpu_us"] for r in mine)
            pairs = [r["cpu_us"] / f["cpu_us"] for r, f in zip(mine, floor)]
            lines.append(
                f"| {concurrency} | {system.name} | {median(r['rps'] for r in mine):,.0f} | {cpu:,.0f} | "
                f"{cpu / median(f['cpu_us'] for f in floor):.2f}× | {min(pairs):.2f}–{max(pairs):.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve_unbilled(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64")
    args = parser.parse_args()
    print(compare(args.rounds, args.duration, [int(c) for c in args.concurrency.split(",")]))
