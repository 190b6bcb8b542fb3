"""What the gateway's routes cost against the floor: Anthropic's Messages API (`POST /v1/messages`,
native), Chat Completions (openai) and OpenAI's Responses API (responses).

The native route runs the gateway's chain without the refusals and the translator: the body goes
upstream as the client sent it, the reply comes back as the upstream sent it. The two OpenAI
routes translate. The systems, driven in turns with wrk (non-streaming) and the asyncio client
(streams) at each concurrency: the floor (bench/passthrough.py) and the gateway on each route of
`--routes` (by default native and openai), all with the same upstream work, the gateways trading
places every other round. A round lasts long enough for about 20 answers (paced streams at
concurrency 1: 10 s). Prints each route's CPU per request and its ratio to the floor, with the
rounds' range; targets: the native route within 1.5× the floor on a Claude Code turn and 1.6× on the
tiny streams, and the Responses route within
1.10× the Chat Completions route when both are driven (its row gains responses ÷ openai, with
the rounds' range). Writes every run to bench/results/native-<timestamp>.json.

`--baseline REV` measures another revision's gateway in the same run, before and after on the
same machine: REV is checked out in a detached git worktree in a temporary directory (removed
and pruned at the end), and its gateway, started as the current one but with `python -m gateway`
from the worktree, first on PYTHONPATH, is driven on each route too (baseline-native,
baseline-openai), the gateways trading places every other round; each route's row gains the
current gateway ÷ the baseline, with the rounds' range. The run checks that this environment
imports `gateway` and `middlewares` from the worktree, and records the revision, its commit, the
worktree and those files in the JSON file's meta.

    python bench/native.py [--rounds 4] [--duration 2] [--concurrency 1,64] [--scenarios nonstream,stream50]
                           [--routes native,openai,responses] [--no-limits] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
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
from routes import GATEWAY_ROUTES, ROUTE_OF_API
from scenarios import SCENARIOS, floor_requests, request_body, upstream_requests
from systems import (
    BENCH,
    PYTHON,
    ROOT,
    floor_system,
    gateway_config,
    gateway_system,
    images_system,
    mock_system,
    source_env,
)

# native ÷ floor, CPU per request (issue 34): a Claude Code turn, and the tiny streams; the tiny
# non-streaming request is the floor's own yardstick, with no target of its own.
NATIVE_TARGETS = {"claude-code": 1.5, "stream50": 1.6, "tool": 1.6, "paced": 1.6}
RESPONSES_TARGET = 1.10  # responses ÷ openai, CPU per request: the Responses route costs what the chat route does
RESULTS = BENCH / "results"
# The gateway's: Anthropic's Messages API, Chat Completions, Responses (stored, and with "store": false).
ROUTES = tuple(GATEWAY_ROUTES)
RESPONSES = ("responses", "responses-unstored")  # the routes held to RESPONSES_TARGET
DEFAULT_ROUTES = ("native", "openai")


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
    openai: Chat Completions; responses: OpenAI's Responses API) is driven against the floor;
    with `baseline` (from `worktree`), that revision's gateway is driven beside the current one
    on each route (baseline-<route>). The systems after the floor trade places every other
    round, so that none of them always runs first."""
    wrk = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="ezat-native-"))
    scenarios = [SCENARIOS[name] for name in names]
    models = [s.model for s in scenarios]
    mock = mock_system().start(workdir)
    started = [mock]
    try:
        images = None
        if any(s.images for s in scenarios):
            images = images_system().start(workdir)
            started.append(images)
        images_at = f"http://127.0.0.1:{images.port}" if images else ""
        # Every route must ask the upstream what the floor does, or their figures compare different
        # work; a captured scenario's floor request comes from its own route, driven or not.
        config = gateway_config(1, "{UPSTREAM}", workdir / "equivalence.db", models)
        own = [ROUTE_OF_API[s.apis[0]] for s in scenarios if s.captured]
        sent = asyncio.run(upstream_requests(config, scenarios, tuple(dict.fromkeys([*routes, *own])), images_at))
        floor_bodies, differences = floor_requests(sent, scenarios)
    except BaseException:
        for system in reversed(started):
            system.stop()
        raise
    for difference in differences:
        log(f"WARNING: the floor's request differs from what the gateway sends upstream: {difference}")
    upstream = f"http://127.0.0.1:{mock.port}"
    systems = [floor_system(upstream)]
    for route in routes:
        if baseline:
            source = Path(baseline["worktree"])
            systems.append(
                gateway_system(
                    upstream, workdir, models, name=f"baseline-{route}", route=route, limits=limits, source=source
                )
            )
        systems.append(gateway_system(upstream, workdir, models, name=f"gateway-{route}", route=route, limits=limits))
    result = {
        "meta": machine(wrk)
        | {
            "rounds": rounds,
            "duration_s": duration,
            "concurrency": levels,
            "limits": limits,
            "routes": routes,
            "baseline": baseline,
            "same_upstream_requests": not differences,
        },
        "cells": [],
    }
    beside_chat = "openai" in routes and any(route in RESPONSES for route in routes)
    head = ["scenario", "conc.", "route", "floor CPU µs/req", "gateway", "gateway ÷ floor", "rounds' range"]
    if beside_chat:
        head += ["÷ openai", "rounds' range"]
    if baseline:
        head += ["baseline", "baseline ÷ floor", "gateway ÷ baseline", "rounds' range"]
    head += ["target", "met"]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | --- " + "| ---: " * (len(head) - 5) + "| --- | --- |"]
    options = SimpleNamespace(client="auto")  # wrk for plain answers, the asyncio client for streams
    try:
        for system in systems:
            system.start(workdir)
            started.append(system)
        for scenario in scenarios:
            bodies = {}
            for system in systems:
                bodies[system.name] = workdir / f"{scenario.name}-{system.name}.json"
                body = (
                    floor_bodies[scenario.name]
                    if system.kind == "floor"
                    else request_body(system.api, scenario, system.body_fields, images_at)
                )
                bodies[system.name].write_bytes(body)
                check(system, scenario, bodies[system.name])
            for concurrency in levels:

                def drive(system, seconds):
                    return driver(options, wrk, system, scenario, bodies[system.name], concurrency, seconds)

                seconds = round_seconds(duration, scenario, concurrency)
                label = f"{scenario.name} c={concurrency}"
                runs = in_turns(systems, mock, drive, rounds, seconds, label, swap=len(systems) > 2)
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
                    if beside_chat:
                        if route in RESPONSES:
                            figures["against_openai"] = cpu[name] / cpu["gateway-openai"]
                            figures["against_openai_rounds"] = per_round(runs[name], runs["gateway-openai"])
                            row += [
                                f"**{figures['against_openai']:.3f}×**",
                                spread(figures["against_openai_rounds"], 3),
                            ]
                        else:
                            row += ["–", "–"]
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
                    target, verdict = "–", "–"
                    if route == "native":
                        cell.update(figures)  # at the top too, where runs before --routes had them
                        if scenario.name in NATIVE_TARGETS:
                            target = f"≤ {NATIVE_TARGETS[scenario.name]}× floor"
                            figures["met"] = cell["met"] = figures["ratio"] <= NATIVE_TARGETS[scenario.name]
                    elif route in RESPONSES and beside_chat:
                        target = f"≤ {RESPONSES_TARGET:.2f}× openai"
                        figures["met"] = figures["against_openai"] <= RESPONSES_TARGET
                    if "met" in figures:
                        verdict = "yes" if figures["met"] else "**no**"
                    row += [target, verdict]
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
        default=",".join(DEFAULT_ROUTES),
        help="the gateway's routes to drive against the floor, one or more: native (Messages), openai (Chat "
        'Completions), responses (OpenAI\'s Responses API, each response stored), responses-unstored ("store": false)',
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
    routes = list(dict.fromkeys(args.routes.split(",")))  # each once: a system per route
    if not routes or any(route not in ROUTES for route in routes):
        parser.error(f"--routes: one or more of {', '.join(ROUTES)}")
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            parser.error(f"--scenarios: {name!r} is none of {', '.join(SCENARIOS)}")
        unspoken = [route for route in routes if GATEWAY_ROUTES[route][1] not in SCENARIOS[name].apis]
        if unspoken:
            parser.error(
                f"--scenarios: {name} is a request in {' and '.join(SCENARIOS[name].apis)} only, not on {', '.join(unspoken)}"
            )
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
