"""Micro-benchmark: rows per second the billing ledger sustains on SQLite, through
gateway.accounting.ledger.Ledger (group commit) and the gateway's SQLite store, with many concurrent
record() calls, as concurrent requests make them. Target (issue 5): at least 5,000 rows/s.

Each level runs `concurrency` tasks that record rows back to back for `duration` seconds; a
task's record() returns once its row is committed. Reports rows/s, record() latency and the
transactions written (batches: the group commits, and the rows written at once by record()
itself, Store.write_ledger_now), then counts the level's rows in the file: every row
recorded must be there. If one is missing, the table says so and the exit status is 1.

    python bench/ledger.py [--duration 2] [--concurrency 1,64,1000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from loadgen import percentile
from report import ledger_table

from gateway.accounting.ledger import Ledger
from gateway.config import KeyConfig
from gateway.storage import LedgerRow, open_store


async def level(db: Path, concurrency: int, duration: float) -> dict:
    store = open_store(f"sqlite:///{db}")
    await store.open()
    digest = hashlib.sha256(f"bench-{concurrency}".encode()).hexdigest()
    await store.sync_config_keys([KeyConfig(name=f"bench-{concurrency}", key_sha256=digest)])
    key = await store.find_key(digest)
    batches: list[int] = []  # rows per transaction
    write, write_now = store.write_ledger, store.write_ledger_now

    async def counted_write(rows):
        batches.append(len(rows))
        await write(rows)

    def counted_write_now(rows):
        written = write_now(rows)
        if written:  # False: nothing written, the row goes the usual way (counted there)
            batches.append(len(rows))
        return written

    store.write_ledger, store.write_ledger_now = counted_write, counted_write_now  # count the transactions
    ledger = Ledger(store)
    now = datetime.now(UTC)
    latencies: list[float] = []
    recorded = 0

    async def recorder(task: int) -> None:
        nonlocal recorded
        n = 0
        while time.perf_counter() < deadline:
            row = LedgerRow(
                request_id=f"c{concurrency}-t{task}-{n}",
                key_id=key.id,
                model="bench-nonstream",
                answered_model="bench-nonstream",
                deployment="mock",
                input_tokens=12,
                cache_write_tokens=0,
                cache_read_tokens=0,
                output_tokens=100,
                reasoning_tokens=0,
                cost_usd=Decimal("0.001536"),
                outcome="complete",
                started_at=now,
                finished_at=now,
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
    written = len(await store.ledger(key_id=key.id))
    await store.close()

    def pick(q: float) -> float | None:
        seconds = percentile(latencies, q)
        return None if seconds is None else round(seconds * 1000, 3)

    return {
        "concurrency": concurrency,
        "rows": recorded,
        "rows_per_s": round(recorded / elapsed),
        "record_ms": {"p50": pick(50), "p99": pick(99)},
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
    print(json.dumps(result) if args.json else ledger_table(result))
    lost = [r for r in result["levels"] if r["rows_in_file"] != r["rows"]]
    for r in lost:
        print(
            f"FAILED: {r['concurrency']} concurrent record(): {r['rows']:,} rows recorded, "
            f"{r['rows_in_file']:,} in the file",
            file=sys.stderr,
        )
    sys.exit(1 if lost else 0)
