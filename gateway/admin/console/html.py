"""The console's HTML: one page layout, its stylesheet, and the small pieces every page uses.

Every value a person set (a key's or an organization's name, an audit entry's actor and what it
changed, a model's name) goes through `text()`, which escapes it: a key named `<script>` shows as
those characters. Pages hold no script, and their one stylesheet is allowed by its hash
(headers.py), so nothing injected could run or restyle them."""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 0.6em 1.5em; display: flex; gap: 1.5em; align-items: center; }
header a { color: #cfd6e4; text-decoration: none; }
header a.here { color: #fff; font-weight: 600; }
header .who { margin-left: auto; color: #cfd6e4; }
header form { margin: 0; }
main { padding: 1em 1.5em 3em; max-width: 1100px; }
h1 { font-size: 1.4em; margin: 0.4em 0 0.6em; }
h2 { font-size: 1.1em; margin: 1.4em 0 0.5em; }
table { border-collapse: collapse; background: #fff; width: 100%; }
th, td { text-align: left; padding: 0.35em 0.7em; border-bottom: 1px solid #e3e6eb; vertical-align: top; }
th { font-weight: 600; background: #eef0f4; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td form { display: inline; margin: 0; }
code { font-family: ui-monospace, monospace; font-size: 0.9em; }
dl.fields { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 0 0.6em; margin: 0; font-size: 0.9em; }
dl.fields dt { color: #667085; }
dl.fields dd { margin: 0; overflow-wrap: break-word; }
details summary { color: #667085; cursor: pointer; font-size: 0.85em; }
.figures { display: flex; gap: 1em; flex-wrap: wrap; }
.figure { background: #fff; padding: 0.7em 1em; border: 1px solid #e3e6eb; min-width: 11em; }
.figure b { display: block; font-size: 1.5em; }
.notice { background: #fff8d6; border: 1px solid #e6cf6a; padding: 0.7em 1em; margin: 1em 0; }
.secret { font-size: 1.05em; background: #fff; padding: 0.3em 0.5em; border: 1px solid #c9ced8; }
.error { background: #fde8e8; border: 1px solid #e4a0a0; padding: 0.7em 1em; margin: 1em 0; }
.muted { color: #667085; }
.revoked { color: #98a2b3; }
svg { display: block; background: #fff; border: 1px solid #e3e6eb; }
svg .bar { fill: #3e6fd8; }
svg .track { fill: #e3e6eb; }
svg .used { fill: #3e6fd8; }
svg .over { fill: #d64545; }
svg text { font: 11px system-ui, sans-serif; fill: #667085; }
svg line { stroke: #98a2b3; }
svg line.rule { stroke: #e3e6eb; }
td svg { border: 0; display: inline-block; vertical-align: middle; background: none; }
form.inline input, form.inline select, form.inline button { margin-right: 0.5em; }
input, select, button { font: inherit; padding: 0.25em 0.5em; }
button { cursor: pointer; }
a.button { font-size: 0.9em; padding: 0.15em 0.5em; border: 1px solid #c9ced8; border-radius: 3px; background: #fff;
  color: inherit; text-decoration: none; white-space: nowrap; }
button.danger, a.button.danger { color: #a11; }
.confirm { display: flex; gap: 1em; align-items: center; }
.confirm form { margin: 0; }
.sign-in { max-width: 26em; margin: 4em auto; background: #fff; padding: 1.5em 2em; border: 1px solid #e3e6eb; }
.sign-in input { width: 100%; box-sizing: border-box; margin: 0.4em 0 1em; }
"""

PAGES: tuple[tuple[str, str], ...] = (
    ("/console", "Overview"),
    ("/console/keys", "Keys"),
    ("/console/organizations", "Organizations"),
)
PAGES += (("/console/audit", "Audit log"),)


def text(value: Any) -> str:
    """A value as HTML text, escaped (quotes too: it may go into an attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def csrf_field(csrf: str) -> str:
    return f'<input type="hidden" name="csrf" value="{text(csrf)}">'


def button_form(action: str, label: str, csrf: str, *, danger: bool = False) -> str:
    """A form that is one button, POSTing the CSRF token to `action`."""
    kind = ' class="danger"' if danger else ""
    return f'<form method="post" action="{text(action)}">{csrf_field(csrf)}<button{kind}>{text(label)}</button></form>'


def table(header: Iterable[str], rows: Iterable[Iterable[str]], *, numeric: Iterable[int] = ()) -> str:
    """A table of cells that are HTML already (escape values with text() first); columns in
    `numeric` are right-aligned."""
    numeric = set(numeric)
    head = "".join(f"<th{' class=num' if i in numeric else ''}>{text(h)}</th>" for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if i in numeric else ''}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(
    title: str,
    body: str,
    *,
    here: str = "",
    who: str = "",
    csrf: str = "",
    links: tuple[tuple[str, str], ...] = PAGES,
    head: str = "",
) -> str:
    """A whole page: the navigation (when signed in: `links`, `who` and the sign-out button), then
    `body`; `head` is markup for the page's head (HTML already)."""
    nav = ""
    if who:
        nav_links = "".join(
            f'<a href="{path}"{" class=here" if path == here else ""}>{name}</a>' for path, name in links
        )
        sign_out = button_form("/console/sign-out", "Sign out", csrf)
        nav = f'<header><b>ezat-gateway</b>{nav_links}<span class="who">{text(who)}</span>{sign_out}</header>'
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{text(title)} · ezat-gateway console</title>"
        f"<style>{STYLE}</style>{head}</head>"
        f"<body>{nav}<main>{body}</main></body></html>\n"
    )
