"""Downloads images (and PDFs) for the images stage, safely: public hosts only, limited size,
time and redirects, every hop checked, and the whole body never buffered past the limit."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.http_exceptions import ContentEncodingError
from yarl import URL

from middlewares.core.addresses import PrivateAddress, PublicOnlyResolver, is_public, literal_address
from middlewares.core.media import PDF
from middlewares.core.sizes import MAX_BODY_BYTES, MiB
from middlewares.images.sniff import image_type

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_ACCEPT_PDF = {"Accept": PDF}


@dataclass(frozen=True)
class ImageLimits:
    """What the images stage downloads, at most: the API's own limits for an image, a request's
    URLs and their bytes, a download's time and redirects; and how many downloads run at once,
    so that one key's flood of image URLs cannot take every download, nor one slow host every
    connection. The stage's defaults, and the gateway's `[images]`."""

    image_bytes: int = 10 * MiB
    urls: int = 20  # distinct URLs a request
    total_bytes: int = MAX_BODY_BYTES  # all the downloads of one request
    timeout: float = 15.0  # seconds a download
    redirects: int = 3
    concurrent_downloads: int = 8  # of one request
    downloads_per_key: int = 16  # over all the requests of one key
    connections_per_host: int = 32  # the pool's, to any one host

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError("ImageLimits: timeout must be positive")
        if not isinstance(self.redirects, int) or self.redirects < 0:
            raise ValueError("ImageLimits: redirects must be 0 or more")
        for name, value in vars(self).items():
            if name not in ("timeout", "redirects") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ImageLimits: {name} must be a positive integer")


class ImageError(Exception):
    """Why an image could not be used; the stage puts the part's path before it. `outcome` says
    it in a word, for the app's metrics: refused, too_large, timeout, http_error, not_an_image
    or error."""

    def __init__(self, message: str, outcome: str = "error") -> None:
        super().__init__(message)
        self.outcome = outcome


class Budget:
    """The bytes a request may still download, shared by its concurrent downloads."""

    def __init__(self, total: int) -> None:
        self.total = self.left = total

    def take(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise ImageError(f"the images of this request are over {self.total // MiB} MB in total", "too_large")


class ImageFetcher:
    def __init__(
        self,
        limits: ImageLimits,
        *,
        ports: tuple[int, ...] = (),
        allow_private_hosts: bool = False,
        resolver: AbstractResolver | None = None,
    ) -> None:
        self.limits = limits
        self.ports = ports  # the ports allowed; empty: any port (the API sets no limit)
        self.allow_private_hosts = allow_private_hosts
        self._resolver = resolver  # tests may give a resolver of their own (a fake DNS)
        self._session: aiohttp.ClientSession | None = None

    @property
    def open(self) -> bool:
        return self._session is not None

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: one connection pool for every download of the app."""
        resolver = self._resolver
        if not self.allow_private_hosts:
            resolver = PublicOnlyResolver(resolver)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                resolver=resolver,
                limit=100,
                limit_per_host=self.limits.connections_per_host,
                ttl_dns_cache=None,
                use_dns_cache=False,
            ),
            timeout=aiohttp.ClientTimeout(total=self.limits.timeout),
            auto_decompress=True,
            headers={"Accept": "image/*"},
            cookie_jar=aiohttp.DummyCookieJar(),  # no host's cookie goes from one key's download to another's
        )
        yield
        session, self._session = self._session, None
        await session.close()

    async def fetch(self, url: str, budget: Budget, *, pdf: bool = False) -> tuple[str, bytes]:
        """(media type, bytes) of the image at `url` (with `pdf`, of the PDF document there)."""
        what = "document" if pdf else "image"
        try:
            async with asyncio.timeout(self.limits.timeout):
                return await self._follow(URL(url), budget, pdf)
        except TimeoutError:
            raise ImageError(
                f"could not download the {what} (timed out after {self.limits.timeout:g} s)", "timeout"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # aiohttp's connector wraps what the resolver raised
            if isinstance(exc, PrivateAddress) or isinstance(getattr(exc, "os_error", None), PrivateAddress):
                raise ImageError("the host is not a public address", "refused") from None
            raise ImageError(f"could not download the {what} ({_failure(exc, what)})") from None

    async def _follow(self, url: URL, budget: Budget, pdf: bool) -> tuple[str, bytes]:
        what = "document" if pdf else "image"
        session = self._session
        if session is None:
            raise RuntimeError("the image fetcher is not open: its lifespan is not in the app's cleanup_ctx")
        for _ in range(self.limits.redirects + 1):
            self._check(url)
            async with session.get(url, allow_redirects=False, headers=_ACCEPT_PDF if pdf else None) as response:
                if response.status in _REDIRECTS and "Location" in response.headers:
                    url = url.join(URL(response.headers["Location"]))
                    continue
                if response.status != 200:
                    raise ImageError(f"could not download the {what} (HTTP {response.status})", "http_error")
                return await self._read(response, budget, pdf)
        raise ImageError(f"could not download the {what} (more than {self.limits.redirects} redirects)", "http_error")

    def _check(self, url: URL) -> None:
        """What can be refused before connecting (a name's addresses are checked on resolving)."""
        if url.scheme not in ("http", "https") or not url.host:
            raise ImageError("only http and https URLs can be downloaded", "refused")
        if url.user is not None or url.password is not None:
            raise ImageError("URLs with credentials are not allowed", "refused")
        if self.ports and url.port not in self.ports:
            raise ImageError(f"port {url.port} is not allowed", "refused")
        literal = literal_address(url.host)
        if literal is not None and not self.allow_private_hosts and not is_public(literal):
            raise ImageError("the host is not a public address", "refused")

    async def _read(self, response: aiohttp.ClientResponse, budget: Budget, pdf: bool) -> tuple[str, bytes]:
        limit = self.limits.image_bytes
        too_large = f"the {'document' if pdf else 'image'} is over {limit // MiB} MB"
        if response.content_length is not None and response.content_length > limit:
            raise ImageError(too_large, "too_large")  # said up front: not a byte of it is read
        parts, size = [], 0
        async for chunk in response.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise ImageError(too_large, "too_large")
            budget.take(len(chunk))
            parts.append(chunk)
        data = b"".join(parts)
        if pdf:
            if not data.startswith(b"%PDF-"):
                raise ImageError("the file is not a PDF document", "not_an_image")
            return PDF, data
        media_type = image_type(data)
        if media_type is None:
            raise ImageError("the file is not a JPEG, PNG, GIF or WebP image", "not_an_image")
        return media_type, data


_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH})
_RESET = frozenset({errno.ECONNRESET, errno.EPIPE})


def _failure(exc: BaseException, what: str) -> str:
    """What went wrong with a download, in words a client can act on: never an exception's class
    name, which says nothing to someone who does not read aiohttp's source."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "the server's TLS certificate could not be verified"
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLError | aiohttp.ServerFingerprintMismatch):
        return "the TLS handshake failed"
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(cause, socket.gaierror):
            return "the host name could not be resolved"
        if isinstance(cause, ConnectionRefusedError):
            return "the connection was refused"
        if cause.errno in _UNREACHABLE:
            return "the host could not be reached"
        return "the connection to the host failed"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before answering"
    if isinstance(exc, ConnectionResetError) or (isinstance(exc, OSError) and exc.errno in _RESET):
        return "the connection was reset"
    if isinstance(exc, aiohttp.ClientPayloadError):
        if isinstance(exc.__cause__, ContentEncodingError):
            return f"the {what}'s Content-Encoding could not be decoded"
        return f"the connection closed before the whole {what} arrived"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "the server's answer was not valid HTTP"
    if isinstance(exc, ValueError):  # aiohttp's InvalidURL is one
        return "the URL is not valid"
    return "the connection failed"
