"""The console's device page, `/console/device`: where a person approves (or denies) the sign-in of a
command line, `ezat-gateway login`, by the user code it shows (gateway/admin/device.py is the
command line's side). Only a person signed in through the identity provider approves one: the
command line gets a key in their name, under their group's policy. Someone not signed in is sent
to the sign-in page and, once signed in through the provider, back here with their code (`next`);
an admin token's session has no person behind it, and is told so."""

from __future__ import annotations

from urllib.parse import urlencode

from aiohttp import web

from gateway.admin.console.actions import see_other
from gateway.admin.console.html import PAGES, csrf_field, page, text
from gateway.admin.console.pages import MY_PAGE, PEOPLE, html
from gateway.admin.console.sessions import MEMBER, Admin, Sessions
from gateway.admin.device import USER_CODE_LENGTH, VERIFICATION_PATH, normalised_user_code, shown_user_code
from gateway.admin.policies import policy_for
from gateway.config import PolicyConfig
from gateway.storage import Store
from gateway.storage.records import DEVICE_APPROVED, DEVICE_DENIED, DEVICE_USED, DeviceGrant

TITLE = "Sign in a command line"
MOST_TYPED = 40  # characters of a typed code shown back


class DevicePage:
    def __init__(self, sessions: Sessions, store: Store, policies: tuple[PolicyConfig, ...]) -> None:
        self.sessions = sessions
        self.store = store
        self.policies = policies

    async def show(self, request: web.Request) -> web.Response:
        """GET: the form, its code prefilled from `?user_code=`."""
        admin = await self.sessions.admin(request)
        if admin is None:  # signed in, they come back here with the code
            return see_other("/console/sign-in?" + urlencode({"next": request.path_qs}))
        typed = request.query.get("user_code", "")
        refused = self._refusal(request, admin)
        if refused is not None:
            return refused
        assert admin.person is not None  # _refusal said so
        policy = policy_for(admin.person.groups, self.policies)
        assert policy is not None  # _refusal said so
        body = (
            f"<h1>{TITLE}</h1>"
            "<p>A command line (<code>ezat-gateway login</code>) asks for a key in your name. Approve it only "
            "if you started it yourself, just now, and the code below is the one it shows.</p>"
            f'<form class="inline" method="post" action="{VERIFICATION_PATH}">'
            + csrf_field(admin.csrf)
            + f'<label>Code <input name="user_code" value="{text(_shown(typed))}" maxlength="{MOST_TYPED}" '
            'autocomplete="off" required autofocus></label> '
            '<button name="action" value="approve">Approve</button>'
            '<button name="action" value="deny" class="danger">Deny</button></form>'
            f'<p class="muted">Its key uses your group <b>{text(policy.group)}</b>\'s policy: models '
            f"{text(', '.join(policy.models))}; it lives {policy.key_ttl_hours} hours, and the command line "
            "may renew it while you are in a policy's group. It is listed with your keys on "
            f'<a href="{MY_PAGE[0]}">My page</a>.</p>'
        )
        return self._page(admin, body)

    async def decide(self, request: web.Request, admin: Admin, form) -> web.Response:
        """POST (its CSRF token checked by the console's guard): `action` approve or deny, for `user_code`."""
        refused = self._refusal(request, admin)
        if refused is not None:
            return refused
        assert admin.person is not None  # _refusal said so
        action = str(form.get("action", ""))
        typed = str(form.get("user_code", ""))
        if action not in ("approve", "deny"):
            return self._problem(admin, "Choose Approve or Deny.", status=400)
        code = normalised_user_code(typed)
        if code is None:
            return self._problem(
                admin,
                f"That is not a code ezat-gateway login shows: {USER_CODE_LENGTH} letters, as BCDF-GHJK.",
                status=400,
            )
        grant = await self.store.decide_device_grant(code, admin.person.id, action == "approve")
        if grant is None:
            return self._problem(admin, _why_not(code, await self.store.find_device_grant(code)), status=400)
        if action == "deny":
            body = (
                "<h1>Sign-in refused</h1>"
                f"<p>The command line that showed {text(shown_user_code(code))} gets no key: it says so in "
                "its terminal.</p>"
            )
        else:
            body = (
                "<h1>Command line signed in</h1>"
                f"<p>The command line that showed {text(shown_user_code(code))} is signed in: go back to "
                "your terminal, where <code>ezat-gateway login</code> finishes by itself. Its key is yours, "
                f'under your group\'s policy, and listed on <a href="{MY_PAGE[0]}">My page</a>.</p>'
            )
        return self._page(admin, body)

    def _refusal(self, request: web.Request, admin: Admin) -> web.Response | None:
        """The page for a session that may not approve a device: an admin token's, or a person's
        in no policy's group; else None."""
        if admin.person is None:
            again = "/console/oidc/start?" + urlencode({"next": request.path_qs})
            return self._problem(
                admin,
                "Only a person can approve a command line's sign-in, and this session is an admin token's: "
                "its key would be nobody's.",
                status=403,
                more=f'<p><a class="button" href="{text(again)}">Sign in with your identity provider</a></p>',
            )
        if policy_for(admin.person.groups, self.policies) is None:
            return self._problem(
                admin,
                "None of your groups (as of your last sign-in) has a policy on this gateway: you cannot make a "
                "key, so no command line can get one in your name.",
                status=403,
            )
        return None

    def _problem(self, admin: Admin, message: str, *, status: int, more: str = "") -> web.Response:
        return self._page(admin, f'<h1>{TITLE}</h1><div class="error">{text(message)}</div>{more}', status=status)

    def _page(self, admin: Admin, body: str, *, status: int = 200) -> web.Response:
        if admin.role == MEMBER:
            links: tuple[tuple[str, str], ...] = (MY_PAGE,)
        else:
            links = PAGES + (PEOPLE,) + ((MY_PAGE,) if admin.person else ())
        who = f"{admin.name} ({admin.role})"
        return html(page(TITLE, body, who=who, csrf=admin.csrf, links=links), status=status)


def _shown(typed: str) -> str:
    """A typed code as the form shows it back: ABCD-EFGH when it is one, else as typed (its start)."""
    code = normalised_user_code(typed)
    return shown_user_code(code) if code is not None else typed[:MOST_TYPED]


def _why_not(code: str, grant: DeviceGrant | None) -> str:
    """Why no pending grant has `code`, as the person who typed it is told."""
    shown = shown_user_code(code)
    if grant is None:
        return (
            f"No command line is waiting with the code {shown}: check it against your terminal, or run "
            "ezat-gateway login again."
        )
    if grant.status in (DEVICE_APPROVED, DEVICE_USED):
        return f"The code {shown} was approved already: its command line is signed in."
    if grant.status == DEVICE_DENIED:
        return f"The code {shown} was denied already: run ezat-gateway login again."
    return f"The code {shown} has expired: run ezat-gateway login again."  # pending, so past its time
