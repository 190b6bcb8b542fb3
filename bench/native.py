"""What Anthropic's Messages API costs through the gateway (`POST /v1/messages`), against the floor.

The native route runs the gateway's chain without the refusals and the translator: the body goes
upstream as the client sent it, the reply comes back as the upstream sent it. Three systems,
driven in turns with wrk (non-streaming) and the asyncio client (streams) at each concurrency:
the floor (bench/passthrough.py), the gateway's native route and, for reference, its OpenAI route,
all with the same upstream work (`--routes` drives one route alone). A round lasts long enough
for about 20 answers (paced streams at concurrency 1: 10 s). Prints each route's CPU per request
and its ratio to the floor, with the rounds' range; target: the native route within 1.3× the
floor. Writes every run to bench/results/native-<timestamp>.json.

`--baseline REV` measures another revision's gateway in the same run, before and after on the
same machine: REV is checked out in a detached git worktree in a temporary directory (removed
and pruned at the end), and its gateway, started as the current one but with `python -m gateway`
from the worktree, first on PYTHONPATH, is driven on each route too (baseline-native,
baseline-openai), the gateways trading places every other round; each route's row gains the
current gateway ÷ the baseline, with the rounds' range. The run checks that this environment
imports `gateway` and `middlewares` from the worktree, and records the revision, its commit, the
worktree and those files in the JSON file's meta.

    python bench/native.py [--rounds 4] [--duration 2] [--concurrency 1,64] [--scenarios nonstream,stream50]
                           [--routes native,openai] [--no-limits] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path
from statistics import median
from types import SimpleNamespace

from drive import check, driver, in_turns, round_seconds
from environment import ensure_wrk, log, machine
from scenarios import SCENARIOS, anthropic_request, openai_request
from systems import BENCH, PYTHON, ROOT, floor_system, gateway_system, mock_system, source_env

TARGET = 1.3  # native ÷ floor, CPU per request
RESULTS = BENCH / "results"
ENCODERS = {"anthropic": anthropic_request, "openai": openai_request}
ROUTES = ("native", "openai")  # the gateway's: Anthropic's Messages API, Chat Completions


def run(argv: list[str], **options) -> str:
    """What `argv` prints; its error, and the end of the run, if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, **options)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout.strip()


def git(*args: str) -> str:
    return run(["git", *args], cwd=ROOT)


@contextmanager
def worktree(rev: str):
    """REV checked out, detached, in a temporary directory; removed and pruned at the end. Yields
    what the run's meta records of it, once its environment is seen to import the worktree's code."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    parent = Path(tempfile.mkdtemp(prefix="ezat-baseline-"))
    path = parent / commit[:12]
    git("worktree", "add", "--detach", str(path), commit)
    try:
        if not (path / "gateway" / "__main__.py").is_file():
            raise SystemExit(f"{rev} has no gateway/__main__.py: its gateway cannot run as python -m gateway")
        code = "import gateway, middlewares; print(gateway.__file__); print(middlewares.__file__)"
        files = run([PYTHON, "-c", code], cwd=path, env=source_env(path)).split()
        imports = dict(zip(("gateway", "middlewares"), files))
        for name, file in imports.items():
            if not Path(file).resolve().is_relative_to(path.resolve()):
                raise SystemExit(f"the baseline imports {name} from {file}, not from {path}")
        baseline = {"rev": rev, "commit": commit, "worktree": str(path), "imports": imports}
        log(f"baseline: {rev} ({commit[:12]}) in {path}; gateway from {imports['gateway']}")
        yield baseline
    finally:
        git("worktree", "remove", "--force", str(path))
        git("worktree", "prune")
        shutil.rmtree(parent, ignore_errors=True)


def compare(
    rounds: int,
    duration: float,
    levels: list[int],
    names: list[str],
    limits: bool,
    routes: list[str],
    baseline: dict | None = None,
) -> tuple[str, dict]:
    """The table and the JSON result. Each route of `routes` (native: Anthropic's Messages API;
    openai: Chat Completions) is driven against the floor; with `baseline` (from `worktree`),
    that revision's gateway is driven beside the current one on each route (baseline-<route>),
    and the systems after the floor trade places every other round, so that neither of a pair
    always runs first."""
    wrk = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="ezat-native-"))
    scenarios = [SCENARIOS[name] for name in names]
    models = [s.model for s in scenarios]
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    systems = [floor_system(upstream)]
    for route in routes:
        if baseline:
            source = Path(baseline["worktree"])
            systems.append(
                gateway_system(
                    upstream,
                    workdir,
                    models,
                    name=f"baseline-{route}",
                    native=route == "native",
                    limits=limits,
                    source=source,
                )
            )
        systems.append(
            gateway_system(upstream, workdir, models, name=f"gateway-{route}", native=route == "native", limits=limits)
        )
    started = [mock]
    result = {
        "meta": machine(wrk)
        | {
            "rounds": rounds,
            "duration_s": duration,
            "concurrency": levels,
            "limits": limits,
            "routes": routes,
            "baseline": baseline,
        },
        "cells": [],
    }
    head = ["scenario", "conc.", "route", "floor CPU µs/req", "gateway", "gateway ÷ floor", "rounds' range"]
    if baseline:
        head += ["baseline", "baseline ÷ floor", "gateway ÷ baseline", "rounds' range"]
    head.append(f"native ≤ {TARGET}×")
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | --- " + "| ---: " * (len(head) - 4) + "| --- |"]
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

                seconds = round_seconds(duration, scenario, concurrency)
                label = f"{scenario.name} c={concurrency}"
                runs = in_turns(systems, mock, drive, rounds, seconds, label, swap=baseline is not None)
                cpu = {name: median(r["cpu_us"] for r in rs) for name, rs in runs.items()}
                cell = {
                    "scenario": scenario.name,
                    "concurrency": concurrency,
                    "duration_s": seconds,
                    "runs": runs,
                    "cpu_us": cpu,
                    "routes": {},
                }
                for route in routes:
                    name = f"gateway-{route}"
                    figures = {"ratio": cpu[name] / cpu["floor"], "round_ratios": per_round(runs[name], runs["floor"])}
                    row = [scenario.name, str(concurrency), route, f"{cpu['floor']:,.0f}", f"{cpu[name]:,.0f}"]
                    row += [f"**{figures['ratio']:.2f}×**", spread(figures["round_ratios"])]
                    if baseline:
                        other = f"baseline-{route}"
                        figures["baseline_ratio"] = cpu[other] / cpu["floor"]
                        figures["against_baseline"] = cpu[name] / cpu[other]
                        figures["against_baseline_rounds"] = per_round(runs[name], runs[other])
                        row += [f"{cpu[other]:,.0f}", f"{figures['baseline_ratio']:.2f}×"]
                        row += [
                            f"**{figures['against_baseline']:.3f}×**",
                            spread(figures["against_baseline_rounds"], 3),
                        ]
                    verdict = "–"
                    if route == "native":
                        figures["met"] = figures["ratio"] <= TARGET
                        verdict = "yes" if figures["met"] else "**no**"
                        cell.update(figures)  # at the top too, where runs before --routes had them
                    row.append(verdict)
                    lines.append("| " + " | ".join(row) + " |")
                    cell["routes"][route] = figures
                result["cells"].append(cell)
    finally:
        for system in reversed(started):
            system.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(lines), result


def per_round(runs: list[dict], others: list[dict]) -> list[float]:
    """Each round's CPU per request of `runs` ÷ that round's of `others`."""
    return [run["cpu_us"] / other["cpu_us"] for run, other in zip(runs, others)]


def spread(ratios: list[float], digits: int = 2) -> str:
    return f"{min(ratios):.{digits}f}–{max(ratios):.{digits}f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--scenarios", default="nonstream,stream50")
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help="the gateway's routes to drive against the floor: native (Messages), openai (Chat Completions), or both",
    )
    parser.add_argument(
        "--no-limits",
        action="store_true",
        help="the gateways' key without a spend limit, rpm or tpm (they have them, too high to bite, by default)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="a git revision whose gateway is measured too on each route, from a temporary worktree (baseline-<route>)",
    )
    args = parser.parse_args()
    routes = args.routes.split(",")
    if not routes or any(route not in ROUTES for route in routes):
        parser.error(f"--routes: one or both of {', '.join(ROUTES)}")
    with worktree(args.baseline) if args.baseline else nullcontext() as baseline:
        table, result = compare(
            args.rounds,
            args.duration,
            [int(c) for c in args.concurrency.split(",")],
            args.scenarios.split(","),
            not args.no_limits,
            routes,
            baseline,
        )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"native-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"results: {path}")
