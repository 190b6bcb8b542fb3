"""How the project's servers run: on uvloop when it is installed, with the garbage collector
tuned for serving and as many open files as the system allows, until SIGINT or SIGTERM. The
gateway, the mock upstream and the benchmarks' floor all run this way, so that the benchmarks
compare like with like."""

from __future__ import annotations

import asyncio
import gc
import resource
import signal
from collections.abc import Coroutine


def run(main: Coroutine) -> None:
    """asyncio.run, on uvloop when it is installed (a faster event loop, same behaviour)."""
    raise_open_files_limit()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main)


async def until_stopped() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()


def tune_garbage_collector() -> None:
    """Call once the server is built, before it serves.

    Requests allocate many short-lived dicts (parsed JSON above all), nearly none in cycles;
    at Python's default threshold the cyclic collector runs every 700 allocations and costs more
    than parsing the JSON itself (measured: bench/HISTORY.md). Collect young objects far less
    often, and leave what start-up made (modules, the app) out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one, and returned. A stream holds two
    sockets (its client's and its upstream's); the common default of 1,024 would cap a
    process near 500 streams, far below what its memory allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit some kernels refuse as a soft one
            return soft
    return hard
