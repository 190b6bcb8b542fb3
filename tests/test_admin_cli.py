"""`ezat-gateway keys …` and `ezat-gateway usage` as an operator runs them: the installed console
script in a subprocess, against the same store a gateway serves from (a SQLite file from the
config, or PostgreSQL through `--storage`)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import re
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import openai
import pytest

from gateway.accounting.usage import USAGE_COLUMNS
from gateway.config import StorageConfig, load_config
from gateway.mock.upstream import Scenario
from gateway.storage import open_store
from tests.support import MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, read_store, run_command

CONFIG_KEY = "sk-config-key-for-cfg"

CONFIG = """
[storage]
url = "sqlite:///{db}"

[[deployments]]
name = "primary"
base_url = "{upstream}"
api_key = "{upstream_key}"

[[models]]
id = "{model}"
upstream_model = "{upstream_model}"
deployments = ["primary"]
pricing = {{ input = 3, output = 15, cache_write = 3.75, cache_read = 0.30 }}

[[models]]
id = "test/small"
upstream_model = "small-1"
deployments = ["primary"]
free = true

[[keys]]
key = "{config_key}"
name = "cfg"
"""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def backend(request, tmp_path, upstream):
    """(config file, storage options for the command, storage URL) for each backend. With
    PostgreSQL the config still names a SQLite file: `--storage` must win over it."""
    db = tmp_path / "ezat.db"
    path = tmp_path / "gateway.toml"
    path.write_text(
        CONFIG.format(
            db=db,
            upstream=upstream.url,
            upstream_key=UPSTREAM_KEY,
            model=MODEL,
            upstream_model=UPSTREAM_MODEL,
            config_key=CONFIG_KEY,
        )
    )
    if request.param == "sqlite":
        return path, [], f"sqlite:///{db}"
    url = request.getfixturevalue("postgres_url")
    return path, ["--storage", url], url


# The line on stderr naming the database a command opened from its config (or the demo's):
# tests/test_cli_first_hour.py checks it.
USING_THE_DATABASE = re.compile(r"^using the database at .*\n")


async def ezat(backend, *args: str) -> tuple[int, str]:
    """Runs `ezat-gateway <args> --config <file> [--storage url]`; (exit status, stdout and stderr,
    without the line naming the database, which --storage does not print)."""
    path, storage, _ = backend
    status, output = await run_command(*args, "--config", str(path), *storage, cwd=path.parent)
    return status, USING_THE_DATABASE.sub("", output, count=1)


async def serve(start_gateway, backend):
    """A gateway from the same config file (and store), reading keys afresh on every request."""
    path, _, url = backend
    config = replace(load_config(path), storage=StorageConfig(url=url))
    return await start_gateway(config, key_cache_seconds=0)


async def in_database_files(url: str, needle: str) -> bool:
    """Whether `needle` is anywhere in the SQLite file or its WAL. Read by another process: closing
    a descriptor of the file here would drop the SQLite locks this process (the gateway) holds."""
    path = url.removeprefix("sqlite:///")
    script = "import glob, sys; sys.exit(any(sys.argv[2].encode() in open(p, 'rb').read() for p in glob.glob(sys.argv[1] + '*')))"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, path, needle)
    return await asyncio.wait_for(process.wait(), 10) == 1


async def stored_keys(url: str) -> dict:
    """The keys of the store at `url`, by name."""
    _, keys = await read_store(url)
    return {key.name: key for key in keys}


async def ask(gateway, secret: str, model: str = MODEL):
    async with gateway.client(api_key=secret) as client:
        # A small output limit: each request reserves its estimate of the key's 1,000 tpm.
        return await client.chat.completions.create(
            model=model, max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )


LIMITS = ("--models", "anthropic/*", "--spend-limit", "5", "--rpm", "10", "--tpm", "1000", "--expires", "2030-01-01")


async def create_ci_key(backend, *options: str) -> str:
    status, output = await ezat(backend, "keys", "create", "--name", "ci", *options)
    assert status == 0, output
    secrets = re.findall(r"sk-ezat-[A-Za-z0-9_-]+", output)
    assert len(secrets) == 1, output  # shown once
    return secrets[0]


async def test_keys_create_list_update_revoke(backend, start_gateway, upstream, caplog):
    caplog.set_level(logging.DEBUG)
    _, _, url = backend
    secret = await create_ci_key(backend, *LIMITS)

    created = (await stored_keys(url))["ci"]
    assert created.models == ("anthropic/*",)
    assert (created.spend_limit_usd, created.rpm, created.tpm) == (Decimal("5"), 10, 1000)
    assert created.expires_at == datetime(2030, 1, 1, tzinfo=UTC)
    assert created.revoked is False

    gateway = await serve(start_gateway, backend)
    completion = await ask(gateway, secret)
    assert completion.choices[0].message.content
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await ask(gateway, secret, model="test/small")  # not one of its models
    assert refused.value.status_code == 403
    for _ in range(9):  # rpm 10: the first request and nine more...
        await ask(gateway, secret)
    with pytest.raises(openai.RateLimitError) as limited:  # ...then the eleventh is refused
        await ask(gateway, secret)
    assert limited.value.body["code"] == "rate_limit_exceeded"
    assert int(limited.value.response.headers["retry-after"]) >= 1

    status, listed = await ezat(backend, "keys", "list")
    assert status == 0, listed
    header, *lines = listed.splitlines()
    assert header.split()[:4] == ["id", "name", "models", "spent_usd"]
    (ci_line,) = [line for line in lines if line.split()[1] == "ci"]
    assert ci_line.split()[2:3] == ["anthropic/*"]
    for shown in ("5.0000", "10", "1000", "2030-01-01T00:00:00+00:00", "False"):
        assert shown in ci_line.split(), ci_line
    assert any(line.split()[1] == "cfg" for line in lines)
    assert secret not in listed
    if url.startswith("sqlite:///"):
        assert await in_database_files(url, created.key_sha256)  # the search works: the digest is there
        assert not await in_database_files(url, secret)

    status, output = await ezat(backend, "keys", "update", "ci", "--spend-limit", "none", "--rpm", "0")
    assert status == 0, output
    updated = (await stored_keys(url))["ci"]
    assert (updated.spend_limit_usd, updated.rpm) == (None, None)  # cleared
    assert (updated.tpm, updated.models, updated.expires_at) == (1000, ("anthropic/*",), created.expires_at)
    await ask(gateway, secret)  # no request limit any more: the twelfth goes through

    status, output = await ezat(backend, "keys", "revoke", "ci")
    assert status == 0, output
    assert (await stored_keys(url))["ci"].revoked is True
    with pytest.raises(openai.AuthenticationError) as revoked:
        await ask(gateway, secret)
    assert revoked.value.status_code == 401
    assert revoked.value.body["code"] == "invalid_api_key"
    await ask(gateway, CONFIG_KEY)  # the other key is untouched

    # A revoked key's settings may still change, but the command says it stays refused.
    status, output = await ezat(backend, "keys", "update", "ci", "--rpm", "7")
    assert status == 0, output
    note, header, line = output.splitlines()
    assert (
        note
        == "key 'ci' is revoked: the change is kept, but its requests still get 401 (--unrevoke makes it usable again)"
    )
    assert header.split()[:2] == ["id", "name"] and "True" in line.split()
    assert ((await stored_keys(url))["ci"].rpm, (await stored_keys(url))["ci"].revoked) == (7, True)
    with pytest.raises(openai.AuthenticationError):
        await ask(gateway, secret)
    status, output = await ezat(backend, "keys", "revoke", "ci")
    assert (status, output.splitlines()[0]) == (0, "key 'ci' was revoked already")

    status, output = await ezat(backend, "keys", "update", "ci", "--unrevoke", "--rpm", "0")
    assert status == 0, output
    assert output.split()[:2] == ["id", "name"]  # usable again: only the table
    await ask(gateway, secret)

    for command in (["keys", "revoke", "nobody"], ["keys", "update", "nobody", "--rpm", "3"]):
        status, output = await ezat(backend, *command)
        assert status == 1, output
        assert "nobody" in output

    assert secret not in caplog.text  # the key never appears in a log line


@pytest.mark.parametrize(
    "option, value, expected",
    [
        (
            "--spend-limit",
            "abc",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not 'abc'",
        ),
        ("--spend-limit", "-1", "expected an amount of USD from 0 to 1,000,000,000,000, or \"none\", not '-1'"),
        (
            "--spend-limit",
            "NaN",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not 'NaN'",
        ),
        (
            "--spend-limit",
            "1e999999",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not '1e999999'",
        ),
        (
            "--spend-limit",
            "5_000",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not '5_000'",
        ),
        (
            "--spend-limit",
            "١٢",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not '١٢'",
        ),
        (
            "--spend-limit",
            "1e3",
            "expected an amount of USD as a plain decimal number such as 12.50, or \"none\", not '1e3'",
        ),
        (
            "--spend-limit",
            "1000000000001",
            "expected an amount of USD from 0 to 1,000,000,000,000, or \"none\", not '1000000000001'",
        ),
        ("--name", "x" * 201, "expected 1 to 200 characters, not 201"),
        ("--name", "invoice\u202eexe.pdf", "expected no control or bidirectional formatting character, not U+202E"),
        ("--name", "two\nlines", "expected no control or bidirectional formatting character, not U+000A"),
        ("--name", "42", "expected a name that is not digits alone (digits are an id)"),
        (
            "--spend-limit",
            "0.0000000001",
            "expected at most 9 decimal places (billionths of a dollar), or \"none\", not '0.0000000001'",
        ),
        ("--rpm", "ten", "expected a whole number from 0 to 9223372036854775807, not 'ten'"),
        ("--tpm", "-5", "expected a whole number from 0 to 9223372036854775807, not '-5'"),
        (
            "--tpm",
            "9223372036854775808",
            "expected a whole number from 0 to 9223372036854775807, not '9223372036854775808'",
        ),
        ("--expires", "next week", "expected an ISO datetime such as 2030-01-31T12:00, or \"never\", not 'next week'"),
    ],
)
async def test_a_bad_option_value_is_a_usage_error(tmp_path, upstream, option, value, expected):
    path = tmp_path / "gateway.toml"
    path.write_text(
        CONFIG.format(
            db=tmp_path / "ezat.db",
            upstream=upstream.url,
            upstream_key=UPSTREAM_KEY,
            model=MODEL,
            upstream_model=UPSTREAM_MODEL,
            config_key=CONFIG_KEY,
        )
    )
    status, output = await run_command(
        "keys", "create", "--name", "x", option, value, "--config", str(path), cwd=tmp_path
    )
    assert status == 2
    assert f"argument {option}: {expected}" in output
    assert "Traceback" not in output


async def test_a_budget_period_without_a_spend_limit_is_refused(backend):
    status, output = await ezat(
        backend, "keys", "create", "--name", "monthly", "--budget-period", "month", "--spend-limit", "5"
    )
    assert status == 0, output
    status, output = await ezat(backend, "keys", "create", "--name", "weekly", "--budget-period", "week")
    assert (status, output) == (
        1,
        "a budget period (week) needs a spend limit to count over: give the key a spend limit too, "
        "or no budget period\n",
    )
    assert "weekly" not in await stored_keys(backend[2])
    status, output = await ezat(backend, "keys", "update", "monthly", "--spend-limit", "none")
    assert (status, output.startswith("a budget period (month) needs a spend limit")) == (1, True), output
    status, output = await ezat(
        backend, "keys", "update", "monthly", "--spend-limit", "none", "--budget-period", "none"
    )
    assert status == 0, output
    key = (await stored_keys(backend[2]))["monthly"]
    assert (key.spend_limit_usd, key.budget_period) == (None, None)


async def test_a_key_taken_out_of_the_config_file_stops_working_at_the_next_start(backend, start_gateway, upstream):
    path = backend[0]
    await ask(await serve(start_gateway, backend), CONFIG_KEY)
    path.write_text(path.read_text().split("[[keys]]")[0])  # the file declares no key any more
    gateway = await serve(start_gateway, backend)
    with pytest.raises(openai.AuthenticationError) as caught:
        await ask(gateway, CONFIG_KEY)
    assert caught.value.body["message"] == "This API key has been revoked."


async def test_a_key_from_the_config_file_is_changed_there_not_by_the_cli(backend, start_gateway, upstream):
    """A change the next start would undo is refused: the file is the key's source of truth."""
    await serve(start_gateway, backend)  # the config's key is in the store
    for args in (("revoke", "cfg"), ("update", "cfg", "--rpm", "5")):
        status, output = await ezat(backend, "keys", *args)
        assert (status, output) == (
            1,
            "key 'cfg' is declared in the config file: change it there (revoked = true to revoke it)\n",
        )
    gateway = await serve(start_gateway, backend)
    await ask(gateway, CONFIG_KEY)  # still usable, unchanged


async def test_usage_of_an_unknown_key_or_since_never_is_said_plainly(backend):
    await create_ci_key(backend)  # a database with a key, not the one asked for
    assert await ezat(backend, "usage", "--key", "nobody") == (1, "no key named 'nobody'\n")
    status, output = await ezat(backend, "usage", "--since", "never")
    assert status == 2
    assert "argument --since: expected an ISO datetime such as 2030-01-31T12:00, not 'never'" in output


@pytest.mark.parametrize(
    "key, said",
    [
        ("nobody", "no key named 'nobody'"),
        ("424242", "no key numbered 424242"),
        ("99999999999999999999", "no key numbered 99999999999999999999"),
        ("²", "no key named '²'"),
    ],
)
async def test_an_unknown_key_name_or_number_is_said_plainly(backend, key, said):
    await create_ci_key(backend)  # a database with a key, not the one asked for
    status, output = await ezat(backend, "keys", "revoke", key)
    assert (status, output) == (1, f"{said}\n")


async def test_a_key_is_found_by_its_id_or_its_name_and_a_shared_name_by_neither(backend, start_gateway):
    _, _, url = backend
    gateway = await serve(start_gateway, backend)  # the config file's key is in the store from here on
    await create_ci_key(backend)
    keys = await stored_keys(url)
    # Digits are an id: a key named so by an older version is reached by its id, never by that name.
    store = open_store(url)
    await store.open()
    try:
        older = await store.create_key("0" * 64, name=str(keys["ci"].id))
    finally:
        await store.close()
    status, output = await ezat(backend, "keys", "update", str(keys["ci"].id), "--rpm", "5")
    assert status == 0, output
    status, output = await ezat(backend, "keys", "update", str(older.id), "--rpm", "7")
    assert status == 0, output
    keys = await stored_keys(url)
    assert (keys["ci"].rpm, keys[str(keys["ci"].id)].rpm, keys["cfg"].rpm) == (5, 7, None)
    # Two keys of one name: neither the commands nor usage pick one of them, and usage by key
    # keeps them apart.
    for _ in range(2):
        status, output = await ezat(backend, "keys", "create", "--name", "dup")
        await ask(gateway, re.findall(r"sk-ezat-[A-Za-z0-9_-]+", output)[0])
    refusal = "2 keys are named 'dup': name one by its id (keys list shows them)\n"
    assert await ezat(backend, "keys", "revoke", "dup") == (1, refusal)
    assert await ezat(backend, "usage", "--key", "dup") == (1, refusal)
    _, keys = await read_store(url)
    assert not any(key.revoked for key in keys)
    status, output = await ezat(backend, "usage", "--by", "key", "--format", "json")
    assert sorted(line["key"] for line in json.loads(output)) == sorted(
        f"dup ({key.id})" for key in keys if key.name == "dup"
    )


async def test_keys_update_changes_expiry_and_models(backend, start_gateway, upstream):
    secret = await create_ci_key(backend, *LIMITS)
    gateway = await serve(start_gateway, backend)
    status, output = await ezat(backend, "keys", "update", "ci", "--models", "test/*", "anthropic/*", "--tpm", "0")
    assert status == 0, output
    await ask(gateway, secret, model="test/small")
    status, output = await ezat(backend, "keys", "update", "ci", "--expires", "2020-01-01T00:00:00")
    assert status == 0, output
    with pytest.raises(openai.AuthenticationError):
        await ask(gateway, secret)
    status, output = await ezat(backend, "keys", "update", "ci", "--expires", "never")
    assert status == 0, output
    await ask(gateway, secret)
    key = (await stored_keys(backend[2]))["ci"]
    assert (key.models, key.tpm, key.expires_at, key.rpm) == (("test/*", "anthropic/*"), None, None, 10)


async def test_keys_and_usage_read_only_the_storage_table(tmp_path, upstream):
    """Managing keys needs the store, not the upstream's secret: only [storage] is interpolated
    and checked, so a deployment's unset ${VAR} does not stop them."""
    db = tmp_path / "ezat.db"
    path = tmp_path / "gateway.toml"
    path.write_text(
        CONFIG.format(
            db="${EZAT_TEST_DB}",
            upstream=upstream.url,
            upstream_key="${SOME_UNSET_VAR}",
            model=MODEL,
            upstream_model=UPSTREAM_MODEL,
            config_key=CONFIG_KEY,
        )
    )
    status, output = await run_command("check-config", str(path), env={"EZAT_TEST_DB": str(db)})
    assert (status, output) == (1, "deployments[0].api_key: environment variable SOME_UNSET_VAR is not set\n")

    async def admin(*args):
        status, output = await run_command(*args, "--config", str(path), env={"EZAT_TEST_DB": str(db)}, cwd=tmp_path)
        assert output.startswith(f"using the database at {db} (SQLite)\n")  # the file [storage] names, interpolated
        return status, USING_THE_DATABASE.sub("", output, count=1)

    status, output = await admin("keys", "create", "--name", "ci")
    assert status == 0, output
    status, listed = await admin("keys", "list")
    assert status == 0, listed
    assert [line.split()[1] for line in listed.splitlines()[1:]] == ["ci"]
    assert list(await stored_keys(f"sqlite:///{db}")) == ["ci"]  # the file [storage] names, interpolated
    status, output = await admin("usage")
    assert (status, output.split()) == (0, ["day", *USAGE_COLUMNS])  # nothing spent yet


@pytest.mark.parametrize(
    "storage, problem",
    [
        ('url = "sqlite:///${EZAT_UNSET_DB}"', "storage.url: environment variable EZAT_UNSET_DB is not set"),
        ('url = "mysql://admin:hunter2@db/x"', "storage.url: expected a sqlite:///, postgresql:// or postgres:// URL"),
        ('uri = "sqlite:///ezat.db"', "storage.uri: unknown key"),
    ],
)
async def test_a_bad_storage_table_is_reported_with_its_key_path(tmp_path, storage, problem):
    path = tmp_path / "gateway.toml"
    path.write_text(f"[storage]\n{storage}\n")
    for command in (("keys", "list"), ("usage",)):
        status, output = await run_command(*command, "--config", str(path), cwd=tmp_path)
        assert (status, output) == (1, f"{path}: invalid config\n  {problem}\n")
    assert list(tmp_path.iterdir()) == [path]  # no database made anywhere


# --- usage

SMALL = "test/small"
CI_USAGE = [  # (model, usage the upstream reports, exact cost at 3/15/3.75/0.30 USD per million)
    (MODEL, {"input_tokens": 1000, "output_tokens": 200}, Decimal("0.006")),
    (
        MODEL,
        {
            "input_tokens": 10,
            "cache_creation_input_tokens": 2000,
            "cache_read_input_tokens": 5000,
            "output_tokens": 50,
            "thinking_tokens": 20,
        },
        Decimal("0.00978"),
    ),
]
CFG_USAGE = [
    (MODEL, {"input_tokens": 7, "output_tokens": 3}, Decimal("0.000066")),
    (SMALL, {"input_tokens": 40, "output_tokens": 9}, Decimal(0)),  # free = true: still counted
]


def totals(rows) -> dict:
    return {
        "requests": len(rows),
        "input_tokens": sum(r.input_tokens for r in rows),
        "cache_write_tokens": sum(r.cache_write_tokens for r in rows),
        "cache_write_1h_tokens": sum(r.cache_write_1h_tokens for r in rows),
        "cache_read_tokens": sum(r.cache_read_tokens for r in rows),
        "output_tokens": sum(r.output_tokens for r in rows),
        "reasoning_tokens": sum(r.reasoning_tokens for r in rows),
        "cost_usd": sum((r.cost_usd for r in rows), Decimal(0)),
    }


def parsed(output: str, format: str, by: str) -> dict:
    """{group: totals} from the command's csv, json or table output (an empty group, as
    requests without a session are in csv and json, is None). Costs: in csv and json exact
    decimals of nine places, read as Decimal; in a table, for people, the text shown."""
    if format == "json":
        lines = json.loads(output)
    elif format == "csv":
        lines = list(csv.DictReader(io.StringIO(output)))
    else:
        header, *rest = output.splitlines()
        # Cells are left-aligned under their column's name: sliced at the names' offsets.
        starts = [match.start() for match in re.finditer(r"\S+", header)]
        lines = [
            {header[start:end].strip(): line[start:end].strip() for start, end in zip(starts, [*starts[1:], None])}
            for line in rest
        ]
    result = {}
    for line in lines:
        assert set(line) == {by, *totals([])}, line
        if format != "table":
            assert re.fullmatch(r"\d+\.\d{9}", line["cost_usd"]), line
        result[line[by] if line[by] not in ("", None) else None] = {
            name: (value if format == "table" else Decimal(value)) if name == "cost_usd" else int(value)
            for name, value in line.items()
            if name != by
        }
    return result


def printed(expected: dict, format: str) -> dict:
    """`expected` as `parsed` reads it back in `format`: a table labels the requests without a
    session, and shows costs to four places ("<0.0001" for less, above 0)."""
    if format != "table":
        return expected
    return {
        "(no session)" if group is None else group: {
            **numbers,
            "cost_usd": "<0.0001" if 0 < numbers["cost_usd"] < Decimal("0.0001") else f"{numbers['cost_usd']:.4f}",
        }
        for group, numbers in expected.items()
    }


async def billed(gateway, secret: str, model: str, usage: dict, upstream) -> None:
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "billed"}], usage=usage))
    await ask(gateway, secret, model=model)


async def test_usage_reports_by_day_model_and_key_in_every_format(backend, start_gateway, upstream):
    _, _, url = backend
    secret = await create_ci_key(backend)
    gateway = await serve(start_gateway, backend)
    for model, usage, _ in CI_USAGE:
        await billed(gateway, secret, model, usage, upstream)
    between = datetime.now(UTC)
    for model, usage, _ in CFG_USAGE:
        await billed(gateway, CONFIG_KEY, model, usage, upstream)

    rows, _ = await read_store(url)
    assert [r.cost_usd for r in rows] == [cost for _, _, cost in CI_USAGE + CFG_USAGE]
    ci_id = (await stored_keys(url))["ci"].id
    ci_rows = [r for r in rows if r.key_id == ci_id]
    cfg_rows = [r for r in rows if r.key_id != ci_id]
    assert totals(rows)["cost_usd"] == Decimal("0.015846")
    assert totals(ci_rows)["reasoning_tokens"] == 20
    days = {r.finished_at.date().isoformat() for r in rows}

    expected = {
        "day": {day: totals([r for r in rows if r.finished_at.date().isoformat() == day]) for day in days},
        "model": {
            MODEL: totals([r for r in rows if r.answered_model == MODEL]),
            SMALL: totals([r for r in rows if r.answered_model == SMALL]),
        },
        "key": {"ci": totals(ci_rows), "cfg": totals(cfg_rows)},
    }
    runs = [(by, format) for by in ("day", "model", "key") for format in ("table", "csv", "json")]
    outputs = await asyncio.gather(*(ezat(backend, "usage", "--by", by, "--format", f) for by, f in runs))
    for (by, format), (status, output) in zip(runs, outputs):
        assert status == 0, output
        assert parsed(output, format, by) == printed(expected[by], format), (by, format, output)

    default_status, default_output = await ezat(backend, "usage")  # --by day --format table
    assert default_status == 0
    assert parsed(default_output, "table", "day") == printed(expected["day"], "table")

    filters = {
        ("--key", "ci"): {"ci": totals(ci_rows)},
        ("--key", str(ci_id)): {"ci": totals(ci_rows)},
        ("--since", between.isoformat()): {"cfg": totals(cfg_rows)},
        ("--since", (between - timedelta(days=1)).date().isoformat()): expected["key"],
        ("--since", (between + timedelta(days=1)).date().isoformat()): {},
        ("--key", "ci", "--since", between.isoformat()): {},
    }
    outputs = await asyncio.gather(
        *(ezat(backend, "usage", *options, "--by", "key", "--format", "json") for options in filters)
    )
    for (options, want), (status, output) in zip(filters.items(), outputs):
        assert status == 0, output
        assert parsed(output, "json", "key") == want, (options, output)


async def test_usage_by_session_adds_up_each_conversations_cost_in_every_format(backend, start_gateway, upstream):
    """Each conversation named by x-ezat-session or prompt_cache_key; the requests that named
    none are one group, last."""
    _, _, url = backend
    secret = await create_ci_key(backend)
    gateway = await serve(start_gateway, backend)
    asked = [  # (key, session options, model, usage)
        (secret, {"extra_headers": {"x-ezat-session": "alpha"}}, *CI_USAGE[0][:2]),
        (secret, {"prompt_cache_key": "beta"}, *CI_USAGE[1][:2]),
        (CONFIG_KEY, {"extra_headers": {"x-ezat-session": "alpha"}}, *CFG_USAGE[0][:2]),
        (CONFIG_KEY, {}, *CFG_USAGE[1][:2]),
    ]
    for key, options, model, usage in asked:
        upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "billed"}], usage=usage))
        async with gateway.client(api_key=key) as client:
            await client.chat.completions.create(
                model=model, max_tokens=20, messages=[{"role": "user", "content": "hi"}], **options
            )
    rows, _ = await read_store(url)
    assert [r.session for r in rows] == ["alpha", "beta", "alpha", None]
    expected = {"alpha": totals([rows[0], rows[2]]), "beta": totals([rows[1]]), None: totals([rows[3]])}
    assert expected["alpha"]["cost_usd"] == CI_USAGE[0][2] + CFG_USAGE[0][2]

    for format in ("table", "csv", "json"):
        status, output = await ezat(backend, "usage", "--by", "session", "--format", format)
        assert status == 0, output
        assert parsed(output, format, "session") == printed(expected, format), (format, output)
        assert list(parsed(output, format, "session")) == list(printed(expected, format))  # the unnamed last
    status, output = await ezat(backend, "usage", "--by", "session", "--key", "ci", "--format", "json")
    assert parsed(output, "json", "session") == {"alpha": totals([rows[0]]), "beta": totals([rows[1]])}
