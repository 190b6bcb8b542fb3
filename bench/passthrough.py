"""The floor: the least any Python aiohttp proxy in front of an Anthropic upstream can do.

One shared ClientSession (a pool without a connection limit, as the gateway's); the request body
is forwarded as it came to {upstream}/v1/messages (or, for Bedrock's
/model/{id}/invoke-with-response-stream, to that path upstream), and the response's status, headers and bytes
are streamed back untouched, each read written as it arrives. No parsing, no auth, no billing.
The gateway is measured against this, in the same run, on the same machine.

With --parse, the parsing floor: the same, but the request body is parsed (orjson.loads) and
what goes upstream is that parse encoded again (orjson.dumps), once each: the least any gateway
that reads the request pays, on a large body far above what forwarding it costs.

    python bench/passthrough.py --upstream http://127.0.0.1:8081 --port 8082 [--parse]
"""

from __future__ import annotations

import argparse

import aiohttp
import orjson
from aiohttp import web

from gateway.runtime import run, tune_garbage_collector, until_stopped
from gateway.server import LISTEN_BACKLOG

# Hop-by-hop headers (and those aiohttp recomputes) are not forwarded; everything else is.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str, parse: bool = False) -> web.Application:
    base = upstream.rstrip("/")
    target = base + "/v1/messages"

    async def messages(request: web.Request) -> web.StreamResponse:
        return await forward(request, target)

    async def bedrock(request: web.Request) -> web.StreamResponse:
        return await forward(request, base + request.raw_path)

    async def forward(request: web.Request, target: str) -> web.StreamResponse:
        body = await request.read()
        if parse:
            body = orjson.dumps(orjson.loads(body))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with request.app[SESSION].post(target, data=body, headers=headers) as upstream_response:
            response = web.StreamResponse(
                status=upstream_response.status,
                headers={k: v for k, v in upstream_response.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            if upstream_response.content_length is not None:
                response.content_length = upstream_response.content_length
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0)
        app[SESSION] = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/messages", messages)
    # Bedrock's InvokeModel and its response stream, the model id in the path: forwarded to the
    # same path, its event-stream frames relayed as the bytes they are.
    app.router.add_post("/model/{model_id}/{action}", bedrock)
    return app


async def serve(host: str, port: int, upstream: str, parse: bool) -> None:
    # As `ezat-gateway serve` runs the gateway: handler cancellation, no access log, the garbage
    # collector tuned once the app is built, its listen backlog, uvloop (gateway.runtime.run,
    # below) when installed.
    runner = web.AppRunner(make_app(upstream, parse), handler_cancellation=True, access_log=None)
    await runner.setup()
    tune_garbage_collector()
    await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
    print(f"pass-through proxy{' (parsing)' if parse else ''} on http://{host}:{port} -> {upstream}", flush=True)
    await until_stopped()
    await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--parse", action="store_true", help="parse the request body and encode it again")
    args = parser.parse_args()
    run(serve(args.host, args.port, args.upstream, args.parse))
