"""The native stage, on the routes that speak Anthropic's Messages API (where the translator
stands on OpenAI's): the request goes upstream as the client sent it, every field the gateway
does not touch included, and the reply comes back as the upstream sent it, named by the model
the client asked for. One thing it checks, as the translators do on OpenAI's routes: the output
limit, which is the model's `max_output_tokens` on every route."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import BODY, MODEL, body_changed
from middlewares.core.errors import invalid_request
from middlewares.core.reply import AnthropicSSE, EventStreamReply, MessageReply

__all__ = ["native_middleware"]


def native_middleware() -> Stage:
    """Refuses a `max_tokens` above `request[MODEL].max_output_tokens` (400), and takes the
    gateway's own `models` (the fallbacks, which limits read) out of `request[BODY]`, an
    Anthropic Messages request; then sets `model` in the handler's reply, an unsent Anthropic
    message or event stream, back to the name the client sent (the handler sent the upstream's)."""

    @stage("native", requires=(BODY, MODEL))
    async def native(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request[BODY]
        if not isinstance(body.get("stream", False), bool):  # whether the reply is a stream hangs on it
            raise invalid_request("stream: Input should be a valid boolean", "stream")
        most = request[MODEL].max_output_tokens
        asked_tokens = body.get("max_tokens")  # its type is the upstream's to judge
        if isinstance(asked_tokens, int) and not isinstance(asked_tokens, bool) and asked_tokens > most:
            raise invalid_request(f"max_tokens: at most {most} for this model", "max_tokens")
        asked = body.get("model")
        if "models" in body:  # else the client's bytes may go upstream as they are
            body_changed(request)
            del body["models"]
        reply = await handler(request)
        if isinstance(reply, MessageReply):
            reply.payload["model"] = asked
            if reply.usage.estimated is not None:  # what is billed is what the client is told
                usage = reply.payload.get("usage")
                reply.payload["usage"] = {**(usage or {}), "output_tokens": reply.usage.output_tokens}
        elif isinstance(reply, EventStreamReply):
            reply.encoder = AnthropicSSE(asked, reply.usage)
        return reply

    return native
