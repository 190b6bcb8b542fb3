"""What metrics and the access log cost a request.

With them, each request binds a few label children, counts and times itself, and writes one
JSON access line; the ledger counts tokens and cost as it commits. The same gateway config twice
(bench/ab.py), without `/metrics` and the access log, and with both (the log in JSON, as
production runs it); target: within 1.05× at concurrency 64.

    python bench/observability.py [--rounds 6] [--duration 2] [--concurrency 1,64]
"""

from ab import main

if __name__ == "__main__":
    main("observability", __doc__, {"observed": False}, {"observed": True}, 1.05)
