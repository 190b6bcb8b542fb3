"""Driving one system with a load generator, and measuring it from /proc meanwhile."""

from __future__ import annotations

import base64
import json
import resource
import subprocess
import time
import urllib.request
from pathlib import Path

from environment import log
from scenarios import SCENARIOS, Scenario, anthropic_request, closing_marker, openai_request
from systems import BENCH, PYTHON, CpuClock, System, machine_ticks, memory_kib, reset_peak_rss

LOADGEN = BENCH / "loadgen.py"
WRK_SCRIPT = BENCH / "wrk_post.lua"
SETTLE = 0.2  # seconds after the client ends before reading /proc, so connection teardown counts
# A round of a cell lasts long enough for about this many answers: the four paced streams that
# 2 s hold at concurrency 1 are too few for their CPU per request to be more than noise.
ANSWERS_PER_ROUND = 20


def round_seconds(duration: float, scenario: Scenario, concurrency: int) -> float:
    """A round's length: `duration`, or longer where the scenario's answers take long."""
    return max(duration, ANSWERS_PER_ROUND * scenario.seconds / concurrency)


def drive_wrk(wrk: str, system: System, body: Path, concurrency: int, duration: float, path: str = "") -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [
            wrk,
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(duration))}s",
            "--timeout",
            "30s",
            "-s",
            str(WRK_SCRIPT),
            f"http://127.0.0.1:{system.port}{path or system.path}",
            "--",
            str(body),
            *system.headers,
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((out for out in done.stdout.splitlines() if out.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {done.stdout}\n{done.stderr}")
    data = json.loads(line.removeprefix("WRK_JSON "))
    requests = data["requests"]
    return {
        "client": "wrk",
        "requests": requests,
        "errors": sum(data["errors"].values()),
        "rps": requests / (data["duration_us"] / 1e6),
        "p50_ms": data["latency_us"]["p50"] / 1000,
        "p99_ms": data["latency_us"]["p99"] / 1000,
        "first_byte_p50_ms": None,
        "first_token_p50_ms": None,
        "client_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }


def drive_asyncio(
    system: System,
    body: Path,
    expect: str,
    concurrency: int,
    duration: float,
    streams: int | None = None,
    ramp: float = 0.0,
    path: str = "",
) -> dict:
    argv = [
        PYTHON,
        str(LOADGEN),
        "--port",
        str(system.port),
        "--path",
        path or system.path,
        "--body-file",
        str(body),
        "--expect",
        expect,
        "-H",
        "Content-Type: application/json",
    ]
    for header in system.headers:
        argv += ["-H", header]
    argv += (
        ["--streams", str(streams), "--ramp", str(ramp), "--timeout", "60"]
        if streams
        else ["--concurrency", str(concurrency), "--duration", str(duration)]
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + ramp + 120)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr[-3000:]}")
    data = json.loads(done.stdout)
    return {
        "client": "asyncio",
        "requests": data["requests"],
        "errors": sum(data["errors"].values()),
        "error_kinds": data["errors"],
        "rps": data["rps"],
        "p50_ms": data["latency_ms"]["p50"],
        "p99_ms": data["latency_ms"]["p99"],
        "max_ms": data["latency_ms"]["max"],
        "first_byte_p50_ms": data["first_byte_ms"]["p50"],
        "first_token_p50_ms": data["first_token_ms"]["p50"],
        "max_in_flight": data["max_in_flight"],
        "client_cpu_s": data["client_cpu_s"],
    }


def in_turns(
    systems: list[System], mock: System, drive, rounds: int, duration: float, label: str, swap: bool = False
) -> dict[str, list[dict]]:
    """Each system warmed up, then measured `rounds` times in turns, A, B, A, B, so that the
    machine's drift cancels out; with `swap`, the systems after the first trade places every
    other round. `drive(system, seconds)` makes a run's driver. {system name: its runs}."""
    for system in systems:
        drive(system, 1)()  # connection pools, caches, the allocator
    runs = {system.name: [] for system in systems}
    for round_ in range(rounds):
        order = [systems[0], *reversed(systems[1:])] if swap and round_ % 2 else systems
        for system in order:
            run = measure(system, mock, drive(system, duration))
            runs[system.name].append(run)
            log(f"{label} {system.name:24} round {round_ + 1}: {run['cpu_us']:6.0f} µs/req ({run['errors']} errors)")
    return runs


def measure(system: System, mock: System, drive) -> dict:
    """One run: the system's and the mock's CPU time and the system's peak RSS around `drive()`
    (with several workers: their sums). The mock is the system's own where it has one (Bedrock's)."""
    mock = system.upstream or mock
    pids = system.pids()
    for pid in pids:
        reset_peak_rss(pid)
    rss_before = sum(memory_kib(pid)["VmRSS"] for pid in pids)
    clocks, mock_cpu = [CpuClock(pid) for pid in pids], CpuClock(mock.pid)
    ticks, started = machine_ticks(), time.monotonic()
    run = drive()
    wall = time.monotonic() - started
    time.sleep(SETTLE)
    cpu, mock_cpu = sum(clock.elapsed() for clock in clocks), mock_cpu.elapsed()
    total, idle, steal = (after - before for after, before in zip(machine_ticks(), ticks))
    n = run["requests"]
    per_request = (lambda seconds: seconds / n * 1e6) if n else (lambda seconds: None)
    run.update(
        cpu_s=round(cpu, 3),
        cores_busy=round(cpu / wall, 3),  # the system's CPU time over the run's wall time
        cpu_us=per_request(cpu),
        mock_cpu_us=per_request(mock_cpu),
        client_cpu_us=per_request(run.pop("client_cpu_s")),
        machine_busy=round(1 - idle / total, 3) if total else None,  # all cores, every process
        machine_steal=round(steal / total, 3) if total else None,
        rss_before_mib=rss_before / 1024,
        peak_rss_mib=sum(memory_kib(pid)["VmHWM"] for pid in pids) / 1024,
    )
    return run


def driver(args, wrk: str | None, system: System, scenario: Scenario, body: Path, concurrency: int, duration: float):
    use_wrk = wrk and (args.client == "wrk" or (args.client == "auto" and not scenario.stream))
    path = system.path_for(scenario)
    if use_wrk:
        return lambda: drive_wrk(wrk, system, body, concurrency, duration, path)
    expect = closing_marker(system.api, scenario)
    if scenario.stream:
        return lambda: drive_asyncio(system, body, expect, concurrency, duration, path=path)
    return lambda: drive_asyncio(system, body, expect, concurrency, duration, path=path) | {"first_token_p50_ms": None}


def check(system: System, scenario: Scenario, body: Path) -> None:
    """One request of each scenario, checked, so no run measures an error path."""
    headers = {"Content-Type": "application/json", **dict(h.split(": ", 1) for h in system.headers)}
    request = urllib.request.Request(
        f"http://127.0.0.1:{system.port}{system.path_for(scenario)}", data=body.read_bytes(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        status, data = response.status, response.read()
    if system.api == "bedrock":
        data = bedrock_events(data)
    expected = {
        ("openai", False): b'"chat.completion"',
        ("openai", True): b"data: [DONE]",
        ("responses", False): b'"object":"response"',
        ("responses", True): b'"type":"response.completed"',
        ("anthropic", False): b'"type":"message"',
        ("anthropic", True): b'"type":"message_stop"',
        ("bedrock", True): b'"type":"message_stop"',
    }[(system.api, scenario.stream)]
    needs = [expected] + ([scenario.tool_name.encode()] if scenario.tools else [b"Tokens a"])
    if status != 200 or not all(n in data for n in needs):
        raise RuntimeError(f"{system.name} answered {scenario.name} wrongly ({status}): {data[:500]!r}")


def bedrock_events(data: bytes) -> bytes:
    """A Bedrock stream's events, decoded by botocore (not the gateway's decoder, which this
    checks the gateway against): every frame checked, each `chunk` event's Anthropic event, one
    a line. Not a stream of frames, or an exception frame: what it was, to fail the check."""
    from botocore.eventstream import EventStreamBuffer, ParserError

    frames = EventStreamBuffer()
    frames.add_data(data)
    events = []
    try:
        for frame in frames:
            if frame.headers.get(":message-type") != "event":
                return data
            events.append(base64.b64decode(json.loads(frame.payload)["bytes"]))
    except (ParserError, ValueError, KeyError, TypeError):
        return data
    return b"\n".join(events)


def nonstream_in_turns(
    wrk: str,
    mock: System,
    systems: list[System],
    workdir: Path,
    levels: list[int],
    rounds: int,
    duration: float,
    swap: bool = False,
):
    """For each concurrency of `levels`: (it, in_turns' runs of `systems` driven by wrk with
    non-streaming requests). Each system is started and checked first; all of them, the mock
    (started already) included, are stopped at the end, whatever happens."""
    nonstream = SCENARIOS["nonstream"]
    bodies = {"floor": workdir / "floor.json", "gateway": workdir / "gateway.json"}
    bodies["floor"].write_bytes(anthropic_request(nonstream))
    bodies["gateway"].write_bytes(openai_request(nonstream))
    started = [mock]
    try:
        for system in systems:
            system.start(workdir)
            started.append(system)
            check(system, nonstream, bodies[system.kind])
        for concurrency in levels:

            def drive(system, seconds):
                return lambda: drive_wrk(wrk, system, bodies[system.kind], concurrency, seconds)

            yield concurrency, in_turns(systems, mock, drive, rounds, duration, f"c={concurrency}", swap=swap)
    finally:
        for system in reversed(started):
            system.stop()
