"""The limits stage: admission, before any costly work (downloading images, translating,
calling the upstream). It resolves the model once, for every later stage, and decides whether
the caller's key may run this request at all: its organization is not suspended (403), the
model exists (404), the key may use it and every fallback model the request names (403), it is
within its rate and its requests at once (429), and the request's worst-case cost fits what is
left of the key's spend limit, of its person's budget over all their keys and of its
organization's balance (402). What it admits it reserves, atomically, until the request is
settled. A refused request costs the gateway nothing more."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import API_KEY, BODY, BODY_BYTES, FALLBACK_MODELS, MODEL, SETTLE, request_id
from middlewares.core.errors import GatewayError, invalid_request, model_not_found, retry_after
from middlewares.core.periods import EVERY, next_start
from middlewares.core.protocols import FindModel, ModelSpec, RateLimiter, Spending, Wait
from middlewares.core.records import KeyRecord, Shortfall
from middlewares.core.sizes import DEFAULT_MAX_TOKENS
from middlewares.core.usage import PER_MILLION, Usage, estimate_tokens, every_pricing, possible_rates

__all__ = ["limits_middleware"]


# Seconds a reservation outlives a request that never settles it (its process died), by
# default: the most a request of the gateway's takes with its default deadlines, non-streaming
# (590 s) or streamed, with room to spare. An app whose requests may run longer passes its own.
RESERVATION_TTL = 3600.0


def limits_middleware(
    *,
    find_model: FindModel,
    spending: Spending | None = None,
    limiter: RateLimiter | None = None,
    reserve: bool = True,
    reservation_ttl: float = RESERVATION_TTL,
    api: str = "openai",
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    used_up: Callable[[KeyRecord, str], None] | None = None,
) -> Stage:
    """Resolves `request[BODY]["model"]` with `find_model(id)` into `request[MODEL]`, and the
    request's `models` (fallbacks, tried in order when the asked model cannot answer) into
    `request[FALLBACK_MODELS]`. Then, for the key in `request[API_KEY]`:
    - its organization must not be suspended (403 `permission_error`), before any other check;
    - its `models` must allow each model (403 `permission_error`);
    - `limiter.admit(key, tokens)` must let it through (429 `rate_limit_exceeded` with
      `retry-after`): it takes one request and reserves the request's token estimate, its input
      estimated from its size plus its output limit, at most the model's `max_output_tokens` (a
      larger one is the 400 of the stage that reads the body after this one): a chat completion
      request's, a Responses API request's (`api="responses"`, its `max_output_tokens`), an
      Anthropic Messages request's (`api="anthropic"`);
    - with `max_concurrent`, `limiter.enter(key, request id)` must find it running fewer (429
      `rate_limit_exceeded`); it leaves when the request is settled;
    - `spending.reserve(...)` must hold the request's worst-case cost within the key's
      `spend_limit_usd` (402 `insufficient_quota`, saying what is left): that estimate's tokens
      at the dearest prices of every model that may answer, at any of its deployments; and, in the same step, within its
      organization's `organization_balance_usd`, which all the organization's keys share (402
      naming the organization). A key with a `budget_period` ("day", "week" or "month") has its
      limit for each such period (UTC calendar; `now()` says which it is): its 402 says what is
      left of this period's and when the next begins. A key of a person with a budget
      (`person_budget_usd`, over `person_budget_period`, as the gateway sets them from the
      person's policy) has it held, in the same step, against what all the person's keys spent
      in the current period and hold (402 naming the person's budget). A reservation never
      settled (its process died) expires after `reservation_ttl` seconds: longer than any
      request may run. A 402 whose request could not pay even for its input calls
      `used_up(key, "key" | "organization")`: that budget or balance is used up (the gateway's
      alerts hear of it so; they know no person's budget).
    Without `spending` or `limiter`, those checks are not made. With `reserve=False`, for
    requests that cost nothing (Anthropic's count_tokens), only the request is taken from the
    key's rpm: nothing is taken from or checked against its tpm, and no place among its running
    requests or spend is reserved.

    `request[SETTLE](usage)`, which billing calls once the row is recorded (the row's commit ends
    the spend reservation), settles the tokens to those used and gives back the request's place
    among the key's running requests; `SETTLE(None)` gives back all it holds (its tokens, its
    place and its spend reservation), for a request that is not billed. A request that fails
    before its reply leaves this stage is settled so here."""
    if not callable(find_model):
        raise TypeError("limits_middleware: find_model must be a callable")
    if api not in _OUTPUT_LIMITS:
        raise ValueError('limits_middleware: api must be "openai", "anthropic" or "responses"')
    output_fields = _OUTPUT_LIMITS[api]

    @stage("limits", requires=(BODY, BODY_BYTES, API_KEY), provides=(MODEL, FALLBACK_MODELS, SETTLE))
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        body, key = request[BODY], request[API_KEY]
        _check_organization(key)
        model = _asked_model(body, find_model)
        request[MODEL] = model  # known from here on, refused or not (the app's logs and metrics name it)
        fallbacks = _fallbacks(body.get("models"), model, find_model)
        models = (model, *fallbacks)
        _check_models_allowed(key, models)
        # What admitting it would reserve: its tokens against the key's tpm, its worst-case cost
        # against the key's spend limit, its person's budget and its organization's balance
        # (nothing with reserve=False).
        spends = reserve and spending is not None
        limit = key.spend_limit_usd if spends else None
        balance = key.organization_balance_usd if spends else None
        budget = key.person_budget_usd if spends and key.person_id is not None else None
        held = limit is not None or balance is not None or budget is not None
        tokens = reserve and limiter is not None and bool(key.tpm)
        input_tokens, output_tokens = (
            _token_estimate(body, request[BODY_BYTES], model, output_fields)
            if tokens or held  # estimated only where a limit needs it
            else _NO_ESTIMATE
        )
        rid = request_id(request)
        reservation = Reservation(limiter, key, rid, input_tokens + output_tokens if tokens else 0)
        if limiter is not None:
            # A request that reserves nothing is held to the key's rpm alone, not its tpm.
            _check_rate(key, await limiter.admit(key, reservation.tokens if reserve else None))
        # From here on the request holds something: whatever ends it (a refusal below, the
        # store failing, a cancellation, an error in a later stage) gives back what it holds.
        try:
            if reserve and limiter is not None and key.max_concurrent:
                # Marked first: a request cancelled while its place is taken gives it back
                # (leave is a no-op for a request that holds none).
                reservation.running = True
                _check_concurrency(key, await limiter.enter(key, rid))
            if spending is not None and held:
                cost = _worst_cost(models, input_tokens, output_tokens)
                short = await spending.reserve(
                    rid,
                    key.id,
                    cost,
                    limit,
                    reservation_ttl,
                    organization_id=key.organization_id,
                    balance=balance,
                    person_id=key.person_id,
                    person_budget=budget,
                    person_period=key.person_budget_period or "month",
                )
                _check_spend(key, short, models, input_tokens, cost, output_fields[-1], now, used_up)
                reservation.spending = spending
            request[FALLBACK_MODELS] = fallbacks
            request[SETTLE] = reservation.settle
            return await handler(request)
        except BaseException:
            await reservation.settle(None)
            raise

    return limits


# The steps of admission, in the order the stage takes them. Each refuses by raising; those after
# an await are handed its answer, so a step costs a call, never a coroutine of its own.

_NO_ESTIMATE = (0, 0)  # (input, output) tokens, where no limit needs an estimate


def _check_organization(key: KeyRecord) -> None:
    """A suspended organization's keys are refused before anything else is looked at."""
    if key.organization_suspended:
        raise GatewayError(
            403, f"This key's organization `{key.organization}` is suspended.", type="permission_error", refusal="auth"
        )


def _asked_model(body: dict[str, Any], find_model: FindModel) -> ModelSpec:
    """The model the request names, resolved once for every later stage."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise invalid_request("model: required", "model")
    model = find_model(name)
    if model is None:
        raise model_not_found(name)
    return model


def _fallbacks(models: Any, asked: ModelSpec, find_model: FindModel) -> tuple[ModelSpec, ...]:
    """The request's `models`, resolved: alternatives to the asked model, in order, once each."""
    if models is None:
        return ()
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise invalid_request("models: expected a list of model ids", "models")
    resolved: dict[str, ModelSpec] = {}
    for name in models:
        model = find_model(name)
        if model is None:
            raise model_not_found(name)
        if model.id != asked.id:
            resolved.setdefault(model.id, model)
    return tuple(resolved.values())


def _check_models_allowed(key: KeyRecord, models: tuple[ModelSpec, ...]) -> None:
    """The key may use every model that may answer: the asked one and each fallback."""
    for model in models:
        if not key.allows(model.id):
            raise GatewayError(
                403, f"This key may not use the model `{model.id}`.", type="permission_error", refusal="model"
            )


def _check_rate(key: KeyRecord, wait: float) -> None:
    """`wait`, the limiter's answer to admitting the request: a 429 to wait that long, if any."""
    if wait:
        raise GatewayError(
            429,
            "Too many requests for this key; wait and try again.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=retry_after(wait),
            refusal=(wait.limit if isinstance(wait, Wait) else None) or ("rpm" if key.rpm else "tpm"),
        )


def _check_concurrency(key: KeyRecord, wait: float) -> None:
    """`wait`, the limiter's answer to entering the key's running requests: a 429 if it is full."""
    if wait:
        raise GatewayError(
            429,
            f"This key already runs {key.max_concurrent} requests, the most it may at once; wait for one to finish.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=retry_after(wait),
            refusal="concurrency",
        )


def _check_spend(
    key: KeyRecord,
    short: Shortfall | None,
    models: tuple[ModelSpec, ...],
    input_tokens: int,
    cost: Decimal,
    output_field: str,
    now: Callable[[], datetime],
    used_up: Callable[[KeyRecord, str], None] | None,
) -> None:
    """`short`, the spend reservation's answer (None: `cost` is held): a 402 saying whose limit,
    the key's spend limit (or its budget for the period), its person's budget or its
    organization's balance, has less left than `cost` (and, when the input alone fits, that a
    lower `output_field` would)."""
    if short is None:
        return
    input_cost = _worst_cost(models, input_tokens, 0)
    if short.of == "person":  # (no alert watches a person's budget)
        raise _over_persons_budget(key, short.left, cost, input_cost, output_field, now)
    if used_up is not None and input_cost >= short.left:  # no lower output limit would fit
        used_up(key, short.of)
    if short.of == "organization":
        raise _over_limit(
            f"This key's organization `{key.organization}`",
            "balance",
            "has used up its balance of",
            key.organization_balance_usd,
            short.left,
            cost,
            input_cost,
            output_field,
        )
    if key.budget_period is not None:
        every = EVERY[key.budget_period]
        resets = f"; it resets on {next_start(key.budget_period, now()).isoformat()}"
        raise _over_limit(
            "This key",
            f"{every} budget",
            f"has used up its {every} budget of",
            key.spend_limit_usd,
            short.left,
            cost,
            input_cost,
            output_field,
            resets,
        )
    raise _over_limit(
        "This key",
        "spend limit",
        "has reached its spend limit of",
        key.spend_limit_usd,
        short.left,
        cost,
        input_cost,
        output_field,
    )


# Per API, the fields that set a request's output limit, the first one present winning.
_OUTPUT_LIMITS = {
    "openai": ("max_completion_tokens", "max_tokens"),
    "anthropic": ("max_completion_tokens", "max_tokens"),  # (a Messages request has only the second)
    "responses": ("max_output_tokens",),
}


def _token_estimate(
    body: dict[str, Any], body_bytes: int, model: ModelSpec, fields: tuple[str, ...]
) -> tuple[int, int]:
    """The most tokens a request can take: its input, estimated from the body's size (JSON
    syntax makes that an overestimate), and its output limit (the first of `fields` it sets), at
    most the model's maximum."""
    output = min(DEFAULT_MAX_TOKENS, model.max_output_tokens)
    for field in fields:
        limit = body.get(field)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            output = min(limit, model.max_output_tokens)
            break
    return estimate_tokens(body_bytes), output


def _worst_cost(models: tuple[ModelSpec, ...], input_tokens: int, output_tokens: int) -> Decimal:
    """USD at the dearest of any model that may answer, at any deployment it may answer at (each
    pricing it may be billed at: `every_pricing`), in any service tier it may answer in (at its
    long-context rates for a long request): each input token at its dearest kind (a cache write
    costs more than plain input); the asked model (the first) writing all of `output_tokens`, a
    fallback at most its maximum (the handler lowers max_tokens for it)."""
    return (
        max(
            input_tokens * max(rates.input, rates.cache_write, rates.cache_write_1h, rates.cache_read)
            + (output_tokens if m is models[0] else min(output_tokens, m.max_output_tokens)) * rates.output
            for m in models
            for pricing in every_pricing(m)
            for rates in possible_rates(pricing, input_tokens)
        )
        / PER_MILLION
    )


def _over_limit(
    who: str,
    limit: str,
    exhausted: str,
    total: Decimal | None,  # (never None: a limit that ran out is set)
    left: Decimal,
    cost: Decimal,
    input_cost: Decimal,
    output_field: str,
    resets: str = "",
) -> GatewayError:
    """The 402 for a request whose worst case does not fit what is left of `who`'s `limit`
    (`resets`: when a period's limit begins again, said last)."""
    if left <= 0:
        message = f"{who} {exhausted} ${total}{resets}."
    else:
        message = (
            f"{who} has ${_usd(left)} left of its {limit} of ${total}, less than this request may cost "
            f"(${_usd(cost)})" + (f"; a lower {output_field} would fit" if input_cost < left else "") + f"{resets}."
        )
    return GatewayError(402, message, type="insufficient_quota", code="insufficient_quota", refusal="spend")


# A person's budget period as their 402 names the current one.
_THIS_PERIOD = {"day": "today", "week": "this week", "month": "this month"}


def _over_persons_budget(
    key: KeyRecord, left: Decimal, cost: Decimal, input_cost: Decimal, output_field: str, now: Callable[[], datetime]
) -> GatewayError:
    """The 402 for a request whose worst case does not fit what is left of the budget its
    person's policy gives them over all their keys: to the person, who may hold several keys,
    what they have used of it (spent, and held by their requests under way) and when it resets."""
    total, period = key.person_budget_usd, key.person_budget_period or "month"  # (as reserved)
    assert total is not None  # a person's budget ran out: they have one
    budget = f"your budget for {_THIS_PERIOD[period]} across all your keys (${_usd(total - left)} of ${total} used)"
    resets = f"; it resets on {next_start(period, now()).isoformat()}"
    if left <= 0:
        message = f"You have used up {budget}{resets}."
    else:
        message = (
            f"You have ${_usd(left)} left of {budget}, less than this request may cost (${_usd(cost)})"
            + (f"; a lower {output_field} would fit" if input_cost < left else "")
            + f"{resets}."
        )
    return GatewayError(402, message, type="insufficient_quota", code="insufficient_quota", refusal="spend")


def _usd(amount: Decimal) -> str:
    """Dollars to the millionth, no further: what a message needs."""
    return f"{amount.quantize(Decimal('0.000001')).normalize():f}"


class Reservation:
    """What a request holds from admission until it is settled, once: the tokens it reserved
    (settled to what it used, or given back if it failed), its place among the key's running
    requests, and, with a spend limit or a balance, its spend reservation (ended by its ledger
    row, or released if it is not billed)."""

    __slots__ = ("_limiter", "_key", "_request_id", "tokens", "running", "spending", "_settled")

    def __init__(self, limiter: RateLimiter | None, key: KeyRecord, request_id: str, tokens: int) -> None:
        self._limiter, self._key, self._request_id, self.tokens = limiter, key, request_id, tokens
        self.running = False  # it holds a place among the key's running requests
        self.spending: Spending | None = None  # where its spend reservation is held
        self._settled = False

    async def settle(self, usage: Usage | None) -> None:
        """Each part is given back even if another fails (Redis down, say, or a cancellation)."""
        if self._settled:
            return
        self._settled = True
        try:
            used = 0 if usage is None else usage.prompt_tokens + usage.output_tokens
            if self._limiter is not None and self._key.tpm and used != self.tokens:
                await self._limiter.charge_tokens(self._key, used - self.tokens)
        finally:
            try:
                if self.running and self._limiter is not None:  # (running: a limiter holds its place)
                    await self._limiter.leave(self._key, self._request_id)
            finally:
                if usage is None and self.spending is not None:
                    await self.spending.release(self._request_id)
