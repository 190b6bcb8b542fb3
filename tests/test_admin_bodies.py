"""Property-based: whatever body reaches a console or admin route, with whatever content type and
charset, the answer is a 4xx (or a success), never a 5xx; a console answer carries the console's
Content-Security-Policy; and no log line, at any level, holds a byte of what was sent.

Each example sends one body, holding a fresh marker token, to one of the app's /console and
/admin/v1 routes (every one the router has), as a visitor with no credentials, with a wrong
token, or signed in (a session cookie, the sign-in form's cookie, and a form that may carry the
right CSRF token), through a real gateway on loopback. The servers run on a loop of their own,
as in test_fuzz.py, and every log record the process makes is kept and searched for the marker.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import string
from dataclasses import replace
from urllib.parse import urlencode

import aiohttp
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from gateway.admin.console.headers import CONTENT_SECURITY_POLICY, is_console
from gateway.app import build_app
from gateway.mock.upstream import MockUpstream
from tests.support import UPSTREAM_KEY, Gateway, make_config
from tests.test_console import ADMIN, ROOT_TOKEN, SESSION_COOKIE
from tests.test_fuzz import LoopThread

SIGN_IN_COOKIE = "ezat_console_sign_in"
BODY_SETTINGS = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Kept(logging.Handler):
    """Every record, formatted with its traceback, as a log file would hold it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class Servers:
    """A gateway with the console and the admin API on SQLite, in front of the mock upstream."""

    def __init__(self, storage_url: str) -> None:
        self.loop = LoopThread()
        self.loop.run(self._start(storage_url))
        self.routes = sorted(
            {
                (route.method, re.sub(r"\{[^}]*\}", "1", route.resource.canonical))
                for route in self.gateway.app.router.routes()
                if route.resource is not None and route.resource.canonical.startswith(("/console", "/admin/v1"))
            }
        )

    async def _start(self, storage_url: str) -> None:
        self.upstream = MockUpstream(api_key=UPSTREAM_KEY)
        await self.upstream.start()
        config = replace(make_config(self.upstream.url, storage_url), admin=ADMIN)
        self.gateway = await Gateway(build_app(config), config.server).start()
        self.http = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())

    def send(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        async def send():
            async with self.http.request(
                method, self.gateway.url + path, data=body, headers=headers, allow_redirects=False
            ) as response:
                return response.status, response.headers, await response.read()

        return self.loop.run(send())

    def signed_in(self) -> tuple[dict[str, str], dict[str, str]]:
        """A new session's cookies (and a sign-in form's), and the CSRF tokens each one's forms carry."""

        async def sign_in():
            cookies: dict[str, str] = {}

            async def call(method: str, path: str, form: dict | None = None) -> str:
                header = "; ".join(f"{name}={value}" for name, value in cookies.items())
                async with self.http.request(
                    method, self.gateway.url + path, data=form, headers={"Cookie": header}, allow_redirects=False
                ) as response:
                    for name, morsel in response.cookies.items():
                        cookies[name] = morsel.value
                    return await response.text()

            form = await call("GET", "/console/sign-in")
            await call("POST", "/console/sign-in", {"token": ROOT_TOKEN, "csrf": csrf(form)})
            session = csrf(await call("GET", "/console/keys"))
            session_cookie = cookies.pop(SESSION_COOKIE)
            sign_in = csrf(await call("GET", "/console/sign-in"))  # a form's, as if signed out
            return {**cookies, SESSION_COOKIE: session_cookie}, {"session": session, "sign-in": sign_in}

        return self.loop.run(sign_in())

    def close(self) -> None:
        async def close() -> None:
            await self.http.close()
            await self.gateway.runner.cleanup()
            await self.upstream.close()

        self.loop.run(close())
        self.loop.stop()


def csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    kept, root = Kept(), logging.getLogger()
    level = root.level
    root.addHandler(kept)
    root.setLevel(logging.DEBUG)  # every record of every logger, debug ones too
    started = Servers(f"sqlite:///{tmp_path_factory.mktemp('bodies') / 'ezat.db'}")
    started.kept = kept
    yield started
    started.close()
    root.removeHandler(kept)
    root.setLevel(level)


# --- Strategies.

CHARSETS = st.sampled_from(["utf-8", "utf-16", "latin-1", "ascii", "shift_jis", "utf-32", "nonsense", "", "utf-7"])
FIELDS = st.sampled_from(["token", "csrf", "name", "organization", "spend_limit_usd", "budget_period", "x"])


HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@st.composite
def bodies(draw) -> tuple[bytes, str | None, str]:
    """(body, Content-Type or None for none, what kind it is), holding the marker `MARKER`."""
    kind = draw(st.sampled_from(["form", "multipart", "json", "bytes"]))
    fields = draw(st.lists(st.tuples(FIELDS, st.text(max_size=20)), max_size=5))
    fields.append((draw(FIELDS), "MARKER"))
    fields = draw(st.permutations(fields))
    if kind == "form":
        charset = draw(CHARSETS)
        text = urlencode(fields) if draw(st.booleans()) else "&".join(f"{name}={value}" for name, value in fields)
        encoding = charset if charset in ("utf-16", "latin-1", "shift_jis", "utf-32") else "utf-8"
        body = text.encode(encoding, "replace") + draw(st.binary(max_size=8))
        return body, "application/x-www-form-urlencoded" + (f"; charset={charset}" if draw(st.booleans()) else ""), kind
    if kind == "multipart":
        boundary = draw(
            st.text(alphabet=string.ascii_letters + string.digits + "'()+_,-./:=?", min_size=1, max_size=30)
        )
        parts = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode("utf-8", "replace")
            + (b'; filename="f.txt"' if draw(st.booleans()) else b"")
            + draw(st.sampled_from([b"", b"\r\nContent-Transfer-Encoding: ", b"\r\nContent-Encoding: "]))
            + draw(st.sampled_from([b"", b"base64", b"quoted-printable", b"gzip", b"x-unknown", b"binary"]))
            + f"\r\n\r\n{value}\r\n".encode("utf-8", "replace")
            for name, value in fields
        )
        ending = draw(st.sampled_from([f"--{boundary}--\r\n".encode(), b"--MARKER-other--\r\n", b""]))
        body = draw(st.sampled_from([b"", b"MARKER preamble\r\n"])) + parts + ending + draw(st.binary(max_size=20))
        said = draw(
            st.sampled_from([f"; boundary={boundary}", f'; boundary="{boundary}"', "", "; boundary=", "; boundary=x"])
        )
        return body, "multipart/form-data" + said, kind
    if kind == "json":
        return repr(dict(fields)).replace("'", '"').encode(), draw(st.sampled_from(["application/json", None])), kind
    body = draw(st.binary(max_size=60)) + b"MARKER" + draw(st.binary(max_size=60))
    return (
        body,
        # Any value a client can send as a header: printable ASCII (a control character is refused
        # by the client itself, never sent).
        draw(st.one_of(st.none(), HEADER_TEXT, CHARSETS.map(lambda c: f"text/plain; charset={c}"))),
        kind,
    )


@BODY_SETTINGS
@given(data=st.data(), body=bodies(), who=st.sampled_from(["nobody", "wrong token", "signed in"]))
def test_no_body_is_a_5xx_nor_logged(servers, data, body, who):
    method, path = data.draw(st.sampled_from(servers.routes), label="route")
    if method == "*":  # the console's catch-all
        method = data.draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]), label="method")
    raw, content_type, kind = body
    marker = "ezat-marker-" + secrets.token_hex(12)
    raw = raw.replace(b"MARKER", marker.encode())
    headers = {} if content_type is None else {"Content-Type": content_type}
    if who == "wrong token":
        headers["Authorization"] = f"Bearer {marker}-token"
    if who == "signed in":
        cookies, tokens = servers.signed_in()
        headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
        headers["Authorization"] = f"Bearer {ROOT_TOKEN}"
        choice = data.draw(st.sampled_from(["session", "sign-in", None]), label="csrf")
        if choice is not None and kind == "form":
            raw += b"&csrf=" + tokens[choice].encode()
    note(f"{method} {path} {headers} {raw[:300]!r}")
    logged = len(servers.kept.lines)
    status, answered, answer = servers.send(method, path, raw, headers)
    note(f"HTTP {status} {answer[:300]!r}")
    assert status < 500, (status, answer[:500])
    if is_console(path):
        assert answered["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    lines = servers.kept.lines[logged:]
    assert not [line for line in lines if marker in line or marker.encode().hex() in line], lines
