"""Claude on Google Vertex AI: rawPredict, streamRawPredict and the count-tokens model.

The body is Anthropic's without `model` (the path names it; the count takes it in the body),
with Vertex's `anthropic_version`; the kept beta flags stay in the `anthropic-beta` header.
Answers and streams are Anthropic's own bytes. The Bearer token is an OAuth 2 access token
from google-auth (a service-account key file, or Application Default Credentials): fetched
once, refreshed before it expires, in a thread, one refresh at a time; never one a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import google.auth
import urllib3
from google.auth.transport.urllib3 import Request
from google.oauth2 import service_account
from multidict import CIMultiDictProxy
from yarl import URL

from gateway.config import Deployment
from gateway.upstream.errors import upstream_error
from gateway.upstream.provider import (
    COUNT_TOKENS,
    KeptBetas,
    Lines,
    Outgoing,
    Provider,
    SingleFlight,
    UpstreamBody,
    beta_flags,
    encoded,
    parsed,
)
from middlewares.core.errors import GatewayError

log = logging.getLogger("ezat.upstream")

VERTEX_VERSION = "vertex-2023-10-16"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
# The beta flags Vertex AI takes for Claude (it refuses a request with any other).
VERTEX_BETAS = frozenset(
    {
        "computer-use-2024-10-22",
        "computer-use-2025-01-24",
        "computer-use-2025-11-24",
        "interleaved-thinking-2025-05-14",
        "context-1m-2025-08-07",
        "context-management-2025-06-27",
        "tool-search-tool-2025-10-19",
        "web-search-2025-03-05",
        "mid-conversation-system-2026-04-07",
    }
)
# The body's fields the gateway sets (the path names the model): a client's own anthropic_beta
# would pass flags Vertex refuses.
_SET_HERE = frozenset({"model", "anthropic_version", "anthropic_beta"})
# How long a token request may take: google-auth sets no timeout of its own.
_TOKEN_TIMEOUT = urllib3.Timeout(connect=10, read=30)


class Vertex(Provider):
    def __init__(self, deployment: Deployment) -> None:
        super().__init__(deployment)
        self._betas = KeptBetas(deployment, VERTEX_BETAS)
        self._models = f"{deployment.base_url}/projects/{deployment.project}/locations/{deployment.region}/publishers/anthropic/models"
        self._tokens = _Tokens(deployment)

    async def outgoing(self, body: UpstreamBody, path: str, headers: Lines, query: Mapping[str, str]) -> Outgoing:
        request = parsed(body)
        predict = {k: v for k, v in request.items() if k not in _SET_HERE}
        predict["anthropic_version"] = VERTEX_VERSION
        if path == COUNT_TOKENS:
            predict["model"] = request.get("model")
            target = "count-tokens:rawPredict"
        else:
            target = f"{request.get('model')}:{'streamRawPredict' if request.get('stream') else 'rawPredict'}"
        sent = {"content-type": "application/json", "authorization": f"Bearer {await self._tokens.token()}"}
        if betas := self._betas(beta_flags(headers)):
            sent["anthropic-beta"] = ",".join(betas)
        return Outgoing(URL(f"{self._models}/{target}"), sent, encoded(predict))

    def error(self, status: int, body: bytes, headers: CIMultiDictProxy[str], path: str) -> GatewayError:
        """Google's envelope for its own refusals (auth, routing, quota), Anthropic's for the
        model's: both carry error.message. A 401 or 403 is the gateway's own credential's."""
        if status in (401, 403):
            log.error("Vertex AI refused deployment %s's credentials: %s", self.deployment.name, body[:200])
            return GatewayError(500, "The upstream rejected the gateway's credentials.", type="server_error")
        return upstream_error(status, body, headers)


class _Tokens:
    """A deployment's access tokens: its credentials found once, a token fetched when there is
    none or it is within google-auth's refresh window of expiring; one fetch at a time, which
    every request that needs it waits for."""

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self._credentials: Any = None
        self._http = Request(urllib3.PoolManager(timeout=_TOKEN_TIMEOUT))
        self._run = SingleFlight(self._refreshed)

    async def token(self) -> str:
        credentials = self._credentials
        if credentials is not None and credentials.valid:
            return str(credentials.token)
        try:
            return await self._run()
        except Exception as error:  # google-auth's, the key file's OSError, a malformed key: any
            log.error("deployment %s: could not get a Google access token: %s", self._deployment.name, error)
            raise GatewayError(500, "The gateway could not sign in to the upstream.", type="server_error") from None

    def _refreshed(self) -> str:
        """In a thread: the credentials found (once), a token fetched if theirs is not valid."""
        if self._credentials is None:
            if self._deployment.credentials_file:
                self._credentials = service_account.Credentials.from_service_account_file(
                    self._deployment.credentials_file, scopes=[CLOUD_PLATFORM]
                )
            else:
                self._credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
        if not self._credentials.valid:
            self._credentials.refresh(self._http)
        return str(self._credentials.token)
