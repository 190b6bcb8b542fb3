"""The console's sessions: who signed in, kept in the store, and the CSRF token of their forms.

A session's cookie holds an opaque id, 256 random bits; the store keeps only its SHA-256 digest,
who the session is for (an admin token, by its digest; or a person who signed in through the
identity provider, by their id) and its CSRF token, so every replica on the store reads it, and
signing out deletes it there: a copy of the cookie is worth nothing after. The token itself is
never in the cookie nor the session. On every request the token (or the person) is looked up
again (the config's tokens, in constant time, then the store's), so a token revoked or a person
disabled ends their sessions at once, and a role changed takes effect on the next page; a
person's role is the first of `[[oidc.roles]]` whose group they were in at their last sign-in. The sign-in form's
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
from gateway.config import AdminConfig, OidcConfig
from gateway.storage import Store
from gateway.storage.records import ADMIN_TOKEN_SESSION, PersonRecord, SessionRecord

SESSION_COOKIE = "ezat_console_session"
SIGN_IN_COOKIE = "ezat_console_sign_in"  # the sign-in form's CSRF nonce, before there is a session
COOKIE_PATH = "/console"
SESSION_SECONDS = 8 * 3600
SIGN_IN_SECONDS = 3600
PERSON_SESSION = "person"  # a session's kind, beside ADMIN_TOKEN_SESSION: its subject is the person's id
MEMBER = "member"  # the role of a person in none of [[oidc.roles]]' groups: their own page only


class Admin(NamedTuple):
    """Who a session is: the token's name, or the person's address (the audit log's actor), and
    role, as they are now."""

    name: str
    role: str  # "admin", "viewer", or MEMBER
    csrf: str  # the session's CSRF token, which every form carries
    person: PersonRecord | None = None  # a person's session: who, as the store has them now

    @property
    def writes(self) -> bool:
        return self.role == "admin"


class Sessions:
    """Signs sessions in and out, and finds a request's."""

    def __init__(self, tokens: AdminTokens, config: AdminConfig, store: Store, oidc: OidcConfig | None = None) -> None:
        self.tokens = tokens
        self.store = store
        self._key = config.session_signing_key  # the sign-in form's cookie's
        self._roles = oidc.roles if oidc is not None else ()

    # --- who a session is

    async def admin(self, request: web.Request) -> Admin | None:
        """The request's session, if its cookie names one that is unexpired and whose token is
        still valid."""
        session_id = request.cookies.get(SESSION_COOKIE, "")
        if not session_id:
            return None
        session = await self.store.find_session(changes.digest(session_id))
        if session is not None and session.kind == PERSON_SESSION:
            return await self._person(session)
        if session is None or session.kind != ADMIN_TOKEN_SESSION:
            return None
        holder = await self.tokens.holder(session.subject)
        if holder is None:  # the token was taken out of the config file
            await self.store.delete_session(session.id_sha256)
            return None
        return Admin(*holder, csrf=session.csrf)

    async def _person(self, session: SessionRecord) -> Admin | None:
        person = await self.store.find_person(int(session.subject))
        if person is None or person.disabled:
            await self.store.delete_session(session.id_sha256)
            return None
        return Admin(person.email or person.subject, self.role_of(person), session.csrf, person)

    def role_of(self, person: PersonRecord) -> str:
        """The first of [[oidc.roles]] whose group the person is in, else MEMBER."""
        return next((role.role for role in self._roles if role.group in person.groups), MEMBER)

    # --- signing in and out

    async def sign_in(self, request: web.Request, response: web.StreamResponse, token: str) -> None:
        """A new session for the valid admin token `token`: kept in the store, its cookie set on
        `response`."""
        await self._open_session(request, response, ADMIN_TOKEN_SESSION, changes.digest(token))

    async def sign_in_person(self, request: web.Request, response: web.StreamResponse, person: PersonRecord) -> None:
        """A new session for a person the identity provider vouched for."""
        await self._open_session(request, response, PERSON_SESSION, str(person.id))

    async def _open_session(self, request: web.Request, response: web.StreamResponse, kind: str, subject: str) -> None:
        session_id = secrets.token_urlsafe(32)
        now = datetime.now(UTC)
        session = SessionRecord(
            changes.digest(session_id),
            kind,
            subject,
            secrets.token_urlsafe(32),
            now,
            now + timedelta(seconds=SESSION_SECONDS),
        )
        await self.store.create_session(session)
        set_cookie(request, response, SESSION_COOKIE, session_id, SESSION_SECONDS)
        response.del_cookie(SIGN_IN_COOKIE, path=COOKIE_PATH)

    async def sign_out(self, request: web.Request, response: web.StreamResponse) -> None:
        await self.store.delete_session(changes.digest(request.cookies.get(SESSION_COOKIE, "")))
        response.del_cookie(SESSION_COOKIE, path=COOKIE_PATH)

    def sign_in_nonce(self, request: web.Request, response: web.StreamResponse) -> str:
        """The sign-in form's CSRF token: the one its cookie holds, else a new one set on
        `response` (a double-submit: another site can neither read nor set the cookie)."""
        payload = self.open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is not None and payload.get("exp", 0) > time.time() and isinstance(payload.get("csrf"), str):
            return payload["csrf"]
        csrf = secrets.token_urlsafe(32)
        payload = {"exp": int(time.time()) + SIGN_IN_SECONDS, "csrf": csrf}
        set_cookie(request, response, SIGN_IN_COOKIE, self.seal(payload), SIGN_IN_SECONDS)
        return csrf

    def sign_in_csrf_holds(self, request: web.Request, presented: str) -> bool:
        payload = self.open(request.cookies.get(SIGN_IN_COOKIE, ""))
        if payload is None or payload.get("exp", 0) <= time.time() or not isinstance(payload.get("csrf"), str):
            return False
        return csrf_holds(payload["csrf"], presented)

    # --- the sign-in form's cookie: base64url(JSON) "." base64url(HMAC-SHA256(key, JSON))

    def seal(self, payload: dict) -> str:
        body = orjson.dumps(payload)
        return _b64(body) + "." + _b64(hmac.new(self._key, body, sha256).digest())

    def open(self, value: str) -> dict | None:
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


def set_cookie(
    request: web.Request,
    response: web.StreamResponse,
    name: str,
    value: str,
    seconds: int,
    *,
    path: str = COOKIE_PATH,
    samesite: str = "Strict",
) -> None:
    response.set_cookie(
        name,
        value,
        max_age=seconds,
        path=path,
        httponly=True,
        samesite=samesite,
        secure=request.secure,  # over TLS (or behind a proxy aiohttp was told about)
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
