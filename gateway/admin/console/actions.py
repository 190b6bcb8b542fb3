"""What the console's forms do: sign in and out, and create, revoke and rotate keys. Every change
goes through gateway/admin/changes.py, as the CLI's and the admin API's do, so the audit log
names the signed-in token as its actor. A new or rotated key's secret is shown once, on the page
that answers the POST: it is kept nowhere but in that answer."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.web_request import FileField
from multidict import MultiDictProxy

from gateway.admin import changes
from gateway.admin.changes import AdminError, row_id
from gateway.admin.console.html import page, text
from gateway.admin.console.identity import local_next
from gateway.admin.console.pages import Pages, html
from gateway.admin.console.sessions import Admin, Sessions
from gateway.admin.policies import make_person_key
from gateway.admin.tokens import Refused
from gateway.config import usd
from middlewares.core.periods import PERIODS


def see_other(location: str) -> web.Response:
    """303: the browser GETs `location` (a reload there posts nothing again)."""
    return web.Response(status=303, headers={"Location": location})


class Actions:
    def __init__(
        self, sessions: Sessions, pages: Pages, forget_key: Callable[[str], None], *, single_sign_on: bool = False
    ) -> None:
        self.sessions = sessions
        self.pages = pages
        self.store = pages.store
        self.forget_key = forget_key
        self.single_sign_on = single_sign_on  # [oidc]: the sign-in page offers the identity provider

    # --- signing in and out

    async def sign_in_form(self, request: web.Request) -> web.Response:
        """The sign-in page; `?next=` (a console path: identity.local_next) is where signing in
        moves on to, through the identity provider or with a token."""
        after = local_next(request.query.get("next", ""))
        if await self.sessions.admin(request) is not None:
            return see_other(after or "/console")
        return self._sign_in_page(request, after=after)

    def _sign_in_page(
        self, request: web.Request, *, error: str = "", status: int = 200, after: str | None = None
    ) -> web.Response:
        response = html("", status=status)
        csrf = self.sessions.sign_in_nonce(request, response)
        problem = f'<p class="error">{text(error)}</p>' if error else ""
        start = "/console/oidc/start" + (f"?{urlencode({'next': after})}" if after else "")
        provider = (
            f'<p><a class="button" href="{text(start)}">Sign in with your identity provider</a></p>'
            '<p class="muted">Or with an admin token:</p>'
            if self.single_sign_on
            else ""
        )
        moves_on = f'<input type="hidden" name="next" value="{text(after)}">' if after else ""
        response.text = page(
            "Sign in",
            '<form class="sign-in" method="post" action="/console/sign-in">'
            "<h1>ezat-gateway console</h1>"
            f"{problem}{provider}"
            f'<input type="hidden" name="csrf" value="{text(csrf)}">{moves_on}'
            '<label>Admin token<input type="password" name="token" autocomplete="off" required autofocus></label>'
            "<button>Sign in</button>"
            '<p class="muted">An admin token from the config file\'s [[admin.tokens]], or from '
            "<code>ezat-gateway admin-tokens create</code>.</p></form>",
        )
        return response

    async def sign_in(self, request: web.Request) -> web.Response:
        form = await read_form(request)
        if form is None:
            return unreadable_form()
        if not self.sessions.sign_in_csrf_holds(request, str(form.get("csrf", ""))):
            return forbidden("The form has expired or did not come from this console: open the sign-in page again.")
        token = str(form.get("token", "")).strip()
        after = local_next(form.get("next", ""))
        found = await self.sessions.tokens.check(token, request.remote or "")
        if isinstance(found, Refused) and found.wait:
            response = self._sign_in_page(
                request,
                error=f"Too many failed sign-ins from this address: try again in {found.wait} s.",
                status=429,
                after=after,
            )
            response.headers["Retry-After"] = str(found.wait)
            return response
        if isinstance(found, Refused):
            return self._sign_in_page(request, error="That is not a valid admin token.", status=401, after=after)
        response = see_other(after or "/console")
        await self.sessions.sign_in(request, response, token)
        return response

    async def sign_out(self, request: web.Request, admin: Admin, form) -> web.Response:
        response = see_other("/console/sign-in")
        await self.sessions.sign_out(request, response)
        return response

    # --- people

    async def disable_person(self, request: web.Request, admin: Admin, form) -> web.Response:
        return await self._set_disabled(request, admin, True)

    async def enable_person(self, request: web.Request, admin: Admin, form) -> web.Response:
        return await self._set_disabled(request, admin, False)

    async def _set_disabled(self, request: web.Request, admin: Admin, disabled: bool) -> web.Response:
        """Audited as the admin API's are; a disabled person's sessions end on their next page."""
        person_id = row_id(request.match_info["id"])
        person = None
        if person_id is not None:
            person = await changes.set_person_disabled(self.store, admin.name, person_id, disabled, self.forget_key)
        if person is None:
            return await self.pages.people_list(request, admin, error="No such person.", status=404)
        return see_other("/console/people")

    # --- a person's own keys

    async def make_my_key(self, request: web.Request, admin: Admin, form) -> web.Response:
        """A key for the signed-in person, living their policy's key_ttl_hours (as `ezat-gateway
        login`'s keys are: policies.make_person_key); its secret shown once. The name is optional."""
        person = admin.person
        if person is None:
            return forbidden("Only a person who signed in through the identity provider has keys of their own.")
        name = str(form.get("name", ""))
        try:
            key, secret = await make_person_key(self.store, person, self.pages.policies, self.pages.now(), name=name)
        except AdminError as refused:
            return await self.pages.me(request, admin, error=refused.message, status=refused.status)
        expires = f"{key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "never"
        said = f"Key {key.id} ({key.name or 'no name'}) was made; it expires {expires}."
        return await self.pages.me(request, admin, notice=_secret_notice(said, secret))

    async def revoke_my_key(self, request: web.Request, admin: Admin, form) -> web.Response:
        person = admin.person
        key = await changes.find_key(self.store, request.match_info["id"])
        if person is None or key is None or key.person_id != person.id:  # only one's own: others' are not found
            return await self.pages.me(request, admin, error="You have no such key.", status=404)
        await changes.revoke_key(self.store, admin.name, key, forget_key=self.forget_key)
        return see_other("/console/me")

    # --- keys

    async def create_key(self, request: web.Request, admin: Admin, form) -> web.Response:
        # As given, not trimmed: the CLI and the API take names so (changes refuses a space at an end).
        name = str(form.get("name", ""))
        organization = str(form.get("organization", "")) or None
        limit_text = str(form.get("spend_limit_usd", "")).strip()
        fields: dict = {"name": name}  # checked by changes.create_key, as the CLI's and the API's are
        period = str(form.get("budget_period", "")).strip()
        if period:
            if period not in PERIODS:
                return await self._refused(request, admin, "Budget period: expected day, week or month.")
            fields["budget_period"] = period
        if limit_text and limit_text.lower() != "none":
            try:
                fields["spend_limit_usd"] = usd(limit_text)
            except ValueError as problem:
                return await self._refused(request, admin, f"Spend limit: {problem}.")
        try:
            key, secret = await changes.create_key(self.store, admin.name, organization=organization, **fields)
        except AdminError as refused:
            return await self._refused(request, admin, refused.message, refused.status)
        return await self.pages.keys(
            request, admin, notice=_secret_notice(f"Key {key.id} ({key.name}) was created.", secret)
        )

    # Revoking and rotating ask first: the key's buttons GET a page that says what will happen,
    # whose one form POSTs (with the session's CSRF token) to do it; Cancel goes back to the key.

    async def confirm_revoke(self, request: web.Request, admin: Admin) -> web.Response:
        return await self._confirm(
            request,
            admin,
            "revoke",
            "Revoke key {}?",
            "Its requests get 401 from now on (on other gateway processes within seconds). Its settings, "
            "spend and ledger rows stay; ezat-gateway keys update --unrevoke makes it usable again.",
        )

    async def confirm_rotate(self, request: web.Request, admin: Admin) -> web.Response:
        return await self._confirm(
            request,
            admin,
            "rotate",
            "Give key {} a new secret?",
            "The new secret is shown once, on the next page. The old one stops working at once on this "
            "process and within seconds on the others. Its id, settings, spend and ledger rows stay.",
        )

    async def _confirm(
        self, request: web.Request, admin: Admin, verb: str, question: str, consequence: str
    ) -> web.Response:
        if not admin.writes:
            return forbidden(f"Admin token {admin.name!r} is a viewer's: it may look, not change.")
        key = await changes.find_key(self.store, request.match_info["id"])
        if key is None:
            return await self._refused(request, admin, "No such key.", 404)
        if key.from_config or key.revoked:
            why = "is declared in the config file: change it there" if key.from_config else "is revoked already"
            return await self._refused(request, admin, f"Key {_named(key)} {why}.", 409)
        return self.pages.confirmation(
            admin,
            question.format(_named(key)),
            consequence,
            action=f"/console/keys/{key.id}/{verb}",
            button=verb.capitalize(),
            cancel=f"/console/keys/{key.id}",
            danger=verb == "revoke",
        )

    async def revoke_key(self, request: web.Request, admin: Admin, form) -> web.Response:
        key = await changes.find_key(self.store, request.match_info["id"])
        if key is None:
            return await self._refused(request, admin, "No such key.", 404)
        try:
            revoked = await changes.revoke_key(self.store, admin.name, key, forget_key=self.forget_key)
        except AdminError as refused:
            return await self._refused(request, admin, refused.message, refused.status)
        said = (
            f"Key {_named(key)} was revoked already: nothing changed."
            if key.revoked
            else f"Key {_named(revoked)} was revoked: its requests get 401 from now on."
        )
        return await self.pages.keys(request, admin, notice=f'<div class="notice"><p>{text(said)}</p></div>')

    async def rotate_key(self, request: web.Request, admin: Admin, form) -> web.Response:
        key = await changes.find_key(self.store, request.match_info["id"])
        if key is None:
            return await self._refused(request, admin, "No such key.", 404)
        try:
            rotated, secret = await changes.rotate_key(self.store, admin.name, key, forget_key=self.forget_key)
        except AdminError as refused:
            return await self._refused(request, admin, refused.message, refused.status)
        said = (
            f"Key {_named(rotated)} has a new secret; the old one stops working within seconds "
            "(at once on this process)."
        )
        return await self.pages.keys(request, admin, notice=_secret_notice(said, secret))

    async def _refused(self, request: web.Request, admin: Admin, message: str, status: int = 400) -> web.Response:
        return await self.pages.keys(request, admin, error=message, status=status)


def _named(key) -> str:
    return f"{key.id} ({key.name or 'no name'})"


def _secret_notice(said: str, secret: str) -> str:
    return (
        f'<div class="notice"><p>{text(said)} Its secret is shown only this once: copy it now.</p>'
        f'<p><code class="secret" id="secret">{text(secret)}</code></p></div>'
    )


async def read_form(request: web.Request) -> MultiDictProxy[str | bytes | bytearray | FileField] | None:
    """The request's form, urlencoded or multipart; None if it cannot be read (a charset unknown,
    bytes that are not in it, a multipart body without its boundary or with a part's encoding
    unknown). aiohttp's parsers raise many kinds of exception for those, some quoting the body,
    so each is answered alike and none logged."""
    try:
        return await request.post()
    except web.HTTPException:  # 413 past the size limit, 400 for too many fields: answers already
        raise
    except Exception:
        return None


def unreadable_form() -> web.Response:
    """The answer to a form read_form could not read: it quotes nothing of it."""
    return html(page("Bad request", "<h1>Bad request</h1><p>The form could not be read.</p>"), status=400)


def forbidden(message: str) -> web.Response:
    return html(page("Forbidden", f"<h1>Forbidden</h1><p>{text(message)}</p>"), status=403)
