"""The images stage (spec, "Images and PDFs"): http(s) image URLs are downloaded and sent
inline, since the models take images only inline; data URLs must hold the image type they
name. Every failure is a 400 naming the part, e.g.
`messages[0].content[2].image_url.url: could not download the image (HTTP 404)`."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from aiohttp import web

from gateway.context import BODY
from gateway.errors import invalid_request
from middlewares.images.fetch import Budget, ImageError, ImageFetcher, Limits
from middlewares.images.sniff import IMAGE_TYPES, image_type

__all__ = ["ImageFetcher", "Limits", "images_middleware"]

# Downloads of one request running at once.
CONCURRENT_DOWNLOADS = 8


def images_middleware(fetcher: ImageFetcher):
    async def images(request: web.Request, handler) -> web.StreamResponse:
        parts = list(_image_parts(request[BODY]))
        if parts:
            await _inline(parts, fetcher)
        return await handler(request)

    return images


def _image_parts(body: dict[str, Any]):
    """(path, image_url object) of every image part of the user messages."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                if isinstance(part["image_url"].get("url"), str):
                    yield f"messages[{i}].content[{j}].image_url.url", part["image_url"]


async def _inline(parts: list[tuple[str, dict[str, Any]]], fetcher: ImageFetcher) -> None:
    limits = fetcher.limits
    downloads: dict[str, asyncio.Task] = {}  # url → its one download, shared by repeats
    waiting: list[tuple[str, dict[str, Any], asyncio.Task]] = []
    budget, gate = Budget(limits.total_bytes), asyncio.Semaphore(CONCURRENT_DOWNLOADS)

    async def download(url: str) -> tuple[str, bytes]:
        async with gate:
            return await fetcher.fetch(url, budget)

    try:
        for path, image in parts:
            url = image["url"]
            if url.startswith("data:"):
                _check_data_url(url, path)
            elif url.startswith(("http://", "https://")):
                if url not in downloads:
                    if len(downloads) == limits.urls:
                        raise invalid_request(f"{path}: more than {limits.urls} image URLs in one request", "messages")
                    downloads[url] = asyncio.create_task(download(url))
                waiting.append((path, image, downloads[url]))
            else:
                raise invalid_request(f"{path}: expected an http(s) URL or a base64 data URL", "messages")
        for path, image, task in waiting:
            try:
                media_type, data = await task
            except ImageError as exc:
                raise invalid_request(f"{path}: {exc}", "messages") from None
            image["url"] = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    finally:
        for task in downloads.values():
            task.cancel()  # one failure ends the others: the request is refused anyway
        await asyncio.gather(*downloads.values(), return_exceptions=True)


def _check_data_url(url: str, path: str) -> None:
    head, _, data = url.partition(",")
    declared = head[5:].removesuffix(";base64").lower()
    if not head.endswith(";base64") or declared not in IMAGE_TYPES:
        raise invalid_request(
            f"{path}: expected data:<type>;base64,<data> with type image/jpeg, image/png, image/gif or image/webp",
            "messages",
        )
    try:
        # The first 16 bytes tell the type; 24 base64 characters hold 18 of them.
        head_bytes = base64.b64decode(data[:24], validate=True)
    except (ValueError, binascii.Error):
        head_bytes = b""
    if image_type(head_bytes) != declared:
        raise invalid_request(f"{path}: the data is not a {declared} image", "messages")
