"""`ezat-gateway login`'s server side: OAuth's device authorization grant (RFC 8628) and its
refresh grant (RFC 6749 §6), so that a person's command line gets a key of theirs without the
person copying one from the console (docs/admin.md, "Signing in a command line").

`POST /oauth/device/authorize` gives the command line a device code, which it polls
`POST /oauth/token` with, and a user code, which the person approves on the console's
`/console/device` (gateway/admin/console/device.py) once signed in through the identity provider.
The poll that finds the grant approved gets a new key, made as the console's "Make a key" makes
one (policies.make_person_key: the person's policy's models and key_ttl_hours, audited with their
address as actor), and a renewal token, which later gets a new key without a browser while the
person is still enabled and in a policy's group. Renewal tokens are rotated: each renewal answers
with a new one, and the one it used stops working.

Only digests of device codes and renewal tokens are kept, and neither is ever logged or put in an
answer's message. Answers are JSON; refusals are RFC 6749 §5.2's `{"error", "error_description"}`,
400 (401 `invalid_client`). Without `[oidc]` both routes answer 404 `unsupported`: no person signs
in here."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import orjson
from aiohttp import web
from multidict import MultiDict, MultiDictProxy
from yarl import URL

from gateway.admin import changes
from gateway.admin.changes import AdminError
from gateway.admin.oidc import OidcError, ProviderUnavailable
from gateway.admin.policies import make_person_key, policy_for
from gateway.admin.provider_tokens import ProviderTokens
from gateway.admin.tokens import FailedAttempts
from gateway.clock import Clock, system
from gateway.config import OidcConfig, PolicyConfig
from gateway.storage import Store
from gateway.storage.records import (
    DEVICE_APPROVED,
    DEVICE_DENIED,
    DEVICE_EXPIRED,
    DEVICE_PENDING,
    DEVICE_TOO_SOON,
    DeviceGrant,
    PersonRecord,
    RenewalRecord,
)

AUTHORIZE_PATH = "/oauth/device/authorize"
TOKEN_PATH = "/oauth/token"
VERIFICATION_PATH = "/console/device"
CLIENT_ID = "ezat-gateway-cli"  # the one client: ezat-gateway's command line, a public client
DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
REFRESH_GRANT = "refresh_token"
# RFC 8628 §6.1: letters without vowels (no words spelt by chance), 8 of them (20^8 codes), shown
# as two groups of four.
USER_CODE_LETTERS = "BCDFGHJKLMNPQRSTVWXZ"
USER_CODE_LENGTH = 8
# Seconds a device code (and its user code) lives, and the client's first interval between
# polls. Read at each authorization, so the tests may shorten them.
EXPIRES_IN = 600
INTERVAL = 5
KEY_NAME = "ezat-gateway login"  # the name of the keys the command line gets
RENEWAL_PREFIX = "ezat-renew-"  # a renewal token's, so a secret scanner can tell what it found
# A renewal token unused this long expires (each renewal gives a new one, for as long again).
RENEWAL_LIFETIME = timedelta(days=30)
NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}  # RFC 6749 §5.1
AUTHORIZATIONS_PER_MINUTE = 20  # per client address and process: a person runs login now and then


def new_user_code() -> str:
    """A user code as the store keeps it: USER_CODE_LENGTH letters of USER_CODE_LETTERS."""
    return "".join(secrets.choice(USER_CODE_LETTERS) for _ in range(USER_CODE_LENGTH))


def normalised_user_code(typed: str) -> str | None:
    """A user code as a person typed it, as the store keeps it: upper case, with no hyphen and no
    space; None when it cannot be one (the wrong letters or length)."""
    code = "".join(char for char in typed if char != "-" and not char.isspace()).upper()
    if len(code) != USER_CODE_LENGTH or any(char not in USER_CODE_LETTERS for char in code):
        return None
    return code


def shown_user_code(code: str) -> str:
    """A stored user code as people see it: ABCD-EFGH."""
    half = len(code) // 2
    return f"{code[:half]}-{code[half:]}"


class OAuthError(Exception):
    """A refusal in RFC 6749 §5.2's shape. `description` is for people and holds no secret."""

    def __init__(self, error: str, description: str, status: int = 400) -> None:
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status

    def response(self) -> web.Response:
        return _json({"error": self.error, "error_description": self.description}, status=self.status)


def _json(body: dict[str, object], *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=NO_STORE)


class DeviceFlow:
    """The two /oauth routes' handlers, over the store, `[oidc]` (None: the routes answer 404) and
    `[[policies]]`; `now` is the gateway's idea of now, which a key's expiry counts from."""

    def __init__(
        self,
        store: Store,
        oidc: OidcConfig | None,
        policies: Sequence[PolicyConfig],
        now: Clock = system,
        provider: ProviderTokens | None = None,
    ) -> None:
        self.store = store
        self.oidc = oidc
        self.policies = tuple(policies)
        self.now = now
        self.provider = provider  # asks the identity provider again at each renewal
        # Authorizations need no credential and each writes a row: counted per client address.
        self._authorizations = FailedAttempts(AUTHORIZATIONS_PER_MINUTE)

    # --- the routes

    async def authorize(self, request: web.Request) -> web.Response:
        """RFC 8628 §3.1-3.2: a new grant, its device code, user code and where to approve it."""
        try:
            await self._form(request)
        except OAuthError as refused:
            return refused.response()
        address = request.remote or ""
        if wait := self._authorizations.wait(address):
            slowed = OAuthError("slow_down", f"Too many sign-ins from this address: try again in {wait} s.", 429)
            response = slowed.response()
            response.headers["Retry-After"] = str(wait)
            return response
        self._authorizations.failed(address)  # counted, as the admin tokens' failures are
        device_code = secrets.token_urlsafe(32)  # 43 characters
        now = datetime.now(UTC)
        while True:  # another unexpired grant with the same user code is rare: draw again
            user_code = new_user_code()
            grant = DeviceGrant(
                device_sha256=changes.digest(device_code),
                user_code=user_code,
                client_id=CLIENT_ID,
                created_at=now,
                expires_at=now + timedelta(seconds=EXPIRES_IN),
                interval=INTERVAL,
                status=DEVICE_PENDING,
            )
            if await self.store.create_device_grant(grant):
                break
        verification = self.origin(request).with_path(VERIFICATION_PATH)
        return _json(
            {
                "device_code": device_code,
                "user_code": shown_user_code(user_code),
                "verification_uri": str(verification),
                "verification_uri_complete": str(verification.with_query(user_code=shown_user_code(user_code))),
                "expires_in": EXPIRES_IN,
                "interval": INTERVAL,
            }
        )

    async def token(self, request: web.Request) -> web.Response:
        """RFC 8628 §3.4-3.5's device code grant and RFC 6749 §6's refresh grant."""
        try:
            form = await self._form(request)
            grant_type = _one(form, "grant_type")
            if grant_type == DEVICE_CODE_GRANT:
                return await self._device_code(_one(form, "device_code"))
            if grant_type == REFRESH_GRANT:
                return await self._refresh(_one(form, "refresh_token"))
            raise OAuthError("unsupported_grant_type", f"grant_type: expected {DEVICE_CODE_GRANT} or {REFRESH_GRANT}")
        except OAuthError as refused:
            return refused.response()

    def origin(self, request: web.Request) -> URL:
        """The gateway's origin as browsers reach it: `[oidc] redirect_url`'s (said for a gateway
        behind a proxy that ends TLS), else the request's own."""
        if self.oidc is not None and self.oidc.redirect_url:
            return URL(self.oidc.redirect_url).origin()
        return request.url.origin()

    # --- the grants

    async def _device_code(self, device_code: str) -> web.Response:
        found = await self.store.poll_device_grant(changes.digest(device_code))
        if found is None:
            raise OAuthError("invalid_grant", "This device code is unknown: run ezat-gateway login again.")
        grant, outcome = found
        if outcome == DEVICE_PENDING:
            raise OAuthError("authorization_pending", "Nobody has approved this sign-in yet.")
        if outcome == DEVICE_TOO_SOON:
            raise OAuthError("slow_down", f"Polled too soon: wait {grant.interval} seconds between polls from now on.")
        if outcome == DEVICE_EXPIRED:
            raise OAuthError("expired_token", "This sign-in has expired: run ezat-gateway login again.")
        if outcome == DEVICE_DENIED:
            raise OAuthError("access_denied", "The sign-in was denied on the console.")
        if outcome != DEVICE_APPROVED or grant.person_id is None:  # DEVICE_USED
            raise OAuthError("invalid_grant", "This device code was used already: run ezat-gateway login again.")
        person = await self.store.find_person(grant.person_id)
        refusal = await self.renewal_refusal(person)
        if refusal is not None:  # disabled, or out of every policy's group, since they approved it
            raise OAuthError("access_denied", refusal)
        assert person is not None  # renewal_refusal refuses no one
        answer = await self._granted(person, "access_denied")
        renewal, answer["refresh_token"] = self._new_renewal(person)
        await self.store.create_renewal(renewal)
        return _json(answer)

    async def _refresh(self, token: str) -> web.Response:
        renewal = await self.store.find_renewal(changes.digest(token))
        if renewal is None:
            raise OAuthError("invalid_grant", "This renewal token is unknown: run ezat-gateway login again.")
        person = await self.store.find_person(renewal.person_id)
        if person is not None and not person.disabled and renewal.revoked_at is None:
            if renewal.expires_at <= datetime.now(UTC):
                raise OAuthError("invalid_grant", "This renewal token has expired: run ezat-gateway login again.")
            if self.provider is not None:  # the provider's word, now: still known there, and their groups
                person = await self._rechecked(person)
        refusal = await self.renewal_refusal(person)
        if refusal is not None:
            raise OAuthError("invalid_grant", refusal)
        assert person is not None  # renewal_refusal refuses no one
        if renewal.revoked_at is not None:
            raise OAuthError("invalid_grant", "This renewal token was revoked: run ezat-gateway login again.")
        # Rotated before the key is made: of two renewals with one token, only one gets a key.
        replacement, new_token = self._new_renewal(person)
        if not await self.store.rotate_renewal(renewal.token_sha256, replacement):
            raise OAuthError(
                "invalid_grant", "This renewal token was used already (each renewal gives a new one): log in again."
            )
        answer = await self._granted(person, "invalid_grant")
        answer["refresh_token"] = new_token
        return _json(answer)

    async def _rechecked(self, person: PersonRecord) -> PersonRecord:
        assert self.provider is not None
        try:
            return await self.provider.recheck(self.store, person)
        except ProviderUnavailable:
            raise OAuthError(
                "temporarily_unavailable",
                "The identity provider cannot be reached just now, so the key was not renewed: try again soon.",
                503,
            ) from None
        except OidcError:
            raise OAuthError(
                "invalid_grant", "The identity provider no longer vouches for you: run ezat-gateway login again."
            ) from None

    async def renewal_refusal(self, person: PersonRecord | None) -> str | None:
        """Why `person` may not get a key from a device grant or a renewal now, or None: disabled,
        or in no policy's group by their groups as the store has them (a renewal asks the identity
        provider first, `_rechecked`, and decides on what it says)."""
        if person is None:
            return "This person is not known to the gateway: run ezat-gateway login again."
        if person.disabled:
            return "Your access to this gateway has been disabled by an administrator."
        if policy_for(person.groups, self.policies) is None:
            return (
                "None of your groups (as of your last sign-in) has a policy on this gateway: no key. "
                "If your groups changed, sign in to the console again."
            )
        return None

    # --- what a granted request gets

    def _new_renewal(self, person: PersonRecord) -> tuple[RenewalRecord, str]:
        """A new renewal token for the person: what the store keeps of it, and the token."""
        secret = RENEWAL_PREFIX + secrets.token_urlsafe(32)
        now = datetime.now(UTC)
        return RenewalRecord(changes.digest(secret), person.id, now, now + RENEWAL_LIFETIME), secret

    async def _granted(self, person: PersonRecord, refused_as: str) -> dict[str, object]:
        """A new key for the person, as the console's Make a key makes one, in the answer that
        carries it (less its refresh_token); `refused_as`: the error if it is refused after all."""
        now = self.now()
        try:
            key, secret = await make_person_key(self.store, person, self.policies, now, name=KEY_NAME)
        except AdminError as refused:  # no policy (renewal_refusal looked a moment ago)
            raise OAuthError(refused_as, refused.message) from None
        lives = int((key.expires_at - now).total_seconds()) if key.expires_at else 0
        return {"access_token": secret, "token_type": "Bearer", "expires_in": lives}

    # --- the request

    async def _form(self, request: web.Request) -> MultiDictProxy[str]:
        """The request's form, from the one client: 404 without [oidc], invalid_request for a body
        that is not a form or repeats a parameter (RFC 6749 §3.2), invalid_client for another client."""
        if self.oidc is None:
            raise OAuthError(
                "unsupported", "This gateway has no [oidc]: people do not sign in to it, so no command line does.", 404
            )
        if request.content_type != "application/x-www-form-urlencoded":
            raise OAuthError("invalid_request", "Expected a form body (application/x-www-form-urlencoded).")
        try:
            posted = await request.post()
        except web.HTTPException:  # 413 past the size limit: an answer already
            raise
        except Exception:  # a charset unknown, bytes not in it: nothing of it is quoted
            raise OAuthError("invalid_request", "The form could not be read.") from None
        form = MultiDictProxy(MultiDict((name, value) for name, value in posted.items() if isinstance(value, str)))
        for name in form:
            if len(form.getall(name)) > 1:
                raise OAuthError("invalid_request", f"{name[:40]}: given more than once.")
        if form.get("client_id") != CLIENT_ID:
            raise OAuthError("invalid_client", f"Unknown client: this gateway serves client_id={CLIENT_ID}.", 401)
        return form


def _one(form: MultiDictProxy[str], name: str) -> str:
    value = form.get(name, "")
    if not value:
        raise OAuthError("invalid_request", f"{name}: missing.")
    return value


def add_device_routes(
    app: web.Application,
    store: Store,
    *,
    oidc: OidcConfig | None,
    policies: Sequence[PolicyConfig] = (),
    now: Clock = system,
    provider: ProviderTokens | None = None,
) -> None:
    """POST /oauth/device/authorize and POST /oauth/token on `app`, outside the API chains (as
    the admin API's routes are); without `oidc` each answers 404 `unsupported`. With `provider`,
    a renewal asks the identity provider about the person first."""
    flow = DeviceFlow(store, oidc, policies, now, provider)
    app.router.add_post(AUTHORIZE_PATH, flow.authorize)
    app.router.add_post(TOKEN_PATH, flow.token)
