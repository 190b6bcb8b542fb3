"""`ezat-gateway login` and `ezat-gateway key`: a person's own gateway key, got through OAuth's
device authorization grant (RFC 8628) and renewed with its refresh token (RFC 6749 §6).

`login` asks the gateway for a device code, tells the person where to approve it (the console's
device page, behind the company's identity provider) and polls until the gateway answers with a
key; `key` prints the saved key, renewed first when it has expired or is about to. What they get
is kept in one file per user (`credentials_file()`), keyed by the gateway's URL, written whole and
atomically, readable by its owner only.

stdout is the key's alone (`key` is Claude Code's apiKeyHelper, and `$(ezat-gateway key …)`):
everything said to the person goes to stderr. Neither the refresh token nor the device code is
ever printed or put in a message; what the gateway says is shown only as printable text."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import secrets
import shlex
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

from gateway import clock, version

T = TypeVar("T")

CLIENT_ID = "ezat-gateway-cli"  # the client id the gateway's /oauth endpoints know this command by
DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
AUTHORIZE_PATH = "/oauth/device/authorize"
TOKEN_PATH = "/oauth/token"
GATEWAY_ENV = "EZAT_GATEWAY"  # the gateway's URL when --gateway is not given
TIMEOUT = 10.0  # seconds for any one request to the gateway, connecting and reading included
RENEW_WITHIN = timedelta(minutes=5)  # `key` renews a key that expires sooner than this
DEFAULT_INTERVAL = 5  # seconds between polls when the gateway names none (RFC 8628 §3.2)
SLOW_DOWN_SECONDS = 5  # added to the interval at each `slow_down` (RFC 8628 §3.5)
MAX_BODY = 64 * 1024  # bytes: an OAuth answer is far smaller
MAX_SHOWN = 200  # characters of the gateway's own words (an error's description) shown
MAX_LIFETIME = 10 * 366 * 86400  # seconds: an expires_in beyond this is no key's
# A key is printed where a shell or Claude Code reads it: printable ASCII, no space, nothing else.
KEY_SHAPE = re.compile(r"[\x21-\x7e]{1,1024}")

Say = Callable[[str], None]


class LoginError(Exception):
    """What stops `login` or `key`, in words for the person: never a key, a code or a token."""


def normalised_gateway(text: str) -> str:
    """The gateway's URL as the credentials file keys it: http(s), scheme and host in lower case,
    no trailing slash. ValueError, saying what was expected, for anything else."""
    text = text.strip()
    expected = f"expected the gateway's URL, such as https://gateway.example.com, not {text!r}"
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError:
        raise ValueError(expected) from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(expected)
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{expected}: the gateway's address alone, without a query, a fragment or a password")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def login_line(gateway: str) -> str:
    """The command that signs in to `gateway` again, as a person may paste it."""
    return f"`ezat-gateway login --gateway {shlex.quote(gateway)}`"


# --- The credentials file


@dataclass(frozen=True)
class Credentials:
    """A key the gateway gave, when it expires, and the token that renews it (None: it cannot be)."""

    key: str = field(repr=False)
    expires_at: datetime
    refresh_token: str | None = field(default=None, repr=False)

    def lasts(self, now: datetime) -> bool:
        """Whether the key is good for more than RENEW_WITHIN from `now`."""
        return self.expires_at - now > RENEW_WITHIN


def credentials_file(environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_CONFIG_HOME/ezat-gateway/credentials.json, by default under ~/.config (a relative
    XDG_CONFIG_HOME is to be ignored, the XDG spec says)."""
    base = environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "ezat-gateway" / "credentials.json"


def read_credentials(path: Path, gateway: str) -> Credentials | None:
    """The credentials saved for `gateway` (normalised), or None when there are none, or none usable."""
    entry = _read_entries(path).get(gateway)
    if not isinstance(entry, dict):
        return None
    key, expires_at, refresh_token = entry.get("key"), entry.get("expires_at"), entry.get("refresh_token")
    if not isinstance(key, str) or not KEY_SHAPE.fullmatch(key) or not isinstance(expires_at, str):
        return None
    try:
        moment = datetime.fromisoformat(expires_at)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return Credentials(key, moment, refresh_token if isinstance(refresh_token, str) and refresh_token else None)


def save_credentials(path: Path, gateway: str, credentials: Credentials) -> None:
    """Saves `credentials` as `gateway`'s, keeping the other gateways' entries: the whole file is
    written anew beside the old one (mode 0600, in a 0700 folder), then put in its place, so a
    reader sees the old file or the new one, never half of one. Call it under `locked(path)`."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    entries = _read_entries(path)
    entries[gateway] = {
        "key": credentials.key,
        "expires_at": _iso(credentials.expires_at),
        "refresh_token": credentials.refresh_token,
    }
    text = json.dumps(entries, indent=2, sort_keys=True) + "\n"
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """The credentials file to this process alone (an advisory lock on a file beside it), from
    reading it to saving it: two `key` commands renewing at once would each spend the same
    refresh token, and the gateway, which rotates it, would refuse the second."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # and the lock with it


def _read_entries(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise LoginError(f"cannot read {path}: {exc.strerror}") from None
    try:
        entries = json.loads(text)
    except ValueError:
        entries = None
    if not isinstance(entries, dict):
        raise LoginError(f"{path} is not a credentials file (a JSON object): move it away, then sign in again")
    return entries


# --- The commands


def login_command(gateway: str, *, environ: Mapping[str, str] = os.environ, now: clock.Clock = clock.system) -> int:
    """`ezat-gateway login`: 0 once signed in and saved; 1, saying why, when not; 130 on Ctrl-C."""
    path = credentials_file(environ)

    def sign_in_and_save() -> Credentials:
        _read_entries(path)  # a file that is not a credentials file is said before anything is approved
        credentials = asyncio.run(sign_in(gateway, say=_say, now=now))
        with locked(path):
            save_credentials(path, gateway, credentials)
        return credentials

    credentials = _attempt("login", path, sign_in_and_save)
    if isinstance(credentials, int):
        return credentials
    _say(f"Signed in to {gateway}: your key expires at {_when(credentials.expires_at, now())}.")
    _say(f"`ezat-gateway key --gateway {shlex.quote(gateway)}` prints it, renewed when it is about to expire.")
    return 0


def key_command(gateway: str, *, environ: Mapping[str, str] = os.environ, now: clock.Clock = clock.system) -> int:
    """`ezat-gateway key`: the key on stdout and 0, else a message on stderr and 1 (130 on Ctrl-C)."""
    path = credentials_file(environ)
    key = _attempt("key", path, lambda: current_key(path, gateway, now=now), then=f"; then run {login_line(gateway)}")
    if isinstance(key, int):
        return key
    print(key, flush=True)
    return 0


def _attempt(command: str, path: Path, work: Callable[[], T], *, then: str = "") -> T | int:
    """`work()`'s result, or the exit status of a command it failed for, said on stderr: 130 on
    Ctrl-C, 1 for a refusal or a file that cannot be saved (`then`: what to do next)."""
    try:
        return work()
    except KeyboardInterrupt:
        return 130
    except LoginError as exc:
        _say(f"ezat-gateway {command}: {exc}")
        return 1
    except OSError as exc:
        _say(f"ezat-gateway {command}: cannot save {path}: {exc.strerror}{then}")
        return 1


def current_key(path: Path, gateway: str, *, now: clock.Clock = clock.system) -> str:
    """The key saved for `gateway`, renewed first (and the renewal saved) when it expires within
    RENEW_WITHIN. LoginError when there is none, or the gateway will not renew it."""
    not_signed_in = f"not signed in to {gateway} (no key saved for it in {path}): run {login_line(gateway)}"
    credentials = read_credentials(path, gateway)
    if credentials is None:
        raise LoginError(not_signed_in)
    if credentials.lasts(now()):
        return credentials.key  # the usual case: no lock, no request
    with locked(path):
        credentials = read_credentials(path, gateway)  # another process may have renewed it meanwhile
        if credentials is None:
            raise LoginError(not_signed_in)
        if credentials.lasts(now()):
            return credentials.key
        if credentials.refresh_token is None:
            raise LoginError(
                f"your key for {gateway} expires at {_when(credentials.expires_at, now())} and cannot be "
                f"renewed: run {login_line(gateway)}"
            )
        renewed = asyncio.run(renew(gateway, credentials.refresh_token, now=now))
        save_credentials(path, gateway, renewed)
    return renewed.key


# --- The conversation with the gateway


@dataclass(frozen=True)
class DeviceCode:
    """The gateway's answer to a device authorization request (RFC 8628 §3.2)."""

    device_code: str = field(repr=False)
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    expires_in: int
    interval: int


async def sign_in(gateway: str, *, say: Say, now: clock.Clock = clock.system) -> Credentials:
    """The device flow from start to key: asks for a code, `say`s where to approve it, then polls
    at the gateway's interval until the gateway gives a key or says why it will not."""
    async with _session() as session:
        code = await _device_code(session, gateway)
        where = f"Open {code.verification_uri} and enter {code.user_code}"
        if code.verification_uri_complete:
            where += f" (or open {code.verification_uri_complete})"
        say(where)
        say(f"Waiting for the code to be approved (it expires in {_duration(code.expires_in)}; Ctrl-C to stop)…")
        return await _poll(session, gateway, code, now)


async def renew(gateway: str, refresh_token: str, *, now: clock.Clock = clock.system) -> Credentials:
    """A new key for `refresh_token` (RFC 6749 §6). The answer's refresh token replaces the old
    one; an answer without one leaves the old one in use, as §6 allows."""
    form = {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": CLIENT_ID}
    async with _session() as session:
        status, answer = await _post(session, gateway, TOKEN_PATH, form)
    if status == 200:
        renewed = _credentials(gateway, answer, now())
        return renewed if renewed.refresh_token else Credentials(renewed.key, renewed.expires_at, refresh_token)
    error, description = _oauth_error(answer)
    if status in (400, 401) and error:
        raise LoginError(
            f"the gateway at {gateway} refused to renew your key: {_sentence(description or error)} "
            f"Sign in again with {login_line(gateway)}."
        )
    raise LoginError(f"the gateway at {gateway} answered {status} to renewing your key")


async def _device_code(session: aiohttp.ClientSession, gateway: str) -> DeviceCode:
    status, answer = await _post(session, gateway, AUTHORIZE_PATH, {"client_id": CLIENT_ID})
    if status != 200:
        error, description = _oauth_error(answer)
        raise LoginError(
            f"the gateway at {gateway} refused to start a sign-in: {description or error or f'it answered {status}'}"
        )
    what = f"the gateway at {gateway} answered {AUTHORIZE_PATH} with"
    complete = answer.get("verification_uri_complete")
    return DeviceCode(
        device_code=_text(answer, "device_code", what),
        user_code=_text(answer, "user_code", what),
        verification_uri=_text(answer, "verification_uri", what),
        verification_uri_complete=_text(answer, "verification_uri_complete", what) if complete is not None else None,
        expires_in=_seconds(answer, "expires_in", what, low=1),
        # At least a second apart, whatever the gateway says.
        interval=max(1, _seconds(answer, "interval", what, low=0)) if "interval" in answer else DEFAULT_INTERVAL,
    )


async def _poll(session: aiohttp.ClientSession, gateway: str, code: DeviceCode, now: clock.Clock) -> Credentials:
    expired = f"the code expired before it was approved: run {login_line(gateway)} again"
    form = {"grant_type": DEVICE_CODE_GRANT, "device_code": code.device_code, "client_id": CLIENT_ID}
    interval = code.interval
    deadline = time.monotonic() + code.expires_in
    while True:
        await asyncio.sleep(interval)
        if time.monotonic() >= deadline:
            raise LoginError(expired)
        status, answer = await _post(session, gateway, TOKEN_PATH, form)
        if status == 200:
            return _credentials(gateway, answer, now())
        error, description = _oauth_error(answer)
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_SECONDS
            continue
        if error == "expired_token":
            raise LoginError(expired)
        if error == "access_denied":
            raise LoginError("the sign-in was denied on the gateway's device page: not signed in")
        if error == "invalid_grant":
            raise LoginError(f"the gateway does not know this code (any more): run {login_line(gateway)} again")
        raise LoginError(
            f"the gateway at {gateway} refused the sign-in: {description or error or f'it answered {status}'}"
        )


def _credentials(gateway: str, answer: dict[str, Any], now: datetime) -> Credentials:
    """A token answer (RFC 6749 §5.1) as Credentials, the key's expiry counted from `now`."""
    what = f"the gateway at {gateway} answered {TOKEN_PATH} with"
    key = answer.get("access_token")
    if not isinstance(key, str) or not KEY_SHAPE.fullmatch(key):
        raise LoginError(f"{what} no usable access_token")
    lifetime = _seconds(answer, "expires_in", what, low=0)
    refresh_token = answer.get("refresh_token")
    if refresh_token is not None and (not isinstance(refresh_token, str) or not refresh_token):
        raise LoginError(f"{what} a refresh_token that is no token")
    return Credentials(key, now + timedelta(seconds=lifetime), refresh_token)


def _session() -> aiohttp.ClientSession:
    # trust_env: a laptop behind the company's proxy reaches the gateway as its other tools do.
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=TIMEOUT),
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"User-Agent": f"ezat-gateway-cli/{version()}"},
        trust_env=True,
    )


async def _post(
    session: aiohttp.ClientSession, gateway: str, path: str, form: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """POSTs `form` to `gateway` + `path`: the answer's status and JSON object. LoginError when
    there is no answer, or one that is no OAuth endpoint's (a redirect, a page, a 404)."""
    try:
        async with session.post(
            gateway + path, data=form, headers={"Accept": "application/json"}, allow_redirects=False
        ) as response:
            status = response.status
            if 300 <= status < 400:
                where = _shown(response.headers.get("Location", ""))
                raise LoginError(
                    f"the gateway at {gateway} redirects {path} ({status} to {where}): give --gateway the "
                    f"address it redirects to, without {path}"
                )
            body = bytearray()
            async for chunk in response.content.iter_chunked(16 * 1024):
                body += chunk
                if len(body) > MAX_BODY:
                    raise LoginError(f"the gateway at {gateway} answered {path} with more than {MAX_BODY // 1024} KB")
    except TimeoutError:
        raise LoginError(f"cannot reach the gateway at {gateway}: no answer within {TIMEOUT:g} s") from None
    except aiohttp.ClientConnectorCertificateError as exc:
        reason = _shown(str(exc.certificate_error))
        raise LoginError(
            f"cannot reach the gateway at {gateway}: its TLS certificate is not trusted ({reason})"
        ) from None
    except aiohttp.ClientConnectorError as exc:
        raise LoginError(f"cannot reach the gateway at {gateway}: {_shown(exc.strerror or str(exc))}") from None
    except aiohttp.ClientError as exc:
        raise LoginError(f"cannot reach the gateway at {gateway}: {_shown(str(exc) or type(exc).__name__)}") from None
    if status >= 500:  # the gateway's store out of reach, a proxy in front of it failing: nothing to act on
        raise LoginError(f"the gateway at {gateway} answered {status} (a server error): try again later")
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        if status == 404:
            raise LoginError(
                f"the gateway at {gateway} has no {path}: it does not offer `ezat-gateway login` "
                "(its [oidc] sign-in is not configured, or it is older than this command)"
            )
        raise LoginError(f"the gateway at {gateway} answered {path} with {status} and no JSON: is it an ezat-gateway?")
    if status == 404 and not answer.get("error_description"):
        raise LoginError(f"the gateway at {gateway} does not offer `ezat-gateway login` (its [oidc] is not configured)")
    return status, answer


def _oauth_error(answer: dict[str, Any]) -> tuple[str, str]:
    """An error answer's `error` and `error_description` (RFC 6749 §5.2), as printable text."""
    error, description = answer.get("error"), answer.get("error_description")
    return (
        _shown(error) if isinstance(error, str) else "",
        _shown(description) if isinstance(description, str) else "",
    )


def _text(answer: dict[str, Any], name: str, what: str) -> str:
    """A field the person is shown (or that goes back in a form): a short printable string."""
    value = answer.get(name)
    if not isinstance(value, str) or not value or len(value) > 2048 or _shown(value, 2048) != value or " " in value:
        raise LoginError(f"{what} no usable {name}")
    return value


def _seconds(answer: dict[str, Any], name: str, what: str, *, low: int) -> int:
    value = answer.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_LIFETIME:
        raise LoginError(f"{what} no usable {name} (a whole number of seconds)")
    return value


def _shown(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` as it may be printed on a terminal: control characters (escape sequences) replaced,
    and cut to `limit` characters."""
    text = "".join("?" if unicodedata.category(c).startswith("C") else c for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else text + "."


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _iso(moment: datetime) -> str:
    """An instant in ISO 8601, in UTC, to the second: 2026-11-20T21:30:00Z."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _when(moment: datetime, now: datetime) -> str:
    """ "2026-11-20 21:30 UTC (in 6 hours)", or "(… ago)"."""
    shown = moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    seconds = round((moment - now).total_seconds())
    return f"{shown} (in {_duration(seconds)})" if seconds >= 0 else f"{shown} ({_duration(-seconds)} ago)"


def _duration(seconds: int) -> str:
    """Seconds in the largest unit of which there are two or more: "6 hours", "90 seconds"."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= 2 * size:
            return f"{round(seconds / size)} {unit}s"
    return "1 second" if seconds == 1 else f"{seconds} seconds"
