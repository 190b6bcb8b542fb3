"""What the tests share: the test config and a gateway served on loopback."""

from __future__ import annotations

import hashlib
import socket
from decimal import Decimal

import openai
from aiohttp import web

from gateway.app import build_app
from gateway.config import Config, Deployment, KeyConfig, Model, Pricing, StorageConfig

KEY = "sk-test-key"
MODEL = "anthropic/claude-sonnet-5-5"
UPSTREAM_MODEL = "claude-sonnet-5-5"
UPSTREAM_KEY = "upstream-secret"


def make_config(upstream_url: str, storage_url: str = "sqlite:///:memory:", **model_fields) -> Config:
    model = Model(
        id=MODEL,
        upstream_model=UPSTREAM_MODEL,
        deployments=("primary",),
        max_output_tokens=model_fields.pop("max_output_tokens", 64000),
        pricing=Pricing(Decimal("3"), Decimal("15"), Decimal("3.75"), Decimal("0.30")),
        **model_fields,
    )
    small = Model(id="test/small", upstream_model="small-1", deployments=("primary",), max_output_tokens=4096)
    return Config(
        storage=StorageConfig(url=storage_url),
        deployments=(Deployment(name="primary", base_url=upstream_url, api_key=UPSTREAM_KEY),),
        models=(model, small),
        keys=(KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest()),),
    )


def free_port() -> int:
    """A loopback port nothing listens on (for a server a test starts as a process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """A gateway app served on a free loopback port, exactly as `ezat-gateway serve` runs it."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.url = ""

    async def start(self) -> Gateway:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.AsyncOpenAI(base_url=self.url + "/openai/v1", max_retries=0, **kwargs)

    def sync_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.OpenAI(base_url=self.url + "/openai/v1", max_retries=0, **kwargs)
