"""What a key's limits cost a request: the spend limit's reservation and tpm's.

A key with `spend_limit_usd` makes every request reserve its worst-case cost in the store at
admission (a SQLite write transaction; the ledger row's commit ends it), and one with `tpm`
reserves its token estimate in the rate limiter. Three systems, driven in turns with wrk
(non-streaming requests, concurrency 1 and 64): the floor, for reference, and the same gateway
config twice, its key without any limit and with spend_limit_usd, rpm and tpm far too high to
bite (as `make bench` runs it). The two gateways swap places every other round. Prints each
one's CPU per request and limits ÷ no limits with the rounds' range (each round's limits run
÷ that round's no-limits run); target: within 1.10× at concurrency 64. Writes every run to
bench/results/limits-<timestamp>.json.

    python bench/limits.py [--rounds 6] [--duration 2] [--concurrency 1,64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from statistics import median

from drive import check, drive_wrk, measure
from environment import ensure_wrk, log, machine
from scenarios import SCENARIOS, anthropic_request, openai_request
from systems import BENCH, floor_system, gateway_system, mock_system

NONSTREAM = SCENARIOS["nonstream"]
TARGET = 1.10  # limits ÷ no limits at concurrency 64
RESULTS = BENCH / "results"


def compare(rounds: int, duration: float, levels: list[int]) -> tuple[str, dict]:
    wrk = ensure_wrk()
    if wrk is None:
        raise SystemExit("bench/limits.py needs wrk")
    workdir = Path(tempfile.mkdtemp(prefix="ezat-limits-"))
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    floor = floor_system(upstream)
    gateways = [gateway_system(upstream, workdir, [NONSTREAM.model], name="gateway-no-limits", limits=False),
                gateway_system(upstream, workdir, [NONSTREAM.model], name="gateway-limits")]
    bodies = {"floor": workdir / "floor.json", "gateway": workdir / "gateway.json"}
    bodies["floor"].write_bytes(anthropic_request(NONSTREAM))
    bodies["gateway"].write_bytes(openai_request(NONSTREAM))
    started = [mock]
    result = {"meta": machine(wrk) | {"rounds": rounds, "duration_s": duration, "concurrency": levels},
              "levels": {}}
    lines = ["| conc. | floor CPU µs/req | no limits | limits | limits ÷ no limits | rounds' range "
             f"| ≤ {TARGET:.2f}× |", "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    try:
        for system in (floor, *gateways):
            system.start(workdir)
            started.append(system)
            check(system, NONSTREAM, bodies[system.kind])
        for concurrency in levels:
            def drive(system, seconds):
                return lambda: drive_wrk(wrk, system, bodies[system.kind], concurrency, seconds)

            for system in (floor, *gateways):
                drive(system, 1)()  # warm up
            runs = {system.name: [] for system in (floor, *gateways)}
            for round_ in range(rounds):
                for system in (floor, *(gateways if round_ % 2 == 0 else gateways[::-1])):
                    run = measure(system, mock, drive(system, duration))
                    runs[system.name].append(run)
                    log(f"c={concurrency} {system.name:17} round {round_ + 1}: {run['cpu_us']:6.0f} µs/req "
                        f"({run['errors']} errors)")
            cpu = {name: median(r["cpu_us"] for r in rs) for name, rs in runs.items()}
            ratio = cpu["gateway-limits"] / cpu["gateway-no-limits"]
            pairs = [a["cpu_us"] / b["cpu_us"] for a, b in zip(runs["gateway-limits"], runs["gateway-no-limits"])]
            met = None
            verdict = "no target"
            if concurrency == 64:
                met = ratio <= TARGET
                verdict = ("yes" if met else "**no**") + (" (range straddles it)" if min(pairs) <= TARGET < max(pairs) else "")
            lines.append(f"| {concurrency} | {cpu['floor']:,.0f} | {cpu['gateway-no-limits']:,.0f} | "
                         f"{cpu['gateway-limits']:,.0f} | **{ratio:.3f}×** | {min(pairs):.3f}–{max(pairs):.3f} | {verdict} |")
            result["levels"][concurrency] = {"runs": runs, "cpu_us": cpu, "ratio": ratio, "round_ratios": pairs,
                                             "met": met}
    finally:
        for system in reversed(started):
            system.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(lines), result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64")
    args = parser.parse_args()
    table, result = compare(args.rounds, args.duration, [int(c) for c in args.concurrency.split(",")])
    print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"limits-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"results: {path}")
