"""The processes a benchmark runs, and what /proc says about them.

Each system runs in a process of its own, so that its CPU time (utime + stime from
/proc/<pid>/stat, every thread included) and its peak RSS (VmHWM from /proc/<pid>/status,
reset before each run through /proc/<pid>/clear_refs) are its alone.

utime + stime come in clock ticks (10 ms), too coarse for a short run of a cheap process; the
same time is kept to the nanosecond per thread in /proc/<pid>/task/*/schedstat, so `CpuClock`
adds that up, checked against stat.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from routes import GATEWAY_KEY, GATEWAY_ROUTES, ROUTE_FIELDS, route_headers
from scenarios import REASONING_KEY, Scenario, bedrock_model_id

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PYTHON = sys.executable
EZAT_GATEWAY = str(Path(PYTHON).parent / "ezat-gateway")  # the console script, as production runs it
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CpuClock:
    """A process's CPU time between two readings, in seconds: the living threads' schedstat
    run time (to the nanosecond), unless it disagrees with stat's utime + stime by more than
    stat's resolution (a thread exited meanwhile, taking its schedstat with it): then stat's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._start = self._read()

    def elapsed(self) -> float:
        fine0, coarse0 = self._start
        fine1, coarse1 = self._read()
        coarse = coarse1 - coarse0
        if fine0 is None or fine1 is None:
            return coarse
        fine = fine1 - fine0
        return fine if abs(fine - coarse) <= 2 / CLOCK_TICKS + 0.05 * coarse else coarse

    def _read(self) -> tuple[float | None, float]:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        coarse = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14, 15 of stat(5)
        try:
            fine = 0
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                    fine += int(f.read().split()[0])
            return fine / 1e9, coarse
        except (OSError, ValueError):  # a thread exited while we read, or no schedstat here
            return None, coarse


def machine_ticks() -> tuple[int, int, int]:
    """(all, idle, steal) CPU ticks of the whole machine since boot, from /proc/stat: how busy
    the machine was during a run, and how much a hypervisor took from it (steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4], fields[7]  # user … steal; idle + iowait; steal


def memory_kib(pid: int) -> dict[str, int]:
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                name, value = line.split(":")
                found[name] = int(value.split()[0])
    return found


def reset_peak_rss(pid: int) -> bool:
    """Make VmHWM start again from the current RSS (Linux 4.0+), so each run has its own peak."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class System:
    """A server process the benchmark drives (or the mock behind both)."""

    name: str
    port: int
    path: str  # the route the clients POST to
    headers: list[str]  # the clients' request headers (besides Host, Content-Length)
    argv: list[str]
    ready_path: str | None = None  # GET this until 200; else wait for the port to accept
    workers: int = 1  # processes serving the port (the gateway's --workers)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    extra: dict = field(default_factory=dict)
    api: str = "anthropic"  # what its clients speak: "anthropic" (Messages), "openai" (Chat Completions), "responses"
    cwd: Path | None = None  # where the process runs; else the work directory
    env: dict | None = None  # its environment; else this process's
    body_fields: dict = field(default_factory=dict)  # what its clients add to a scenario's body (ROUTE_FIELDS)
    upstream: System | None = None  # the mock it sends to, where not the run's (Bedrock's)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def path_for(self, scenario: Scenario) -> str:
        """The path its clients POST a scenario's request to: Bedrock's names the model."""
        return self.path.format(model=bedrock_model_id(scenario.model)) if "{model}" in self.path else self.path

    @property
    def kind(self) -> str:
        """gateway, floor or mock (a gateway with workers is named gateway-N-workers, the parsing
        floor floor-parsing)."""
        return self.name.partition("-")[0]

    def pids(self) -> list[int]:
        """The process and its descendants (the workers of `serve --workers N`)."""
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo += [int(child) for child in f.read().split()]
            except OSError:
                pass
        return found

    def start(self, workdir: Path, env: dict | None = None) -> System:
        self.log = workdir / f"{self.name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd or workdir,
                env=env or self.env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # not left running behind a caller that goes on without it
            raise
        return self

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if self.workers > 1 and len(self._listening()) < self.workers:
                    time.sleep(0.05)
                    continue
                if self.ready_path:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=1) as r:
                        if r.status == 200:
                            return
                else:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not get ready in {timeout:g} s:\n{self.log.read_text()[-3000:]}")

    def _listening(self) -> set[int]:
        """The processes of this system that have a socket listening on its port."""
        return {pid for pid, sockets in listening(self.pids()).items() if any(p == self.port for _, p in sockets)}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def listening(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """For each of `pids`, the (address, port) of each socket it listens on, from
    /proc/net/tcp and tcp6 (an IPv6 address in brackets)."""
    sockets = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # LISTEN
                        address, port = fields[1].split(":")
                        sockets[f"socket:[{fields[9]}]"] = (_address(address, width), int(port, 16))
        except OSError:
            pass
    found = {}
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        found[pid] = {sockets[link] for link in links if link in sockets}
    return found


def _address(hex_address: str, width: int) -> str:
    """/proc/net/tcp's address: IPv4 as four bytes little-endian, IPv6 as four such words."""
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    return "[" + ":".join(b"".join(words).hex()[i : i + 4] for i in range(0, 32, 4)) + "]"


def mock_system(provider: str = "anthropic") -> System:
    """bench/mock.py: the fast mock; with provider "bedrock", Bedrock's (named mock-bedrock)."""
    port = free_port()
    if provider == "bedrock":
        argv = [PYTHON, str(BENCH / "mock.py"), "--port", str(port), "--provider", "bedrock"]
        return System("mock-bedrock", port, BEDROCK_STREAM_PATH, [], argv)
    return System("mock", port, "/v1/messages", [], [PYTHON, str(BENCH / "mock.py"), "--port", str(port)])


# Bedrock's InvokeModelWithResponseStream, where the Bedrock floor's clients POST (every Bedrock
# scenario streams); {model} is the scenario's Bedrock model id.
BEDROCK_STREAM_PATH = "/model/{model}/invoke-with-response-stream"


def images_system() -> System:
    """bench/images.py: the images the `images` scenario's requests point at."""
    port = free_port()
    return System("images", port, "/", [], [PYTHON, str(BENCH / "images.py"), "--port", str(port)])


def floor_system(upstream_url: str, parse: bool = False, bedrock: System | None = None) -> System:
    """bench/passthrough.py: the floor, or with `parse` the parsing floor (named floor-parsing,
    so that it is of the floor's kind and is sent the floor's requests). With `bedrock` (the
    Bedrock mock), the Bedrock floor, floor-bedrock: the same pass-through in front of it, sent
    the Bedrock request the gateway makes and relaying its event-stream frames untouched."""
    port = free_port()
    if bedrock is not None:
        return System(
            "floor-bedrock",
            port,
            BEDROCK_STREAM_PATH,
            ["authorization: Bearer bench", "accept: application/json"],
            [PYTHON, str(BENCH / "passthrough.py"), "--port", str(port), "--upstream", upstream_url],
            api="bedrock",
            upstream=bedrock,
        )
    return System(
        "floor-parsing" if parse else "floor",
        port,
        "/v1/messages",
        ["x-api-key: bench", "anthropic-version: 2023-06-01"],
        [PYTHON, str(BENCH / "passthrough.py"), "--port", str(port), "--upstream", upstream_url]
        + (["--parse"] if parse else []),
    )


def gateway_system(
    upstream_url: str,
    workdir: Path,
    models: list[str],
    workers: int = 1,
    name: str | None = None,
    limits: bool = True,
    route: str = "openai",
    observed: bool = True,
    ratelimit_url: str | None = None,
    source: Path | None = None,
    bedrock: System | None = None,
) -> System:
    """The gateway exactly as production runs it: `ezat-gateway serve --config <file>`, with
    one key, the benchmark models on one deployment (the mock), and the ledger in SQLite. Its
    config and database are named after it (by default gateway or gateway-N-workers), so
    each gateway started in one work directory starts afresh. `limits=False`: the key has no
    spend limit, rpm or tpm (bench/limits.py). `route`: the one of GATEWAY_ROUTES its clients
    POST to (bench/native.py), by default Chat Completions. `observed=False`: no metrics and no access
    log (bench/observability.py); by default both, the log in JSON, as production runs it.
    `ratelimit_url`: the key's rate limits counted in that Redis, as `--workers` needs.
    `source`: the gateway's code from that checkout (another revision's git worktree), run as
    `python -m gateway serve` from it, with it first on PYTHONPATH (`source_env`). `bedrock`: its
    deployment is Bedrock's, this mock (`upstream_url` its address), reached with a Bedrock API
    key, each model at its Bedrock id (scenarios.bedrock_model_id)."""
    port = free_port()
    name = name or ("gateway" if workers == 1 else f"gateway-{workers}-workers")
    config = workdir / f"{name}.toml"
    config.write_text(
        gateway_config(
            port, upstream_url, workdir / f"{name}.db", models, limits, observed, ratelimit_url, bedrock is not None
        )
    )
    command = [PYTHON, "-m", "gateway"] if source else [EZAT_GATEWAY]
    path, api = GATEWAY_ROUTES[route]
    return System(
        name,
        port,
        path,
        route_headers(route),
        command + ["serve", "--config", str(config)] + (["--workers", str(workers)] if workers > 1 else []),
        ready_path="/healthz",
        workers=workers,
        extra={"config": str(config), "db": str(workdir / f"{name}.db")},
        api=api,
        body_fields=ROUTE_FIELDS.get(route, {}),
        cwd=source,
        env=source_env(source) if source else None,
        upstream=bedrock,
    )


def source_env(source: Path) -> dict:
    """This environment with `source` first on PYTHONPATH, so that `gateway` and `middlewares`
    are imported from it, not from the editable install (whose finder comes after the path)."""
    path = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path}


def gateway_config(
    port: int,
    upstream_url: str,
    db: Path,
    models: list[str],
    limits: bool = True,
    observed: bool = True,
    ratelimit_url: str | None = None,
    bedrock: bool = False,
) -> str:
    """`bedrock`: the deployment is Bedrock's at `upstream_url` (a Bedrock API key, no SigV4),
    each model at its Bedrock id."""
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "",
        "[storage]",
        f'url = "sqlite:///{db}"',
        "",
        "[metrics]",
        f"enabled = {'true' if observed else 'false'}",
        "",
        "[logging]",
        'format = "json"',
        f"access_log = {'true' if observed else 'false'}",
        "",
        # The images scenario's URLs are on loopback (bench/images.py); a Codex turn's reasoning
        # comes back sealed under this key (scenarios.REASONING_KEY).
        "[images]",
        "allow_private_hosts = true",
        "",
        "[responses]",
        f'reasoning_key = "{REASONING_KEY.hex()}"',
        "",
        "[[deployments]]",
        'name = "mock"',
        *(['provider = "bedrock"', 'region = "us-east-1"'] if bedrock else []),
        f'base_url = "{upstream_url}"',
        'api_key = "bench"',
        "",
    ]
    if ratelimit_url:
        lines += ["[ratelimit]", f'url = "{ratelimit_url}"', ""]
    for model in dict.fromkeys(models):  # scenarios may share a model (its answer)
        lines += [
            "[[models]]",
            f'id = "{model}"',
            'deployments = ["mock"]',
            *([f'upstream_models = {{ "mock" = "{bedrock_model_id(model)}" }}'] if bedrock else []),
            "max_output_tokens = 64000",
            "pricing = { input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }",
            "",
        ]
    # Limits far too high to bite, so that billing's spend check and the rate limiter do their
    # work on every request, as for a production key that has them.
    lines += ["[[keys]]", f'key = "{GATEWAY_KEY}"', 'name = "bench"']
    if limits:
        lines += ["spend_limit_usd = 1000000000", "rpm = 1000000000", "tpm = 1000000000000"]
    lines.append("")
    return "\n".join(lines)
