"""The benchmark suite: the gateway side by side with a pass-through floor, in one run.

Starts the fast mock upstream, the floor and the parsing floor (bench/passthrough.py, the second
with --parse), the gateway (`ezat-gateway serve --config …`) on each route the scenarios'
clients use, and the peers (bench/peers.py), each in its own process; drives each scenario's
systems in turns (A, B, C, A, B, C) with a load generator in a process of its own; reports
medians and every system's ratios to the floors as Markdown on stdout, and writes everything to
bench/results/<timestamp>.json.
bench/README.md explains the method and every figure.

    python bench/run.py                      # the whole suite, the peers beside
    python bench/run.py --quick              # a smaller one (a few minutes)
    python bench/run.py --no-peers           # without LiteLLM and Portkey
    python bench/run.py --profile stream50,nonstream   # py-spy flame graphs of the gateway
    python bench/run.py --profile stream50 --profile-route responses   # on another of its routes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from statistics import median
from urllib.parse import urlsplit

import peers
import report
from drive import ANSWERS_PER_ROUND, check, drive_asyncio, driver, measure, round_seconds
from environment import ensure_py_spy, ensure_wrk, log, machine
from routes import GATEWAY_ROUTES, ROUTE_OF_API
from scenarios import (
    BEDROCK_SCENARIOS,
    SCENARIOS,
    SLOW,
    Scenario,
    bedrock_floor_requests,
    closing_marker,
    floor_requests,
    request_body,
    upstream_requests,
)
from systems import (
    BENCH,
    PYTHON,
    System,
    floor_system,
    gateway_config,
    gateway_system,
    images_system,
    machine_ticks,
    mock_system,
)

from gateway.runtime import raise_open_files_limit

RESULTS = BENCH / "results"


# --- the suite --------------------------------------------------------------------------


def write_bodies(
    workdir: Path, plan: dict[str, list], floor: dict[str, bytes], images_at: str, bedrock: dict[str, bytes]
) -> dict:
    """Each scenario's request body for each system that drives it: {(system, scenario name): file}.
    `plan`: {scenario name: its systems}; `floor`: the floor's requests (scenarios.floor_requests);
    `bedrock`: the Bedrock floor's (scenarios.bedrock_floor_requests)."""
    bodies = {}
    for name, systems in plan.items():
        s = SCENARIOS.get(name) or SLOW
        for system in systems:
            path = bodies[(system.name, name)] = workdir / f"{name}-{system.name}.json"
            if system.api == "bedrock":
                body = bedrock[name]
            elif system.kind == "floor":
                body = floor[name]
            else:
                body = request_body(system.api, s, system.body_fields, images_at)
            path.write_bytes(body)
    return bodies


def scenario_systems(
    scenario: Scenario, floors: list[System], gateways: dict[str, System], peer_systems: list, bedrock: list
) -> list:
    """Who drives a scenario: the floors, ezat's gateway on the route its clients use, and the peers
    when its clients speak Chat Completions (the route the peers translate) and they do its work;
    then, for a Bedrock scenario, the Bedrock floor and ezat in front of Bedrock on the same route
    (`bedrock`: [the Bedrock floor, {route: its Bedrock gateway}], empty without them)."""
    route = ROUTE_OF_API[scenario.apis[0]]
    peer_systems = [
        p for p in peer_systems if route == "openai" and (not scenario.images or p.name in peers.FETCHES_IMAGES)
    ]
    cloud = [bedrock[0], bedrock[1][route]] if bedrock and scenario.name in BEDROCK_SCENARIOS else []
    return [*floors, gateways[route], *peer_systems, *cloud]


def _longer_rounds(cells: list[dict], duration: float) -> str:
    longer = [c for c in cells if c["duration_s"] > duration]
    return ", ".join(f"{c['scenario']} c={c['concurrency']}: {c['duration_s']:g} s" for c in longer)


def bench_cells(args, wrk, mock, plan, bodies) -> list[dict]:
    cells = []
    total = sum(args.rounds * len(plan[s.name]) for s, _ in args.cells)
    done, warm = 0, set()
    for scenario, concurrency in args.cells:
        systems = plan[scenario.name]
        duration = round_seconds(args.duration, scenario, concurrency)
        cell = {
            "scenario": scenario.name,
            "concurrency": concurrency,
            "duration_s": duration,
            "runs": {s.name: [] for s in systems},
        }
        drives = {
            s.name: (lambda d, s=s: driver(args, wrk, s, scenario, bodies[(s.name, scenario.name)], concurrency, d))
            for s in systems
        }
        for system in systems:  # warm up: connection pools, caches, the allocator
            # A peer's first cell warms it up longer: it keeps getting faster for seconds after it starts.
            drives[system.name](
                max(args.warmup, peers.WARMUP_SECONDS.get(system.name, 0) * (system.name not in warm))
            )()
            warm.add(system.name)
        for round_ in range(args.rounds):
            for system in systems:  # A, B, A, B: drift of the machine cancels out
                run = measure(system, mock, drives[system.name](duration))
                cell["runs"][system.name].append(run)
                done += 1
                log(
                    f"[{done:3}/{total}] {scenario.name:11} c={concurrency:<3} {system.name:17} round {round_ + 1}: "
                    f"{run['rps']:8,.0f} req/s  p50 {run['p50_ms']:7.2f} ms  "
                    f"CPU {run['cpu_us'] or 0:7,.0f} µs/req  ({run['client']}, {run['errors']} errors)"
                )
        report.summarise_cell(cell, next(s.name for s in systems if s.kind == "gateway"))
        report.summarise_bedrock(cell)
        cells.append(cell)
    return cells


def bench_slow(args, mock, systems, bodies, workdir: Path, mock_files: int, ramp: float = 0.0) -> dict:
    """Thousands of slow streams open at once, for memory; none may be dropped. `ramp`: their
    requests are sent evenly over that many seconds (less than a stream lasts, so that all are
    open together), not all in one instant. Each run is a system's first since it started: a
    process keeps the memory it has freed, so a second run would be measured in the first's.
    `mock_files`: the mock's open files before any load, which each run waits for it to be back to."""
    runs = {s.name: [] for s in systems}
    for round_ in range(args.slow_rounds):
        for system in systems:
            system.stop()
            # The last run's system keeps its connections to the mock open a while (its pool's
            # keep-alive): the mock could not hold them and this run's too.
            drained(mock, mock_files)
            system.start(workdir)
            expect = closing_marker(system.api, SLOW)
            body = bodies[(system.name, SLOW.name)]
            run = measure(
                system, mock, lambda: drive_asyncio(system, body, expect, 0, 15, streams=args.slow_streams, ramp=ramp)
            )
            run["completed"] = run["requests"]
            run["dropped"] = args.slow_streams - run["requests"]
            run["p50_s"] = run["p50_ms"] / 1000 if run["p50_ms"] is not None else None
            run["max_s"] = run["max_ms"] / 1000 if run["max_ms"] is not None else None
            run["rss_per_stream_kib"] = (run["peak_rss_mib"] - run["rss_before_mib"]) * 1024 / args.slow_streams
            runs[system.name].append(run)
            log(
                f"slow streams {system.name:7} over {ramp:g} s, round {round_ + 1}: {run['completed']:,}/{args.slow_streams:,} completed, "
                f"{run['max_in_flight']:,} at once, peak RSS {run['peak_rss_mib']:.1f} MiB, errors {run.get('error_kinds')}"
            )
    keys = ("completed", "dropped", "max_in_flight", "p50_s", "first_token_p50_ms", "rss_per_stream_kib", "cpu_us")
    med = {
        name: {k: _median([r[k] for r in rs]) for k in keys}
        | {
            "max_s": max((r["max_s"] or 0) for r in rs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "dropped": max(r["dropped"] for r in rs),
            "max_in_flight": min(r["max_in_flight"] for r in rs),
        }
        for name, rs in runs.items()
    }
    ratio = {
        k: med["gateway"][k] / med["floor"][k] if med["floor"].get(k) else None
        for k in ("peak_rss_mib", "rss_per_stream_kib", "cpu_us")
    }
    return {"streams": args.slow_streams, "ramp_s": ramp, "runs": runs, "median": med, "ratio": ratio}


def _median(values):
    values = [v for v in values if v is not None]
    return median(values) if values else None


def bench_ledger(duration: float) -> dict:
    done = subprocess.run(
        [PYTHON, str(BENCH / "ledger.py"), "--json", "--duration", str(duration)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH,
    )
    try:
        # It exits with 1 when rows are missing from the file, after printing its results: the
        # report shows the levels that lost rows, and the ledger target is then not met.
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"bench/ledger.py failed ({done.returncode}): {done.stderr[-3000:]}") from None


def bench_workers(args, wrk, mock, workdir, models, body) -> dict:
    """`serve --workers 2` against one process, both started here afresh (a config and a
    database of their own each, an empty ledger): non-streaming requests at concurrency 64, in
    turns. The mock and the load generator share the machine's cores with them, so on a small
    machine this shows the direction more than the slope."""
    scenario = SCENARIOS["nonstream"]
    upstream = f"http://127.0.0.1:{mock.port}"
    # Workers share a key's rate limits through Redis (serve refuses to start them without it);
    # the one process counts in the same Redis, so that both pay for it. Without a Redis to
    # reach, both run with a key without limits.
    redis = reachable_redis()
    if redis is None:
        log(f"workers: no Redis at {REDIS_URL}: both gateways' key has no limits")
    options = {"ratelimit_url": redis} if redis else {"limits": False}
    systems = {
        1: gateway_system(upstream, workdir, models, name="gateway-1-worker", **options),
        2: gateway_system(upstream, workdir, models, workers=2, **options),
    }
    runs = {1: [], 2: []}
    started = []
    try:
        for system in systems.values():
            system.start(workdir)
            started.append(system)
            check(system, scenario, body)
        for system in systems.values():
            driver(args, wrk, system, scenario, body, 64, args.warmup)()
        for round_ in range(args.rounds):
            for n, system in systems.items():
                run = measure(system, mock, driver(args, wrk, system, scenario, body, 64, args.duration))
                runs[n].append(run)
                log(f"workers={n} round {round_ + 1}: {run['rps']:8,.0f} req/s  CPU {run['cpu_us'] or 0:7,.0f} µs/req")
    finally:
        for system in started:
            system.stop()
    med = {n: {k: _median([r[k] for r in rs]) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")} for n, rs in runs.items()}
    speedup = med[2]["rps"] / med[1]["rps"] if med[1]["rps"] else None
    return {
        "scenario": scenario.name,
        "concurrency": 64,
        "runs": runs,
        "median": med,
        "speedup": speedup,
        "ratelimit": "redis" if redis else "none",
    }


# Where the workers' rate limits are counted (a database of its own: the tests use 15).
REDIS_URL = os.environ.get("EZAT_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def reachable_redis() -> str | None:
    url = urlsplit(REDIS_URL)
    try:
        socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=2).close()
    except OSError:
        return None
    return REDIS_URL


def ledger_rows(db: Path) -> int | None:
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
    except sqlite3.Error:
        return None


# --- profile mode -----------------------------------------------------------------------


def profile(args, wrk, mock, gateway, workdir, names: list[str], stamp: str, images_at: str) -> None:
    """Record the gateway under load on its route `args.profile_route` with py-spy; write a flame
    graph and a summary of the top frames."""
    import flame

    spy = ensure_py_spy()
    route = args.profile_route
    for scenario in [SCENARIOS[n] for n in names]:
        body = workdir / f"{scenario.name}-{route}.json"
        body.write_bytes(request_body(gateway.api, scenario, gateway.body_fields, images_at))
        check(gateway, scenario, body)
        drive = driver(args, wrk, gateway, scenario, body, args.profile_concurrency, args.profile_duration)
        driver(args, wrk, gateway, scenario, body, args.profile_concurrency, 1)()  # warm up
        # The chat route's files keep the names they had before other routes could be profiled.
        what = scenario.name if route == "openai" else f"{route}-{scenario.name}"
        if args.profile_provider != "anthropic":  # in front of Bedrock's mock: profile-bedrock-…
            what = f"{args.profile_provider}-{what}"
        raw = RESULTS / f"profile-{what}-{stamp}.raw"
        # --nonblocking: pausing the process for each sample would make py-spy count idle threads as running.
        argv = [
            spy,
            "record",
            "--pid",
            str(gateway.pid),
            "--rate",
            "250",
            "--nonblocking",
            "--threads",
            "--format",
            "raw",
            "--output",
            str(raw),
        ]
        for _ in range(3):  # attaching now and then fails ("failed to find python version"): try again
            recorder = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            time.sleep(1.0)
            if recorder.poll() is None:
                break
        else:
            raise RuntimeError(f"py-spy could not attach to the gateway: {recorder.stdout.read()[-2000:]!r}")
        run = measure(gateway, mock, drive)
        recorder.send_signal(signal.SIGINT)
        recorder.wait(60)
        upstream = "" if args.profile_provider == "anthropic" else f" in front of {args.profile_provider.capitalize()}"
        title = f"gateway{upstream}, {route} route, {scenario.name}, concurrency {args.profile_concurrency} ({run['client']})"
        svg, text = flame.render(raw, title)
        header = (
            f"# Profile: {title}\n\n{run['rps']:,.0f} req/s, {run['cpu_us']:,.0f} µs CPU per request "
            f"(inflated by sampling), {run['errors']} errors\n\n"
        )
        summary = raw.with_suffix(".md")
        summary.write_text(header + text + f"\nFlame graph: {svg.name}\n")
        print(header + text)
        log(f"flame graph: {svg}\nsummary: {summary}")


# --- main -------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (about a minute)")
    parser.add_argument("--rounds", type=int, help="measured runs of each system per cell (default 5; quick 2)")
    parser.add_argument("--duration", type=float, help="seconds per run (default 2; quick 1)")
    parser.add_argument(
        "--warmup", type=float, help="seconds of unmeasured load per system per cell (default 1; quick 0.5)"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--concurrency", help="comma-separated connection counts (default 1,16,64; quick: 16, and 1 for nonstream)"
    )
    parser.add_argument(
        "--slow-streams",
        type=int,
        help="simultaneous slow streams (default 10,000, or what the open-files limit allows; quick 500; 0: skip)",
    )
    parser.add_argument(
        "--slow-rounds", type=int, help="runs of each system with the slow streams (default 2; quick 1)"
    )
    parser.add_argument(
        "--client",
        choices=("auto", "asyncio", "wrk"),
        default="auto",
        help="auto: wrk for non-streaming requests, the asyncio client for streams (first-token times)",
    )
    parser.add_argument("--no-ledger", action="store_true", help="skip the ledger micro-benchmark")
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="skip the peers (LiteLLM, Portkey), which are installed from PyPI and npm on first use",
    )
    parser.add_argument(
        "--minimal",
        action="store_true",
        help="the gateway's minimal configuration: a key without limits, no metrics, no access log",
    )
    parser.add_argument(
        "--no-workers", action="store_true", help="skip `serve --workers 2` against one process (skipped by --quick)"
    )
    parser.add_argument(
        "--no-bedrock",
        action="store_true",
        help=f"skip the Bedrock route (ezat and a floor in front of a Bedrock mock) on {', '.join(BEDROCK_SCENARIOS)}",
    )
    parser.add_argument("--profile", metavar="SCENARIOS", help="profile the gateway on these scenarios instead")
    parser.add_argument("--profile-duration", type=float, default=10.0)
    parser.add_argument("--profile-concurrency", type=int, default=64)
    parser.add_argument(
        "--profile-route",
        choices=tuple(GATEWAY_ROUTES),
        default="openai",
        help="the gateway's route to profile: openai (Chat Completions), responses, responses-unstored, native",
    )
    parser.add_argument(
        "--profile-provider",
        choices=("anthropic", "bedrock"),
        default="anthropic",
        help="the gateway's deployment when profiling: Anthropic's mock, or Bedrock's (its frames decoded)",
    )
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (2 if q else 5)
    args.duration = args.duration or (1.0 if q else 2.0)
    args.warmup = args.warmup or (0.5 if q else 1.0)
    if args.slow_streams is None:
        args.slow_streams = 500 if q else min(SLOW_STREAMS, streams_within_open_files())
    args.slow_rounds = args.slow_rounds or (1 if q else 2)
    args.scenarios = [SCENARIOS[n] for n in args.scenarios.split(",")]
    if args.concurrency or not q:
        levels = [int(c) for c in (args.concurrency or "1,16,64").split(",")]
        args.cells = [(s, c) for s in args.scenarios for c in levels]
    else:  # quick: the peers' regime, plus the cells the latency targets are about
        args.cells = [(s, c) for s in args.scenarios for c in ((1, 16) if s.name in LATENCY else (16,))]
    args.no_workers = args.no_workers or q
    return args


def _gateway_name(route: str) -> str:
    return "gateway" if route == "openai" else f"gateway-{route}"


def bedrock_systems(args, workdir: Path, models: list[str], started: list) -> list:
    """The Bedrock route, for the Bedrock scenarios the run drives: Bedrock's fast mock (started
    here), and, not started yet, the Bedrock floor in front of it and ezat with a Bedrock
    deployment on each route those scenarios' clients use (gateway-bedrock: Chat Completions;
    gateway-native-bedrock: Messages). [floor, {route: gateway}], or [] without any."""
    scenarios = [s for s in args.scenarios if s.name in BEDROCK_SCENARIOS]
    if args.no_bedrock or not scenarios:
        return []
    mock = mock_system("bedrock").start(workdir)
    started.append(mock)
    url = f"http://127.0.0.1:{mock.port}"
    options = {"limits": not args.minimal, "observed": not args.minimal, "bedrock": mock}
    gateways = {
        route: gateway_system(url, workdir, models, route=route, name=_gateway_name(route) + "-bedrock", **options)
        for route in dict.fromkeys(ROUTE_OF_API[s.apis[0]] for s in scenarios)
    }
    return [floor_system(url, bedrock=mock), gateways]


def start_peers(args, upstream_url: str, workdir: Path, models: list[str], started: list) -> list:
    """The peers, installed when missing and started; one that cannot be is skipped, saying why
    (in the log and in `args.peers_skipped`, which the results' meta keeps)."""
    args.peers_skipped = {}
    if args.no_peers:
        args.peers_skipped = {name: "skipped: --no-peers" for name in peers.PEERS}
        return []
    running = []
    for name in peers.PEERS:
        why = peers.prepare(name)
        if why is None:
            system = peers.peer_system(name, upstream_url, workdir, models)
            try:
                system.start(workdir)
            except RuntimeError as exc:
                why = f"did not start: {str(exc)[:300]}"
            else:
                started.append(system)
                if wide := peers.beyond_loopback(system):
                    why = f"listens beyond 127.0.0.1 ({', '.join(wide)})"
                    system.stop()
                else:
                    system.extra["version"] = peers.versions().get(name)
                    running.append(system)
        if why is not None:
            args.peers_skipped[name] = f"skipped: {why}"
            log(f"peer {name} skipped: {why}")
    return running


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def drained(mock, files: int, within: float = 60.0) -> None:
    """Wait until the mock holds no more open files than `files` (and a few), at most `within` s."""
    until = time.monotonic() + within
    while open_files(mock.pid) > files + 16 and time.monotonic() < until:
        time.sleep(0.5)


# The scenarios whose added latency at concurrency 1 has a target.
LATENCY = ("nonstream", "claude-code")
# The slow streams of a whole run: the performance target's number.
SLOW_STREAMS = 10_000
# The second run's streams arrive over this many seconds: a stream lasts about 10 (SLOW).
SLOW_RAMP = 8.0


def streams_within_open_files() -> int:
    """The most streams one process can hold here: two sockets each (client and upstream),
    and a few dozen files of its own."""
    most = (raise_open_files_limit() - 64) // 2
    if most < SLOW_STREAMS:
        log(
            f"slow streams: this machine's limit on open files lets one process hold {most:,} streams, "
            f"not {SLOW_STREAMS:,}"
        )
    return most


def main() -> int:
    raise_open_files_limit()  # the load generators' too: they inherit it
    args = parse_args()
    began, ticks = time.monotonic(), machine_ticks()
    wrk = ensure_wrk()
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(tempfile.mkdtemp(prefix="ezat-bench-"))
    models = [s.model for s in (*SCENARIOS.values(), SLOW)]
    mock = mock_system().start(workdir)
    mock_files = open_files(mock.pid)  # before any load: what the slow streams wait for it to be back to
    mock_url = f"http://127.0.0.1:{mock.port}"
    options = {"limits": not args.minimal, "observed": not args.minimal}
    started = [mock]
    try:
        names = args.profile.split(",") if args.profile else [s.name for s in args.scenarios]
        images_at = ""
        if any(SCENARIOS[name].images for name in names):
            images = images_system().start(workdir)
            started.append(images)
            images_at = f"http://127.0.0.1:{images.port}"
        if args.profile:
            if args.profile_provider == "bedrock":
                bedrock_mock = mock_system("bedrock").start(workdir)
                started.append(bedrock_mock)
                url = f"http://127.0.0.1:{bedrock_mock.port}"
                gateway = gateway_system(
                    url, workdir, models, route=args.profile_route, bedrock=bedrock_mock, **options
                )
            else:
                gateway = gateway_system(mock_url, workdir, models, route=args.profile_route, **options)
            gateway.start(workdir)
            started.append(gateway)
            profile(args, wrk, mock, gateway, workdir, names, stamp, images_at)
            return 0
        # ezat on each route a scenario's clients use: Chat Completions (named gateway, as the
        # slow streams and the workers run it), and Messages and Responses where needed.
        routes = dict.fromkeys(["openai", *(ROUTE_OF_API[s.apis[0]] for s in args.scenarios)])
        gateways = {
            route: gateway_system(mock_url, workdir, models, route=route, name=_gateway_name(route), **options)
            for route in routes
        }
        gateway, floor, parsing_floor = gateways["openai"], floor_system(mock_url), floor_system(mock_url, parse=True)
        peer_systems = start_peers(args, mock_url, workdir, models, started)
        bedrock = bedrock_systems(args, workdir, models, started)
        for system in [
            *gateways.values(),
            floor,
            parsing_floor,
            *bedrock[:1],
            *(bedrock[1].values() if bedrock else ()),
        ]:
            system.start(workdir)
            started.append(system)
        plan = {
            s.name: scenario_systems(s, [floor, parsing_floor], gateways, peer_systems, bedrock) for s in args.scenarios
        }
        plan |= {SLOW.name: [floor, gateway], "nonstream": plan.get("nonstream") or [floor, gateway]}
        meta = machine(wrk) | {
            "args": {k: v for k, v in vars(args).items() if k not in ("scenarios", "cells")}
            | {"cells": [f"{s.name}@{c}" for s, c in args.cells]},
            "sqlite": gateway.extra["db"],
            "pids": {s.name: s.pid for s in started},
            "peers": {p.name: p.extra.get("version") for p in peer_systems} | args.peers_skipped,
        }
        log(
            f"mock {mock_url}, floor :{floor.port}, parsing floor :{parsing_floor.port}, gateway :{gateway.port}; "
            f"wrk: {wrk or 'none'}; work dir {workdir}"
        )
        config = gateway_config(1, "{UPSTREAM}", workdir / "equivalence.db", models)
        sent = asyncio.run(upstream_requests(config, args.scenarios, tuple(routes), images_at))
        # Also the slow streams' body and the workers' (nonstream), which the cells may not include.
        floor_bodies, differences = floor_requests(
            sent, list(dict.fromkeys([*args.scenarios, SLOW, SCENARIOS["nonstream"]]))
        )
        bedrock_bodies = {}
        if bedrock:
            config = gateway_config(1, "{UPSTREAM}", workdir / "equivalence-bedrock.db", models, bedrock=True)
            scenarios = [s for s in args.scenarios if s.name in BEDROCK_SCENARIOS]
            sent = asyncio.run(upstream_requests(config, scenarios, tuple(bedrock[1]), images_at, bedrock=True))
            bedrock_bodies, bedrock_differences = bedrock_floor_requests(sent, floor_bodies)
            differences += bedrock_differences
        bodies = write_bodies(workdir, plan, floor_bodies, images_at, bedrock_bodies)
        for scenario in args.scenarios:
            for system in plan[scenario.name]:
                check(system, scenario, bodies[(system.name, scenario.name)])
        meta["same_upstream_requests"] = not differences
        for difference in differences:
            log(f"WARNING: the floor's request differs from what the gateway sends upstream: {difference}")
        cells = bench_cells(args, wrk, mock, plan, bodies)
        # Both ways streams come: all in one instant (the admission of every one at once is the
        # peak), and over a few seconds, as a busy replica's do.
        slow = (
            [bench_slow(args, mock, [floor, gateway], bodies, workdir, mock_files, ramp) for ramp in (0.0, SLOW_RAMP)]
            if args.slow_streams
            else []
        )
        workers = None
        if not args.no_workers:
            workers = bench_workers(args, wrk, mock, workdir, models, bodies[("gateway", "nonstream")])
    finally:
        for system in reversed(started):
            system.stop()  # the gateway writes its last ledger rows before it exits
    gateway_requests = sum(r["requests"] for c in cells for r in c["runs"].get("gateway", []))
    rows = ledger_rows(Path(gateway.extra["db"]))
    ledger = None if args.no_ledger else bench_ledger(1.0 if args.quick else 2.0)
    found = report.targets(cells, slow, ledger, workers, meta.get("cores"))
    elapsed = time.monotonic() - began
    total, _, steal = (after - before for after, before in zip(machine_ticks(), ticks))
    meta["steal"] = round(steal / total, 3) if total else None

    markdown = [
        f"## ezat-gateway benchmark, {meta['date']}",
        "",
        *(
            []
            if meta["same_upstream_requests"]
            else [
                "**Warning: the floor's requests differ from what the gateway sends upstream (see the log); "
                "bench/scenarios.py needs updating.**",
                "",
            ]
        ),
        f"{meta['cpu']}, {meta['cores']} cores, {meta['memory']}, Linux {meta['kernel']}; Python {meta['python']}, "
        f"aiohttp {meta['aiohttp']}, orjson {meta['orjson']}, uvloop {'installed' if meta['uvloop'] else 'not installed'}; "
        f"{meta['wrk'] or 'no wrk'}; commit {meta['commit']}{' (with uncommitted changes)' if meta['dirty'] else ''}. "
        f"{args.rounds} rounds of {args.duration:g} s per system and cell (longer where needed for "
        f"{ANSWERS_PER_ROUND} answers a round: {_longer_rounds(cells, args.duration) or 'none'}), medians; {elapsed / 60:.1f} minutes in all; "
        f"the hypervisor took {100 * (meta['steal'] or 0):.1f}% of the machine's CPU time (steal). The gateway's "
        + (
            "minimal configuration: a key without limits, no metrics, no access log."
            if args.minimal
            else "production configuration: a key with spend, rpm and tpm limits, /metrics, a JSON access line per request."
        ),
        "",
        "### Every system, each scenario",
        "",
        report.systems_table(cells),
        "",
        "### Every figure, against the floor",
        "",
        report.cells_table(cells),
        "",
    ]
    if any("bedrock" in cell for cell in cells):
        markdown += [
            "### The Bedrock route: ezat in front of Bedrock against the Anthropic route and the Bedrock floor",
            "",
            report.bedrock_table(cells),
            "",
        ]
    for run in slow:
        markdown += [
            f"### {run['streams']:,} simultaneous slow streams ({SLOW.what}), {report.arrival(run)}",
            "",
            report.slow_table(run),
            "",
        ]
    if workers:
        markdown += [
            "### `serve --workers 2` against one process (nonstream, concurrency 64)",
            "",
            report.workers_table(workers),
            "",
        ]
    if ledger:
        markdown += ["### Ledger micro-benchmark (SQLite, group commit)", "", report.ledger_table(ledger), ""]
    markdown += [
        f"Ledger rows the gateway wrote in this run: {'?' if rows is None else f'{rows:,}'} for "
        f"{gateway_requests:,} measured requests (plus warm-ups, checks and slow streams).",
        "",
        "### Targets",
        "",
        report.targets_table(found),
        "",
    ]
    text = "\n".join(markdown)
    print(text)
    result = {
        "meta": meta,
        "cells": cells,
        "slow_streams": slow,
        "workers": workers,
        "ledger": ledger,
        "ledger_rows": rows,
        "targets": found,
        "elapsed_s": round(elapsed, 1),
    }
    (RESULTS / f"{stamp}.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS / f"{stamp}.md").write_text(text)
    log(f"results: {RESULTS / (stamp + '.json')} and .md")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
