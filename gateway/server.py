"""The gateway's HTTP server: aiohttp's, but what it answers and logs on its own says nothing a
request held, nor which versions of Python and aiohttp serve it.

When aiohttp's parser rejects a request (a header line over 8,190 bytes, a control byte in a
header, a malformed request line), its RequestHandler.handle_error answers with the parser's
message and logs it at ERROR with a traceback: both quote the request's raw bytes, so a key in
`Authorization` would be sent back and written to the log. Here such a request gets OpenAI's
envelope with fixed text, and one log line naming the error's class and the peer.

The keep-alive timeout is also the deadline for a request's headers: aiohttp arms its timer when
a connection is made, and again when an answer ends, and closes the connection if it fires while
no whole request has arrived. Data trickling in does not put it off, so a client that never
finishes its headers holds its connection that long at most. (aiohttp's default is 3,630 s.)
"""

from __future__ import annotations

import errno
import logging
import socket

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gateway.config import ServerConfig
from middlewares.core.errors import GatewayError

log = logging.getLogger("ezat.server")

# Every answer's Server header: the product, never a version (aiohttp's default names Python's
# and its own, which only helps someone matching them against known flaws).
SERVER = "ezat-gateway"
NOT_HTTP = GatewayError(400, "The request is not valid HTTP.").body  # the envelope, fixed text
# Connections the kernel completes while the server is busy, before it accepts them (capped at
# net.core.somaxconn). aiohttp's 128 overflows when many clients, or a load balancer, connect at
# once: the connections past it wait for their SYN to be sent again, 1, 3, 7, 15 s… later.
# 2,048 is what uvicorn and gunicorn listen with.
LISTEN_BACKLOG = 2048


class CannotListen(Exception):
    """The server's address could not be had: one line for its operator, naming it."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        if error.errno == errno.EADDRINUSE:
            message = (
                f"port {port} on {host} is already in use (another process listens there): "
                "stop it, or choose another port with --port"
            )
        elif isinstance(error, socket.gaierror):
            message = f"cannot listen on {host} port {port}: no such host ({error.strerror})"
        elif error.errno == errno.EADDRNOTAVAIL:
            message = f"cannot listen on {host} port {port}: {host} is not an address of this machine"
        else:
            message = f"cannot listen on {host} port {port}: {(error.strerror or str(error)).lower()}"
        super().__init__(message)


def bound_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Sockets bound to every address `host` names (as asyncio's create_server binds them), not
    listening yet, so that `serve` learns of a port already taken before it starts anything, or
    says it listens; CannotListen if one cannot be had. With `reuse_port`, several processes bind
    the same port (SO_REUSEPORT); without, any process listening there already refuses it."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        raise CannotListen(host, port, error) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(addresses):  # once each, in order
            sock = socket.socket(family, kind, protocol)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart is not held off by TIME_WAIT
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin has its own
            sock.setblocking(False)
            sock.bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise CannotListen(host, port, error) from None
    return sockets


def app_runner(app: web.Application, server: ServerConfig = ServerConfig()) -> web.AppRunner:
    """`app`'s runner as `ezat-gateway serve` runs it: a handler is cancelled when its client goes,
    no access log, request bodies left encoded, and `server`'s timeouts."""
    return _AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        auto_decompress=False,  # size_limit decodes request bodies (and answers 415 for br, zstd…)
        shutdown_timeout=server.shutdown_timeout_seconds,
        keepalive_timeout=server.keepalive_timeout_seconds,
    )


async def server_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: aiohttp has just set its own Server header (a setdefault)."""
    response.headers[hdrs.SERVER] = SERVER


# The subclasses exist only to reach handle_error: aiohttp has no hook for the answers to requests
# its parser rejects (they bypass the app's middlewares and its on_response_prepare), and builds
# its Server, which makes the RequestHandlers, inside AppRunner._make_server.


class _RequestHandler(RequestHandler):
    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):  # a handler's exception: aiohttp's 500
            return super().handle_error(request, status, exc, message)
        # As aiohttp does, a connection whose first line is no HTTP method (TLS, a port scan) is
        # only debug noise. The exception's text quotes the request: it is never logged.
        level = logging.DEBUG if self._request_count == 1 and isinstance(exc, BadHttpMethod) else logging.WARNING
        log.log(level, "a request that is not valid HTTP (%s) from %s", type(exc).__name__, request.remote)
        response = web.Response(
            status=status, body=NOT_HTTP, content_type="application/json", headers={hdrs.SERVER: SERVER}
        )
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # starts the app; aiohttp's Server, as it would serve it
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
