"""What a key's limits cost a request: the spend limit's reservation and tpm's.

A key with `spend_limit_usd` makes every request reserve its worst-case cost in the store at
admission (a SQLite write transaction; the ledger row's commit ends it), and one with `tpm`
reserves its token estimate in the rate limiter. The same gateway config twice (bench/ab.py), its
key without any limit and with spend_limit_usd, rpm and tpm far too high to bite (as `make bench`
runs it); target: within 1.10× at concurrency 64.

    python bench/limits.py [--rounds 6] [--duration 2] [--concurrency 1,64]
"""

from ab import main

if __name__ == "__main__":
    main("limits", __doc__, {"limits": False}, {"limits": True}, 1.10)
