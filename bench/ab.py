"""What one feature costs a request: the same gateway config with and without it (A and B),
driven in turns with wrk, non-streaming requests at each concurrency, the floor beside them for
reference; A and B swap places every other round. Prints each one's CPU per request and B ÷ A
with the rounds' range (each round's B run ÷ that round's A run), against a target at
concurrency 64, and writes every run to bench/results/<name>-<timestamp>.json. bench/limits.py
(a key's limits) and bench/observability.py (metrics and the access log) are its two uses."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from statistics import median

from drive import nonstream_in_turns
from environment import ensure_wrk, log, machine
from scenarios import SCENARIOS
from systems import BENCH, floor_system, gateway_system, mock_system

NONSTREAM = SCENARIOS["nonstream"]
RESULTS = BENCH / "results"


def compare(
    name: str, without: dict, with_: dict, target: float, rounds: int, duration: float, levels: list[int]
) -> tuple[str, dict]:
    """`without` and `with_`: gateway_system's options for A and for B."""
    wrk = ensure_wrk()
    if wrk is None:
        raise SystemExit(f"bench/{name}.py needs wrk")
    workdir = Path(tempfile.mkdtemp(prefix=f"ezat-{name}-"))
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    floor = floor_system(upstream)
    a, b = f"gateway-no-{name}", f"gateway-{name}"
    gateways = [
        gateway_system(upstream, workdir, [NONSTREAM.model], name=a, **without),
        gateway_system(upstream, workdir, [NONSTREAM.model], name=b, **with_),
    ]
    result = {"meta": machine(wrk) | {"rounds": rounds, "duration_s": duration, "concurrency": levels}, "levels": {}}
    lines = [
        f"| conc. | floor CPU µs/req | no {name} | {name} | {name} ÷ no {name} | rounds' range | ≤ {target:.2f}× |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for concurrency, runs in nonstream_in_turns(
        wrk, mock, [floor, *gateways], workdir, levels, rounds, duration, swap=True
    ):
        cpu = {system: median(r["cpu_us"] for r in rs) for system, rs in runs.items()}
        ratio = cpu[b] / cpu[a]
        pairs = [x["cpu_us"] / y["cpu_us"] for x, y in zip(runs[b], runs[a])]
        met, verdict = None, "no target"
        if concurrency == 64:
            met = ratio <= target
            verdict = ("yes" if met else "**no**") + (
                " (range straddles it)" if min(pairs) <= target < max(pairs) else ""
            )
        lines.append(
            f"| {concurrency} | {cpu['floor']:,.0f} | {cpu[a]:,.0f} | {cpu[b]:,.0f} | **{ratio:.3f}×** | "
            f"{min(pairs):.3f}–{max(pairs):.3f} | {verdict} |"
        )
        result["levels"][concurrency] = {"runs": runs, "cpu_us": cpu, "ratio": ratio, "round_ratios": pairs, "met": met}
    shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(lines), result


def main(name: str, doc: str, without: dict, with_: dict, target: float) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64")
    args = parser.parse_args()
    table, result = compare(
        name, without, with_, target, args.rounds, args.duration, [int(c) for c in args.concurrency.split(",")]
    )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"results: {path}")
