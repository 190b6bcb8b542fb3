"""What Anthropic's Messages API costs through the gateway (`POST /v1/messages`), against the floor.

The native route runs the gateway's chain without the refusals and the translator: the body goes
upstream as the client sent it, the reply comes back as the upstream sent it. Three systems,
driven in turns with wrk (non-streaming) and the asyncio client (streams) at each concurrency:
the floor (bench/passthrough.py), the gateway's native route and, for reference, its OpenAI route,
all with the same upstream work. Prints each one's CPU per request and its ratio to the floor,
with the rounds' range; target: the native route within 1.3× the floor. Writes every run to
bench/results/native-<timestamp>.json.

`--baseline REV` measures another revision's native route in the same run, before and after on
the same machine: REV is checked out in a detached git worktree in a temporary directory (removed
and pruned at the end), and its gateway, started as the current one but with `python -m gateway`
from the worktree, first on PYTHONPATH, is a fourth system, baseline-native. The run checks that
this environment imports `gateway` and `middlewares` from the worktree, and records the revision,
its commit, the worktree and those files in the JSON file's meta.

    python bench/native.py [--rounds 4] [--duration 2] [--concurrency 1,64] [--scenarios nonstream,stream50]
                           [--no-limits] [--baseline REV]
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

from drive import check, driver, in_turns
from environment import ensure_wrk, log, machine
from scenarios import SCENARIOS, anthropic_request, openai_request
from systems import BENCH, PYTHON, ROOT, floor_system, gateway_system, mock_system, source_env

TARGET = 1.3  # native ÷ floor, CPU per request
RESULTS = BENCH / "results"
ENCODERS = {"anthropic": anthropic_request, "openai": openai_request}


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
    rounds: int, duration: float, levels: list[int], names: list[str], limits: bool, baseline: dict | None = None
) -> tuple[str, dict]:
    """The table and the JSON result; with `baseline` (from `worktree`), its gateway's native
    route is measured too, as baseline-native."""
    wrk = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="ezat-native-"))
    scenarios = [SCENARIOS[name] for name in names]
    models = [s.model for s in scenarios]
    mock = mock_system().start(workdir)
    upstream = f"http://127.0.0.1:{mock.port}"
    systems = [
        floor_system(upstream),
        gateway_system(upstream, workdir, models, name="gateway-native", native=True, limits=limits),
        gateway_system(upstream, workdir, models, name="gateway-openai", limits=limits),
    ]
    if baseline:
        systems.insert(
            1,
            gateway_system(
                upstream,
                workdir,
                models,
                name="baseline-native",
                native=True,
                limits=limits,
                source=Path(baseline["worktree"]),
            ),
        )
    started = [mock]
    result = {
        "meta": machine(wrk)
        | {"rounds": rounds, "duration_s": duration, "concurrency": levels, "limits": limits, "baseline": baseline},
        "cells": [],
    }
    head = (
        ["scenario", "conc.", "floor CPU µs/req"]
        + (["baseline", "baseline ÷ floor"] if baseline else [])
        + ["native", "native ÷ floor", "rounds' range", "OpenAI route ÷ floor", f"native ≤ {TARGET}×"]
    )
    lines = ["| " + " | ".join(head) + " |", "| --- " + "| ---: " * (len(head) - 2) + "| --- |"]
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
                cell = {
                    "scenario": scenario.name,
                    "concurrency": concurrency,
                    "runs": runs,
                    "cpu_us": cpu,
                    "ratio": ratio,
                    "round_ratios": pairs,
                    "met": met,
                }
                row = [scenario.name, str(concurrency), f"{cpu['floor']:,.0f}"]
                if baseline:
                    cell["baseline_ratio"] = cpu["baseline-native"] / cpu["floor"]
                    row += [f"{cpu['baseline-native']:,.0f}", f"{cell['baseline_ratio']:.2f}×"]
                row += [
                    f"{cpu['gateway-native']:,.0f}",
                    f"**{ratio:.2f}×**",
                    f"{min(pairs):.2f}–{max(pairs):.2f}",
                    f"{cpu['gateway-openai'] / cpu['floor']:.2f}×",
                    "yes" if met else "**no**",
                ]
                lines.append("| " + " | ".join(row) + " |")
                result["cells"].append(cell)
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
    parser.add_argument(
        "--no-limits",
        action="store_true",
        help="the gateways' key without a spend limit, rpm or tpm (they have them, too high to bite, by default)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="a git revision whose native route is measured too, from a temporary worktree (baseline-native)",
    )
    args = parser.parse_args()
    with worktree(args.baseline) if args.baseline else nullcontext() as baseline:
        table, result = compare(
            args.rounds,
            args.duration,
            [int(c) for c in args.concurrency.split(",")],
            args.scenarios.split(","),
            not args.no_limits,
            baseline,
        )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"native-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"results: {path}")
