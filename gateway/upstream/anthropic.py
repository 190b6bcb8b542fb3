"""Anthropic's API, or any upstream that speaks its Messages API: the gateway POSTs
{base_url}/v1/messages with the deployment's x-api-key, and reads its answers as they come."""

from __future__ import annotations

from collections.abc import Mapping

from yarl import URL

from gateway.config import Deployment
from gateway.upstream.provider import (
    ClientBytes,
    KeptBetas,
    Lines,
    Outgoing,
    Provider,
    UpstreamBody,
    beta_flags,
    encoded,
)

ANTHROPIC_VERSION = "2023-06-01"


class Anthropic(Provider):
    def __init__(self, deployment: Deployment) -> None:
        super().__init__(deployment)
        self._fixed = {
            "x-api-key": deployment.api_key,
            "anthropic-version": ANTHROPIC_VERSION,
            "content-type": "application/json",
        }
        self._urls: dict[str, URL] = {}  # per path, parsed once, not per request
        # Anthropic's API ignores a flag it does not know: every flag goes, unless the config lists them.
        self._betas = KeptBetas(deployment, None) if deployment.betas is not None else None

    async def outgoing(self, body: UpstreamBody, path: str, headers: Lines, query: Mapping[str, str]) -> Outgoing:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.deployment.base_url + path)
        if query:
            url = url.with_query(query)
        data = body.raw if isinstance(body, ClientBytes) else encoded(body)
        if self._betas is not None and any(name == "anthropic-beta" for name, _ in headers):
            kept = self._betas(beta_flags(headers))
            headers = [line for line in headers if line[0] != "anthropic-beta"]
            headers += [("anthropic-beta", ",".join(kept))] if kept else []
        if not headers:
            return Outgoing(url, self._fixed, data)
        # The client's lines (each as it sent it) in place of the deployment's of the same name.
        names = {name for name, _ in headers}
        return Outgoing(url, [*((n, v) for n, v in self._fixed.items() if n not in names), *headers], data)
