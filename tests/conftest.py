"""Shared fixtures: a real mock upstream and a real gateway, both on loopback."""

from __future__ import annotations

import pytest

from gateway.app import build_app
from gateway.config import Config
from gateway.mock_upstream import MockUpstream
from tests.support import UPSTREAM_KEY, Gateway, make_config


@pytest.fixture
async def upstream():
    mock = MockUpstream(api_key=UPSTREAM_KEY)
    await mock.start()
    yield mock
    await mock.close()


@pytest.fixture
async def start_gateway(upstream):
    """Starts a gateway in front of `upstream`; keyword arguments go to build_app."""
    started: list[Gateway] = []

    async def start(config: Config | None = None, **app_options) -> Gateway:
        gateway = await Gateway(build_app(config or make_config(upstream.url), **app_options)).start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        await gateway.runner.cleanup()


@pytest.fixture
async def gateway(start_gateway) -> Gateway:
    return await start_gateway()


@pytest.fixture
async def client(gateway):
    async with gateway.client() as c:
        yield c
