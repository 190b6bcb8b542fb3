"""The console's sessions: who signed in, kept in a signed cookie, and the CSRF token of their forms.

A session is a cookie holding the admin token's digest, the session's expiry and a CSRF nonce,
signed with HMAC-SHA256 under `[admin] session_key`: any worker or replica with the same key
reads it, and no server-side state is kept. The token itself is never in it. On every request the
digest is looked up again (the config's tokens, in constant time, then the store's), so a token
revoked ends its sessions at once, and a role changed takes effect on the next page."""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
import time
from collections.abc import Callable
from hashlib import sha256
from typing import NamedTuple

import orjson
from aiohttp import web

from gateway.admin import changes
from gateway.admin.tokens import AdminTokens, FailedAttempts
from gateway.config import AdminConfig
from gateway.storage import Store

SESSION_COOKIE = "ezat_console_session"
SIGN_IN_COOKIE = "ezat_console_sign_in"  # the sign-in form's CSRF nonce, before there is a session
COOKIE_PATH = "/console"
SESSION_SECONDS = 8 * 3600
SIGN_IN_SECONDS = 3600


class Admin(NamedTuple):
    """Who a session is: the token's name (the audit log's actor) and role, as they are now."""

    name: str
    role: str
    csrf: str  # the session's CSRF token, which every form carries

    @property
    def writes(self) -> bool:
        return self.role == "admin"


class Sessions:
    """Signs sessions in and out, and finds a request's."""

    def __init__(self, config: AdminConfig, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self._tokens = AdminTokens(config, store)
        self._key = config.session_signing_key
        self._clock = clock
        self.failures = FailedAttempts(config.failed_attempts_per_minute)

    # --- who a session is

    async def admin(self, request: web.Request) -> Admin | None:
        """The request's session, if its cookie is ours, unexpired, and its token still valid."""
        payload = self._open(request.cookies.get(SESSION_COOKIE, ""))
        if payload is None or payload.get("exp", 0) <= self._clock():
            return None
        digest, csrf = payload.get("sha256"), payload.get("csrf")
        if not isinstance(digest, str) or not isinstance(csrf, str) or len(digest) != 64:
            return None
        try:
            holder = await self._tokens.holder(digest)
        except ValueError:  # not hex
            return None
        return None if holder is None else Admin(*holder, csrf=csrf)

    # --- signing in and out

    async def sign_in(self, request: web.Request, response: web.StreamResponse, token: str) -> Admin | None:
        """Sets the session cookie on `response` if `token` is a valid admin token."""
        digest = changes.digest(token)
        holder = await self._tokens.holder(digest)
        if holder is None:
            return None
        csrf = secrets.token_urlsafe(32)
        payload = {"sha256": digest, "exp": int(self._clock()) + SESSION_SECONDS, "csrf": csrf}
        _set_cookie(request, response, SESSION_COOKIE, self._seal(payload), SESSION_SECONDS)
        response.del_cookie(SIGN_IN_COOKIE, path=COOKIE_PATH)
        return Admin(*holder, csrf=csrf)

    @staticmethod
    def sign_out(response: web.StreamResponse) -> None:
        response.del_cookie(SESSION_COOKIE, path=COOKIE_PATH)

    def sign_in_nonce(self, request: web.Request, response: web.StreamResponse) -> str:
        """The sign-in form's CSRF token: the one its cookie holds, else a new one set on
        `response` (a double-submit: another site can neither read nor set the cookie)."""
        payload = self._open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is not None and payload.get("exp", 0) > self._clock() and isinstance(payload.get("csrf"), str):
            return payload["csrf"]
        csrf = secrets.token_urlsafe(32)
        payload = {"exp": int(self._clock()) + SIGN_IN_SECONDS, "csrf": csrf}
        _set_cookie(request, response, SIGN_IN_COOKIE, self._seal(payload), SIGN_IN_SECONDS)
        return csrf

    def sign_in_csrf_holds(self, request: web.Request, presented: str) -> bool:
        payload = self._open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is None or payload.get("exp", 0) <= self._clock() or not isinstance(payload.get("csrf"), str):
            return False
        return csrf_holds(payload["csrf"], presented)

    # --- the cookie's value: base64url(JSON) "." base64url(HMAC-SHA256(key, JSON))

    def _seal(self, payload: dict) -> str:
        body = orjson.dumps(payload)
        return _b64(body) + "." + _b64(hmac.new(self._key, body, sha256).digest())

    def _open(self, value: str) -> dict | None:
        body_text, dot, signature_text = value.partition(".")
        if not dot:
            return None
        try:
            body, signature = _unb64(body_text), _unb64(signature_text)
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(hmac.new(self._key, body, sha256).digest(), signature):
            return None
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return payload if isinstance(payload, dict) else None


def csrf_holds(expected: str, presented: str) -> bool:
    """Whether a form's `csrf` field is its session's, compared in constant time."""
    return bool(presented) and hmac.compare_digest(expected.encode(), presented.encode())


def _set_cookie(request: web.Request, response: web.StreamResponse, name: str, value: str, seconds: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=seconds,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=request.secure,  # over TLS (or behind a proxy aiohttp was told about)
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
