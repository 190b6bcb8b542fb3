"""The console, `/console`: the gateway's administration in a browser (docs/admin.md, "The console").

Server-rendered HTML with inline SVG plots, no script and nothing loaded from elsewhere, served
by the gateway itself when the config has an `[admin]` table. Signed in with an admin token (the
admin API's: a `viewer` sees everything, an `admin` may also change keys), or, with `[oidc]`,
through the company's identity provider (a person's role comes from their groups; a person in
none of [[oidc.roles]]' groups is a member, who sees their own page only); every POST carries
the session's CSRF token. One concern per module: sessions.py (the cookie, who is signed in),
identity.py (signing in through the identity provider), device.py (a person approving
`ezat-gateway login`'s sign-in), headers.py (the CSP and the others),
html.py and plots.py (the markup), numbers.py (the figures, the usage report's), pages.py (what
is shown), actions.py (what the forms do)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.admin.console.actions import Actions, forbidden, read_form, see_other, unreadable_form
from gateway.admin.console.device import DevicePage
from gateway.admin.console.headers import console_headers, is_console
from gateway.admin.console.html import page, text
from gateway.admin.console.identity import CALLBACK, IdentitySignIn
from gateway.admin.console.pages import Pages, html
from gateway.admin.console.sessions import MEMBER, Sessions, csrf_holds
from gateway.admin.provider_tokens import ProviderTokens
from gateway.admin.tokens import admin_tokens
from gateway.clock import Clock, system
from gateway.config import AdminConfig, OidcConfig, PolicyConfig
from gateway.storage import Store
from middlewares.core.errors import GatewayError

__all__ = ["add_console_routes", "is_console", "refusal_page"]


def add_console_routes(
    app: web.Application,
    config: AdminConfig,
    store: Store,
    *,
    oidc: OidcConfig | None = None,
    policies: tuple[PolicyConfig, ...] = (),
    provider: ProviderTokens | None = None,
    forget_key: Callable[[str], None] | None = None,
    now: Clock = system,
) -> None:
    """The console's routes on `app`, and its headers on every answer under /console; with `oidc`,
    sign-in through the identity provider and the people pages. `forget_key(digest)` drops a key
    revoked or rotated from the auth stage's cache; `now` is the gateway's idea of now, for the
    plots' days."""
    sessions = Sessions(admin_tokens(app, config, store), config, store, oidc)
    pages = Pages(store, now, people=oidc is not None, policies=policies)
    actions = Actions(sessions, pages, forget_key or (lambda digest: None), single_sign_on=oidc is not None)

    def reads(handler, *, members: bool = False):
        """A page for a session; a member's only where `members` says so (else their own page)."""

        async def guard(request: web.Request) -> web.StreamResponse:
            admin = await sessions.admin(request)
            if admin is None:
                return see_other("/console/sign-in")
            if admin.role == MEMBER and not members:
                return see_other("/console/me")
            return await handler(request, admin)

        return guard

    def posts(handler, *, writes: bool = True):
        """A form's POST for a session, with its CSRF token; `writes`: an admin's only (else any
        session's, a member's too: signing out, their own keys)."""

        async def guard(request: web.Request) -> web.StreamResponse:
            admin = await sessions.admin(request)
            if admin is None:
                return forbidden("Sign in first: your session has ended or was never there.")
            form = await read_form(request)
            if form is None:
                return unreadable_form()
            if not csrf_holds(admin.csrf, str(form.get("csrf", ""))):
                return forbidden("The form did not come from this console's session: open the page again.")
            if writes and not admin.writes:
                return forbidden(f"Admin token {admin.name!r} is a viewer's: it may look, not change.")
            return await handler(request, admin, form)

        return guard

    app.on_response_prepare.append(console_headers)
    router = app.router
    router.add_get("/console/sign-in", actions.sign_in_form)
    router.add_post("/console/sign-in", actions.sign_in)
    router.add_post("/console/sign-out", posts(actions.sign_out, writes=False))
    router.add_get("/console", reads(pages.overview))
    router.add_get("/console/keys", reads(pages.keys))
    router.add_post("/console/keys", posts(actions.create_key))
    router.add_get("/console/keys/{id}", reads(pages.key))
    router.add_get("/console/keys/{id}/revoke", reads(actions.confirm_revoke))
    router.add_post("/console/keys/{id}/revoke", posts(actions.revoke_key))
    router.add_get("/console/keys/{id}/rotate", reads(actions.confirm_rotate))
    router.add_post("/console/keys/{id}/rotate", posts(actions.rotate_key))
    router.add_get("/console/organizations", reads(pages.organizations))
    router.add_get("/console/audit", reads(pages.audit))
    router.add_get("/console/me", reads(pages.me, members=True))
    if oidc is not None:
        assert provider is not None  # with [oidc], the app's
        identity = IdentitySignIn(oidc, sessions, provider)
        router.add_get("/console/oidc/start", identity.start)
        router.add_get(CALLBACK, identity.callback)
        router.add_get("/console/people", reads(pages.people_list))
        router.add_post("/console/people/{id}/disable", posts(actions.disable_person))
        router.add_post("/console/people/{id}/enable", posts(actions.enable_person))
        router.add_post("/console/me/keys", posts(actions.make_my_key, writes=False))
        router.add_post("/console/me/keys/{id}/revoke", posts(actions.revoke_my_key, writes=False))
        device = DevicePage(sessions, store, policies)  # its GET sends visitors to sign in, and back
        router.add_get("/console/device", device.show)
        router.add_post("/console/device", posts(device.decide, writes=False))
    router.add_route("*", "/console/{anything:.*}", not_found)  # an HTML 404 (or 405), not the API's JSON


async def not_found(request: web.Request) -> web.Response:
    if request.path == "/console/" and request.method in ("GET", "HEAD"):
        return see_other("/console")
    return html(
        page("Not found", f'<h1>Not found</h1><p>Nothing at {text(request.path)}. <a href="/console">Overview</a></p>'),
        status=404,
    )


def refusal_page(error: GatewayError) -> web.Response:
    """The console's page for a request the app's error guard refuses (its database unavailable):
    the error's message, status and headers (`retry-after`), as a page, not the API's JSON."""
    response = html(page("Unavailable", f"<h1>Unavailable</h1><p>{text(error.message)}</p>"), status=error.status)
    response.headers.update({name: value for name, value in error.headers.items() if name.lower() == "retry-after"})
    return response
