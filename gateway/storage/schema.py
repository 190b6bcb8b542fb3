"""Versioned schema migrations, one list per database; the gateway applies what is missing
on start, each migration in its own transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
    # Organizations: every key belongs to one ("default" unless it says otherwise), whose balance
    # all its keys share. Its spend counts from this migration. (SQLite adds no column with a
    # REFERENCES clause and a default other than NULL while foreign keys are on: the stores set
    # organization_id only to an organization's id.)
    """
    CREATE TABLE organizations (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        name        TEXT NOT NULL UNIQUE,
        balance_usd TEXT,
        suspended   INTEGER NOT NULL DEFAULT 0,
        spent_usd   TEXT NOT NULL DEFAULT '0',
        from_config INTEGER NOT NULL DEFAULT 0,
        created_at  TEXT NOT NULL
    );
    INSERT INTO organizations (id, name, created_at) VALUES (1, 'default', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'));
    ALTER TABLE keys ADD COLUMN organization_id INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE reservations ADD COLUMN organization_id INTEGER NOT NULL DEFAULT 1;
    """,
    # Of a request's cache writes, those for an hour, priced apart from the 5-minute ones.
    "ALTER TABLE ledger ADD COLUMN cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0",
    # What a key's and an organization's requests under way hold, kept beside their spend, so
    # that a hold reads one row, not every reservation: in whole billionths of a dollar (SQLite
    # adds integers exactly, decimals not), each reservation's rounded up. Rows held while the
    # file is migrated are converted through a float, whose error here is far below a billionth.
    """
    ALTER TABLE reservations ADD COLUMN amount_nano_usd INTEGER NOT NULL DEFAULT 0;
    UPDATE reservations SET amount_nano_usd = CAST(amount_usd * 1000000000 AS INTEGER) + 1;
    ALTER TABLE keys ADD COLUMN reserved_nano_usd INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE organizations ADD COLUMN reserved_nano_usd INTEGER NOT NULL DEFAULT 0;
    UPDATE keys SET reserved_nano_usd =
        (SELECT coalesce(sum(amount_nano_usd), 0) FROM reservations WHERE key_id = keys.id);
    UPDATE organizations SET reserved_nano_usd =
        (SELECT coalesce(sum(amount_nano_usd), 0) FROM reservations WHERE organization_id = organizations.id);
    """,
    # An organization's keys, counted when organizations are listed (ledger writes never change it).
    "CREATE INDEX keys_by_organization ON keys (organization_id)",
    # The conversation a request belonged to (LedgerRow.session_name); rows from before have none.
    "ALTER TABLE ledger ADD COLUMN session TEXT",
    # Responses API responses kept for their key (StoredResponse), as JSON text, until they expire
    # (the sweep deletes them by expires_at). No foreign key: a write takes no lock on its key's
    # row, which the ledger updates. A rowid table: its rows are large, and WITHOUT ROWID suits
    # small ones.
    """
    CREATE TABLE responses (
        response_id  TEXT NOT NULL PRIMARY KEY,
        key_id       INTEGER NOT NULL,
        created_at   TEXT NOT NULL,
        expires_at   TEXT NOT NULL,
        response     TEXT NOT NULL,
        input_items  TEXT NOT NULL,
        conversation TEXT NOT NULL
    );
    CREATE INDEX responses_by_expiry ON responses (expires_at);
    """,
    # The admin API's tokens made with the CLI (only their SHA-256), and the audit log of every
    # change made through the API or the CLI: who, what, to what, the thing before and after
    # (JSON text, never a secret nor a digest).
    """
    CREATE TABLE admin_tokens (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        name         TEXT NOT NULL UNIQUE,
        role         TEXT NOT NULL,
        token_sha256 TEXT NOT NULL UNIQUE,
        created_at   TEXT NOT NULL,
        revoked_at   TEXT
    );
    CREATE TABLE audit_log (
        id     INTEGER PRIMARY KEY AUTOINCREMENT,
        at     TEXT NOT NULL,
        actor  TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        before TEXT,
        after  TEXT
    );
    """,
    # Budget periods: the period a key's spend limit counts over, and what it spent in the last
    # period it spent in (period_start, its first day).
    """
    ALTER TABLE keys ADD COLUMN budget_period TEXT;
    ALTER TABLE keys ADD COLUMN period_start TEXT;
    ALTER TABLE keys ADD COLUMN period_spent_usd TEXT NOT NULL DEFAULT '0'
    """,
    # Alerts: each threshold crossed, once (the unique key), and its webhook delivery.
    """
    CREATE TABLE alerts (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        webhook_url     TEXT NOT NULL,
        subject         TEXT NOT NULL,
        period          TEXT NOT NULL,
        threshold       TEXT NOT NULL,
        payload         BLOB NOT NULL,
        created_at      TEXT NOT NULL,
        attempts        INTEGER NOT NULL DEFAULT 0,
        next_attempt_at TEXT NOT NULL,
        delivered_at    TEXT,
        given_up_at     TEXT,
        last_error      TEXT,
        UNIQUE (webhook_url, subject, period, threshold)
    );
    CREATE INDEX alerts_due ON alerts (next_attempt_at) WHERE delivered_at IS NULL AND given_up_at IS NULL
    """,
    # The console's sessions (SessionRecord): the digest of each one's id, never the id, and who
    # it is for, found by that to end its sessions when an admin token is revoked.
    """
    CREATE TABLE sessions (
        id_sha256  TEXT NOT NULL PRIMARY KEY,
        kind       TEXT NOT NULL,
        subject    TEXT NOT NULL,
        csrf       TEXT NOT NULL,
        created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX sessions_by_subject ON sessions (kind, subject);
    CREATE INDEX sessions_by_expiry ON sessions (expires_at)
    """,
    # People who signed in to the console through the identity provider, one row per subject (its
    # `sub`, which the sign-in's upsert finds them by): email, name and groups (a JSON array) as of
    # their last sign-in. Listed by id; nothing is looked up by email.
    """
    CREATE TABLE people (
        id         INTEGER PRIMARY KEY AUTOINCREMENT,
        subject    TEXT NOT NULL UNIQUE,
        email      TEXT NOT NULL,
        name       TEXT NOT NULL,
        groups     TEXT NOT NULL DEFAULT '[]',
        first_seen TEXT NOT NULL,
        last_seen  TEXT NOT NULL,
        disabled   INTEGER NOT NULL DEFAULT 0
    )
    """,
    # The person a key belongs to (NULL: an admin's key, every key from before). A column whose
    # default is NULL may have a REFERENCES clause while foreign keys are on. A person's keys are
    # listed, by this index.
    """
    ALTER TABLE keys ADD COLUMN person_id INTEGER REFERENCES people (id);
    CREATE INDEX keys_by_person ON keys (person_id)
    """,
    # `ezat-gateway login` (RFC 8628's device authorization grant): each device's request for a
    # key (DeviceGrant), found by its device code's digest as the client polls and by its user
    # code as a person approves it; and the renewal tokens (RenewalRecord) that get a person's
    # command line a new key later, by their digest, revoked by person when one is disabled. Both
    # deleted by expiry as new ones are made.
    """
    CREATE TABLE device_grants (
        device_sha256    TEXT NOT NULL PRIMARY KEY,
        user_code        TEXT NOT NULL UNIQUE,
        client_id        TEXT NOT NULL,
        created_at       TEXT NOT NULL,
        expires_at       TEXT NOT NULL,
        interval_seconds INTEGER NOT NULL,
        status           TEXT NOT NULL,
        person_id        INTEGER REFERENCES people (id),
        last_polled_at   TEXT
    ) WITHOUT ROWID;
    CREATE INDEX device_grants_by_expiry ON device_grants (expires_at);
    CREATE TABLE renewal_tokens (
        token_sha256 TEXT NOT NULL PRIMARY KEY,
        person_id    INTEGER NOT NULL REFERENCES people (id),
        created_at   TEXT NOT NULL,
        expires_at   TEXT NOT NULL,
        revoked_at   TEXT
    ) WITHOUT ROWID;
    CREATE INDEX renewal_tokens_by_person ON renewal_tokens (person_id);
    CREATE INDEX renewal_tokens_by_expiry ON renewal_tokens (expires_at)
    """,
    # A person's budget over all their keys (a policy's budget_usd), held as a key's period
    # budget is: what their keys spent in the last day, week and month they spent in (each by its
    # first day; all three, since the period is the policy's, which may change, not the store's),
    # and what their requests under way hold, in billionths of a dollar as keys'. A reservation
    # names its person only where their budget counts it. Spend counts from this migration.
    """
    ALTER TABLE people ADD COLUMN day_start TEXT;
    ALTER TABLE people ADD COLUMN day_spent_usd TEXT NOT NULL DEFAULT '0';
    ALTER TABLE people ADD COLUMN week_start TEXT;
    ALTER TABLE people ADD COLUMN week_spent_usd TEXT NOT NULL DEFAULT '0';
    ALTER TABLE people ADD COLUMN month_start TEXT;
    ALTER TABLE people ADD COLUMN month_spent_usd TEXT NOT NULL DEFAULT '0';
    ALTER TABLE people ADD COLUMN reserved_nano_usd INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE reservations ADD COLUMN person_id INTEGER
    """,
    # The identity provider's refresh token of a person, sealed (gateway/admin/provider_tokens.py):
    # a renewal asks the provider again with it. NULL: none given, or dropped.
    "ALTER TABLE people ADD COLUMN provider_token TEXT",
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
    # Organizations: every key belongs to one ("default", id 1, unless it says otherwise), whose
    # balance all its keys share. Its spend counts from this migration.
    """
    CREATE TABLE organizations (
        id          BIGSERIAL PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        balance_usd NUMERIC,
        suspended   BOOLEAN NOT NULL DEFAULT FALSE,
        spent_usd   NUMERIC NOT NULL DEFAULT 0,
        from_config BOOLEAN NOT NULL DEFAULT FALSE,
        created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    INSERT INTO organizations (name) VALUES ('default');
    ALTER TABLE keys ADD COLUMN organization_id BIGINT NOT NULL DEFAULT 1 REFERENCES organizations (id);
    ALTER TABLE reservations ADD COLUMN organization_id BIGINT NOT NULL DEFAULT 1;
    CREATE INDEX reservations_by_organization ON reservations (organization_id, expires_at);
    """,
    # Of a request's cache writes, those for an hour, priced apart from the 5-minute ones.
    "ALTER TABLE ledger ADD COLUMN cache_write_1h_tokens BIGINT NOT NULL DEFAULT 0",
    # An organization's keys, counted when organizations are listed (ledger writes never change it).
    "CREATE INDEX keys_by_organization ON keys (organization_id)",
    # The conversation a request belonged to (LedgerRow.session_name); rows from before have none.
    "ALTER TABLE ledger ADD COLUMN session TEXT",
    # Responses API responses kept for their key (StoredResponse), as JSON text (TOAST compresses
    # the large ones), until they expire (the sweep deletes them by expires_at). No foreign key:
    # a write takes no lock on its key's row, which the ledger updates.
    """
    CREATE TABLE responses (
        response_id  TEXT PRIMARY KEY,
        key_id       BIGINT NOT NULL,
        created_at   TIMESTAMPTZ NOT NULL,
        expires_at   TIMESTAMPTZ NOT NULL,
        response     TEXT NOT NULL,
        input_items  TEXT NOT NULL,
        conversation TEXT NOT NULL
    );
    CREATE INDEX responses_by_expiry ON responses (expires_at);
    """,
    # The admin API's tokens made with the CLI (only their SHA-256), and the audit log of every
    # change made through the API or the CLI (JSON text, as written: never a secret nor a digest).
    """
    CREATE TABLE admin_tokens (
        id           BIGSERIAL PRIMARY KEY,
        name         TEXT NOT NULL UNIQUE,
        role         TEXT NOT NULL,
        token_sha256 TEXT NOT NULL UNIQUE,
        created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
        revoked_at   TIMESTAMPTZ
    );
    CREATE TABLE audit_log (
        id     BIGSERIAL PRIMARY KEY,
        at     TIMESTAMPTZ NOT NULL DEFAULT now(),
        actor  TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        before TEXT,
        after  TEXT
    );
    """,
    """
    ALTER TABLE keys ADD COLUMN budget_period TEXT;
    ALTER TABLE keys ADD COLUMN period_start DATE;
    ALTER TABLE keys ADD COLUMN period_spent_usd NUMERIC NOT NULL DEFAULT 0
    """,
    """
    CREATE TABLE alerts (
        id              BIGSERIAL PRIMARY KEY,
        webhook_url     TEXT NOT NULL,
        subject         TEXT NOT NULL,
        period          TEXT NOT NULL,
        threshold       TEXT NOT NULL,
        payload         BYTEA NOT NULL,
        created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
        attempts        INTEGER NOT NULL DEFAULT 0,
        next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        delivered_at    TIMESTAMPTZ,
        given_up_at     TIMESTAMPTZ,
        last_error      TEXT,
        UNIQUE (webhook_url, subject, period, threshold)
    );
    CREATE INDEX alerts_due ON alerts (next_attempt_at) WHERE delivered_at IS NULL AND given_up_at IS NULL;
    """,
    """
    CREATE TABLE sessions (
        id_sha256  TEXT PRIMARY KEY,
        kind       TEXT NOT NULL,
        subject    TEXT NOT NULL,
        csrf       TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX sessions_by_subject ON sessions (kind, subject);
    CREATE INDEX sessions_by_expiry ON sessions (expires_at);
    """,
    """
    CREATE TABLE people (
        id         BIGSERIAL PRIMARY KEY,
        subject    TEXT NOT NULL UNIQUE,
        email      TEXT NOT NULL,
        name       TEXT NOT NULL,
        groups     TEXT NOT NULL DEFAULT '[]',
        first_seen TIMESTAMPTZ NOT NULL,
        last_seen  TIMESTAMPTZ NOT NULL,
        disabled   BOOLEAN NOT NULL DEFAULT FALSE
    );
    """,
    # The person a key belongs to (NULL: an admin's key, every key from before); a person's keys
    # are listed, by this index.
    """
    ALTER TABLE keys ADD COLUMN person_id BIGINT REFERENCES people (id);
    CREATE INDEX keys_by_person ON keys (person_id);
    """,
    # `ezat-gateway login`'s device grants and renewal tokens (SQLite's migration says more).
    """
    CREATE TABLE device_grants (
        device_sha256    TEXT PRIMARY KEY,
        user_code        TEXT NOT NULL UNIQUE,
        client_id        TEXT NOT NULL,
        created_at       TIMESTAMPTZ NOT NULL,
        expires_at       TIMESTAMPTZ NOT NULL,
        interval_seconds INTEGER NOT NULL,
        status           TEXT NOT NULL,
        person_id        BIGINT REFERENCES people (id),
        last_polled_at   TIMESTAMPTZ
    );
    CREATE INDEX device_grants_by_expiry ON device_grants (expires_at);
    CREATE TABLE renewal_tokens (
        token_sha256 TEXT PRIMARY KEY,
        person_id    BIGINT NOT NULL REFERENCES people (id),
        created_at   TIMESTAMPTZ NOT NULL,
        expires_at   TIMESTAMPTZ NOT NULL,
        revoked_at   TIMESTAMPTZ
    );
    CREATE INDEX renewal_tokens_by_person ON renewal_tokens (person_id);
    CREATE INDEX renewal_tokens_by_expiry ON renewal_tokens (expires_at);
    """,
    # A person's budget over all their keys (SQLite's migration says more); their requests' holds
    # are summed from the reservations that name them, by this index.
    """
    ALTER TABLE people
        ADD COLUMN day_start DATE, ADD COLUMN day_spent_usd NUMERIC NOT NULL DEFAULT 0,
        ADD COLUMN week_start DATE, ADD COLUMN week_spent_usd NUMERIC NOT NULL DEFAULT 0,
        ADD COLUMN month_start DATE, ADD COLUMN month_spent_usd NUMERIC NOT NULL DEFAULT 0;
    ALTER TABLE reservations ADD COLUMN person_id BIGINT;
    CREATE INDEX reservations_by_person ON reservations (person_id, expires_at) WHERE person_id IS NOT NULL;
    """,
    # The identity provider's refresh token of a person, sealed (gateway/admin/provider_tokens.py).
    "ALTER TABLE people ADD COLUMN provider_token TEXT",
]

# Key columns a caller may set, in the order both stores read them back.
KEY_FIELDS = (
    "name",
    "models",
    "spend_limit_usd",
    "rpm",
    "tpm",
    "expires_at",
    "revoked",
    "max_concurrent",
    "budget_period",
)
# Read from keys (k) joined with their organizations (o) and their people (p; none for an
# admin's key, whose person columns are NULL): KEY_COLUMNS FROM KEY_TABLES. Last, the person's
# spend in the last day, week and month they spent in (KeyRecord.person_spend).
KEY_COLUMNS = (
    "k.id, k.name, k.key_sha256, k.models, k.spend_limit_usd, k.rpm, k.tpm, k.expires_at, k.revoked,"
    " k.spent_usd, k.from_config, k.max_concurrent, o.name AS organization, k.organization_id,"
    " o.balance_usd AS organization_balance_usd, o.suspended AS organization_suspended,"
    " k.budget_period, k.period_start, k.period_spent_usd,"
    " k.person_id, p.email AS person_email, p.groups AS person_groups, p.disabled AS person_disabled,"
    " p.day_start AS person_day_start, p.day_spent_usd AS person_day_spent_usd,"
    " p.week_start AS person_week_start, p.week_spent_usd AS person_week_spent_usd,"
    " p.month_start AS person_month_start, p.month_spent_usd AS person_month_spent_usd"
)
KEY_TABLES = "keys k JOIN organizations o ON o.id = k.organization_id LEFT JOIN people p ON p.id = k.person_id"
ORGANIZATION_COLUMNS = (
    "o.id, o.name, o.balance_usd, o.suspended, o.spent_usd, o.from_config,"
    " (SELECT count(*) FROM keys WHERE keys.organization_id = o.id) AS keys"
)
LEDGER_FIELDS = LedgerRow._fields  # the ledger's columns, in the order a row holds them
LEDGER_COLUMNS = ", ".join(LEDGER_FIELDS)
LEDGER_SELECT = ", ".join("ledger." + column for column in LEDGER_FIELDS)
# The admin tokens', the audit log's, the sessions', the people's, the responses', the device
# grants' and the renewal tokens' columns, in the order both stores read them.
ADMIN_TOKEN_COLUMNS = "id, name, role, token_sha256, created_at, revoked_at"
AUDIT_COLUMNS = "id, at, actor, action, target, before, after"
SESSION_COLUMNS = "id_sha256, kind, subject, csrf, created_at, expires_at"
PERSON_COLUMNS = "id, subject, email, name, groups, first_seen, last_seen, disabled"
RESPONSE_COLUMNS = "response_id, key_id, created_at, expires_at, response, input_items, conversation"
DEVICE_GRANT_COLUMNS = (
    "device_sha256, user_code, client_id, created_at, expires_at, interval_seconds, status, person_id, last_polled_at"
)
RENEWAL_COLUMNS = "token_sha256, person_id, created_at, expires_at, revoked_at"
# Expired responses deleted per transaction by a sweep: a backlog goes in several short ones,
# which other writers interleave with.
SWEEP_BATCH = 500


# What a ledger page may be filtered by, in the order ledger_page_query takes their values.
LEDGER_FILTERS = ("ledger.key_id =", "ledger.finished_at >=", "ledger.finished_at <", "ledger.id >")


def ledger_page_query(mark: Callable[[int], str], values: Sequence[Any], limit: int | None) -> tuple[str, list[Any]]:
    """The ledger page's SELECT (each row after its id, oldest first), filtered by each of `values`
    that is not None, in LEDGER_FILTERS' order; `mark(n)` writes the dialect's n-th placeholder."""
    where: list[str] = []
    params: list[Any] = []
    for condition, value in zip(LEDGER_FILTERS, values):
        if value is not None:
            params.append(value)
            where.append(f"{condition} {mark(len(params))}")
    query = f"SELECT ledger.id, {LEDGER_SELECT} FROM ledger"
    if where:
        query += " WHERE " + " AND ".join(where)
    query += " ORDER BY ledger.id"
    if limit is not None:
        params.append(limit)
        query += f" LIMIT {mark(len(params))}"
    return query, params
