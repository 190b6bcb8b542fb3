"""Versioned schema migrations, one list per database; the gateway applies what is missing
on start, each migration in its own transaction."""

from __future__ import annotations

from middlewares.core.records import LedgerRow

SQLITE = [
    """
    CREATE TABLE keys (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        name            TEXT NOT NULL DEFAULT '',
        key_sha256      TEXT NOT NULL UNIQUE,
        models          TEXT NOT NULL DEFAULT '["*"]',
        spend_limit_usd TEXT,
        rpm             INTEGER,
        tpm             INTEGER,
        expires_at      TEXT,
        revoked         INTEGER NOT NULL DEFAULT 0,
        spent_usd       TEXT NOT NULL DEFAULT '0',
        from_config     INTEGER NOT NULL DEFAULT 0,
        created_at      TEXT NOT NULL
    );
    CREATE TABLE ledger (
        id                 INTEGER PRIMARY KEY,
        request_id         TEXT NOT NULL UNIQUE,
        key_id             INTEGER NOT NULL REFERENCES keys (id),
        model              TEXT NOT NULL,
        answered_model     TEXT NOT NULL,
        deployment         TEXT NOT NULL,
        input_tokens       INTEGER NOT NULL,
        cache_write_tokens INTEGER NOT NULL,
        cache_read_tokens  INTEGER NOT NULL,
        output_tokens      INTEGER NOT NULL,
        reasoning_tokens   INTEGER NOT NULL,
        cost_usd           TEXT NOT NULL,
        outcome            TEXT NOT NULL,
        started_at         TEXT NOT NULL,
        finished_at        TEXT NOT NULL
    );
    CREATE INDEX ledger_by_time ON ledger (finished_at);
    CREATE INDEX ledger_by_key ON ledger (key_id, finished_at);
    """,
    # What admitted requests may still cost: a key's spend and reservations stay within its limit.
    # Only requests under way are in it, a few pages at most: one b-tree (WITHOUT ROWID) and no
    # index keep each reservation's commit to a page or two; a key's are found by a scan.
    """
    CREATE TABLE reservations (
        request_id TEXT PRIMARY KEY,
        key_id     INTEGER NOT NULL,
        amount_usd TEXT NOT NULL,
        expires_at TEXT NOT NULL
    ) WITHOUT ROWID;
    """,
    "ALTER TABLE keys ADD COLUMN max_concurrent INTEGER",
]

POSTGRES = [
    """
    CREATE TABLE keys (
        id              BIGSERIAL PRIMARY KEY,
        name            TEXT NOT NULL DEFAULT '',
        key_sha256      TEXT NOT NULL UNIQUE,
        models          TEXT NOT NULL DEFAULT '["*"]',
        spend_limit_usd NUMERIC,
        rpm             INTEGER,
        tpm             INTEGER,
        expires_at      TIMESTAMPTZ,
        revoked         BOOLEAN NOT NULL DEFAULT FALSE,
        spent_usd       NUMERIC NOT NULL DEFAULT 0,
        from_config     BOOLEAN NOT NULL DEFAULT FALSE,
        created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE ledger (
        id                 BIGSERIAL PRIMARY KEY,
        request_id         TEXT NOT NULL UNIQUE,
        key_id             BIGINT NOT NULL REFERENCES keys (id),
        model              TEXT NOT NULL,
        answered_model     TEXT NOT NULL,
        deployment         TEXT NOT NULL,
        input_tokens       BIGINT NOT NULL,
        cache_write_tokens BIGINT NOT NULL,
        cache_read_tokens  BIGINT NOT NULL,
        output_tokens      BIGINT NOT NULL,
        reasoning_tokens   BIGINT NOT NULL,
        cost_usd           NUMERIC NOT NULL,
        outcome            TEXT NOT NULL,
        started_at         TIMESTAMPTZ NOT NULL,
        finished_at        TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX ledger_by_time ON ledger (finished_at);
    CREATE INDEX ledger_by_key ON ledger (key_id, finished_at);
    """,
    # Limits as large as SQLite's INTEGER holds (rpm, tpm: up to config.MAX_PER_MINUTE).
    """
    ALTER TABLE keys ALTER COLUMN rpm TYPE BIGINT, ALTER COLUMN tpm TYPE BIGINT;
    """,
    # What admitted requests may still cost: a key's spend and reservations stay within its limit.
    """
    CREATE TABLE reservations (
        request_id TEXT PRIMARY KEY,
        key_id     BIGINT NOT NULL,
        amount_usd NUMERIC NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX reservations_by_key ON reservations (key_id, expires_at);
    """,
    "ALTER TABLE keys ADD COLUMN max_concurrent INTEGER",
]

# Key columns a caller may set, in the order both stores read them back.
KEY_FIELDS = ("name", "models", "spend_limit_usd", "rpm", "tpm", "expires_at", "revoked", "max_concurrent")
KEY_COLUMNS = ("id, name, key_sha256, models, spend_limit_usd, rpm, tpm, expires_at, revoked, spent_usd, from_config,"
               " max_concurrent")
LEDGER_FIELDS = LedgerRow._fields  # the ledger's columns, in the order a row holds them
LEDGER_COLUMNS = ", ".join(LEDGER_FIELDS)
LEDGER_SELECT = ", ".join("ledger." + column for column in LEDGER_FIELDS)  # beside a join with keys
