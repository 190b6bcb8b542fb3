"""Load and validate the gateway's TOML config file.

The dataclasses below drive validation: a field's type says what the file may hold there, and
field metadata adds checks. Every problem is collected, each prefixed with its key path
(`models[1].pricing.input`), so an operator can fix the whole file in one pass.
"""

import base64
import binascii
import dataclasses
import hashlib
import ipaddress
import json
import math
import os
import re
import secrets
import tomllib
import unicodedata
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from functools import cached_property
from pathlib import Path
from typing import Any, get_args, get_origin
from urllib.parse import urlsplit

from middlewares.bounds import DEFAULT_BOUNDS
from middlewares.core.periods import PERIODS
from middlewares.core.sizes import MiB
from middlewares.images import DEFAULT_LIMITS as IMAGES

EFFORTS = ("low", "medium", "high", "xhigh", "max")


class ConfigError(Exception):
    """The config is unusable; `problems` holds every reason, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# The largest rpm or tpm: the stores keep them as 64-bit integers.
MAX_PER_MINUTE = 2**63 - 1
# Stands in for a value whose problem is already reported, so it is not reported twice.
_INVALID: Any = object()


# --- Field checks: each takes a converted value and returns a problem message, or None if fine.


def _rule(is_fine: Callable[[Any], bool], problem: str) -> Callable[[Any], str | None]:
    return lambda value: None if is_fine(value) else problem


_port = _rule(lambda v: 1 <= v <= 65535, "expected an integer from 1 to 65535")
_positive = _rule(lambda v: v > 0, "expected a positive integer")
_per_minute = _rule(lambda v: 0 < v <= MAX_PER_MINUTE, f"expected a positive integer up to {MAX_PER_MINUTE}")
_non_negative = _rule(lambda v: v >= 0, "expected a non-negative number")
MAX_USD = Decimal(10**12)  # the most a spend limit, a balance or a top-up may be


def usd_problem(amount: Decimal) -> str | None:
    """Why `amount` cannot be a spend limit, a balance or a top-up, or None: the stores keep
    amounts exactly, and reservations count billionths of a dollar."""
    if not amount.is_finite() or not 0 <= amount <= MAX_USD:
        return f"expected an amount of USD from 0 to {MAX_USD:,}"
    exponent = amount.normalize().as_tuple().exponent
    assert isinstance(exponent, int)  # an amount that is finite has one (not "n", "N" or "F")
    if exponent < -9:
        return "expected at most 9 decimal places (billionths of a dollar)"
    return None


# Digits, a point and digits, in ASCII: Decimal() would also read "5_000", "1e3" and other
# scripts' digits ("١٢"), which no one writing an amount means.
PLAIN_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def usd(text: str) -> Decimal:
    """An amount of USD as a person or a script writes it (the CLI, the admin API, the console):
    a plain decimal number; ValueError saying what was expected otherwise."""
    text = text.strip()
    if not PLAIN_DECIMAL.fullmatch(text):
        raise ValueError("expected an amount of USD as a plain decimal number such as 12.50")
    amount = Decimal(text)
    problem = usd_problem(amount)
    if problem is not None:
        raise ValueError(problem)
    return amount


MAX_NAME = 200  # characters
# The characters that reorder the text around them (Unicode's bidirectional formatting
# characters): a name holding one can show as another name in a table or a page.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
NOT_TEXT = ("Cc", "Cs", "Zl", "Zp")  # controls, lone surrogates, line and paragraph separators


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a key, an organization or an admin token, or None: the one rule of
    the config file, the CLI, the admin API and the console. A name is shown in tables, pages and
    logs, so it is short and one line, reorders nothing and has no space at either end (which
    no one sees); it is given back where an id may stand, so digits alone, which would read as an
    id, are refused. Every caller takes a name as given: none trims it."""
    if not 0 < len(name) <= MAX_NAME:
        return f"expected 1 to {MAX_NAME} characters, not {len(name)}"
    for char in name:
        if char in BIDI_CONTROLS or unicodedata.category(char) in NOT_TEXT:
            return f"expected no control or bidirectional formatting character, not U+{ord(char):04X}"
    if name != name.strip():  # "alice " beside "alice" in a table: two names that look like one
        return "expected no space at either end"
    if is_id(name):
        return "expected a name that is not digits alone (digits are an id)"
    return None


def is_id(ref: str) -> bool:
    """Whether `ref`, a thing's name or its id where either may stand, is an id: digits are
    always one (names may not be digits alone; one an older version stored is reached by id)."""
    return ref.isascii() and ref.isdigit()


_zero_or_more = _rule(lambda v: v >= 0, "expected 0 or a positive integer")
_positive_number = _rule(lambda v: v > 0, "expected a positive number")
_non_empty = _rule(bool, "expected a non-empty string")
_share = _rule(lambda v: 0 < v <= 1, "expected a share of the limit above 0 and at most 1 (0.8 is 80 %)")
_some_deployments = _rule(bool, "expected at least one deployment name")
_effort = _rule(lambda v: v in EFFORTS, f"expected one of {', '.join(EFFORTS)}")
_sha256_hex = _rule(lambda v: re.fullmatch(r"[0-9a-fA-F]{64}", v) is not None, "expected 64 hex characters")


def _port_fits(url: str) -> bool:
    try:
        _ = urlsplit(url).port  # raises ValueError for a port that is not a number from 0 to 65535
    except ValueError:
        return False
    return True


_redis_url = _rule(
    lambda v: v == "" or (v.startswith(("redis://", "rediss://", "unix://")) and _port_fits(v)),
    "expected a redis://, rediss:// or unix:// URL",
)
storage_url_problem = _rule(
    lambda v: (
        (v.startswith("sqlite:///") and v != "sqlite:///")
        or (v.startswith(("postgresql://", "postgres://")) and _port_fits(v))
    ),
    "expected a sqlite:///, postgresql:// or postgres:// URL",
)


def _http_url(value: str) -> str | None:
    try:
        parts = urlsplit(value)
        host = parts.hostname
        _ = parts.port  # raises ValueError for a port that is not a number from 0 to 65535
    except ValueError:
        host = None
    if not host or parts.scheme not in ("http", "https"):
        return "expected an http(s) URL with a host"
    return None


def _issuer_url(value: str) -> str | None:
    """An identity provider's issuer: https, or plain http on a loopback address only (a provider
    on the same machine), with no query or fragment (OpenID Connect Discovery's rule)."""
    try:
        parts = urlsplit(value)
        host = parts.hostname
        _ = parts.port
    except ValueError:
        host = None
    if not host or parts.query or parts.fragment:
        return "expected an https URL with a host, and no query or fragment"
    if parts.scheme == "https":
        return None
    if parts.scheme == "http" and is_loopback_url(value):
        return None
    return "expected https (plain http only on a loopback address)"


def is_loopback_url(url: str) -> bool:
    """`url`'s host is this machine: localhost, or a loopback address."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


REASONING_KEY_BYTES = 32  # AES-256, which seals reasoning items (middlewares/responses/sealing.py)
# The key of a config that gives none: this process's own, the same for every config it loads.
_PROCESS_REASONING_KEY = secrets.token_bytes(REASONING_KEY_BYTES)


def reasoning_key_bytes(text: str) -> bytes | None:
    """The key a `[responses] reasoning_key` gives: 64 hex digits, or base64 (standard or URL-safe,
    padded or not) of 32 bytes; None for anything else."""
    text = text.strip()
    if re.fullmatch(r"[0-9a-fA-F]{64}", text):
        return bytes.fromhex(text)
    if not re.fullmatch(r"[A-Za-z0-9+/_-]+={0,2}", text):
        return None
    try:
        unpadded = text.translate(str.maketrans("-_", "+/")).rstrip("=")
        key = base64.b64decode(unpadded + "=" * (-len(unpadded) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return key if len(key) == REASONING_KEY_BYTES else None


# The longest a response may be kept: a century, so that its expiry is a date every store (and
# Python's datetime) can hold.
MAX_RETENTION_DAYS = 36500
_retention_days = _rule(lambda v: 0 <= v <= MAX_RETENTION_DAYS, f"expected an integer from 0 to {MAX_RETENTION_DAYS}")
_reasoning_key = _rule(
    lambda v: v == "" or reasoning_key_bytes(v) is not None,
    "expected 32 bytes as base64 (openssl rand -base64 32) or as 64 hex digits (openssl rand -hex 32)",
)


def _field(default: Any = MISSING, *, check=None, check_each=None, clean=None, fallback=None, shown=True) -> Any:
    """A field whose file value is checked (whole or item by item), then cleaned; when the file
    omits a field with no default, `fallback(values_so_far)` gives its value. `shown=False` keeps
    a secret out of the config's repr (and so out of logs and tracebacks)."""
    metadata = {"check": check, "check_each": check_each, "clean": clean, "fallback": fallback}
    return field(default=default, metadata=metadata, repr=shown)


# --- The config itself.


@dataclass(frozen=True)
class ServerConfig:
    host: str = _field("127.0.0.1", check=_non_empty)
    port: int = _field(8080, check=_port)
    workers: int = _field(1, check=_positive)  # processes sharing the port
    shutdown_timeout_seconds: float = _field(30.0, check=_positive_number)  # for open requests on SIGTERM
    write_timeout_seconds: float = _field(30.0, check=_positive_number)  # a stream's client not reading
    body_timeout_seconds: float = _field(60.0, check=_positive_number)  # for a request's whole body, else 408
    keepalive_timeout_seconds: float = _field(
        75.0, check=_positive_number
    )  # an idle connection's; a request's headers' too
    # On SIGTERM: /readyz answers 503 at once, and the gateway serves on this long before it stops
    # listening and drains (so a load balancer that probes readiness stops sending first).
    drain_seconds: float = _field(0.0, check=_non_negative)


@dataclass(frozen=True)
class RoutingConfig:
    max_attempts: int = _field(4, check=_positive)  # deployments and fallback models tried per request
    failures_before_cooldown: int = _field(3, check=_positive)  # in a row
    cooldown_seconds: float = _field(30.0, check=_positive_number)  # unless the upstream's retry-after says


@dataclass(frozen=True)
class StorageConfig:
    url: str = _field("sqlite:///ezat-gateway.db", check=storage_url_problem)


@dataclass(frozen=True)
class ResponsesConfig:
    """The Responses API's state: responses kept for later requests, and the key that seals the
    reasoning items its answers carry."""

    retention_days: int = _field(30, check=_retention_days)  # days a response is kept; 0: none is stored
    # 32 bytes, as base64 or hex, the same on every replica. Empty: a random key for this process
    # (its workers get it with the config), which no other process, nor this one restarted, has.
    reasoning_key: str = _field("", check=_reasoning_key, shown=False)

    def __post_init__(self) -> None:
        key = reasoning_key_bytes(self.reasoning_key) if self.reasoning_key else _PROCESS_REASONING_KEY
        if key is None:  # a file's is checked before
            raise ValueError(f"responses.reasoning_key: {_reasoning_key(self.reasoning_key)}")
        object.__setattr__(self, "_sealing_key", key)  # not a field: no repr, and pickled to the workers

    @property
    def sealing_key(self) -> bytes:
        """The AES-256 key reasoning items are sealed with: reasoning_key's, else this process's own."""
        return self._sealing_key  # type: ignore[attr-defined]  # set by __post_init__, not a field


@dataclass(frozen=True)
class ImagesConfig:
    """The image fetcher; the defaults are the stage's own (middlewares.images.ImageLimits)."""

    allow_private_hosts: bool = False  # true only for tests and trusted networks
    max_image_mb: int = _field(IMAGES.image_bytes // MiB, check=_positive)
    max_total_mb: int = _field(IMAGES.total_bytes // MiB, check=_positive)
    max_urls: int = _field(IMAGES.urls, check=_positive)
    timeout_seconds: float = _field(IMAGES.timeout, check=_positive_number)
    max_redirects: int = _field(IMAGES.redirects, check=_non_negative)
    ports: tuple[int, ...] = _field((), check_each=_port)  # empty: any port (the API sets no limit)
    downloads_per_key: int = _field(IMAGES.downloads_per_key, check=_positive)
    connections_per_host: int = _field(IMAGES.connections_per_host, check=_positive)


@dataclass(frozen=True)
class BoundsConfig:
    """The bounds stage: the most of each list one request may hold, and how deep its schemas may
    nest (docs/api.md, "Limits a client sees"), so no later stage works on an oversized request."""

    max_messages: int = _field(DEFAULT_BOUNDS.max_messages, check=_positive)
    max_content_parts: int = _field(DEFAULT_BOUNDS.max_content_parts, check=_positive)
    max_tools: int = _field(DEFAULT_BOUNDS.max_tools, check=_positive)
    max_stop: int = _field(DEFAULT_BOUNDS.max_stop, check=_positive)
    max_schema_depth: int = _field(DEFAULT_BOUNDS.max_schema_depth, check=_positive)


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True  # GET /metrics, in Prometheus' text format
    token: str = field(default="", repr=False)  # if set, /metrics wants `Authorization: Bearer <token>`


LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class LoggingConfig:
    format: str = _field("text", check=_rule(lambda v: v in LOG_FORMATS, 'expected "text" or "json"'))
    level: str = _field(
        "INFO",
        check=_rule(lambda v: v.upper() in LOG_LEVELS, f"expected one of {', '.join(LOG_LEVELS)}"),
        clean=str.upper,
    )
    access_log: bool = True  # one line per request, when it ends


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces, sent over OTLP/HTTP (the `otel` extra)."""

    endpoint: str = _field("", check=lambda v: v and _http_url(v), clean=lambda url: url.rstrip("/"))
    service_name: str = _field("ezat-gateway", check=_non_empty)


@dataclass(frozen=True)
class RateLimitConfig:
    url: str = _field("", check=_redis_url)  # empty: limits are kept in this process's memory


PROVIDERS = ("anthropic", "bedrock", "vertex")
# A Bedrock deployment's id for a model, checked by its shape (there is no list of models):
# Anthropic's model id on Bedrock, "anthropic." and more (anthropic.claude-…-v1:0), alone (a
# foundation model) or after an inference profile's geography and a dot (us., eu., apac., us-gov.,
# global.: 2 to 6 letters, then maybe a hyphen and more, so that AWS's next one passes too); or any
# Bedrock ARN, its resource unchecked (an inference profile, an application one, a provisioned,
# custom or imported model). Only Anthropic's models take the Messages body sent, hence "anthropic.".
BEDROCK_MODEL_ID = re.compile(
    r"(?:[a-z]{2,6}(?:-[a-z]{2,6})?\.)?anthropic\.[A-Za-z0-9._:-]+"
    r"|arn:aws[a-z-]*:bedrock:[a-z0-9-]*:\d{0,12}:[A-Za-z0-9/._:+-]+"
)
_region = _rule(lambda v: re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", v) is not None, "expected a region such as us-east-1")
# A Google Cloud project id, as Google makes them: 6 to 30 lowercase letters, digits and hyphens,
# from a letter, not to a hyphen; an older one may have its domain before it (example.com:my-project).
# Vertex AI's URLs take the project's number too (digits alone), in its place.
VERTEX_PROJECT = re.compile(r"(?:[a-z0-9][a-z0-9.-]*[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]|[0-9]{1,30}")


@dataclass(frozen=True)
class Deployment:
    """One upstream: Anthropic's API (or any Anthropic-format one: {base_url}/v1/messages), or
    Claude on Amazon Bedrock or Google Vertex AI, each in one region."""

    name: str = _field(check=_non_empty)
    provider: str = _field(
        "anthropic", check=_rule(lambda v: v in PROVIDERS, 'expected "anthropic", "bedrock" or "vertex"')
    )
    # Required for anthropic; for bedrock and vertex, the region's public endpoint when unset.
    base_url: str = _field("", check=_http_url, clean=lambda url: url.rstrip("/"))
    # Anthropic's x-api-key; on bedrock, a Bedrock API key (sent as a Bearer token, no SigV4).
    api_key: str = field(default="", repr=False)  # keep the secret out of logs and tracebacks
    # bedrock and vertex ("global" for vertex). An empty one (the default) passes this check, for
    # the providers that take none: deployment_problems refuses it where one is required.
    region: str = _field("", check=lambda v: v and _region(v))
    project: str = ""  # vertex: the Google Cloud project's id (or number); checked by deployment_problems
    aws_profile: str = ""  # bedrock: a named profile of AWS's shared files; "": the default chain
    # vertex: a service-account key file; "": Application Default Credentials
    credentials_file: str = ""
    # The anthropic-beta flags sent on (others are dropped). None: the provider's default, which on
    # bedrock and vertex is the list of flags they take (upstream/<provider>.py), and on anthropic
    # is no list at all: every flag a client sends passes (Anthropic's API ignores unknown ones).
    betas: tuple[str, ...] | None = _field(None, check_each=_non_empty)
    connect_timeout_seconds: float = _field(10.0, check=_positive_number)
    first_token_timeout_seconds: float = _field(300.0, check=_positive_number)  # streams: then the next one
    stream_idle_timeout_seconds: float = _field(
        60.0, check=_positive_number
    )  # a stream's silence, after its first output
    max_stream_duration_seconds: float = _field(1800.0, check=_positive_number)  # a stream's whole length

    def __post_init__(self) -> None:
        if not self.base_url and self.provider != "anthropic":  # the region's public endpoint
            object.__setattr__(self, "base_url", default_base_url(self.provider, self.region))


def default_base_url(provider: str, region: str) -> str:
    if provider == "bedrock":
        return f"https://bedrock-runtime.{region}.amazonaws.com"
    if region == "global":
        return "https://aiplatform.googleapis.com/v1"
    return f"https://{region}-aiplatform.googleapis.com/v1"


def deployment_problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, problem) pairs for what a deployment's provider needs: found in the raw table, so
    that a value already reported adds nothing."""
    provider = raw.get("provider", "anthropic")
    if provider not in PROVIDERS:
        return []  # reported already
    found = []
    name = raw.get("name")
    deployment = f'deployment "{name}"' if isinstance(name, str) and name else "the deployment"
    if provider == "anthropic":
        if "base_url" not in raw:
            found.append(("base_url", "required"))
        found += [(key, f"only for bedrock or vertex, not {provider}") for key in ("region", "project") if key in raw]
    else:
        example = "us-east-1" if provider == "bedrock" else 'europe-west1, or "global"'
        if "region" not in raw:
            found.append(("region", f"required for {provider}"))
        elif raw["region"] == "":  # else its URLs would be https://bedrock-runtime..amazonaws.com and the like
            found.append(("region", f"empty; {deployment} ({provider}) needs its region, such as {example}"))
        elif provider == "bedrock" and raw["region"] == "global":
            found.append(("region", 'expected an AWS region such as us-east-1 ("global" is Vertex\'s)'))
    if provider == "vertex":
        project = raw.get("project")
        if project is None:
            found.append(("project", "required for vertex"))
        elif project == "":
            found.append(("project", f"empty; {deployment} (vertex) needs its Google Cloud project id"))
        elif isinstance(project, str) and not VERTEX_PROJECT.fullmatch(project):  # (else reported already)
            found.append(
                (
                    "project",
                    f'"{project}" is not a Google Cloud project id: 6 to 30 lowercase letters, digits and hyphens,'
                    " starting with a letter and not ending with a hyphen (or the project's number)",
                )
            )
    if provider != "bedrock":
        found += [(key, "only for bedrock") for key in ("aws_profile",) if key in raw]
        if provider == "vertex" and "api_key" in raw:
            found.append(
                ("api_key", "not for vertex (it signs in with credentials_file or Application Default Credentials)")
            )
    else:
        found += [(key, "only for vertex") for key in ("project",) if key in raw]
        if raw.get("api_key") and raw.get("aws_profile"):
            found.append(("api_key", "not with aws_profile: a Bedrock API key is used in place of AWS credentials"))
    if provider != "vertex" and "credentials_file" in raw:
        found.append(("credentials_file", "only for vertex"))
    elif isinstance(raw.get("credentials_file"), str) and raw["credentials_file"]:
        found += [
            ("credentials_file", problem) for problem in [_service_account_problem(raw["credentials_file"])] if problem
        ]
    return found


def _service_account_problem(path: str) -> str | None:
    """Why the file at `path` is not a Google service-account key, or None."""
    try:
        key = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        return f"cannot read {path}: {error.strerror or error}"
    except (UnicodeDecodeError, ValueError):
        return f"{path} is not JSON"
    if not isinstance(key, dict) or key.get("type") != "service_account":
        return f'{path} is not a service-account key (its "type" is not "service_account")'
    missing = [name for name in ("client_email", "private_key", "token_uri") if not isinstance(key.get(name), str)]
    return f"{path} is a service-account key without {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class Rates:  # USD per million tokens
    # The defaults are for configs built in code: a file must give each price it uses
    # (_pricing_problems), so that no price is 0 by omission.
    input: Decimal = _field(Decimal(0), check=_non_negative)
    output: Decimal = _field(Decimal(0), check=_non_negative)
    cache_write: Decimal = _field(Decimal(0), check=_non_negative)  # a 5-minute cache's
    cache_read: Decimal = _field(Decimal(0), check=_non_negative)
    # A 1-hour cache's. Unset (None), __post_init__ makes it twice input's: a Decimal once made.
    cache_write_1h: Decimal = _field(None, check=_non_negative)

    def __post_init__(self) -> None:
        if self.cache_write_1h is None:  # the upstream's own price for it: 2x the input price
            object.__setattr__(self, "cache_write_1h", 2 * self.input)


@dataclass(frozen=True, kw_only=True)
class LongContextRates(Rates):  # every token of a request whose input is above the threshold
    above_input_tokens: int = _field(check=_positive)  # cache reads and writes included


@dataclass(frozen=True)
class TierRates(Rates):  # one service tier's
    long_context: LongContextRates | None = None  # None: a long request costs no more a token


# The upstream's own fees, per 1,000 uses: Anthropic charges for web searches, not web fetches.
WEB_SEARCH_PER_1000 = Decimal(10)
WEB_FETCH_PER_1000 = Decimal(0)


@dataclass(frozen=True)
class Pricing(TierRates):  # the standard tier's rates, the other tiers' and the server tools' fees
    priority: TierRates | None = None  # None: billed at the standard tier's rates
    batch: TierRates | None = None
    web_search_per_1000: Decimal = _field(WEB_SEARCH_PER_1000, check=_non_negative)  # USD per 1,000 uses
    web_fetch_per_1000: Decimal = _field(WEB_FETCH_PER_1000, check=_non_negative)


FREE = Pricing(web_search_per_1000=Decimal(0), web_fetch_per_1000=Decimal(0))


@dataclass(frozen=True)
class Model:
    id: str = _field(check=_non_empty)  # what clients send
    # Sent upstream; clients may send it too (Config.model says when it names this model).
    upstream_model: str = _field(check=_non_empty, fallback=lambda values: values["id"])
    deployments: tuple[str, ...] = _field(check=_some_deployments)  # in preference order
    aliases: tuple[str, ...] = _field((), check_each=_non_empty)  # other names clients may send for it
    max_output_tokens: int = _field(64000, check=_positive)
    sampling: bool = False
    efforts: tuple[str, ...] = _field(EFFORTS, check_each=_effort)
    forced_tool_choice: bool = True
    min_cache_tokens: int = _field(1024, check=_zero_or_more)  # 0: the model has no prompt cache
    pricing: Pricing = Pricing()  # a file must give it, unless `free`
    free: bool = False  # the model costs nothing: it needs no pricing (and may have none)
    # Per deployment (by name): its own id for the model, where it is not upstream_model (a
    # Bedrock inference profile, a Vertex model@version), and its own prices (regional endpoints
    # cost more). Left out of the hash: a model is hashed by what names it.
    upstream_models: dict[str, str] = field(default_factory=dict, hash=False, metadata={"check_each": _non_empty})
    pricing_by_deployment: dict[str, Pricing] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.free:  # nothing, its server tools' uses included
            object.__setattr__(self, "pricing", FREE)
            object.__setattr__(self, "pricing_by_deployment", {})

    def upstream_model_at(self, deployment: str) -> str:
        """The model's id at `deployment`."""
        return self.upstream_models.get(deployment, self.upstream_model)

    def pricing_at(self, deployment: str | None) -> Pricing:
        """What a request costs answered by `deployment` (None: not answered)."""
        return self.pricing_by_deployment.get(deployment, self.pricing) if deployment else self.pricing

    @property
    def every_pricing(self) -> tuple[Pricing, ...]:
        """Each pricing a request may be billed at: admission reserves the dearest."""
        return (self.pricing, *self.pricing_by_deployment.values())


# The organization every key belongs to unless it names another; it always exists.
DEFAULT_ORGANIZATION = "default"


@dataclass(frozen=True)
class OrganizationConfig:
    name: str = _field(check=name_problem)
    balance_usd: Decimal | None = _field(None, check=usd_problem)  # shared by its keys; None: no balance limit
    suspended: bool = False  # its keys' requests get 403


@dataclass(frozen=True)
class KeyConfig:
    name: str = _field(check=lambda v: v and name_problem(v), fallback=lambda values: "")  # "": none
    key_sha256: str = _field(check=_sha256_hex, clean=str.lower)  # the plaintext key is never kept
    models: tuple[str, ...] = ("*",)  # globs of model ids this key may use
    spend_limit_usd: Decimal | None = _field(None, check=usd_problem)
    rpm: int | None = _field(None, check=_per_minute)  # requests per minute
    tpm: int | None = _field(None, check=_per_minute)  # tokens per minute
    max_concurrent: int | None = _field(None, check=_positive)  # requests running at once
    expires_at: datetime | None = None  # always timezone-aware (UTC)
    revoked: bool = False
    organization: str = _field(DEFAULT_ORGANIZATION, check=_non_empty)  # a declared [[organizations]] name
    # The period spend_limit_usd counts over (UTC calendar); None: the key's whole life.
    budget_period: str | None = _field(None, check=_rule(lambda v: v in PERIODS, 'expected "day", "week" or "month"'))


def budget_problem(period: str | None, limit: Decimal | None) -> str | None:
    """Why a key cannot have `period` as its budget period with `limit` as its spend limit, or
    None: a budget period is what a spend limit counts over, so alone it would limit nothing.
    The config file's rule and the admin commands' (gateway/admin/changes.py)."""
    if period is not None and limit is None:
        return (
            f"a budget period ({period}) needs a spend limit to count over: give the key a spend limit too, "
            "or no budget period"
        )
    return None


ADMIN_ROLES = ("admin", "viewer")  # an admin reads and writes; a viewer only reads
SESSION_KEY_BYTES = 32  # HMAC-SHA256, which signs the console's sign-in form cookie (gateway/admin/console/)
_session_key = _rule(
    lambda v: v == "" or reasoning_key_bytes(v) is not None,
    "expected 32 bytes as base64 (openssl rand -base64 32) or as 64 hex digits (openssl rand -hex 32)",
)


@dataclass(frozen=True)
class AdminTokenConfig:
    """An admin token declared in the file, by its SHA-256 digest (tokens made with the CLI live
    in the store)."""

    name: str = _field(check=name_problem)  # who made a change, in the audit log
    role: str = _field(check=_rule(lambda v: v in ADMIN_ROLES, 'expected "admin" or "viewer"'))
    token_sha256: str = _field(check=_sha256_hex, clean=str.lower)  # the token itself is never kept


@dataclass(frozen=True)
class AdminConfig:
    """The admin API (/admin/v1/…): on when the file has an [admin] table."""

    tokens: tuple[AdminTokenConfig, ...] = ()
    # Wrong admin tokens one client address may send in a minute, per process; past them, 429
    # for a wrong one (a valid token is always accepted).
    failed_attempts_per_minute: int = _field(10, check=_positive)
    # Signs the console's sign-in form cookie: 32 bytes, as base64 or hex, the same on every
    # replica. Empty: a random key for this process (its workers get it with the config), which no
    # other replica, nor this one restarted, has: a form served there is refused (docs/admin.md).
    session_key: str = _field("", check=_session_key, shown=False)

    def __post_init__(self) -> None:
        key = reasoning_key_bytes(self.session_key) if self.session_key else secrets.token_bytes(SESSION_KEY_BYTES)
        if key is None:  # a file's is checked before
            raise ValueError(f"admin.session_key: {_session_key(self.session_key)}")
        object.__setattr__(self, "_session_signing_key", key)  # not a field: no repr, pickled to the workers

    @property
    def session_signing_key(self) -> bytes:
        """The HMAC-SHA256 key of the console's sign-in form cookie: session_key's, else this process's own."""
        return self._session_signing_key  # type: ignore[attr-defined]  # set by __post_init__, not a field


@dataclass(frozen=True)
class OidcRole:
    """People in `group` (as the ID token's groups claim names it) have `role` on the console."""

    group: str = _field(check=_non_empty)
    role: str = _field(check=_rule(lambda v: v in ADMIN_ROLES, 'expected "admin" or "viewer"'))


@dataclass(frozen=True)
class OidcConfig:
    """Sign-in through the company's identity provider (OpenID Connect's authorization-code flow
    with PKCE): on when the file has an [oidc] table, beside the admin tokens."""

    issuer: str = _field(check=_issuer_url)  # discovery at {issuer}/.well-known/openid-configuration
    client_id: str = _field(check=_non_empty)
    client_secret: str = _field(check=_non_empty, shown=False)
    scopes: tuple[str, ...] = _field(
        ("openid", "email", "profile"), check=_rule(lambda v: "openid" in v, 'expected "openid" among them')
    )
    groups_claim: str = _field("groups", check=_non_empty)
    # Empty: any address the provider vouches for; else only these domains (lower-cased).
    allowed_email_domains: tuple[str, ...] = _field(
        (), check_each=_non_empty, clean=lambda v: tuple(d.lower() for d in v)
    )
    # First match in file order; a person in no such group is a member: their own page only.
    roles: tuple[OidcRole, ...] = ()
    # How often the people with keys in use are asked about again (their keys revoked when the
    # provider no longer vouches for them).
    recheck_minutes: int = _field(60, check=_positive)
    # The console's callback as the provider has it registered (…/console/oidc/callback). Empty:
    # the request's own origin's; behind a proxy that ends TLS, say it here.
    redirect_url: str = _field("", check=lambda v: v and _http_url(v))


MAX_KEY_TTL_HOURS = 24 * 90  # a person's key lives at most a quarter; renewal is the point


@dataclass(frozen=True)
class PolicyConfig:
    """What the people of `group` (as their identity provider names it) may do with the keys they
    make for themselves; the first policy whose group a person is in is theirs. Applied to their
    keys on every request (within the auth cache's seconds), so a changed policy takes effect at
    once."""

    group: str = _field(check=_non_empty)
    models: tuple[str, ...] = ("*",)  # globs of model ids the person's keys may use
    rpm: int | None = _field(None, check=_per_minute)  # requests per minute, per key
    tpm: int | None = _field(None, check=_per_minute)  # tokens per minute, per key
    # How long a key the person makes lives.
    key_ttl_hours: int = _field(
        12, check=_rule(lambda v: 0 < v <= MAX_KEY_TTL_HOURS, f"expected hours from 1 to {MAX_KEY_TTL_HOURS}")
    )
    # What the person may spend over all their keys together in each budget_period (UTC calendar,
    # as a key's); None: no such budget. A period without a budget is a config error.
    budget_usd: Decimal | None = _field(
        None, check=lambda v: usd_problem(v) or (None if v > 0 else "expected an amount of USD above 0")
    )
    budget_period: str | None = _field(None, check=_rule(lambda v: v in PERIODS, 'expected "day", "week" or "month"'))

    def __post_init__(self) -> None:
        if self.budget_usd is not None and self.budget_period is None:  # a budget is monthly unless it says
            object.__setattr__(self, "budget_period", "month")


@dataclass(frozen=True)
class AlertConfig:
    """A webhook told when a key has used a share of its spend limit (of its period's, with a
    budget_period) or an organization of its balance: one POST per threshold crossed, per period
    (gateway/accounting/alerts.py)."""

    webhook_url: str = _field(check=_http_url)
    secret: str = _field(check=_non_empty, shown=False)  # signs each POST's body: x-ezat-signature
    thresholds: tuple[float, ...] = _field(
        (0.5, 0.8, 1.0), check=_rule(bool, "expected at least one threshold"), check_each=_share
    )
    # The webhook's host may be a private or loopback address (else it must be public, as images').
    allow_private_hosts: bool = False


@dataclass(frozen=True)
class Config:
    server: ServerConfig = ServerConfig()
    storage: StorageConfig = StorageConfig()
    images: ImagesConfig = ImagesConfig()
    bounds: BoundsConfig = BoundsConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    routing: RoutingConfig = RoutingConfig()
    metrics: MetricsConfig = MetricsConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    responses: ResponsesConfig = ResponsesConfig()
    deployments: tuple[Deployment, ...] = ()
    models: tuple[Model, ...] = ()
    organizations: tuple[OrganizationConfig, ...] = ()
    keys: tuple[KeyConfig, ...] = ()
    admin: AdminConfig | None = None  # None: no [admin] table, no admin API
    oidc: OidcConfig | None = None  # None: no [oidc] table, sign-in with admin tokens only
    policies: tuple[PolicyConfig, ...] = ()  # [[policies]]: what people's own keys may do
    alerts: tuple[AlertConfig, ...] = ()

    def model(self, model_id: str) -> Model | None:
        return self._models_by_id.get(model_id)

    def deployment(self, name: str) -> Deployment | None:
        return self._deployments_by_name.get(name)

    # cached_property writes to the instance __dict__ directly, so it works on a frozen dataclass.
    @cached_property
    def _models_by_id(self) -> dict[str, Model]:
        """Every name a model answers to: its id and its aliases, and its upstream_model (the
        name Claude Code and Anthropic's SDKs send) unless another model's id or alias is that
        name, or another model has the same upstream_model (shared_upstream_models)."""
        shared = Counter(model.upstream_model for model in self.models)
        names = {model.upstream_model: model for model in self.models if shared[model.upstream_model] == 1}
        names.update((name, model) for model in self.models for name in (*model.aliases, model.id))
        return names

    @cached_property
    def _deployments_by_name(self) -> dict[str, Deployment]:
        return {deployment.name: deployment for deployment in self.deployments}


# --- Loading.


def load_config(path: str | os.PathLike[str]) -> Config:
    return _config_from_toml(_read(path), os.environ, source=f"{path}: ")


def parse_config(text: str, env: Mapping[str, str] | None = None) -> Config:
    return _config_from_toml(text, os.environ if env is None else env, source="")


def load_storage_config(path: str | os.PathLike[str]) -> StorageConfig:
    """Only the file's [storage] table, for `keys` and `usage`: the rest is neither interpolated
    nor checked, so listing keys needs no upstream secret in the environment."""
    data = _parse_toml(_read(path), source=f"{path}: ")
    problems: list[str] = []
    raw = _interpolate(data.get("storage", {}), "storage", os.environ, problems)
    storage = _build(StorageConfig, raw, "storage", problems)
    if problems:
        raise ConfigError(problems)
    return storage


def _read(path: str | os.PathLike[str]) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError([f"{path}: cannot read file: {reason}"]) from None


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError([f"{source}invalid TOML: {error}"]) from None


def _config_from_toml(text: str, env: Mapping[str, str], source: str) -> Config:
    data = _parse_toml(text, source)
    problems: list[str] = []  # "path: message" lines
    data = _interpolate(data, "", env, problems)
    config = _build(Config, data, "", problems)
    _check_across_entries(data, problems)
    if config is not _INVALID:
        _report_same_keys(config.keys, problems)
    if problems:
        raise ConfigError(problems)
    return config


def expired_keys(config: Config, now: datetime | None = None) -> list[str]:
    """One line for each key, not revoked, whose expires_at has passed: a valid config, but likely
    a mistake, since every request with it gets 401. Names the entry and its name, never the key."""
    now = now or datetime.now(UTC)
    lines = []
    for i, key in enumerate(config.keys):
        if key.expires_at is not None and key.expires_at <= now and not key.revoked:
            name = f" ({key.name})" if key.name else ""
            lines.append(f"keys[{i}]{name}: expired at {key.expires_at.isoformat()}; requests with it get 401")
    return lines


def unshared_reasoning_key(config: Config) -> list[str]:
    """A line when the config sets up replicas (PostgreSQL storage, or rate limits in Redis) and
    gives no `[responses] reasoning_key`: each replica then seals reasoning items with a key of
    its own, which the others cannot open. Valid, and harmless to one process but for restarts."""
    replicas = config.storage.url.startswith(("postgresql://", "postgres://")) or config.ratelimit.url
    if config.responses.reasoning_key or not replicas:
        return []
    return [
        "responses.reasoning_key: not set, so each replica (and each start) seals reasoning items with a random key "
        "of its own, and replicas (or restarts) cannot open each other's: a conversation continued elsewhere loses "
        'its reasoning; give every replica the same key (reasoning_key = "${EZAT_REASONING_KEY}", '
        "from openssl rand -base64 32)"
    ]


def placeholder_digests(config: Config) -> list[str]:
    """One line for each key, not revoked, whose key_sha256 is one character repeated (the example
    config's zeros): valid hex, but a placeholder left in place, which no key's digest is, so
    every request meant for that entry gets 401."""
    lines = []
    for i, key in enumerate(config.keys):
        if len(set(key.key_sha256)) == 1 and not key.revoked:
            name = f" ({key.name})" if key.name else ""
            lines.append(
                f'keys[{i}]{name}: key_sha256 is a placeholder ("{key.key_sha256[0]}" 64 times), no key\'s digest, '
                f'so no request can use this entry; put your key\'s there (printf %s "$THE_KEY" | sha256sum), '
                f'or use key = "${{ENV_VAR}}"'
            )
    return lines


def shared_upstream_models(config: Config) -> list[str]:
    """One line for each upstream_model name that several models share and no model's id or alias
    is: a valid config (two models may send the same upstream model), but a client sending that
    name gets 404, where a name only one model sends would find it."""
    named = {name for model in config.models for name in (*model.aliases, model.id)}
    sharing: dict[str, list[int]] = {}
    for i, model in enumerate(config.models):
        if model.upstream_model not in named:
            sharing.setdefault(model.upstream_model, []).append(i)
    return [
        f'models[{entries[0]}].upstream_model: "{name}" is also {" and ".join(f"models[{i}]" for i in entries[1:])}\'s;'
        f" requests for it get 404 (an alias of that name on one of them picks it)"
        for name, entries in sharing.items()
        if len(entries) > 1
    ]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --- ${ENV_VAR} interpolation, applied to every string before validation.

# ${NAME}, or ${NAME:-default}: the default when NAME is unset or empty, as in a shell.
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, path: str, env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, dict):
        return {key: _interpolate(item, _join(path, key), env, problems) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, f"{path}[{i}]", env, problems) for i, item in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    missing = [
        name
        for name, default in (m.group(1, 2) for m in _ENV_REFERENCE.finditer(value))
        if name not in env and default is None
    ]
    for name in dict.fromkeys(missing):
        problems.append(f"{path}: environment variable {name} is not set")
    # A "${" left after removing the well-formed references is a typo, not literal text.
    if "${" in _ENV_REFERENCE.sub("", value):
        problems.append(
            f"{path}: malformed ${{...}}; expected ${{NAME}} or ${{NAME:-default}}, NAME of letters, digits and _"
        )
    elif not missing:
        # One pass, so a variable's value (or a default) is never itself expanded.
        return _ENV_REFERENCE.sub(_expanded(env), value)
    return _INVALID


def _expanded(env: Mapping[str, str]):
    def expand(match: re.Match) -> str:
        name, default = match.group(1, 2)
        return env.get(name) or default if default is not None else env[name]

    return expand


# --- The dataclass-driven validator.

# How a TOML value becomes each scalar field type: (accepts, convert, problem when not accepted).
_SCALARS: dict[type, tuple[Callable[[Any], bool], Callable[[Any], Any], str]] = {
    str: (lambda v: isinstance(v, str), lambda v: v, "expected a string"),
    bool: (lambda v: isinstance(v, bool), lambda v: v, "expected true or false"),
    # bool is a subclass of int in Python, but `port = true` is a mistake.
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), lambda v: v, "expected an integer"),
    float: (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        float,
        "expected a number",
    ),
    # Via str() so that 0.30 becomes Decimal("0.30"), not the float's binary expansion.
    Decimal: (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        lambda v: Decimal(str(v)),
        "expected a number",
    ),
    # TOML also has bare dates and times, but an expiry needs both; no offset means UTC.
    datetime: (
        lambda v: isinstance(v, datetime),
        lambda v: v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC),
        "expected an unquoted datetime such as 2027-01-01T00:00:00Z",
    ),
}


_LISTS = {str: "a list of strings", int: "a list of integers"}


def _convert(kind: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Turn a TOML value into `kind` (a scalar, a dataclass or a tuple of either)."""
    if value is _INVALID:
        return _INVALID
    if type(None) in get_args(kind):  # `X | None`: TOML has no null, so the file gives an X
        kind = next(arg for arg in get_args(kind) if arg is not type(None))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _build(kind, value, path, problems)
    if get_origin(kind) is tuple:
        item_kind = get_args(kind)[0]
        if not isinstance(value, list):
            tables = dataclasses.is_dataclass(item_kind)
            problems.append(f"{path}: expected {'an array of tables' if tables else _LISTS.get(item_kind, 'a list')}")
            return _INVALID
        items = [_convert(item_kind, item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
        return _INVALID if any(item is _INVALID for item in items) else tuple(items)
    if get_origin(kind) is dict:  # a table of names to values
        value_kind = get_args(kind)[1]
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a table")
            return _INVALID
        table = {name: _convert(value_kind, item, _join(path, name), problems) for name, item in value.items()}
        return _INVALID if any(item is _INVALID for item in table.values()) else table
    accepts, convert, expected = _SCALARS[kind]
    if not accepts(value):
        problems.append(f"{path}: {expected}")
        return _INVALID
    return convert(value)


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """Make a `cls` from a TOML table, or report every reason why not and return _INVALID."""
    if not isinstance(raw, dict):
        problems.append(f"{path}: expected a table")
        return _INVALID
    if cls is KeyConfig:
        raw = _key_as_digest(dict(raw), path, problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [key for key in raw if key not in fields]
    problems.extend(f"{_join(path, key)}: unknown key" for key in unknown)
    values: dict[str, Any] = {}
    for f in fields.values():
        field_path = _join(path, f.name)
        if f.name not in raw:
            if fallback := f.metadata.get("fallback"):
                values[f.name] = fallback(values)  # _INVALID when what it derives from is
            elif f.default is MISSING and f.default_factory is MISSING:
                problems.append(f"{field_path}: required")
                values[f.name] = _INVALID
            continue
        value = _convert(f.type, raw[f.name], field_path, problems)
        if value is not _INVALID:
            found = _field_problems(f, value)
            problems.extend(f"{field_path}{suffix}: {problem}" for suffix, problem in found)
            clean = f.metadata.get("clean")
            value = _INVALID if found else clean(value) if clean else value
        values[f.name] = value
    if cls is Model and not _pricing_problems(raw, path, problems):
        return _INVALID
    if cls is Deployment and (found := deployment_problems(raw)):
        problems.extend(f"{_join(path, key)}: {problem}" for key, problem in found)
        return _INVALID
    if cls is KeyConfig:
        period, limit = values.get("budget_period"), values.get("spend_limit_usd")
        if period is not _INVALID and limit is not _INVALID and (problem := budget_problem(period, limit)):
            problems.append(f"{_join(path, 'budget_period')}: {problem}")
            return _INVALID
    if cls is PolicyConfig and values.get("budget_period") not in (None, _INVALID) and values.get("budget_usd") is None:
        problems.append(
            f"{_join(path, 'budget_period')}: a budget period ({values['budget_period']}) needs a budget to count "
            "over: give the policy a budget_usd too, or no budget_period"
        )
        return _INVALID
    if unknown or any(value is _INVALID for value in values.values()):
        return _INVALID
    return cls(**values)


def _field_problems(f: dataclasses.Field, value: Any) -> list[tuple[str, str]]:
    """(path suffix, problem) pairs from running a field's checks on its converted value."""
    found = []
    if (check := f.metadata.get("check")) and (problem := check(value)):
        found.append(("", problem))
    if check_each := f.metadata.get("check_each"):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        found += [
            (f"[{i}]" if isinstance(i, int) else f".{i}", problem) for i, item in items if (problem := check_each(item))
        ]
    return found


def _pricing_problems(raw: dict[str, Any], path: str, problems: list[str]) -> bool:
    """A [[models]] entry is priced, or says it is free: no model costs nothing by omission, and a
    free one has no prices (neither pricing nor pricing_by_deployment) to be ignored. Its pricing
    gives input and output, and the cache prices too while the model caches. Found
    in the raw table; a value already reported as bad (`free`, `pricing`, `min_cache_tokens`)
    adds nothing here. False when there is a problem."""
    free = raw.get("free", False)
    pricing = raw.get("pricing")
    if not isinstance(free, bool) or (pricing is not None and not isinstance(pricing, dict)):
        return True  # reported already
    found = []
    if free:
        if pricing is not None:
            found.append(("pricing", "not with free = true (a free model costs nothing)"))
        by_deployment = raw.get("pricing_by_deployment")
        if isinstance(by_deployment, dict) and by_deployment:  # (else none, or reported already)
            found.append(
                ("pricing_by_deployment", "not with free = true (a free model costs nothing at every deployment)")
            )
    elif pricing is None:
        found.append(("pricing", "required (or free = true for a model that costs nothing)"))
    else:
        caches = raw.get("min_cache_tokens", 1024)
        caching = type(caches) is int and caches > 0
        found += _whole_pricing_problems(pricing, "pricing", caching)
        by_deployment = raw.get("pricing_by_deployment")
        for name, table in by_deployment.items() if isinstance(by_deployment, dict) else ():
            if isinstance(table, dict):  # (else reported already)
                found += _whole_pricing_problems(table, f"pricing_by_deployment.{name}", caching)
    problems.extend(f"{_join(path, key)}: {problem}" for key, problem in found)
    return not found


def _whole_pricing_problems(pricing: dict[str, Any], path: str, caching: bool) -> list[tuple[str, str]]:
    """(key path, problem) pairs for a whole pricing table, the model's own (`pricing`) or one
    deployment's (`pricing_by_deployment.NAME`), under the same rules: its standard rates and each
    tier's give their prices (_rates_problems), and while it has long_context, each tier has its own."""
    found = _rates_problems(pricing, path, caching)
    for tier in ("priority", "batch"):
        rates = pricing.get(tier)
        if not isinstance(rates, dict):
            continue  # none, or reported already
        found += _rates_problems(rates, f"{path}.{tier}", caching)
        if "long_context" in pricing and "long_context" not in rates:
            found.append(
                (
                    f"{path}.{tier}.long_context",
                    f"required while {path} has long_context (its own long requests' rates)",
                )
            )
    return found


def _rates_problems(rates: dict[str, Any], path: str, caching: bool) -> list[tuple[str, str]]:
    """(key path, problem) pairs for a tier's table of rates and its long_context's: each gives
    input and output, and the cache prices while the model caches."""
    tables = [(path, rates)]
    if isinstance(rates.get("long_context"), dict):  # (else none, or reported already)
        tables.append((f"{path}.long_context", rates["long_context"]))
    found = []
    for at, table in tables:
        found += [(f"{at}.{name}", "required") for name in ("input", "output") if name not in table]
        if caching:
            found += [
                (f"{at}.{name}", "required while the model caches (min_cache_tokens > 0)")
                for name in ("cache_write", "cache_read")
                if name not in table
            ]
    return found


def _key_as_digest(raw: dict[str, Any], path: str, problems: list[str]) -> dict[str, Any]:
    """Turn a [[keys]] entry's `key` into `key_sha256`, so the plaintext never outlives loading."""
    if ("key" in raw) == ("key_sha256" in raw):
        problems.append(f"{path}: expected exactly one of key or key_sha256")
        raw.pop("key", None)
        raw["key_sha256"] = _INVALID
    elif "key" in raw:
        key = raw.pop("key")
        usable = isinstance(key, str) and key != ""
        if not usable and key is not _INVALID:
            problems.append(f"{path}.key: expected a non-empty string")
        raw["key_sha256"] = hashlib.sha256(key.encode()).hexdigest() if usable else _INVALID
    return raw


# --- Checks across entries.


def _check_across_entries(data: dict[str, Any], problems: list[str]) -> None:
    """Duplicates and dangling references, found in the raw tables so that an entry is
    checked even when it has an unrelated problem."""
    deployment_names = _report_duplicates(data, "deployments", "name", "deployment name", problems)
    _report_duplicates(data, "models", "id", "model id", problems)
    _report_taken_aliases(data, problems)
    _report_dangling_organizations(data, problems)
    admin = data.get("admin")
    if isinstance(admin, dict):
        _report_duplicates({"admin.tokens": admin.get("tokens", [])}, "admin.tokens", "name", "token name", problems)
    if "oidc" in data and not isinstance(admin, dict):
        problems.append("oidc: people sign in to the console, which needs an [admin] table")
    if "policies" in data and "oidc" not in data:
        problems.append("policies: they govern people's keys, and people sign in with [oidc]")
    # With a deployment name missing or bad (already reported), "no deployment named" would be noise.
    if deployment_names is None:
        return
    models = data.get("models")
    for i, model in enumerate(models if isinstance(models, list) else []):
        references = model.get("deployments") if isinstance(model, dict) else None
        for j, name in enumerate(references if isinstance(references, list) else []):
            if isinstance(name, str) and name not in deployment_names:
                problems.append(f'models[{i}].deployments[{j}]: no deployment named "{name}"')
        if isinstance(model, dict) and isinstance(references, list):
            _report_per_deployment(model, f"models[{i}]", references, _providers(data), problems)


def _providers(data: dict[str, Any]) -> dict[str, str]:
    """Each deployment's provider, by name, as the raw tables give them."""
    entries = data.get("deployments")
    return {
        entry["name"]: entry.get("provider", "anthropic")
        for entry in (entries if isinstance(entries, list) else [])
        if isinstance(entry, dict) and isinstance(entry.get("name"), str)
    }


def _report_per_deployment(
    model: dict[str, Any], path: str, listed: list[Any], providers: dict[str, str], problems: list[str]
) -> None:
    """A model's tables by deployment name only name deployments it lists, and the id it has on
    each Bedrock deployment is a Bedrock model id."""
    for table in ("upstream_models", "pricing_by_deployment"):
        entries = model.get(table)
        for name in entries if isinstance(entries, dict) else ():
            if name not in listed:
                problems.append(f'{path}.{table}.{name}: the model does not list deployment "{name}"')
    ids = model.get("upstream_models")
    ids = ids if isinstance(ids, dict) else {}
    default = model.get("upstream_model", model.get("id"))
    for name in listed:
        if not isinstance(name, str) or providers.get(name) != "bedrock":
            continue
        model_id = ids.get(name, default)
        if isinstance(model_id, str) and not BEDROCK_MODEL_ID.fullmatch(model_id):
            where = f"{path}.upstream_models.{name}" if name in ids else f"{path}.upstream_model"
            problems.append(
                f'{where}: "{model_id}" is not an Anthropic model\'s Bedrock id, inference profile or ARN '
                f'(such as "us.anthropic.claude-sonnet-5-5-v1:0"); give deployment "{name}" its id in upstream_models'
            )


def _report_taken_aliases(data: dict[str, Any], problems: list[str]) -> None:
    """An alias names one model only: no model's id, nor another alias."""
    models = data.get("models")
    models = models if isinstance(models, list) else []
    taken = {m["id"] for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)}
    for i, model in enumerate(models):
        aliases = model.get("aliases") if isinstance(model, dict) else None
        for j, alias in enumerate(aliases if isinstance(aliases, list) else []):
            if isinstance(alias, str) and alias in taken:
                problems.append(f'models[{i}].aliases[{j}]: "{alias}" already names a model')
            elif isinstance(alias, str):
                taken.add(alias)


def _report_dangling_organizations(data: dict[str, Any], problems: list[str]) -> None:
    """Organization names repeated, and keys naming an organization the file does not declare
    (other than the default one). With a name missing or bad (already reported), a dangling
    reference would be noise."""
    names = _report_duplicates(data, "organizations", "name", "organization name", problems)
    if names is None:
        return
    keys = data.get("keys")
    for i, key in enumerate(keys if isinstance(keys, list) else []):
        name = key.get("organization") if isinstance(key, dict) else None
        if isinstance(name, str) and name and name != DEFAULT_ORGANIZATION and name not in names:
            problems.append(f'keys[{i}].organization: no organization named "{name}"')


def _report_same_keys(keys: Sequence[KeyConfig], problems: list[str]) -> None:
    """One key twice would be one row with the last entry's settings (the key is not shown)."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key.key_sha256 in first:
            problems.append(f"keys[{i}]: the same key as keys[{first[key.key_sha256]}]")
        first.setdefault(key.key_sha256, i)


def _report_duplicates(data: dict[str, Any], section: str, key: str, what: str, problems: list[str]) -> set[str] | None:
    """Report repeated `key` values in an array of tables; return them, or None if any is unusable."""
    entries = data.get(section, [])
    complete = isinstance(entries, list)
    seen: set[str] = set()
    for i, entry in enumerate(entries if complete else []):
        value = entry.get(key) if isinstance(entry, dict) else None
        if not isinstance(value, str):
            complete = False
        elif value in seen:
            problems.append(f'{section}[{i}].{key}: duplicate {what} "{value}"')
        else:
            seen.add(value)
    return seen if complete else None
