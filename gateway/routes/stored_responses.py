"""The Responses API's stored responses, as the gateway keeps and serves them: `KeptResponses`,
the responses stage's store (middlewares.core.protocols.ResponseStore) on the gateway's, and the
handlers of GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from aiohttp import web

from gateway.storage import Store, StoredResponse
from gateway.storage.group_commit import GroupCommit
from gateway.storage.unavailable import StoreUnavailable
from middlewares.core.context import API_KEY
from middlewares.core.errors import GatewayError, invalid_request

log = logging.getLogger("ezat.responses")


class KeptResponses:
    """The responses stage's store (middlewares.core.protocols.ResponseStore) on the gateway's:
    each response kept `retention_days` from its creation (0: none is). Writes run beside the
    answers, never delaying nor failing one (a write that fails is logged: that response is not
    kept), in groups (gateway/storage/group_commit.py): what is kept while one group is written goes in
    the next, one transaction for many responses; one alone is written at once where the store
    can do that without waiting. A read of a response whose write is still under
    way in this process waits for it, so a client's next request finds its last response."""

    def __init__(self, store: Store, retention_days: int) -> None:
        self._store, self._days = store, retention_days
        self._pending: list[StoredResponse] = []
        self._next_written: asyncio.Future[None] | None = None  # done when the pending group is
        self._unwritten: dict[str, asyncio.Future[None]] = {}  # response id → its group's write, until done
        self._commit = GroupCommit(self._write_groups)

    def keep(
        self,
        key_id: int,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        system: list[dict[str, Any]] | None,
    ) -> None:
        if self._days <= 0:
            return
        created = datetime.fromtimestamp(response["created_at"], UTC)
        stored = StoredResponse(
            response["id"],
            key_id,
            created,
            created + timedelta(days=self._days),
            response,
            input_items,
            messages,
            system,
        )
        if self._commit.alone() and not self._pending:
            # Nothing to share a transaction with: written here and now where the store can
            # (SQLite's file, unlocked), sparing the hop to its thread, as the ledger's lone rows are.
            try:
                if self._store.put_responses_now([stored]):
                    self._commit.written_alone()
                    return
            except StoreUnavailable:  # the usual way below tries again; an outage is logged once
                pass
            except Exception as exc:  # the usual way below tries again
                log.warning("keeping response %s at once failed: %r", stored.response_id, exc)
        if self._next_written is None:
            self._next_written = asyncio.get_running_loop().create_future()
        self._pending.append(stored)
        self._unwritten[stored.response_id] = self._next_written
        self._commit.start()

    async def _write_groups(self) -> None:
        while self._pending:
            await self._commit.linger()
            group, written = self._pending, self._next_written
            assert written is not None  # put() made it with the first of the group
            self._pending, self._next_written = [], None
            self._commit.taken(len(group))
            try:
                await self._write(group)
            finally:
                written.set_result(None)
                for stored in group:
                    if self._unwritten.get(stored.response_id) is written:
                        del self._unwritten[stored.response_id]

    async def _write(self, group: list[StoredResponse]) -> None:
        try:
            await self._store.put_responses(group)
        except StoreUnavailable:
            # None of them is kept, and one at a time would fail alike; the outage is logged once,
            # as it begins and ends, not once a response.
            return
        except Exception as exc:
            if len(group) == 1:
                log.error("keeping response %s failed, so it is not stored: %r", group[0].response_id, exc)
                return
            # One response the database refuses must not cost its neighbours theirs.
            for stored in group:
                await self._write([stored])

    async def find(self, response_id: str, key_id: int) -> StoredResponse | None:
        await self._written(response_id)
        return await self._store.get_response(response_id, key_id)

    async def delete(self, response_id: str, key_id: int) -> bool:
        await self._written(response_id)
        return await self._store.delete_response(response_id, key_id)

    async def _written(self, response_id: str) -> None:
        written = self._unwritten.get(response_id)
        if written is not None:
            await asyncio.shield(written)  # a reader that leaves does not cancel the write

    async def close(self) -> None:
        """Waits for the writes under way and pending."""
        await self._commit.idle()


MAX_ITEMS_LISTED = 100  # input_items' `limit` at most, as OpenAI's


def stored_response_handlers(kept: KeptResponses) -> tuple[Callable, Callable, Callable]:
    """The handlers of a stored response: retrieve it, delete it, list its input items; a
    response the key did not make, or that is not kept, is a 404 as OpenAI words it."""

    async def find(request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        stored = await kept.find(response_id, request[API_KEY].id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def retrieve(request: web.Request) -> web.Response:
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise invalid_request("stream: a stored response is retrieved whole; leave stream out", "stream")
        return _json((await find(request)).response)

    async def delete(request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not await kept.delete(response_id, request[API_KEY].id):
            raise _not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    async def list_items(request: web.Request) -> web.Response:
        limit, order, after = _list_params(request.query)
        items = (await find(request)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if at is None:
                raise invalid_request(f"after: no input item of this response has the id {after!r}", "after")
            items = items[at + 1 :]
        page = items[:limit]
        return _json(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    return retrieve, delete, list_items


def _list_params(query) -> tuple[int, str, str | None]:
    """input_items' `limit` (1 to 100, default 20), `order` (desc by default) and `after`."""
    raw = query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_ITEMS_LISTED:
        raise invalid_request(f"limit: expected an integer from 1 to {MAX_ITEMS_LISTED}, not {raw!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"order: expected 'asc' or 'desc', not {order!r}", "order")
    return limit, order, query.get("after") or None


def _not_found(response_id: str) -> GatewayError:
    return GatewayError(404, f"Response with id '{response_id}' not found.")


def _json(value: Any) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")
