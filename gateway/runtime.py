"""How the project's servers run: on uvloop when it is installed, with the garbage collector
tuned for serving, until SIGINT or SIGTERM. The gateway, the mock upstream and the benchmarks'
floor all run this way, so that the benchmarks compare like with like."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Coroutine


def run(main: Coroutine) -> None:
    """asyncio.run, on uvloop when it is installed (a faster event loop, same behaviour)."""
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
    than parsing the JSON itself (measured: bench/RESULTS.md). Collect young objects far less
    often, and leave what start-up made (modules, the app) out of every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
