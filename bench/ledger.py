"""Micro-benchmark: rows per second the billing ledger sustains on SQLite, through
gateway.ledger.Ledger (group commit) and the gateway's SQLite store, with many concurrent
record() calls, as concurrent requests make them. Target (issue 5): at least 5,000 rows/s.

Each level runs `concurrency` tasks that record rows back to back for `duration` seconds; a
task's record() returns once its row is committed. Reports rows/s, record() latency and the
batches written, then checks that every row is in the file.

    python bench/ledger.py [--duration 2] [--concurrency 1,64,1000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import tempfile
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

from gateway.config import KeyConfig
from gateway.ledger import Ledger
from gateway.storage import LedgerRow, open_store


async def level(db: Path, concurrency: int, duration: float) -> dict:
    store = open_store(f"sqlite:///{db}")
    await store.open()
    digest = hashlib.sha256(f"bench-{concurrency}".encode()).hexdigest()
    await store.sync_config_keys([KeyConfig(name=f"bench-{concurrency}", key_sha256=digest)])
    key = await store.find_key(digest)
    batches: list[int] = []
    write = store.write_ledger

    async def counted_write(rows):
        batches.append(len(rows))
        await write(rows)

    store.write_ledger = counted_write  # count the group commits
    ledger = Ledger(store)
    now = datetime.now(timezone.utc)
    latencies: list[float] = []
    recorded = 0

    async def recorder(task: int) -> None:
        nonlocal recorded
        n = 0
        while time.perf_counter() < deadline:
            row = LedgerRow(
                request_id=f"c{concurrency}-t{task}-{n}", key_id=key.id, model="bench-nonstream",
                answered_model="bench-nonstream", deployment="mock", input_tokens=12, cache_write_tokens=0,
                cache_read_tokens=0, output_tokens=100, reasoning_tokens=0, cost_usd=Decimal("0.001536"),
                outcome="complete", started_at=now, finished_at=now,
            )
            started = time.perf_counter()
            await ledger.record(row)
            latencies.append(time.perf_counter() - started)
            recorded += 1
            n += 1

    start = time.perf_counter()
    deadline = start + duration
    await asyncio.gather(*(recorder(t) for t in range(concurrency)))
    elapsed = time.perf_counter() - start
    await ledger.close()
    written = len(await store.ledger(key=str(key.id)))
    await store.close()
    latencies.sort()
    pick = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 3)  # noqa: E731
    return {
        "concurrency": concurrency,
        "rows": recorded,
        "rows_per_s": round(recorded / elapsed),
        "record_ms": {"p50": pick(0.50), "p99": pick(0.99)},
        "batches": len(batches),
        "mean_batch": round(sum(batches) / max(1, len(batches)), 1),
        "rows_in_file": written,
    }


async def main(duration: float, concurrencies: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ezat-ledger-bench-") as tmp:
        db = Path(tmp) / "ledger.db"
        levels = [await level(db, c, duration) for c in concurrencies]
    return {"store": "sqlite (WAL, synchronous=NORMAL)", "duration_s": duration, "levels": levels}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--concurrency", default="1,64,1000")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = asyncio.run(main(args.duration, [int(c) for c in args.concurrency.split(",")]))
    if args.json:
        print(json.dumps(result))
    else:
        print("| concurrent record() | rows/s | record p50 ms | p99 ms | batches | mean batch | rows in file |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in result["levels"]:
            print(f"| {r['concurrency']} | {r['rows_per_s']:,} | {r['record_ms']['p50']} | {r['record_ms']['p99']} "
                  f"| {r['batches']} | {r['mean_batch']} | {r['rows_in_file']:,} |")
