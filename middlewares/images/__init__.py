"""The images stage: http(s) image URLs are downloaded and sent inline, since the models take
images only inline; data URLs must hold the image type they name. Every failure is a 400 naming
the part, e.g. `messages[0].content[2].image_url.url: could not download the image (HTTP 404)`.
On Anthropic's Messages API (`api="anthropic"`) the same holds for image and PDF document blocks
whose source is a `url` (in a tool result too): each becomes a base64 source. On the Responses
API (`api="responses"`) it holds for the `image_url` of `input_image` parts (in a tool output
too), and a failure names the part's field as `param`, as that API does, e.g.
`input[2].content[1].image_url`.

The stage owns one connection pool for its downloads: an app that mounts it adds
`stage.cleanup_ctx` to its `app.cleanup_ctx`, which opens the pool on startup and closes it on
cleanup.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import pybase64
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.typedefs import Handler

from middlewares.core.chain import Keys, Stage
from middlewares.core.context import API_KEY, BODY, body_changed
from middlewares.core.errors import GatewayError, invalid_request
from middlewares.core.media import IMAGE_TYPES, MEDIA_BLOCKS, split_data_url
from middlewares.images.fetch import Budget, ImageError, ImageFetcher, ImageLimits
from middlewares.images.sniff import image_type

__all__ = ["DEFAULT_LIMITS", "ImageLimits", "ImagesStage", "images_middleware"]

log = logging.getLogger("ezat.images")

DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImagesStage(Stage):
    """The images stage, with what an app does with it: `cleanup_ctx`, which opens its pool on
    startup and closes it on cleanup, and `for_api(api)`, the same stage for another API's
    shape, sharing its pool and its caps."""

    cleanup_ctx: Callable[[web.Application], AsyncIterator[None]]
    for_api: Callable[[str], ImagesStage]


def images_middleware(
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    ports: Sequence[int] = (),
    allow_private_hosts: bool = False,
    resolver: AbstractResolver | None = None,
    api: str = "openai",
    on_download: Callable[[str], None] = lambda outcome: None,
) -> ImagesStage:
    """Downloads the http(s) image URLs of the user messages in `request[BODY]` and puts them
    in place as base64 data URLs; checks that data URLs hold the image type they name.

    `limits` are `DEFAULT_LIMITS` unless given (ImageLimits says what each bounds); any port and
    public addresses only (`allow_private_hosts` lifts that, for trusted networks and tests).
    `downloads_per_key` counts the requests of one key by `request[API_KEY]`, when a stage
    before sets it (else all requests share it).
    `resolver` (an aiohttp resolver) replaces the system's DNS, e.g. in tests. `api` is the
    shape of the request: "openai" (a chat completion), "anthropic" (a Messages request) or
    "responses" (a Responses API request);
    `stage.for_api(api)` is the same stage for the other shape, sharing its pool and its caps.
    `on_download(outcome)` hears of each download that ends: "ok", or an `ImageError`'s outcome."""
    if any(not isinstance(port, int) or not 1 <= port <= 65535 for port in ports):
        raise ValueError("images_middleware: ports must be integers from 1 to 65535")
    fetcher = ImageFetcher(limits, ports=tuple(ports), allow_private_hosts=allow_private_hosts, resolver=resolver)
    keys = KeyGates(limits.downloads_per_key)

    def stage_for(api: str) -> ImagesStage:
        if api not in _SOURCES:
            raise ValueError('images_middleware: api must be "openai", "anthropic" or "responses"')
        sources = _SOURCES[api]

        async def images(request: web.Request, handler: Handler) -> web.StreamResponse:
            parts = list(sources(request[BODY]))
            if parts:
                if not fetcher.open:
                    log.error("images_middleware: its cleanup_ctx is not in the app's cleanup_ctx")
                    raise GatewayError(500, "The image fetcher is not running.", type="server_error")
                body_changed(request)  # the downloads go in place of the URLs
                key = request.get(API_KEY)  # without auth in front, all requests share one key's cap
                async with keys.gate(key.id if key is not None else None) as key_gate:
                    await _inline(parts, fetcher, key_gate, on_download)
            return await handler(request)

        declared = Keys("images", requires=frozenset({BODY}), reads=frozenset({API_KEY}))
        return ImagesStage(declared, images, fetcher.lifespan, stage_for)

    return stage_for(api)


class KeyGates:
    """One semaphore per key with downloads under way, shared by its requests; gone with them."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._gates: dict[object, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def gate(self, key: object) -> AsyncIterator[asyncio.Semaphore]:
        semaphore, users = self._gates.get(key) or (asyncio.Semaphore(self._size), 0)
        self._gates[key] = semaphore, users + 1
        try:
            yield semaphore
        finally:
            semaphore, users = self._gates[key]
            if users == 1:
                del self._gates[key]
            else:
                self._gates[key] = semaphore, users - 1


_HTTP = ("http://", "https://")


class Download(NamedTuple):
    """A URL to download (a PDF's, or an image's) and where its bytes go: `put(media type, data)`;
    `param`, what an error's `param` names."""

    path: str
    url: str
    pdf: bool
    put: Callable[[str, bytes], None]
    param: str = "messages"


def _image_parts(body: dict[str, Any]) -> Iterator[Download]:
    """Every image URL of the messages of a chat completion request; data URLs are checked."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                image, path = part["image_url"], f"messages[{i}].content[{j}].image_url.url"
                url = image.get("url")
                if not isinstance(url, str):
                    continue
                if url.startswith("data:"):
                    _check_data_url(url, path)
                elif not url.startswith(_HTTP):
                    raise invalid_request(f"{path}: expected an http(s) URL or a base64 data URL", "messages")
                else:
                    yield Download(path, url, False, partial(_put_data_url, image))


def _base64(data: bytes) -> str:
    """A downloaded image in standard base64, as a data URL or a base64 source carries it.
    pybase64's codec, not the standard library's, which is many times slower on an image."""
    return pybase64.b64encode(data).decode("ascii")


def _put_data_url(image: dict[str, Any], media_type: str, data: bytes) -> None:
    image["url"] = f"data:{media_type};base64,{_base64(data)}"


def _anthropic_sources(body: dict[str, Any]) -> Iterator[Download]:
    """Every `url` source of the image and document blocks of a Messages request, a tool
    result's among them."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in MEDIA_BLOCKS:  # most blocks are text: only these are looked into
                # (the path is made at once, within this iteration, and only for an error)
                if download := _url_source(block, kind, lambda: f"messages[{i}].content[{j}]"):  # noqa: B023
                    yield download
            elif kind == "tool_result" and isinstance(block.get("content"), list):
                for k, inner in enumerate(block["content"]):
                    inner_kind = inner.get("type") if isinstance(inner, dict) else None
                    if inner_kind in MEDIA_BLOCKS and (
                        download := _url_source(
                            inner,
                            inner_kind,
                            lambda: f"messages[{i}].content[{j}].content[{k}]",  # noqa: B023
                        )
                    ):
                        yield download


def _url_source(block: dict[str, Any], kind: str, path: Callable[[], str]) -> Download | None:
    """The download of an image or document block whose source is a `url` (None for another)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "url":
        return None
    url = source.get("url")
    if not isinstance(url, str) or not url.startswith(_HTTP):
        raise invalid_request(f"{path()}.source.url: expected an http(s) URL", "messages")
    return Download(f"{path()}.source.url", url, kind == "document", partial(_put_base64_source, block))


def _put_base64_source(block: dict[str, Any], media_type: str, data: bytes) -> None:
    block["source"] = {"type": "base64", "media_type": media_type, "data": _base64(data)}


def _responses_images(body: dict[str, Any]) -> Iterator[Download]:
    """Every image URL of the input_image parts of a Responses API request's input: a message's
    content or a tool output's; data URLs are checked."""
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        for field in ("content", "output"):
            parts = item.get(field)
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if (
                    isinstance(part, dict)
                    and part.get("type") == "input_image"
                    and isinstance(part.get("image_url"), str)
                ):
                    url, path = part["image_url"], f"input[{i}].{field}[{j}].image_url"
                    if url.startswith("data:"):
                        _check_data_url(url, path, path)
                    elif not url.startswith(_HTTP):
                        raise invalid_request(f"{path}: expected an http(s) URL or a base64 data URL", path)
                    else:
                        yield Download(path, url, False, partial(_put_image_url, part), path)


def _put_image_url(part: dict[str, Any], media_type: str, data: bytes) -> None:
    part["image_url"] = f"data:{media_type};base64,{_base64(data)}"


_SOURCES = {"openai": _image_parts, "anthropic": _anthropic_sources, "responses": _responses_images}


async def _inline(
    parts: list[Download],
    fetcher: ImageFetcher,
    key_gate: asyncio.Semaphore,
    on_download: Callable[[str], None],
) -> None:
    limits = fetcher.limits
    downloads: dict[
        tuple[str, bool], asyncio.Task[tuple[str, bytes]]
    ] = {}  # (url, pdf) → its one download, shared by repeats
    waiting: list[tuple[Download, asyncio.Task[tuple[str, bytes]]]] = []
    budget, gate = Budget(limits.total_bytes), asyncio.Semaphore(limits.concurrent_downloads)

    async def download(url: str, pdf: bool) -> tuple[str, bytes]:
        async with gate, key_gate:
            try:
                fetched = await fetcher.fetch(url, budget, pdf=pdf)
            except ImageError as exc:
                on_download(exc.outcome)
                raise
        on_download("ok")
        return fetched

    try:
        for part in parts:
            which = (part.url, part.pdf)
            if which not in downloads:
                if len(downloads) == limits.urls:
                    # (On Anthropic's route a PDF's URL counts among them.)
                    raise invalid_request(f"{part.path}: more than {limits.urls} image URLs in one request", part.param)
                downloads[which] = asyncio.create_task(download(*which))
            waiting.append((part, downloads[which]))
        for part, task in waiting:
            try:
                media_type, data = await task
            except ImageError as exc:
                raise invalid_request(f"{part.path}: {exc}", part.param) from None
            part.put(media_type, data)
    finally:
        for task in downloads.values():
            task.cancel()  # one failure ends the others: the request is refused anyway
        await asyncio.gather(*downloads.values(), return_exceptions=True)


def _check_data_url(url: str, path: str, param: str = "messages") -> None:
    parts = split_data_url(url)
    if parts is None or parts[0] not in IMAGE_TYPES:
        raise invalid_request(
            f"{path}: expected data:<type>;base64,<data> with type image/jpeg, image/png, image/gif or image/webp",
            param,
        )
    declared, data = parts
    try:
        # The first 16 bytes tell the type; 24 base64 characters hold 18 of them.
        head_bytes = base64.b64decode(data[:24], validate=True)
    except (ValueError, binascii.Error):
        head_bytes = b""
    if image_type(head_bytes) != declared:
        raise invalid_request(f"{path}: the data is not a {declared} image", param)
