"""The headers on every console answer (its pages, redirects and errors alike): a strict
Content-Security-Policy, and no sniffing, referrers, framing or caching."""

from __future__ import annotations

import base64
import hashlib

from aiohttp import web

from gateway.admin.console.html import STYLE

# No script at all (default-src 'none'); the one stylesheet by its hash, so an injected <style>
# or style attribute would not apply; forms post only to the console; no page may frame it.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        f"style-src 'sha256-{base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()}'",
        "img-src 'self' data:",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",  # a page may show a secret once: no copy in a cache, nor Back
    "X-Frame-Options": "DENY",  # frame-ancestors, for browsers that predate it
}


def is_console(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


async def console_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare hook: every answer under /console gets HEADERS, the router's own
    404s and 405s too."""
    if is_console(request.path):
        response.headers.update(HEADERS)
