import base64
import dataclasses
import hashlib
import inspect
import multiprocessing
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.app import build_app
from gateway.config import (
    Config,
    ConfigError,
    Deployment,
    ImagesConfig,
    KeyConfig,
    Model,
    Pricing,
    ResponsesConfig,
    ServerConfig,
    StorageConfig,
    expired_keys,
    load_config,
    load_storage_config,
    parse_config,
    shared_upstream_models,
)
from middlewares.responses.sealing import open_sealed, seal
from tests.support import ServeProcess, run_command

EXAMPLE = """
[server]
host = "127.0.0.1"
port = 8080

[storage]
url = "sqlite:///ezat-gateway.db"

[images]
allow_private_hosts = false

[[deployments]]                      # one Anthropic-format upstream endpoint
name = "anthropic"
base_url = "https://api.anthropic.com"   # the gateway POSTs {base_url}/v1/messages
api_key = "${ANTHROPIC_API_KEY}"

[[models]]
id = "anthropic/claude-sonnet-5-5"   # what clients send
upstream_model = "claude-sonnet-5-5" # what the upstream is sent
deployments = ["anthropic"]          # in preference order
max_output_tokens = 64000
sampling = false
efforts = ["low", "medium", "high", "xhigh", "max"]
forced_tool_choice = true
min_cache_tokens = 1024
pricing = { input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }  # USD per million tokens

[[keys]]                             # `key_sha256` instead of `key` also accepted
key = "sk-local-example"
name = "laptop"
models = ["anthropic/*"]             # optional globs of model ids this key may use
spend_limit_usd = 50.0               # optional
expires_at = 2027-01-01T00:00:00Z    # optional TOML datetime
revoked = false                      # optional
"""

ENV = {"ANTHROPIC_API_KEY": "sk-ant-secret"}

# A valid deployment to hang models off in the smaller configs below.
DEPLOYMENT = """
[[deployments]]
name = "a"
base_url = "https://a.example"
"""

# ...and a model using it, to append one more field to: UNPRICED to give it a pricing, MODEL
# (free, so valid as it is) for anything else.
UNPRICED = DEPLOYMENT + '[[models]]\nid = "m"\ndeployments = ["a"]\n'
MODEL = UNPRICED + "free = true\n"
# The prices besides input, for a pricing table whose input is the point.
OTHER_PRICES = "output = 15, cache_write = 3.75, cache_read = 0.30"

DIGEST = "ab" * 32


def problems_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, env={} if env is None else env)
    return caught.value.problems


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --- Valid configs


def test_full_example_parses_to_exact_values():
    config = parse_config(EXAMPLE, env=ENV)

    assert config.server == ServerConfig(host="127.0.0.1", port=8080)
    assert config.storage == StorageConfig(url="sqlite:///ezat-gateway.db")
    assert config.images == ImagesConfig(allow_private_hosts=False)
    assert config.deployments == (
        Deployment(name="anthropic", base_url="https://api.anthropic.com", api_key="sk-ant-secret"),
    )
    assert config.models == (
        Model(
            id="anthropic/claude-sonnet-5-5",
            upstream_model="claude-sonnet-5-5",
            deployments=("anthropic",),
            max_output_tokens=64000,
            sampling=False,
            efforts=("low", "medium", "high", "xhigh", "max"),
            forced_tool_choice=True,
            min_cache_tokens=1024,
            pricing=Pricing(Decimal("3.0"), Decimal("15.0"), Decimal("3.75"), Decimal("0.30")),
        ),
    )
    assert config.keys == (
        KeyConfig(
            name="laptop",
            key_sha256=sha256("sk-local-example"),
            models=("anthropic/*",),
            spend_limit_usd=Decimal("50.0"),
            expires_at=datetime(2027, 1, 1, tzinfo=UTC),
            revoked=False,
        ),
    )


def test_prices_are_exact_decimals():
    pricing = parse_config(EXAMPLE, env=ENV).models[0].pricing
    # (None: a table of rates the file does not give)
    assert all(type(price) is Decimal for price in dataclasses.astuple(pricing) if price is not None)
    assert pricing.cache_read == Decimal("0.30")  # not 0.299999999999999988897769753748...
    assert str(pricing.cache_write) == "3.75"


def test_plaintext_key_and_api_key_are_not_kept_or_shown():
    config = parse_config(EXAMPLE, env=ENV)
    assert "sk-local-example" not in repr(config)
    assert "sk-ant-secret" not in repr(config)
    assert not hasattr(config.keys[0], "key")


def test_empty_file_gives_all_defaults():
    config = parse_config("", env={})
    assert config == Config()
    assert config.server == ServerConfig(host="127.0.0.1", port=8080)
    assert config.storage.url == "sqlite:///ezat-gateway.db"
    assert config.images.allow_private_hosts is False
    assert (config.deployments, config.models, config.keys) == ((), (), ())


def test_model_and_key_defaults_applied():
    config = parse_config(
        DEPLOYMENT
        + f"""
[[models]]
id = "claude-x"
deployments = ["a"]
free = true

[[keys]]
key_sha256 = "{DIGEST.upper()}"
"""
    )
    assert config.deployments[0].api_key == ""
    assert config.models[0] == Model(
        id="claude-x",
        upstream_model="claude-x",
        deployments=("a",),
        max_output_tokens=64000,
        sampling=False,
        efforts=("low", "medium", "high", "xhigh", "max"),
        forced_tool_choice=True,
        min_cache_tokens=1024,
        pricing=Pricing(Decimal(0), Decimal(0), Decimal(0), Decimal(0)),
        free=True,
    )
    assert config.keys[0] == KeyConfig(
        name="", key_sha256=DIGEST, models=("*",), spend_limit_usd=None, expires_at=None, revoked=False
    )


def test_integers_accepted_for_number_fields():
    config = parse_config(
        DEPLOYMENT
        + """
[[models]]
id = "m"
deployments = ["a"]
pricing = { input = 3, output = 15, cache_write = 4, cache_read = 0 }

[[keys]]
key = "k"
spend_limit_usd = 20
"""
    )
    assert config.models[0].pricing == Pricing(Decimal(3), Decimal(15), Decimal(4), Decimal(0))
    assert config.keys[0].spend_limit_usd == Decimal(20)


def test_datetimes_are_utc():
    config = parse_config("""
[[keys]]
key = "naive"
expires_at = 2027-01-01T12:00:00

[[keys]]
key = "offset"
expires_at = 2027-01-01T12:00:00+02:00
""")
    assert config.keys[0].expires_at == datetime(2027, 1, 1, 12, tzinfo=UTC)
    assert config.keys[1].expires_at == datetime(2027, 1, 1, 10, tzinfo=UTC)
    assert config.keys[1].expires_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:notaport/0", "redis://h:70000", "memcached://h"])
def test_ratelimit_url_is_a_redis_url(url):
    assert problems_of(f'[ratelimit]\nurl = "{url}"') == [
        "ratelimit.url: expected a redis://, rediss:// or unix:// URL"
    ]


@pytest.mark.parametrize("field", ["rpm", "tpm"])
def test_per_minute_limits_fit_the_stores(field):
    key = f'[[keys]]\nkey = "sk-x"\n{field} = '
    assert getattr(parse_config(key + "9223372036854775807").keys[0], field) == 2**63 - 1
    assert problems_of(key + "9223372036854775808") == [
        f"keys[0].{field}: expected a positive integer up to 9223372036854775807"
    ]


def test_the_same_key_twice_is_a_problem_that_does_not_show_it():
    text = '[[keys]]\nkey = "sk-twice"\nname = "a"\n[[keys]]\nkey = "sk-twice"\nname = "b"\n'
    assert problems_of(text) == ["keys[1]: the same key as keys[0]"]


def test_a_list_of_ports_is_a_list_of_integers():
    assert problems_of("[images]\nports = 443") == ["images.ports: expected a list of integers"]


def test_base_url_trailing_slash_removed():
    config = parse_config('[[deployments]]\nname = "a"\nbase_url = "http://localhost:9000/proxy/"\n')
    assert config.deployments[0].base_url == "http://localhost:9000/proxy"


@pytest.mark.parametrize("url", ["sqlite:///ezat.db", "postgresql://u:p@db/gw", "postgres://db/gw"])
def test_storage_url_schemes_accepted(url):
    assert parse_config(f'[storage]\nurl = "{url}"\n').storage.url == url


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_accepted(port):
    assert parse_config(f"[server]\nport = {port}\n").server.port == port


def test_lookups():
    config = parse_config(EXAMPLE, env=ENV)
    assert config.model("anthropic/claude-sonnet-5-5") is config.models[0]
    assert config.model("claude-sonnet-5-5") is config.models[0]  # its upstream_model
    assert config.model("claude-sonnet") is None
    assert config.deployment("anthropic") is config.deployments[0]
    assert config.deployment("other") is None


def test_config_is_frozen():
    config = parse_config(EXAMPLE, env=ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server = ServerConfig()  # type: ignore[misc]


def test_load_config_reads_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-environ")
    path = tmp_path / "gateway.toml"
    path.write_text(EXAMPLE, encoding="utf-8")
    assert load_config(path).deployments[0].api_key == "from-environ"
    assert load_config(str(path)) == load_config(path)


# --- ${ENV_VAR} interpolation


def test_env_interpolated_in_nested_strings_lists_and_inline_tables():
    config = parse_config(
        """
[storage]
url = "postgresql://${DB_USER}:${DB_PASSWORD}@db/${DB_USER}"

[[deployments]]
name = "${DEPLOYMENT}"
base_url = "https://${HOST}"

[[models]]
id = "m"
deployments = ["${DEPLOYMENT}"]
free = true
""",
        env={"DB_USER": "gw", "DB_PASSWORD": "pw", "DEPLOYMENT": "d", "HOST": "h.example"},
    )
    assert config.storage.url == "postgresql://gw:pw@db/gw"
    assert config.deployments[0] == Deployment(name="d", base_url="https://h.example")
    assert config.models[0].deployments == ("d",)


def test_env_value_is_not_expanded_again_and_plain_dollars_are_untouched():
    config = parse_config(
        '[[deployments]]\nname = "$HOME and $"\nbase_url = "https://x"\napi_key = "${KEY}"\n',
        env={"KEY": "${OTHER}"},
    )
    assert config.deployments[0].name == "$HOME and $"
    assert config.deployments[0].api_key == "${OTHER}"


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("EZAT_TEST_HOST", "0.0.0.0")
    assert parse_config('[server]\nhost = "${EZAT_TEST_HOST}"\n').server.host == "0.0.0.0"


def test_missing_env_var_reported_once_per_variable():
    assert problems_of(EXAMPLE) == ["deployments[0].api_key: environment variable ANTHROPIC_API_KEY is not set"]
    assert problems_of('[server]\nhost = "${A}-${B}-${A}"\n', env={"B": "b"}) == [
        "server.host: environment variable A is not set"
    ]


def test_missing_env_var_inside_list_and_inline_table():
    text = UNPRICED.replace('["a"]', '["a", "${D}"]') + f'pricing = {{ input = "${{P}}", {OTHER_PRICES} }}\n'
    assert problems_of(text) == [
        "models[0].deployments[1]: environment variable D is not set",
        "models[0].pricing.input: environment variable P is not set",
    ]


@pytest.mark.parametrize("host", ["${", "${1X}", "${A-B}", "x${A"])
def test_malformed_env_reference(host):
    assert problems_of(f'[server]\nhost = "{host}"\n', env={"A": "a"}) == [
        "server.host: malformed ${...}; expected ${NAME} or ${NAME:-default}, NAME of letters, digits and _"
    ]


@pytest.mark.parametrize("env, host", [({}, "0.0.0.0"), ({"H": ""}, "0.0.0.0"), ({"H": "::1"}, "::1")])
def test_a_reference_with_a_default_takes_it_when_the_variable_is_unset_or_empty(env, host):
    config = parse_config('[server]\nhost = "${H:-0.0.0.0}"\n[storage]\nurl = "sqlite:///${DB:-}x.db"\n', env=env)
    assert (config.server.host, config.storage.url) == (host, "sqlite:///x.db")


# --- Problems, each with its key path


@pytest.mark.parametrize(
    "text, problem",
    [
        ("bogus = 1", "bogus: unknown key"),
        ("[server]\nprot = 8080", "server.prot: unknown key"),
        (DEPLOYMENT + 'regoin = "eu"', "deployments[0].regoin: unknown key"),
        (UNPRICED + f"pricing = {{ input = 1, {OTHER_PRICES}, inptu = 2 }}", "models[0].pricing.inptu: unknown key"),
        ('[[keys]]\nkey = "k"\nrevoke = true', "keys[0].revoke: unknown key"),
    ],
)
def test_unknown_keys_rejected(text, problem):
    assert problems_of(text) == [problem]


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[server]\nport = "8080"', "server.port: expected an integer"),
        ("[server]\nport = true", "server.port: expected an integer"),
        ("[server]\nport = 80.0", "server.port: expected an integer"),
        ("[server]\nhost = 1", "server.host: expected a string"),
        ('[images]\nallow_private_hosts = "no"', "images.allow_private_hosts: expected true or false"),
        ('server = "x"', "server: expected a table"),
        ("[deployments]\nname = 'a'", "deployments: expected an array of tables"),
        ("deployments = [1]", "deployments[0]: expected a table"),
        (MODEL.replace('["a"]', '"a"'), "models[0].deployments: expected a list of strings"),
        (MODEL.replace('["a"]', '["a", 2]'), "models[0].deployments[1]: expected a string"),
        (MODEL + "sampling = 0", "models[0].sampling: expected true or false"),
        (MODEL + "max_output_tokens = 1.5", "models[0].max_output_tokens: expected an integer"),
        (MODEL + "efforts = 'high'", "models[0].efforts: expected a list of strings"),
        (UNPRICED + "pricing = 3", "models[0].pricing: expected a table"),
        (UNPRICED + f'pricing = {{ input = "3", {OTHER_PRICES} }}', "models[0].pricing.input: expected a number"),
        (UNPRICED + f"pricing = {{ input = true, {OTHER_PRICES} }}", "models[0].pricing.input: expected a number"),
        (UNPRICED + f"pricing = {{ input = nan, {OTHER_PRICES} }}", "models[0].pricing.input: expected a number"),
        # A bad free or min_cache_tokens is reported once, not also as a pricing missing.
        (UNPRICED + 'free = "yes"', "models[0].free: expected true or false"),
        (
            UNPRICED + 'min_cache_tokens = "1024"\npricing = { input = 3, output = 15 }',
            "models[0].min_cache_tokens: expected an integer",
        ),
        ('[[keys]]\nkey = "k"\nspend_limit_usd = "50"', "keys[0].spend_limit_usd: expected a number"),
        (
            '[[keys]]\nkey = "k"\nexpires_at = "2027-01-01T00:00:00Z"',
            "keys[0].expires_at: expected an unquoted datetime such as 2027-01-01T00:00:00Z",
        ),
        (
            '[[keys]]\nkey = "k"\nexpires_at = 2027-01-01',
            "keys[0].expires_at: expected an unquoted datetime such as 2027-01-01T00:00:00Z",
        ),
        ('[[keys]]\nkey = "k"\nrevoked = "yes"', "keys[0].revoked: expected true or false"),
        ('[[keys]]\nkey = "k"\nmodels = "*"', "keys[0].models: expected a list of strings"),
        ("[[keys]]\nkey = 5", "keys[0].key: expected a non-empty string"),
        ('[[keys]]\nkey = ""', "keys[0].key: expected a non-empty string"),
        ("[[keys]]\nkey_sha256 = 5", "keys[0].key_sha256: expected a string"),
    ],
)
def test_wrong_types(text, problem):
    assert problems_of(text) == [problem]


def test_required_fields():
    assert problems_of("[[deployments]]\n[[models]]\n") == [
        "deployments[0].name: required",
        "deployments[0].base_url: required",
        "models[0].id: required",
        "models[0].deployments: required",
        "models[0].pricing: required (or free = true for a model that costs nothing)",
    ]


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_port_out_of_range(port):
    assert problems_of(f"[server]\nport = {port}") == ["server.port: expected an integer from 1 to 65535"]


@pytest.mark.parametrize(
    "url",
    [
        "ftp://a.example",
        "api.anthropic.com",
        "https://",
        "https:///v1",
        "",
        "http://[::1",
        "http://127.0.0.1:99999",
        "http://host:port",
    ],
)
def test_base_url_must_be_http_with_host(url):
    text = f'[[deployments]]\nname = "a"\nbase_url = "{url}"'
    assert problems_of(text) == ["deployments[0].base_url: expected an http(s) URL with a host"]


@pytest.mark.parametrize(
    "url",
    ["mysql://db/gw", "sqlite://relative.db", "ezat.db", "postgresql:/x", "sqlite:///", "postgresql://db:notaport/gw"],
)
def test_storage_url_scheme(url):
    assert problems_of(f'[storage]\nurl = "{url}"') == [
        "storage.url: expected a sqlite:///, postgresql:// or postgres:// URL"
    ]


def test_empty_names_rejected():
    text = '[server]\nhost = ""\n[[deployments]]\nname = ""\nbase_url = "https://a"\n'
    text += '[[models]]\nid = ""\nupstream_model = ""\ndeployments = [""]\nfree = true\n'
    assert problems_of(text) == [
        "server.host: expected a non-empty string",
        "deployments[0].name: expected a non-empty string",
        "models[0].id: expected a non-empty string",
        "models[0].upstream_model: expected a non-empty string",
    ]


def test_model_number_and_effort_checks():
    text = (
        DEPLOYMENT
        + """
[[models]]
id = "m"
deployments = ["a"]
max_output_tokens = 0
min_cache_tokens = -5
efforts = ["low", "ultra", "max", "High"]
pricing = { input = -1, output = 15, cache_write = -0.01, cache_read = 0 }
"""
    )
    assert problems_of(text) == [
        "models[0].max_output_tokens: expected a positive integer",
        "models[0].efforts[1]: expected one of low, medium, high, xhigh, max",
        "models[0].efforts[3]: expected one of low, medium, high, xhigh, max",
        "models[0].min_cache_tokens: expected 0 or a positive integer",
        "models[0].pricing.input: expected a non-negative number",
        "models[0].pricing.cache_write: expected a non-negative number",
    ]


def test_model_deployment_references():
    text = (
        DEPLOYMENT
        + """
[[models]]
id = "m1"
deployments = ["a", "x"]
free = true

[[models]]
id = "m2"
deployments = []
free = true
"""
    )
    assert problems_of(text) == [
        "models[1].deployments: expected at least one deployment name",
        'models[0].deployments[1]: no deployment named "x"',
    ]


def test_references_checked_even_when_the_model_has_other_problems():
    text = MODEL.replace('["a"]', '["nope"]') + "max_output_tokens = 0"
    assert problems_of(text) == [
        "models[0].max_output_tokens: expected a positive integer",
        'models[0].deployments[0]: no deployment named "nope"',
    ]


def test_references_not_checked_against_a_deployment_whose_name_is_bad():
    # The reference may well be to that deployment, so only its name is reported.
    text = '[[deployments]]\nbase_url = "https://a"\n[[models]]\nid = "m"\ndeployments = ["a"]\nfree = true\n'
    assert problems_of(text) == ["deployments[0].name: required"]


def test_duplicate_deployment_names_and_model_ids():
    text = (
        DEPLOYMENT
        + DEPLOYMENT
        + """
[[models]]
id = "m"
deployments = ["a"]
free = true

[[models]]
id = "m"
deployments = ["a"]
free = true
"""
    )
    assert problems_of(text) == [
        'deployments[1].name: duplicate deployment name "a"',
        'models[1].id: duplicate model id "m"',
    ]


def test_names_follow_the_rule_the_admin_commands_follow():
    # Keys', organizations' and admin tokens' names, as the CLI, the admin API and the console
    # check them (gateway.config.name_problem), each reported with its key path.
    text = (
        '[[organizations]]\nname = "42"\n'
        f'[[keys]]\nkey = "k"\nname = "evil\u202etxt.exe"\n'
        f'[[keys]]\nkey = "j"\nname = "{"n" * 201}"\n'
        f'[admin]\ntokens = [{{ name = "7", role = "admin", token_sha256 = "{DIGEST}" }}]\n'
    )
    assert problems_of(text) == [
        "organizations[0].name: expected a name that is not digits alone (digits are an id)",
        "keys[0].name: expected no control or bidirectional formatting character, not U+202E",
        "keys[1].name: expected 1 to 200 characters, not 201",
        "admin.tokens[0].name: expected a name that is not digits alone (digits are an id)",
    ]


def test_a_key_may_have_no_name_and_names_of_200_characters_pass():
    config = parse_config(
        f'[[keys]]\nkey = "k"\n[[keys]]\nkey = "j"\nname = ""\n[[keys]]\nkey = "i"\nname = "{"n" * 200}"\n'
    )
    assert [key.name for key in config.keys] == ["", "", "n" * 200]


def test_a_budget_period_needs_a_spend_limit_as_in_the_admin_api():
    text = '[[keys]]\nkey = "k"\nbudget_period = "month"\n[[keys]]\nkey = "j"\nbudget_period = "day"\nspend_limit_usd = 5\n'
    assert problems_of(text) == [
        "keys[0].budget_period: a budget period (month) needs a spend limit to count over: "
        "give the key a spend limit too, or no budget period"
    ]
    # A spend limit already reported as bad adds no second problem.
    text = '[[keys]]\nkey = "k"\nbudget_period = "month"\nspend_limit_usd = -1\n'
    assert problems_of(text) == ["keys[0].spend_limit_usd: expected an amount of USD from 0 to 1,000,000,000,000"]


def test_key_and_key_sha256_exactly_one():
    text = f'[[keys]]\nname = "neither"\n[[keys]]\nkey = "k"\nkey_sha256 = "{DIGEST}"\n'
    assert problems_of(text) == [
        "keys[0]: expected exactly one of key or key_sha256",
        "keys[1]: expected exactly one of key or key_sha256",
    ]


@pytest.mark.parametrize("digest", ["abc", "g" * 64, DIGEST + "0", ""])
def test_bad_key_sha256(digest):
    problems = problems_of(f'[[keys]]\nkey_sha256 = "{digest}"')
    assert problems == ["keys[0].key_sha256: expected 64 hex characters"]


def test_negative_spend_limit():
    assert problems_of('[[keys]]\nkey = "k"\nspend_limit_usd = -0.5') == [
        "keys[0].spend_limit_usd: expected an amount of USD from 0 to 1,000,000,000,000"
    ]


def test_all_problems_reported_together():
    text = """
[server]
port = 0
prot = 1

[storage]
url = "mysql://db"

[[deployments]]
name = "a"
base_url = "ftp://a"
api_key = "${MISSING_KEY}"

[[models]]
id = "m"
deployments = ["a", "b"]
max_output_tokens = -1
pricing = { output = -15 }

[[keys]]
key_sha256 = "xyz"
spend_limit_usd = -1
"""
    error = pytest.raises(ConfigError, parse_config, text, env={}).value
    expected = [
        "deployments[0].api_key: environment variable MISSING_KEY is not set",
        "server.prot: unknown key",
        "server.port: expected an integer from 1 to 65535",
        "storage.url: expected a sqlite:///, postgresql:// or postgres:// URL",
        "deployments[0].base_url: expected an http(s) URL with a host",
        "models[0].max_output_tokens: expected a positive integer",
        "models[0].pricing.output: expected a non-negative number",
        "models[0].pricing.input: required",
        "models[0].pricing.cache_write: required while the model caches (min_cache_tokens > 0)",
        "models[0].pricing.cache_read: required while the model caches (min_cache_tokens > 0)",
        "keys[0].key_sha256: expected 64 hex characters",
        "keys[0].spend_limit_usd: expected an amount of USD from 0 to 1,000,000,000,000",
        'models[0].deployments[1]: no deployment named "b"',
    ]
    assert error.problems == expected
    assert str(error) == "\n".join(expected)


def test_a_bad_value_is_reported_once():
    # A missing id is one problem, not also one for the upstream_model derived from it,
    # and a missing env var is not also reported as a bad URL.
    text = '[[deployments]]\nname = "a"\nbase_url = "${URL}"\n[[models]]\ndeployments = ["a"]\nfree = true\n'
    assert problems_of(text) == [
        "deployments[0].base_url: environment variable URL is not set",
        "models[0].id: required",
    ]


# --- Pricing: no model costs nothing by omission


PRICED = UNPRICED + "pricing = { input = 3, output = 15, cache_write = 3.75, cache_read = 0.30 }\n"


@pytest.mark.parametrize(
    "model, problems",
    [
        (UNPRICED, ["models[0].pricing: required (or free = true for a model that costs nothing)"]),
        (UNPRICED + "free = false", ["models[0].pricing: required (or free = true for a model that costs nothing)"]),
        (
            UNPRICED + "pricing = {}",
            [
                "models[0].pricing.input: required",
                "models[0].pricing.output: required",
                "models[0].pricing.cache_write: required while the model caches (min_cache_tokens > 0)",
                "models[0].pricing.cache_read: required while the model caches (min_cache_tokens > 0)",
            ],
        ),
        (
            UNPRICED + "pricing = { input = 3, output = 15, cache_write = 3.75 }",
            [
                "models[0].pricing.cache_read: required while the model caches (min_cache_tokens > 0)",
            ],
        ),
        (
            UNPRICED + "min_cache_tokens = 2048\npricing = { input = 3, output = 15 }",
            [
                "models[0].pricing.cache_write: required while the model caches (min_cache_tokens > 0)",
                "models[0].pricing.cache_read: required while the model caches (min_cache_tokens > 0)",
            ],
        ),
        (UNPRICED + "min_cache_tokens = 0\npricing = { output = 15 }", ["models[0].pricing.input: required"]),
        (
            UNPRICED + "[models.pricing]\ninput = 3\ncache_read = 0.3\n",
            [
                "models[0].pricing.output: required",
                "models[0].pricing.cache_write: required while the model caches (min_cache_tokens > 0)",
            ],
        ),
        (PRICED + "free = true", ["models[0].pricing: not with free = true (a free model costs nothing)"]),
    ],
)
def test_a_model_needs_its_prices_or_says_it_is_free(model, problems):
    assert problems_of(model) == problems


def test_each_model_is_checked_with_its_own_path():
    text = PRICED + '[[models]]\nid = "n"\ndeployments = ["a"]\n'
    assert problems_of(text) == ["models[1].pricing: required (or free = true for a model that costs nothing)"]


def test_a_free_model_costs_nothing():
    (model,) = parse_config(MODEL).models
    assert model.free is True
    assert model.pricing == Pricing(Decimal(0), Decimal(0), Decimal(0), Decimal(0), web_search_per_1000=Decimal(0))


def test_prices_written_as_0_are_accepted():
    (model,) = parse_config(UNPRICED + "pricing = { input = 0, output = 0, cache_write = 0, cache_read = 0 }").models
    assert model.free is False
    assert model.pricing == Pricing(Decimal(0), Decimal(0), Decimal(0), Decimal(0))


def test_a_model_without_a_prompt_cache_needs_no_cache_prices():
    (model,) = parse_config(UNPRICED + "min_cache_tokens = 0\npricing = { input = 1, output = 5 }").models
    assert model.pricing == Pricing(Decimal(1), Decimal(5), Decimal(0), Decimal(0))


def test_a_priced_model_in_a_pricing_table():
    (model,) = parse_config(
        UNPRICED + "[models.pricing]\ninput = 3\noutput = 15\ncache_write = 3.75\ncache_read = 0.3\n"
    ).models
    assert model.pricing == Pricing(Decimal(3), Decimal(15), Decimal("3.75"), Decimal("0.3"))


async def test_check_config_refuses_an_unpriced_model(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(UNPRICED + "pricing = { input = 3, output = 15 }\n", encoding="utf-8")
    status, output = await run_command("check-config", str(path), cwd=tmp_path)
    assert (status, output.splitlines()) == (
        1,
        [
            "models[0].pricing.cache_write: required while the model caches (min_cache_tokens > 0)",
            "models[0].pricing.cache_read: required while the model caches (min_cache_tokens > 0)",
        ],
    )
    with pytest.raises(ConfigError):
        load_config(path)


# --- Upstream model names


def models(*entries: tuple[str, str, tuple[str, ...]]) -> str:
    """Free models on deployment a: (id, upstream_model, aliases) each."""
    return DEPLOYMENT + "".join(
        f'[[models]]\nid = "{id}"\nupstream_model = "{upstream}"\naliases = {list(aliases)!r}\n'
        f'deployments = ["a"]\nfree = true\n'.replace("'", '"')
        for id, upstream, aliases in entries
    )


def test_a_model_answers_to_its_upstream_model_name():
    config = parse_config(
        models(
            ("anthropic/claude-haiku-4-5", "claude-haiku-4-5", ()),
            ("anthropic/claude-haiku-4-5-dated", "claude-haiku-4-5-20251001", ()),
        )
    )
    haiku, dated = config.models
    assert config.model("claude-haiku-4-5") is haiku
    assert config.model("claude-haiku-4-5-20251001") is dated
    assert shared_upstream_models(config) == []


def test_another_models_id_or_alias_keeps_its_name():
    config = parse_config(
        models(
            ("anthropic/haiku", "claude-haiku-4-5", ()),  # sent upstream by both
            ("claude-haiku-4-5", "claude-haiku-4-5", ()),  # ...and this one's id
            ("anthropic/sonnet", "claude-sonnet-5-5", ()),
            ("team/sonnet", "claude-sonnet-5-5-20260101", ("claude-sonnet-5-5",)),
        )
    )
    haiku, named_haiku, sonnet, team = config.models
    assert config.model("claude-haiku-4-5") is named_haiku
    assert config.model("claude-sonnet-5-5") is team  # an alias, over another model's upstream name
    assert config.model("claude-sonnet-5-5-20260101") is team and config.model("anthropic/sonnet") is sonnet
    assert shared_upstream_models(config) == []  # each name finds a model: nothing to warn of


def test_an_upstream_model_name_several_models_share_names_none_of_them():
    config = parse_config(
        models(
            ("anthropic/claude-haiku-4-5", "claude-haiku-4-5", ()),
            ("anthropic/claude-sonnet-5-5", "claude-sonnet-5-5", ()),
            ("cheap/haiku", "claude-haiku-4-5", ()),
            ("batch/haiku", "claude-haiku-4-5", ()),
        )
    )
    assert config.model("claude-haiku-4-5") is None
    assert config.model("claude-sonnet-5-5") is config.models[1]
    assert [config.model(m.id) for m in config.models] == list(config.models)
    assert shared_upstream_models(config) == [
        'models[0].upstream_model: "claude-haiku-4-5" is also models[2] and models[3]\'s; requests for it get 404'
        " (an alias of that name on one of them picks it)"
    ]


async def test_check_config_warns_of_an_upstream_model_name_that_names_no_model(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        models(("anthropic/claude-haiku-4-5", "claude-haiku-4-5", ()), ("cheap/haiku", "claude-haiku-4-5", ())),
        encoding="utf-8",
    )
    status, output = await run_command("check-config", str(path), cwd=tmp_path)
    assert (status, output.splitlines()) == (
        0,
        [  # a warning: the file is valid
            f"{path}: ok (1 deployment, 2 models, 0 keys)",
            'models[0].upstream_model: "claude-haiku-4-5" is also models[1]\'s; requests for it get 404'
            " (an alias of that name on one of them picks it)",
        ],
    )
    # An alias of that name on one of them takes it, and the warning goes.
    path.write_text(
        models(
            ("anthropic/claude-haiku-4-5", "claude-haiku-4-5", ("claude-haiku-4-5",)),
            ("cheap/haiku", "claude-haiku-4-5", ()),
        ),
        encoding="utf-8",
    )
    assert await run_command("check-config", str(path), cwd=tmp_path) == (
        0,
        f"{path}: ok (1 deployment, 2 models, 0 keys)\n",
    )


# --- Reading files


def test_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[server]\nport = \n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [problem] = caught.value.problems
    assert problem.startswith(f"{path}: invalid TOML: ")
    assert "line 2" in problem


def test_toml_syntax_error_from_text():
    [problem] = problems_of("[server\n")
    assert problem.startswith("invalid TOML: ")


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{path}: cannot read file: No such file or directory"]


def test_undecodable_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[server]\nhost = "caf\xe9"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [problem] = caught.value.problems
    assert problem.startswith(f"{path}: cannot read file: ")


def test_problems_in_a_file_use_key_paths(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 70000\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ["server.port: expected an integer from 1 to 65535"]


# --- Only [storage], for `keys` and `usage`


def test_load_storage_config_reads_and_interpolates_only_the_storage_table(tmp_path, monkeypatch):
    monkeypatch.setenv("EZAT_TEST_DB_HOST", "db.internal")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    path = tmp_path / "gateway.toml"
    # The rest would not load: ${ANTHROPIC_API_KEY} is unset and max_attempts is out of range.
    text = EXAMPLE.replace("sqlite:///ezat-gateway.db", "postgresql://gw@${EZAT_TEST_DB_HOST}/gw")
    path.write_text(text + "\n[routing]\nmax_attempts = 0\n", encoding="utf-8")
    assert load_storage_config(path) == StorageConfig(url="postgresql://gw@db.internal/gw")
    with pytest.raises(ConfigError):
        load_config(path)


def test_load_storage_config_without_a_storage_table_gives_the_default(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(DEPLOYMENT, encoding="utf-8")
    assert load_storage_config(path) == StorageConfig(url="sqlite:///ezat-gateway.db")


@pytest.mark.parametrize(
    "text, problem",
    [
        ('storage = "sqlite:///x.db"', "storage: expected a table"),
        ("[storage]\nurl = 5", "storage.url: expected a string"),
    ],
)
def test_load_storage_config_problems_use_key_paths(tmp_path, text, problem):
    path = tmp_path / "gateway.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_storage_config(path)
    assert caught.value.problems == [problem]


def test_load_storage_config_still_needs_the_whole_file_to_be_toml(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('[storage]\nurl = "sqlite:///x.db"\n[server\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_storage_config(path)
    [problem] = caught.value.problems
    assert problem.startswith(f"{path}: invalid TOML: ")


# --- Expired keys: valid, but worth a warning


def test_expired_keys_names_the_entry_not_the_key():
    config = parse_config("""
[[keys]]
key = "sk-open-ended"

[[keys]]
key = "sk-expires-now"
name = "bob"
expires_at = 2026-03-01T00:00:00Z

[[keys]]
key = "sk-not-yet"
expires_at = 2026-03-01T00:00:01Z
""")
    now = datetime(2026, 3, 1, tzinfo=UTC)  # the moment it expires, a key is refused
    assert expired_keys(config, now) == [
        "keys[1] (bob): expired at 2026-03-01T00:00:00+00:00; requests with it get 401"
    ]


def test_the_deadlines_default_to_what_the_docs_promise():
    """A connection idle (or its headers unfinished) for 75 s, a body unfinished after 60 s, a
    client not reading for 30 s; an upstream connecting for 10 s, a stream's first output after
    300 s, its silence for 60 s or its running 30 minutes; an image download 15 s; a
    non-streamed request 590 s (the 504 the error table names)."""
    config = parse_config('[[deployments]]\nname = "d"\nbase_url = "https://api.anthropic.com"\n')
    server, deployment = config.server, config.deployments[0]
    assert (server.keepalive_timeout_seconds, server.body_timeout_seconds, server.write_timeout_seconds) == (75, 60, 30)
    assert (deployment.connect_timeout_seconds, deployment.first_token_timeout_seconds) == (10, 300)
    assert (deployment.stream_idle_timeout_seconds, deployment.max_stream_duration_seconds) == (60, 1800)
    assert config.images.timeout_seconds == 15
    assert inspect.signature(build_app).parameters["non_streaming_deadline"].default == 590


# --- [responses]

REASONING_KEY = bytes(range(32))


def test_responses_defaults_keep_a_month_and_seal_with_a_key_of_this_process():
    responses = parse_config("").responses
    assert (responses.retention_days, responses.reasoning_key) == (30, "")
    assert len(responses.sealing_key) == 32
    assert parse_config("[responses]\nretention_days = 7\n").responses.sealing_key == responses.sealing_key
    # Another process (a replica, the gateway restarted) has another.
    elsewhere = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gateway.config import parse_config; print(parse_config('').responses.sealing_key.hex())",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert bytes.fromhex(elsewhere.stdout.strip()) != responses.sealing_key


@pytest.mark.parametrize(
    "written",
    [
        base64.b64encode(REASONING_KEY).decode(),  # openssl rand -base64 32
        base64.b64encode(REASONING_KEY).decode().rstrip("="),
        base64.urlsafe_b64encode(REASONING_KEY).decode(),
        REASONING_KEY.hex(),  # openssl rand -hex 32
        REASONING_KEY.hex().upper(),
        REASONING_KEY.hex() + "\n",  # a file read into the variable, newline and all
    ],
)
def test_a_reasoning_key_as_base64_or_hex_from_the_environment(written):
    config = parse_config(
        '[responses]\nretention_days = 0\nreasoning_key = "${EZAT_REASONING_KEY}"\n',
        env={"EZAT_REASONING_KEY": written},
    )
    assert config.responses.retention_days == 0
    assert parse_config("[responses]\nretention_days = 36500").responses.retention_days == 36500  # a century
    assert config.responses.sealing_key == REASONING_KEY
    # It is the key that seals and opens reasoning items.
    blocks = [{"type": "thinking", "thinking": "t", "signature": "s"}]
    assert open_sealed(seal(blocks, config.responses.sealing_key, 7), REASONING_KEY, 7) == blocks


def test_the_reasoning_key_is_kept_out_of_the_configs_repr():
    config = parse_config(f'[responses]\nreasoning_key = "{REASONING_KEY.hex()}"\n')
    for shown in (repr(config), repr(config.responses), str(config)):
        assert REASONING_KEY.hex() not in shown and repr(REASONING_KEY) not in shown
        assert "reasoning_key" not in shown


def sealing_key_of(config, answer) -> None:
    answer.put(config.responses.sealing_key)


def test_the_workers_get_their_processs_reasoning_key_with_the_config():
    # serve hands its config to each worker it spawns: the key made for the serving process holds
    # in all its workers, though each would make another of its own.
    config = parse_config("")
    spawn = multiprocessing.get_context("spawn")
    answer = spawn.Queue()
    worker = spawn.Process(target=sealing_key_of, args=(config, answer))
    worker.start()
    try:
        assert answer.get(timeout=30) == config.responses.sealing_key
    finally:
        worker.join(timeout=30)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[responses]\nretention_days = -1", "responses.retention_days: expected an integer from 0 to 36500"),
        ("[responses]\nretention_days = 36501", "responses.retention_days: expected an integer from 0 to 36500"),
        ('[responses]\nretention_days = "30"', "responses.retention_days: expected an integer"),
        ("[responses]\nretention_days = 1.5", "responses.retention_days: expected an integer"),
        ("[responses]\nreasoning_key = 5", "responses.reasoning_key: expected a string"),
        ("[responses]\nretention = 30", "responses.retention: unknown key"),
        ('responses = "keep"', "responses: expected a table"),
    ],
)
def test_responses_problems_name_their_key_path(text, problem):
    assert problems_of(text) == [problem]


@pytest.mark.parametrize(
    "written",
    [
        "secret",
        base64.b64encode(bytes(16)).decode(),  # AES-128's: too short
        base64.b64encode(bytes(33)).decode(),
        REASONING_KEY.hex()[:-1],
        REASONING_KEY.hex() + "0",
        "zz" * 32,
        base64.b64encode(REASONING_KEY).decode() + "!",
    ],
)
def test_an_unusable_reasoning_key_is_refused_without_showing_it(written):
    [problem] = problems_of('[responses]\nreasoning_key = "${KEY}"', env={"KEY": written})
    assert problem == (
        "responses.reasoning_key: expected 32 bytes as base64 (openssl rand -base64 32) or as 64 hex digits"
        " (openssl rand -hex 32)"
    )
    assert written not in problem


def test_a_reasoning_key_made_in_code_is_checked_too():
    with pytest.raises(ValueError, match="expected 32 bytes"):
        ResponsesConfig(reasoning_key="secret")
    assert ResponsesConfig(reasoning_key=REASONING_KEY.hex()).sealing_key == REASONING_KEY


REPLICAS_WARNING = (
    "responses.reasoning_key: not set, so each replica (and each start) seals reasoning items with a random key of"
    " its own, and replicas (or restarts) cannot open each other's: a conversation continued elsewhere loses its"
    ' reasoning; give every replica the same key (reasoning_key = "${EZAT_REASONING_KEY}", from openssl rand'
    " -base64 32)"
)


@pytest.mark.parametrize(
    "tables, warned",
    [
        ('[storage]\nurl = "postgresql://ezat@db.internal/ezat"\n', True),
        ('[ratelimit]\nurl = "redis://127.0.0.1:6379/0"\n', True),
        (f'[storage]\nurl = "postgresql://ezat@db.internal/ezat"\n[responses]\nreasoning_key = "{"ab" * 32}"\n', False),
        ('[storage]\nurl = "sqlite:///one-process.db"\n', False),  # one process: only a restart changes its key
    ],
)
async def test_check_config_warns_of_replicas_without_a_shared_reasoning_key(tmp_path, tables, warned):
    path = tmp_path / "gateway.toml"
    path.write_text(tables + MODEL, encoding="utf-8")
    status, output = await run_command("check-config", str(path), cwd=tmp_path)
    assert (status, output.splitlines()) == (
        0,  # a warning: the file is valid
        [f"{path}: ok (1 deployment, 1 model, 0 keys)", *([REPLICAS_WARNING] if warned else [])],
    )


async def test_the_demo_keeps_its_reasoning_key_beside_its_database_across_restarts(tmp_path):
    key_file = tmp_path / "ezat-reasoning.key"
    served = ServeProcess(tmp_path)  # no config file: the embedded demo
    try:
        await served.start("--port", str(served.port))
    finally:
        await served.stop()
    assert served.process.returncode == 0
    kept = key_file.read_text()
    assert len(base64.b64decode(kept.strip(), validate=True)) == 32
    assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only, as its local key

    restarted = ServeProcess(tmp_path, "restarted")
    try:
        await restarted.start("--port", str(restarted.port))
    finally:
        await restarted.stop()
    assert restarted.process.returncode == 0
    assert key_file.read_text() == kept  # the same key: what it sealed before still opens

    key_file.write_text("not a key\n")  # spoilt by hand: a new one replaces it
    spoilt = ServeProcess(tmp_path, "spoilt")
    try:
        await spoilt.start("--port", str(spoilt.port))
    finally:
        await spoilt.stop()
    assert spoilt.process.returncode == 0
    assert "ezat-reasoning.key holds no usable key" in spoilt.log.read_text()
    assert len(base64.b64decode(key_file.read_text().strip(), validate=True)) == 32
