"""Stages that stand alone: each one mounted in a foreign aiohttp app, as another team would
mount it, with its own handler; the chain's order checked before it serves; admission (the
limits stage) before any image is downloaded; and the imports that keep stages apart."""

from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from aioresponses import aioresponses

from gateway.app import chain
from gateway.config import ImagesConfig, KeyConfig
from gateway.upstream.client import UpstreamClient
from gateway.upstream.proxy import proxy_handler
from middlewares.auth import auth_middleware
from middlewares.billing import billing_middleware
from middlewares.bounds import bounds_middleware
from middlewares.cache_breakpoints import cache_breakpoints_middleware
from middlewares.core import API_KEY, BODY, SESSION, ChainError, GatewayError, KeyRecord, checked, stage
from middlewares.core import MODEL as MODEL_KEY
from middlewares.images import ImageLimits, images_middleware
from middlewares.limits import limits_middleware
from middlewares.refusals import refusals_middleware
from middlewares.size_limit import size_limit_middleware
from middlewares.translator import translator_middleware
from tests.support import KEY, MODEL, Gateway, make_config, setting
from tests.test_images import PNG, FakedResponse, ImageServer

ROOT = Path(__file__).resolve().parents[1]
HELLO = {"model": "any", "messages": [{"role": "user", "content": "Hi"}]}


async def echo_body(request: web.Request) -> web.Response:
    """A foreign app's handler: it answers with the body the stages parsed (and changed)."""
    return web.json_response({"body": request[BODY]})


async def serve(app: web.Application) -> Gateway:
    return await Gateway(app).start()


@pytest.fixture
async def foreign():
    """Starts foreign apps on loopback; each is cleaned up after the test."""
    started: list[Gateway] = []

    async def start(middlewares, handler=echo_body, *, on_app=None) -> Gateway:
        app = web.Application(middlewares=checked(middlewares))
        app.router.add_post("/chat", handler)
        if on_app is not None:
            on_app(app)
        started.append(await serve(app))
        return started[-1]

    yield start
    for app in started:
        await app.runner.cleanup()


async def post(app: Gateway, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(app.url + "/chat", data=data, headers=headers) as response:
            return response.status, await response.json()


# --- size_limit and refusals in a foreign app ---------------------------------------------------


async def test_size_limit_and_refusals_refuse_n_2_with_the_exact_400(foreign):
    app = await foreign([size_limit_middleware(), refusals_middleware()])
    status, answer = await post(app, {**HELLO, "n": 2})
    assert status == 400
    assert answer == {
        "error": {
            "message": "n: only 1 choice per request is supported",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }


async def test_a_valid_body_reaches_the_foreign_handler_parsed(foreign):
    app = await foreign([size_limit_middleware(), refusals_middleware()])
    status, answer = await post(app, {**HELLO, "temperature": 0.5})
    assert status == 200
    assert answer == {"body": {**HELLO, "temperature": 0.5}}


async def test_a_body_over_the_limit_gets_413_before_it_is_read(foreign):
    app = await foreign([size_limit_middleware(max_bytes=1024), refusals_middleware()])
    port = int(app.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # Headers that announce 10 MB, then only a few bytes of it: the answer comes without
        # the rest ever being sent.
        writer.write(
            b"POST /chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 10485760\r\n\r\n{"model":'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413")
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        error = json.loads(await reader.readexactly(length))["error"]
    finally:
        writer.close()
    assert error["code"] == "request_too_large"
    assert error["message"] == "The request body is over 1,024 bytes."


async def test_size_limit_refuses_a_bad_setting_when_built():
    with pytest.raises(ValueError, match="max_bytes"):
        size_limit_middleware(max_bytes=0)


@pytest.mark.parametrize(
    ("setting", "refused"),
    [
        ({"urls": 0}, "urls must be a positive integer"),
        ({"downloads_per_key": 1.5}, "downloads_per_key must be a positive integer"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"redirects": -1}, "redirects must be 0 or more"),
    ],
)
def test_the_image_limits_refuse_a_bad_setting_when_built(setting, refused):
    with pytest.raises(ValueError, match=f"^ImageLimits: {refused}$"):
        images_middleware(ImageLimits(**setting))


# --- The image fetcher alone ---------------------------------------------------------------------


async def test_the_image_fetcher_alone_puts_data_urls_in_place_of_image_urls(foreign):
    images = images_middleware()
    app = await foreign([size_limit_middleware(), images], on_app=lambda a: a.cleanup_ctx.append(images.cleanup_ctx))
    url = "https://images.example/cat.png"  # an outside host, faked
    body = {
        "model": "any",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    with aioresponses(passthrough=[app.url]) as mocked:
        mocked.get(url, response_class=FakedResponse, body=PNG, content_type="text/plain")
        status, answer = await post(app, body)
    assert status == 200
    part = answer["body"]["messages"][0]["content"][1]
    assert part == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
    }


async def test_the_image_fetcher_still_refuses_private_hosts_in_a_foreign_app(foreign):
    server = await ImageServer().start()
    try:
        url = server.serve("/cat.png", PNG)
        images = images_middleware()
        app = await foreign(
            [size_limit_middleware(), images], on_app=lambda a: a.cleanup_ctx.append(images.cleanup_ctx)
        )
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        status, answer = await post(app, body)
    finally:
        await server.close()
    assert status == 400
    assert answer["error"]["message"] == "messages[0].content[0].image_url.url: the host is not a public address"
    assert server.hits["/cat.png"] == 0


async def test_the_image_fetcher_without_its_cleanup_ctx_says_so_and_leaks_nothing(foreign):
    app = await foreign([size_limit_middleware(), images_middleware()])
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.example/a.png"}}]}
        ]
    }
    status, answer = await post(app, body)
    assert status == 500
    assert answer["error"]["message"] == "The image fetcher is not running."


# --- auth with a key store of the foreign app's own ------------------------------------------------


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"name": request[API_KEY].name})


async def test_auth_with_a_dict_backed_lookup(foreign):
    keys = {hashlib.sha256(b"sk-team").hexdigest(): KeyRecord(id=7, name="team", key_sha256="…")}

    async def find_key(digest: str) -> KeyRecord | None:
        return keys.get(digest)

    app = await foreign([auth_middleware(find_key=find_key, cache_seconds=0)], whoami)
    assert await post(app, b"{}", {"Authorization": "Bearer sk-team"}) == (200, {"name": "team"})
    assert await post(app, b"{}", {"x-api-key": "sk-team"}) == (200, {"name": "team"})
    status, answer = await post(app, b"{}", {"Authorization": "Bearer sk-other"})
    assert (status, answer["error"]["code"], answer["error"]["message"]) == (
        401,
        "invalid_api_key",
        "Incorrect API key provided.",
    )


def counting_arrivals(arrived: list[str]):
    """A stage in front of auth: each request's key as it arrives, before it waits on a lookup."""

    @web.middleware
    async def arrivals(request: web.Request, handler) -> web.StreamResponse:
        arrived.append(request.headers.get("x-api-key", ""))
        return await handler(request)

    return arrivals


async def until(condition) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_requests_that_arrive_together_share_one_lookup_of_their_key(foreign):
    # A replica that starts under load: every request misses the empty cache at once.
    team = KeyRecord(id=7, name="team", key_sha256="…")
    asked: list[str] = []
    arrived: list[str] = []
    answer = asyncio.Event()

    async def find_key(digest: str) -> KeyRecord | None:
        asked.append(digest)
        await answer.wait()
        return team if digest == hashlib.sha256(b"sk-team").hexdigest() else None

    app = await foreign([counting_arrivals(arrived), auth_middleware(find_key=find_key)], whoami)
    keys = ["sk-team"] * 20 + ["sk-other"] * 5
    waiting = [asyncio.ensure_future(post(app, b"{}", {"x-api-key": key})) for key in keys]
    await until(lambda: len(arrived) == len(keys))  # all 25 are in auth, waiting on a lookup
    await asyncio.sleep(0.05)
    answer.set()
    answers = await asyncio.gather(*waiting)
    assert sorted(asked) == sorted(hashlib.sha256(key).hexdigest() for key in (b"sk-team", b"sk-other"))
    assert answers[:20] == [(200, {"name": "team"})] * 20
    assert {(status, body["error"]["code"]) for status, body in answers[20:]} == {(401, "invalid_api_key")}


async def test_a_lookup_that_fails_fails_the_requests_waiting_on_it_and_is_not_kept(foreign):
    team = KeyRecord(id=7, name="team", key_sha256="…")
    arrived: list[str] = []
    calls = 0
    store_down = True
    answer = asyncio.Event()

    async def find_key(digest: str) -> KeyRecord | None:
        nonlocal calls
        calls += 1
        await answer.wait()
        if store_down:
            raise ConnectionError("the key store is down")
        return team

    app = await foreign([counting_arrivals(arrived), auth_middleware(find_key=find_key)], whoami)
    async with aiohttp.ClientSession() as http:

        async def status() -> int:
            async with http.post(app.url + "/chat", data=b"{}", headers={"x-api-key": "sk-team"}) as response:
                return response.status

        failing = asyncio.gather(status(), status(), status())
        await until(lambda: len(arrived) == 3)
        await asyncio.sleep(0.05)
        answer.set()
        assert (await failing, calls) == ([500, 500, 500], 1)  # one lookup failed, and all three with it
        store_down = False
        assert await post(app, b"{}", {"x-api-key": "sk-team"}) == (200, {"name": "team"})
        assert calls == 2  # the failure was not kept: the next request looked again


# --- The chain's order, checked when it is built -----------------------------------------------------


def test_a_stage_before_its_prerequisite_is_an_error_naming_both():
    with pytest.raises(ChainError) as error:
        checked([refusals_middleware(), size_limit_middleware()])
    assert (
        str(error.value)
        == "refusals needs the request's body, which size_limit provides: put size_limit before refusals"
    )


def test_a_missing_prerequisite_is_an_error_naming_the_stage_and_the_key():
    with pytest.raises(ChainError, match="^translator needs the request's model, which no stage before it provides$"):
        checked([size_limit_middleware(), translator_middleware()])


def test_the_gateways_routes_are_built_only_from_a_chain_in_order(upstream):
    # gateway.app.chain builds each route; the proxy handler needs the model from limits.
    with pytest.raises(ChainError, match="^proxy needs the request's model, which no stage before it provides$"):
        chain(
            [size_limit_middleware(), refusals_middleware()], proxy_handler(make_config(upstream.url), UpstreamClient())
        )
    with pytest.raises(ChainError, match="^cache_breakpoints needs the request's body, which size_limit provides"):
        chain([cache_breakpoints_middleware(), size_limit_middleware()], echo_body)


def test_a_key_read_before_the_stage_that_provides_it_is_an_error_naming_both():
    # Images reads the caller's key for its per-key cap: behind auth, not in front of it.
    def find_key(digest: str) -> None:
        return None

    with pytest.raises(ChainError) as error:
        checked([size_limit_middleware(), images_middleware(), auth_middleware(find_key=find_key)])
    assert str(error.value) == "images reads the request's api_key, which auth provides: put auth before images"


def test_a_key_read_that_no_stage_provides_is_done_without_and_logged(caplog):
    caplog.set_level("DEBUG", logger="ezat.chain")
    stages = [size_limit_middleware(), images_middleware()]
    assert checked(stages) == stages
    assert caplog.messages == ["images reads the request's api_key, which no stage provides here"]


def test_a_key_the_handler_provides_is_read_on_the_way_out(upstream, caplog):
    # billing prices at the model that answered, which only the proxy knows once it has answered.
    caplog.set_level("DEBUG", logger="ezat.chain")
    config = make_config(upstream.url)
    stages = [
        size_limit_middleware(),
        setting("the_key", API_KEY, KeyRecord(id=1, name="k", key_sha256="")),
        setting("the_model", MODEL_KEY, config.model(MODEL)),
        billing_middleware(record=lambda row: None),
    ]
    chain(stages, proxy_handler(config, UpstreamClient()))
    assert [m for m in caplog.messages if "answered_model" in m or "deployment" in m] == []
    assert sorted(caplog.messages) == [
        "billing reads the request's session, which no stage provides here",
        "billing reads the request's settle, which no stage provides here",
        "proxy reads the request's client_bytes, which no stage provides here",
        "proxy reads the request's fallback_models, which no stage provides here",
        "proxy reads the request's session, which no stage provides here",
    ]


def test_the_stages_are_new_style_middlewares():
    stages = [
        size_limit_middleware(),
        bounds_middleware(),
        refusals_middleware(),
        limits_middleware(find_model=lambda name: None),
        images_middleware(),
        cache_breakpoints_middleware(),
        translator_middleware(),
        auth_middleware(find_key=lambda digest: None),
    ]
    assert all(getattr(stage, "__middleware_version__", None) == 1 for stage in stages)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_proxy_lets_go_of_the_prompt_once_its_answer_has_begun(foreign, upstream, stream):
    # A stream may run for minutes and a prompt be megabytes: a stage in front of the proxy
    # reads the body before calling on; after, it is gone, and the answer is whole.
    config = make_config(upstream.url)
    seen = []

    @stage("probe", requires=(BODY,))
    async def probe(request: web.Request, handler) -> web.StreamResponse:
        seen.append(BODY in request)
        reply = await handler(request)
        seen.append(BODY in request)
        return reply

    upstream_client = UpstreamClient()
    app = await foreign(
        [size_limit_middleware(), setting("the_model", MODEL_KEY, config.model(MODEL)), probe],
        proxy_handler(config, upstream_client).handle,
        on_app=lambda app: app.cleanup_ctx.append(upstream_client.lifespan),
    )
    body = {"model": MODEL, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": "Say hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(app.url + "/chat", json=body, headers={"x-api-key": "any"}) as response:
            assert response.status == 200
            answer = await response.read()
    assert seen == [True, False]
    assert (b"event: message_stop" in answer) if stream else (json.loads(answer)["stop_reason"] == "end_turn")


# --- Admission before work: the limits stage refuses before any image is downloaded -----------------


@pytest.fixture
async def image_server():
    server = await ImageServer().start()
    yield server
    await server.close()


async def limited_client(start_gateway, upstream, **key_fields) -> openai.AsyncOpenAI:
    config = make_config(upstream.url)
    config = replace(
        config,
        images=ImagesConfig(allow_private_hosts=True),  # the loopback image server may be reached
        keys=(KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), **key_fields),),
    )
    gateway = await start_gateway(config)
    return gateway.client()


def twenty_images(server: ImageServer) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": server.serve(f"/{i}.png", PNG)}} for i in range(20)]
    return [{"role": "user", "content": [{"type": "text", "text": "Compare these."}, *parts]}]


async def test_a_key_over_its_rpm_gets_429_and_no_image_is_downloaded(start_gateway, upstream, image_server):
    async with await limited_client(start_gateway, upstream, rpm=1) as client:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        for _ in range(4):
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model=MODEL, messages=twenty_images(image_server))
    assert sum(image_server.hits.values()) == 0
    assert image_server.connections == 0


async def test_a_key_over_its_spend_limit_gets_402_and_no_image_is_downloaded(start_gateway, upstream, image_server):
    async with await limited_client(start_gateway, upstream, spend_limit_usd=Decimal(0)) as client:
        with pytest.raises(openai.APIStatusError) as error:
            await client.chat.completions.create(model=MODEL, messages=twenty_images(image_server))
    assert error.value.status_code == 402
    assert error.value.body["code"] == "insufficient_quota"
    assert error.value.body["message"] == "This key has reached its spend limit of $0."
    assert image_server.connections == 0


async def test_a_key_barred_from_the_model_gets_403_and_no_image_is_downloaded(start_gateway, upstream, image_server):
    async with await limited_client(start_gateway, upstream, models=("test/*",)) as client:
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(model=MODEL, messages=twenty_images(image_server))
        with pytest.raises(openai.PermissionDeniedError) as barred:  # a fallback it may not use
            await client.chat.completions.create(
                model="test/small", messages=twenty_images(image_server), extra_body={"models": [MODEL]}
            )
    assert barred.value.body["message"] == f"This key may not use the model `{MODEL}`."
    assert image_server.connections == 0


async def test_an_unknown_model_gets_404_and_no_image_is_downloaded(start_gateway, upstream, image_server):
    async with await limited_client(start_gateway, upstream) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nobody/none", messages=twenty_images(image_server))
    assert image_server.connections == 0


# --- Imports: stages stand alone ---------------------------------------------------------------------


def test_importing_size_limit_and_refusals_loads_none_of_the_gateway():
    code = (
        "import sys, middlewares.size_limit, middlewares.bounds, middlewares.refusals\n"
        "print(sorted(m for m in sys.modules if m == 'gateway' or m.startswith(('gateway.', 'asyncpg', 'redis', 'sqlite3'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]"


STAGES = [
    "auth",
    "size_limit",
    "bounds",
    "refusals",
    "limits",
    "images",
    "cache_breakpoints",
    "translator",
    "responses",
    "native",
    "billing",
]
# What a stage may import besides the core and its own package.
ALLOWED_OUTSIDE = {"aiohttp", "orjson", "yarl"}
# And what one stage needs alone: the Responses API's sealing of reasoning, AES-GCM; the images
# stage's base64 of what it downloads.
ALLOWED_FOR = {"responses": {"cryptography"}, "images": {"pybase64"}}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import, which this check could not follow"
            found.add(node.module)
    return found


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_imports_only_the_core_its_own_package_and_the_chosen_libraries(name):
    package = ROOT / "middlewares" / name
    files = sorted(package.glob("*.py")) if package.is_dir() else [ROOT / "middlewares" / f"{name}.py"]
    for path in files:
        for module in imports_of(path):
            top = module.split(".")[0]
            if top == "middlewares":
                assert module.startswith(("middlewares.core", f"middlewares.{name}")), f"{path.name} imports {module}"
            else:
                allowed = ALLOWED_OUTSIDE | ALLOWED_FOR.get(name, set())
                assert top in allowed or top in sys.stdlib_module_names, f"{path.name} imports {module}"


def test_the_core_imports_only_the_chosen_libraries():
    for path in sorted((ROOT / "middlewares" / "core").glob("*.py")):
        for module in imports_of(path):
            top = module.split(".")[0]
            assert top in ALLOWED_OUTSIDE | {"middlewares"} or top in sys.stdlib_module_names, f"{path.name}: {module}"
            assert top != "middlewares" or module.startswith("middlewares.core"), f"{path.name}: {module}"


# --- limits and billing in a foreign app: what is held is always given back


class Models:
    """A foreign app's model table: one model, free."""

    def __init__(self) -> None:
        from gateway.config import Model, Pricing

        self.model = Model(id="any", upstream_model="any", deployments=("x",), pricing=Pricing())

    def __call__(self, name: str):
        return self.model if name == "any" else None


class DownSpending:
    """A spend store that is down: reserving fails."""

    async def reserve(self, *args, **kwargs):
        raise GatewayError(500, "The spend store is down.", type="server_error")

    async def release(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("mounted", ["spending down", "billing a foreign reply"])
async def test_a_foreign_apps_requests_never_keep_their_place(foreign, mounted):
    from gateway.accounting.ratelimit import MemoryRateLimiter

    recorded = []

    async def record(row):
        recorded.append(row)

    spending = DownSpending() if mounted == "spending down" else None
    stages = [
        size_limit_middleware(),
        setting(
            "the_key",
            API_KEY,
            KeyRecord(id=3, name="solo", key_sha256="", spend_limit_usd=Decimal(1), max_concurrent=1),
        ),
        limits_middleware(find_model=Models(), spending=spending, limiter=MemoryRateLimiter()),
        billing_middleware(record=record),
    ]
    app = await foreign(stages)
    expected = 500 if spending else 200
    # The key may run one request at once: a second one could not if the first kept its place.
    assert [(await post(app, HELLO))[0] for _ in range(3)] == [expected] * 3
    assert recorded == []  # a reply that is no message of the upstream's is not billed


def test_a_key_a_stage_provides_itself_is_not_reported_missing(caplog):
    """A stage may read what it sets itself (the way out reads what the way in set)."""
    caplog.set_level("DEBUG", logger="ezat.chain")

    @stage("own", provides=(SESSION,), reads=(SESSION,))
    async def own(request, handler):
        return await handler(request)

    assert checked([own]) == [own]
    assert caplog.messages == []
