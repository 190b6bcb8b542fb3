"""The console's sessions: who signed in, kept in the store, and the CSRF token of their forms.

A session's cookie holds an opaque id, 256 random bits; the store keeps only its SHA-256 digest,
who the session is for (an admin token, by its digest) and its CSRF token, so every replica on
the store reads it, and signing out deletes it there: a copy of the cookie is worth nothing
after. The token itself is never in the cookie nor the session. On every request the token is
looked up again (the config's tokens, in constant time, then the store's), so a token revoked
ends its sessions at once, and a role changed takes effect on the next page. The sign-in form's
CSRF nonce, before there is a session, is a cookie signed with HMAC-SHA256 under `[admin]
session_key`, which no state is kept for."""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
import time
from datetime import UTC, datetime, timedelta
from hashlib import sha256
from typing import NamedTuple

import orjson
from aiohttp import web

from gateway.admin import changes
from gateway.admin.tokens import AdminTokens
from gateway.config import AdminConfig
from gateway.storage import Store
from gateway.storage.records import ADMIN_TOKEN_SESSION, SessionRecord

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

    def __init__(self, tokens: AdminTokens, config: AdminConfig, store: Store) -> None:
        self.tokens = tokens
        self._store = store
        self._key = config.session_signing_key  # the sign-in form's cookie's

    # --- who a session is

    async def admin(self, request: web.Request) -> Admin | None:
        """The request's session, if its cookie names one that is unexpired and whose token is
        still valid."""
        session_id = request.cookies.get(SESSION_COOKIE, "")
        if not session_id:
            return None
        session = await self._store.find_session(changes.digest(session_id))
        if session is None or session.kind != ADMIN_TOKEN_SESSION:
            return None
        holder = await self.tokens.holder(session.subject)
        if holder is None:  # the token was taken out of the config file
            await self._store.delete_session(session.id_sha256)
            return None
        return Admin(*holder, csrf=session.csrf)

    # --- signing in and out

    async def sign_in(self, request: web.Request, response: web.StreamResponse, token: str) -> None:
        """A new session for the valid admin token `token`: kept in the store, its cookie set on
        `response`."""
        session_id = secrets.token_urlsafe(32)
        now = datetime.now(UTC)
        session = SessionRecord(
            changes.digest(session_id),
            ADMIN_TOKEN_SESSION,
            changes.digest(token),
            secrets.token_urlsafe(32),
            now,
            now + timedelta(seconds=SESSION_SECONDS),
        )
        await self._store.create_session(session)
        _set_cookie(request, response, SESSION_COOKIE, session_id, SESSION_SECONDS)
        response.del_cookie(SIGN_IN_COOKIE, path=COOKIE_PATH)

    async def sign_out(self, request: web.Request, response: web.StreamResponse) -> None:
        await self._store.delete_session(changes.digest(request.cookies.get(SESSION_COOKIE, "")))
        response.del_cookie(SESSION_COOKIE, path=COOKIE_PATH)

    def sign_in_nonce(self, request: web.Request, response: web.StreamResponse) -> str:
        """The sign-in form's CSRF token: the one its cookie holds, else a new one set on
        `response` (a double-submit: another site can neither read nor set the cookie)."""
        payload = self._open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is not None and payload.get("exp", 0) > time.time() and isinstance(payload.get("csrf"), str):
            return payload["csrf"]
        csrf = secrets.token_urlsafe(32)
        payload = {"exp": int(time.time()) + SIGN_IN_SECONDS, "csrf": csrf}
        _set_cookie(request, response, SIGN_IN_COOKIE, self._seal(payload), SIGN_IN_SECONDS)
        return csrf

    def sign_in_csrf_holds(self, request: web.Request, presented: str) -> bool:
        payload = self._open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is None or payload.get("exp", 0) <= time.time() or not isinstance(payload.get("csrf"), str):
            return False
        return csrf_holds(payload["csrf"], presented)

    # --- the sign-in form's cookie: base64url(JSON) "." base64url(HMAC-SHA256(key, JSON))

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
