"""What a stage is handed by the app that mounts it: small Protocols and callable types, so
that another aiohttp app can mount a stage with its own implementations. Their attributes are
read-only (properties): a frozen dataclass or a NamedTuple has them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from middlewares.core.records import KeyRecord, LedgerRow, Shortfall


class Rates(Protocol):
    """USD per million tokens of each kind."""

    @property
    def input(self) -> Decimal: ...
    @property
    def output(self) -> Decimal: ...
    @property
    def cache_write(self) -> Decimal: ...  # a 5-minute cache's write
    @property
    def cache_read(self) -> Decimal: ...
    @property
    def cache_write_1h(self) -> Decimal: ...  # a 1-hour cache's write


class LongContextRates(Rates, Protocol):
    """The rates of every token of a request whose input, cache reads and writes included, is
    above `above_input_tokens` (as Anthropic bills a long request: all of it, not the excess)."""

    @property
    def above_input_tokens(self) -> int: ...


class TierRates(Rates, Protocol):
    """The rates of one service tier, and of its long requests (None: no dearer rate for them)."""

    @property
    def long_context(self) -> LongContextRates | None: ...


class Pricing(TierRates, Protocol):
    """What a model costs: the standard tier's rates, those of the other tiers the upstream may
    report (None: billed at the standard tier's), and its server tools' fees."""

    @property
    def priority(self) -> TierRates | None: ...
    @property
    def batch(self) -> TierRates | None: ...
    @property
    def web_search_per_1000(self) -> Decimal: ...  # USD per 1,000 web searches
    @property
    def web_fetch_per_1000(self) -> Decimal: ...  # USD per 1,000 web fetches


class ModelSpec(Protocol):
    """A model as the stages see it (the gateway's configured model is one)."""

    @property
    def id(self) -> str: ...  # what clients send
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def sampling(self) -> bool: ...  # temperature and top_p are sent on
    @property
    def efforts(self) -> Sequence[str]: ...  # the upstream's effort levels it takes
    @property
    def forced_tool_choice(self) -> bool: ...
    @property
    def min_cache_tokens(self) -> int: ...  # 0: no prompt cache
    @property
    def pricing(self) -> Pricing: ...  # its price wherever it runs, unless it is a PricedPerDeployment


class PricedPerDeployment(ModelSpec, Protocol):
    """A model whose price depends on the deployment that answers it (the gateway's configured
    model is one). Optional: billing and admission use these where a model has them
    (`middlewares.core.usage.pricing_at` and `every_pricing`), and `pricing` alone elsewhere."""

    def pricing_at(self, deployment: str | None) -> Pricing:
        """What a request answered by `deployment` is billed at (None: no deployment said)."""

    @property
    def every_pricing(self) -> Sequence[Pricing]: ...  # each pricing_at may give: admission reserves the dearest


class Wait(float):
    """Seconds to wait, and which of a key's limits asks for them: "rpm" or "tpm" (None: not said)."""

    __slots__ = ("limit",)
    limit: str | None

    def __new__(cls, seconds: float, limit: str | None = None) -> Wait:
        wait = super().__new__(cls, seconds)
        wait.limit = limit
        return wait


class RateLimiter(Protocol):
    async def admit(self, key: KeyRecord, tokens: int | None = 0) -> float:
        """Take one request and `tokens` (the request's estimate) from the key's buckets, or
        none: 0 to let the request through, else the seconds to wait (a `Wait`, which names the
        limit, or a plain number). `tokens=None`: the request is held to rpm alone."""

    async def charge_tokens(self, key: KeyRecord, tokens: int) -> None:
        """Take `tokens` more (a negative count gives them back): what a request used beyond
        what it reserved."""

    async def enter(self, key: KeyRecord, request_id: str) -> float:
        """Count the request among the key's running ones, if fewer than its `max_concurrent`
        run: 0 when it entered, else the seconds to wait."""

    async def leave(self, key: KeyRecord, request_id: str) -> None: ...


class Spending(Protocol):
    """Spend reservations, held atomically by whatever keeps the keys' spend (the gateway's store)."""

    async def reserve(
        self,
        request_id: str,
        key_id: int,
        amount: Decimal,
        limit: Decimal | None,
        ttl: float,
        *,
        organization_id: int = 1,
        balance: Decimal | None = None,
        person_id: int | None = None,
        person_budget: Decimal | None = None,
        person_period: str = "month",
    ) -> Shortfall | None:
        """Hold `amount` for the request, in one step, if the key's spend and reservations leave
        that much of `limit`, its organization's spend and reservations that much of `balance`,
        and its person's spend in the current `person_period` and reservations, over all their
        keys, that much of `person_budget` (each None: no such limit): None when held, else a
        `Shortfall` saying which ran out and what is left of it (nothing is held then).
        Recording the request's ledger row ends it."""

    async def release(self, request_id: str) -> None:
        """End the request's reservation: it was not billed."""


# Finds the key whose SHA-256 hex digest is given, or None.
FindKey = Callable[[str], Awaitable["KeyRecord | None"]]
# The model a client's model id names, or None.
FindModel = Callable[[str], "ModelSpec | None"]
# Records a ledger row durably; returns once it is committed. A caller cancelled meanwhile
# (its client gone) leaves the row to be written: billing settles that request as used.
RecordRow = Callable[["LedgerRow"], Awaitable[None]]


class StoredConversation(Protocol):
    """A kept Responses API response, as a request that continues it reads it."""

    @property
    def response(self) -> dict[str, Any]: ...  # the response object as its client got it
    @property
    def input_items(self) -> list[dict[str, Any]]: ...  # its request's input, as Responses items with their ids
    # The conversation in Anthropic's Messages format, the answer's assistant turn last
    # (thinking blocks included), and the system prompt its input's system and developer
    # messages made (a response's `instructions` are not carried over: OpenAI's rule).
    @property
    def messages(self) -> list[dict[str, Any]]: ...
    @property
    def system(self) -> list[dict[str, Any]] | str | None: ...


class ResponseStore(Protocol):
    """Where the Responses stage keeps responses (`store`) and finds them again, by the key
    that made them."""

    def keep(
        self,
        key_id: int,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        system: list[dict[str, Any]] | None,
    ) -> None:
        """Keep the response (its id is `response["id"]`) without making the caller wait: the
        write runs beside the answer, and a write that fails is logged, never the request's error."""

    async def find(self, response_id: str, key_id: int) -> StoredConversation | None:
        """The response, if `key_id` made it and it is kept (not expired, deleted, nor made with
        `store: false`); a write of it still under way in this process is waited for."""

    async def delete(self, response_id: str, key_id: int) -> bool: ...
