"""What Anthropic's Messages API costs through the gateway (`POST /v1/messages`), against the floor.

The native route runs the gateway's chain without the refusals and the translator: the body goes
upstream as the client sent it, the reply comes back as the upstream sent it. Three systems,
driven in turns with wrk (non-streaming) and the asyncio client (streams) at each concurrency:
the floor (bench/passthrough.py), the gateway's native route and, for reference, its OpenAI route,
all with the same upstream work. Prints each one's CPU per request and its ratio to the floor,
with the rounds' range; target: the native route within 1.3× the floor. Writes every run to
bench/results/native-<timestamp>.json.

    python bench/native.py [--rounds 4] [--duration 2] [--concurrency 1,64] [--scenarios nonstream,stream50] [--no-limits]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from statistics import median
from types import SimpleNamespace

from drive import check, driver, in_turns
from environment import ensure_wrk, log, machine
from scenarios import SCENARIOS, anthropic_request, openai_request
from systems import BENCH, floor_system, gateway_system, mock_system

TARGET = 1.3  # native ÷ floor, CPU per request
RESULTS = BENCH / "results"
ENCODERS = {"anthropic": anthropic_request, "openai": openai_request}


def compare(rounds: int, duration: float, levels: list[int], names: list[str], limits: bool) -> tuple[str, dict]:
    wrk = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="ezat-native-"))
    scenarios = [SCENARIOS[name] for name in names]
    models = [s.model for s in scenarios]
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    systems = [floor_system(upstream),
               gateway_system(upstream, workdir, models, name="gateway-native", native=True, limits=limits),
               gateway_system(upstream, workdir, models, name="gateway-openai", limits=limits)]
    started = [mock]
    result = {"meta": machine(wrk) | {"rounds": rounds, "duration_s": duration, "concurrency": levels,
                                      "limits": limits}, "cells": []}
    lines = ["| scenario | conc. | floor CPU µs/req | native | native ÷ floor | rounds' range | OpenAI route ÷ floor "
             f"| native ≤ {TARGET}× |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    options = SimpleNamespace(client="auto")  # wrk for plain answers, the asyncio client for streams
    try:
        for system in systems:
            system.start(workdir)
            started.append(system)
        for scenario in scenarios:
            bodies = {}
            for system in systems:
                bodies[system.name] = workdir / f"{scenario.name}-{system.name}.json"
                bodies[system.name].write_bytes(ENCODERS[system.api](scenario))
                check(system, scenario, bodies[system.name])
            for concurrency in levels:
                def drive(system, seconds):
                    return driver(options, wrk, system, scenario, bodies[system.name], concurrency, seconds)

                runs = in_turns(systems, mock, drive, rounds, duration, f"{scenario.name} c={concurrency}")
                cpu = {name: median(r["cpu_us"] for r in rs) for name, rs in runs.items()}
                ratio = cpu["gateway-native"] / cpu["floor"]
                pairs = [a["cpu_us"] / b["cpu_us"] for a, b in zip(runs["gateway-native"], runs["floor"])]
                met = ratio <= TARGET
                lines.append(f"| {scenario.name} | {concurrency} | {cpu['floor']:,.0f} | {cpu['gateway-native']:,.0f} | "
                             f"**{ratio:.2f}×** | {min(pairs):.2f}–{max(pairs):.2f} | "
                             f"{cpu['gateway-openai'] / cpu['floor']:.2f}× | {'yes' if met else '**no**'} |")
                result["cells"].append({"scenario": scenario.name, "concurrency": concurrency, "runs": runs, "cpu_us": cpu,
                                        "ratio": ratio, "round_ratios": pairs, "met": met})
    finally:
        for system in reversed(started):
            system.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(lines), result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--scenarios", default="nonstream,stream50")
    parser.add_argument("--no-limits", action="store_true",
                        help="the gateways' key without a spend limit, rpm or tpm (they have them, too high to bite, by default)")
    args = parser.parse_args()
    table, result = compare(args.rounds, args.duration, [int(c) for c in args.concurrency.split(",")],
                            args.scenarios.split(","), not args.no_limits)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"native-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"results: {path}")
