"""Sign-in through the company's identity provider (`[oidc]`): the console's side of OpenID
Connect's authorization-code flow (gateway/admin/oidc.py does the protocol).

`/console/oidc/start` sends the browser to the provider, with the state, nonce and PKCE verifier
kept in a short-lived cookie sealed with HMAC-SHA256 under `[admin] session_key` (no state is kept
on the server, so any replica takes the callback). The cookie is SameSite=Lax: the provider's
redirect back is a cross-site navigation, which a Strict cookie would not come with. The callback
checks them, records the person in the store (groups as of this sign-in) and opens their session;
it answers with a page that moves on to the console itself, so that the Strict session cookie
goes with that next, same-site, request. A sign-in started with `?next=` (a page that sent a
visitor to sign in: the device page, with its code) moves on there instead, sealed in the same
cookie; only a path of the console is taken (local_next), never another site's address."""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

from aiohttp import web

from gateway.admin.console.html import page, text
from gateway.admin.console.pages import html
from gateway.admin.console.sessions import Sessions, set_cookie
from gateway.admin.oidc import OidcError, ProviderUnavailable
from gateway.admin.provider_tokens import ProviderTokens
from gateway.config import OidcConfig

log = logging.getLogger("ezat.console")

FLOW_COOKIE = "ezat_console_oidc"
FLOW_PATH = "/console/oidc"
FLOW_SECONDS = 600  # a sign-in at the provider may take this long
CALLBACK = "/console/oidc/callback"


class IdentitySignIn:
    def __init__(self, config: OidcConfig, sessions: Sessions, provider: ProviderTokens) -> None:
        self.config = config
        self.sessions = sessions
        self.provider = provider
        self.client = provider.client

    def redirect_uri(self, request: web.Request) -> str:
        """The callback's URL as the provider has it registered: `[oidc] redirect_url`, else this
        request's own origin's."""
        return self.config.redirect_url or str(request.url.origin().with_path(CALLBACK))

    async def start(self, request: web.Request) -> web.Response:
        """To the provider; `?next=`, a console path, is where the callback's page moves on to."""
        try:
            started = await self.client.start(self.redirect_uri(request))
        except ProviderUnavailable as down:
            log.warning("the identity provider is unavailable: %s", down)
            return failed("The identity provider cannot be reached just now. An admin token still signs in.", 503)
        response = web.Response(status=303, headers={"Location": started.url})
        flow = {
            "for": FLOW_COOKIE,  # sealed with the sign-in form's key: this says which cookie it is
            "exp": int(time.time()) + FLOW_SECONDS,
            "state": started.state,
            "nonce": started.nonce,
            "verifier": started.code_verifier,
        }
        after = local_next(request.query.get("next", ""))
        if after is not None:
            flow["next"] = after
        set_cookie(
            request, response, FLOW_COOKIE, self.sessions.seal(flow), FLOW_SECONDS, path=FLOW_PATH, samesite="Lax"
        )
        return response

    async def callback(self, request: web.Request) -> web.Response:
        flow = self.sessions.open(request.cookies.get(FLOW_COOKIE, ""))
        if (
            flow is None
            or flow.get("for") != FLOW_COOKIE
            or flow.get("exp", 0) <= time.time()
            or not all(isinstance(flow.get(name), str) for name in ("state", "nonce", "verifier"))
        ):
            return failed("This sign-in has expired or did not start here: sign in again.", 400)
        try:
            identity = await self.client.finish(
                self.redirect_uri(request),
                request.query,
                state=flow["state"],
                nonce=flow["nonce"],
                code_verifier=flow["verifier"],
            )
        except ProviderUnavailable as down:
            log.warning("the identity provider is unavailable: %s", down)
            return failed("The identity provider cannot be reached just now. An admin token still signs in.", 503)
        except OidcError as refused:
            log.info("a sign-in through the identity provider was refused: %s", refused)
            return failed(str(refused), 403)
        store = self.sessions.store
        person = await store.person_signed_in(identity.subject, identity.email, identity.name, identity.groups)
        if person.disabled:
            return failed("Your access to this gateway has been disabled by an administrator.", 403)
        await self.provider.keep(store, person, identity.refresh_token)  # for renewals to ask again
        after = local_next(flow.get("next")) or "/console"
        response = html(
            page(
                "Signed in",
                f"<h1>Signed in</h1><p>Welcome, {text(person.name or person.email)}. "
                f'<a href="{text(after)}">Continue to the console</a></p>',
                head=f'<meta http-equiv="refresh" content="0;url={text(after)}">',
            )
        )
        response.del_cookie(FLOW_COOKIE, path=FLOW_PATH)
        await self.sessions.sign_in_person(request, response, person)
        return response


def failed(message: str, status: int) -> web.Response:
    return html(
        page(
            "Sign-in failed",
            f'<h1>Sign-in failed</h1><p class="error">{text(message)}</p><p><a href="/console/sign-in">Sign in</a></p>',
        ),
        status=status,
    )


def local_next(value: object) -> str | None:
    """`value` if it is a path of this console (/console, or under /console/, with a query
    perhaps), the only place a sign-in moves on to; else None. Nothing with a scheme, a host
    (`//elsewhere`), a backslash (which browsers read as a slash), a `..` segment, a fragment, or
    any character outside printable ASCII: never another site."""
    if not isinstance(value, str) or not value or len(value) > 2000:
        return None
    if not (value.isascii() and value.isprintable()) or " " in value or "\\" in value:
        return None
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or parts.fragment or "//" in parts.path or ".." in parts.path.split("/"):
        return None
    if parts.path != "/console" and not parts.path.startswith("/console/"):
        return None
    return value
