"""The admin API's OpenAPI 3.1 document, written by hand (served at /admin/v1/openapi.json; a test
checks that its paths are exactly the routes gateway/admin/api.py registers)."""

from __future__ import annotations

from typing import Any

from gateway.accounting.usage import USAGE_COLUMNS
from gateway.config import MAX_NAME
from gateway.storage.unavailable import RETRY_AFTER


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


REASONS = {
    400: "A field or parameter is wrong (the message names it).",
    401: "No admin token, or one that is unknown or revoked (a gateway key is not one).",
    403: "A viewer's token, on a route that changes something.",
    404: "No such key, organization or person.",
    409: "Declared in the config file (change it there), or in conflict with what exists.",
    429: (
        "A wrong token from an address past failed_attempts_per_minute: refused for the rest of that "
        "minute (retry-after, in seconds); a valid token from it is always accepted."
    ),
    503: (
        "The gateway's database cannot be reached (error code store_unavailable); "
        f"try again after retry-after ({RETRY_AFTER} s)."
    ),
}
# The errors that say when to try again, in seconds.
RETRY_AFTER_HEADER = {
    "retry-after": {"description": "Seconds to wait before trying again.", "schema": {"type": "integer"}}
}


def _responses(ok: dict[str, Any], *errors: int, status: str = "200") -> dict[str, Any]:
    """`ok`, and the errors: 401, 429 and 503 on every route (each looks its token up in the
    store), and `errors`."""
    refs = {str(code): {"$ref": f"#/components/responses/E{code}"} for code in sorted({401, 429, 503, *errors})}
    return {status: ok, **refs}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}, "description": "The id."}
ORG_ID = {**ID, "description": "The organization's id, or its name."}
PERSON_ID = {**ID, "description": "The person's id."}
PAGE = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "Rows per page."),
    _query("after", {"type": "string"}, "The previous page's `next`."),
]
MONEY = {
    "type": ["string", "null"],
    "description": 'USD, a decimal string of nine places ("12.500000000"); null: no limit.',
}
# An amount as a string: ASCII digits, then a point and digits if any (gateway.config.usd's
# PLAIN_DECIMAL; a "-" it reads is refused as below 0, so the pattern leaves it out).
AMOUNT_TEXT = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$", "examples": ["12.50"]}
MONEY_IN = {
    "oneOf": [{"type": "number", "minimum": 0}, AMOUNT_TEXT, {"type": "null"}],
    "description": 'USD: a number, or a plain decimal string ("12.50"; not "1e3" nor "5_000"), at most '
    "1,000,000,000,000 and 9 decimal places; null: no limit.",
}
NAME_IN = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_NAME,
    "description": "No control or bidirectional formatting character, no space at either end, not digits alone.",
}
BUDGET_PERIOD = {
    "type": ["string", "null"],
    "enum": ["day", "week", "month", None],
    "description": "The UTC calendar period spend_limit_usd counts over; null: the key's whole life.",
}
COUNT_IN = {"type": ["integer", "null"], "minimum": 0, "description": "0 or null: no limit."}

KEY_SETTINGS = {
    "name": NAME_IN,
    "models": {"type": "array", "items": {"type": "string"}, "description": 'Model id globs, e.g. "anthropic/*".'},
    "spend_limit_usd": MONEY_IN,
    "budget_period": BUDGET_PERIOD,
    "rpm": COUNT_IN,
    "tpm": COUNT_IN,
    "max_concurrent": COUNT_IN,
    "expires_at": {"type": ["string", "null"], "format": "date-time", "description": "ISO; UTC without an offset."},
    "organization": {"type": "string", "description": "An organization's name."},
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "Key": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "models": {"type": "array", "items": {"type": "string"}},
            "spend_limit_usd": MONEY,
            "budget_period": BUDGET_PERIOD,
            "rpm": {"type": ["integer", "null"]},
            "tpm": {"type": ["integer", "null"]},
            "max_concurrent": {"type": ["integer", "null"]},
            "expires_at": {"type": ["string", "null"], "format": "date-time"},
            "revoked": {"type": "boolean"},
            "organization": {"type": "string"},
            "person_id": {
                "type": ["integer", "null"],
                "description": "The person who made it for themselves; null for an admin's key.",
            },
            "spent_usd": {"type": "string"},
            "period_spent_usd": {
                "type": ["string", "null"],
                "description": "What the current budget period has spent; null without a period.",
            },
            "reserved_usd": {"type": "string", "description": "What its running requests hold."},
            "from_config": {"type": "boolean", "description": "Declared in the config file: read-only here."},
        },
    },
    "KeyWithSecret": {
        "allOf": [
            _ref("Key"),
            {
                "type": "object",
                "required": ["secret"],
                "properties": {"secret": {"type": "string", "description": "sk-ezat-…, shown this once."}},
            },
        ]
    },
    "KeyCreate": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": KEY_SETTINGS},
    "KeyPatch": {
        "type": "object",
        "additionalProperties": False,
        "properties": {**KEY_SETTINGS, "revoked": {"type": "boolean", "description": "false: usable again."}},
    },
    "KeyPage": {
        "type": "object",
        "properties": {"data": {"type": "array", "items": _ref("Key")}, "next": {"type": ["string", "null"]}},
    },
    "Organization": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "balance_usd": MONEY,
            "suspended": {"type": "boolean"},
            "spent_usd": {"type": "string"},
            "reserved_usd": {"type": "string"},
            "keys": {"type": "integer"},
            "from_config": {"type": "boolean"},
        },
    },
    "OrganizationCreate": {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {"name": NAME_IN, "balance_usd": MONEY_IN, "suspended": {"type": "boolean"}},
    },
    "OrganizationPatch": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"balance_usd": MONEY_IN, "suspended": {"type": "boolean"}},
    },
    "TopUp": {
        "type": "object",
        "required": ["amount_usd"],
        "additionalProperties": False,
        "properties": {"amount_usd": {"oneOf": [{"type": "number", "exclusiveMinimum": 0}, AMOUNT_TEXT]}},
    },
    "OrganizationPage": {
        "type": "object",
        "properties": {
            "data": {"type": "array", "items": _ref("Organization")},
            "next": {"type": ["string", "null"]},
        },
    },
    "Person": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "subject": {"type": "string", "description": "The identity provider's `sub`: who they are to it."},
            "email": {"type": "string"},
            "name": {"type": "string"},
            "groups": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The identity provider's groups, as of their last sign-in.",
            },
            "first_seen": {"type": "string", "format": "date-time", "description": "Their first sign-in."},
            "last_seen": {"type": "string", "format": "date-time", "description": "Their last sign-in."},
            "disabled": {"type": "boolean"},
        },
    },
    "PersonPage": {
        "type": "object",
        "properties": {"data": {"type": "array", "items": _ref("Person")}, "next": {"type": ["string", "null"]}},
    },
    "Usage": {
        "type": "object",
        "properties": {
            "group_by": {"type": "string"},
            "since": {"type": ["string", "null"]},
            "until": {"type": ["string", "null"]},
            "data": {
                "type": "array",
                "description": "The CLI's `usage --format json`: the group (named as group_by), then the totals.",
                "items": {
                    "type": "object",
                    # The CLI's own columns, so the document cannot drift from them.
                    "properties": {
                        name: {"type": "string" if name == "cost_usd" else "integer"} for name in USAGE_COLUMNS
                    },
                },
            },
        },
    },
    "LedgerRow": {
        "type": "object",
        "properties": {
            "request_id": {"type": "string"},
            "key_id": {"type": "integer"},
            "key": {"type": ["string", "null"]},
            "model": {"type": "string"},
            "answered_model": {"type": "string"},
            "deployment": {"type": "string"},
            "input_tokens": {"type": "integer"},
            "cache_write_tokens": {"type": "integer"},
            "cache_write_1h_tokens": {"type": "integer"},
            "cache_read_tokens": {"type": "integer"},
            "output_tokens": {"type": "integer"},
            "reasoning_tokens": {"type": "integer"},
            "cost_usd": {"type": "string"},
            "status": {"type": "string", "enum": ["complete", "client_closed"]},
            "session": {"type": ["string", "null"]},
            "started_at": {"type": "string", "format": "date-time"},
            "finished_at": {"type": "string", "format": "date-time"},
        },
    },
    "LedgerPage": {
        "type": "object",
        "properties": {"data": {"type": "array", "items": _ref("LedgerRow")}, "next": {"type": ["string", "null"]}},
    },
    "AuditEntry": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "at": {"type": "string", "format": "date-time"},
            "actor": {"type": "string", "description": "The admin token's name, or cli:<user>."},
            "action": {"type": "string", "examples": ["key.create", "organization.top_up"]},
            "target": {"type": "string", "examples": ["key:12"]},
            "before": {"type": ["object", "null"]},
            "after": {"type": ["object", "null"]},
        },
    },
    "AuditPage": {
        "type": "object",
        "properties": {"data": {"type": "array", "items": _ref("AuditEntry")}, "next": {"type": ["string", "null"]}},
    },
}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _operation(summary: str, responses: dict[str, Any], *, parameters=(), body: str | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if parameters:
        operation["parameters"] = list(parameters)
    if body:
        operation["requestBody"] = _body(body)
    return operation


KEY_OK = _json(_ref("Key"))
ORG_OK = _json(_ref("Organization"))
PERSON_OK = _json(_ref("Person"))

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "ezat-gateway admin API",
        "version": "1",
        "description": "Keys, organizations, people, usage, the ledger and the audit log. Authenticate with "
        "`Authorization: Bearer <admin token>`; a viewer reads, an admin also writes.",
    },
    "security": [{"adminToken": []}],
    "paths": {
        "/admin/v1/keys": {
            "get": _operation(
                "List keys",
                _responses(_json(_ref("KeyPage")), 400),
                parameters=[
                    _query("organization", {"type": "string"}, "Only this organization's (by name)."),
                    _query("name", {"type": "string"}, "Only keys of this name."),
                    _query("revoked", {"type": "boolean"}, "Only revoked (true) or usable (false) keys."),
                    *PAGE,
                ],
            ),
            "post": _operation(
                "Create a key (its secret is returned this once)",
                _responses(_json(_ref("KeyWithSecret"), "Created"), 400, 403, status="201"),
                body="KeyCreate",
            ),
        },
        "/admin/v1/keys/{id}": {
            "get": _operation("Get a key", _responses(KEY_OK, 404), parameters=[ID]),
            "patch": _operation(
                "Change a key's settings", _responses(KEY_OK, 400, 403, 404, 409), parameters=[ID], body="KeyPatch"
            ),
        },
        "/admin/v1/keys/{id}/revoke": {
            "post": _operation("Revoke a key", _responses(KEY_OK, 403, 404, 409), parameters=[ID]),
        },
        "/admin/v1/keys/{id}/rotate": {
            "post": _operation(
                "Give a key a new secret (returned this once); the old one stops working",
                _responses(_json(_ref("KeyWithSecret")), 403, 404, 409),
                parameters=[ID],
            ),
        },
        "/admin/v1/organizations": {
            "get": _operation("List organizations", _responses(_json(_ref("OrganizationPage")), 400), parameters=PAGE),
            "post": _operation(
                "Create an organization",
                _responses(_json(_ref("Organization"), "Created"), 400, 403, 409, status="201"),
                body="OrganizationCreate",
            ),
        },
        "/admin/v1/organizations/{id}": {
            "get": _operation("Get an organization", _responses(ORG_OK, 404), parameters=[ORG_ID]),
            "patch": _operation(
                "Change an organization's balance or suspension",
                _responses(ORG_OK, 400, 403, 404, 409),
                parameters=[ORG_ID],
                body="OrganizationPatch",
            ),
        },
        "/admin/v1/organizations/{id}/top-up": {
            "post": _operation(
                "Add credit to an organization's balance",
                _responses(ORG_OK, 400, 403, 404, 409),
                parameters=[ORG_ID],
                body="TopUp",
            ),
        },
        "/admin/v1/organizations/{id}/suspend": {
            "post": _operation(
                "Suspend an organization (its keys get 403)", _responses(ORG_OK, 403, 404, 409), parameters=[ORG_ID]
            ),
        },
        "/admin/v1/organizations/{id}/resume": {
            "post": _operation("Resume an organization", _responses(ORG_OK, 403, 404, 409), parameters=[ORG_ID]),
        },
        "/admin/v1/people": {
            "get": _operation(
                "List the people who signed in to the console",
                _responses(_json(_ref("PersonPage")), 400),
                parameters=PAGE,
            ),
        },
        "/admin/v1/people/{id}": {
            "get": _operation("Get a person", _responses(PERSON_OK, 404), parameters=[PERSON_ID]),
        },
        "/admin/v1/people/{id}/disable": {
            "post": _operation("Disable a person", _responses(PERSON_OK, 403, 404), parameters=[PERSON_ID]),
        },
        "/admin/v1/people/{id}/enable": {
            "post": _operation(
                "Enable a disabled person again", _responses(PERSON_OK, 403, 404), parameters=[PERSON_ID]
            ),
        },
        "/admin/v1/usage": {
            "get": _operation(
                "Usage totals, as the CLI's usage reports them",
                _responses(
                    {
                        "description": "OK",
                        "content": {
                            "application/json": {"schema": _ref("Usage")},
                            "text/csv": {"schema": {"type": "string"}},
                        },
                    },
                    400,
                ),
                parameters=[
                    _query(
                        "group_by",
                        {
                            "type": "string",
                            "enum": ["key", "organization", "person", "model", "deployment", "day", "session"],
                            "default": "day",
                        },
                        "How to group the requests.",
                    ),
                    _query("since", {"type": "string", "format": "date-time"}, "Requests finished from then on."),
                    _query("until", {"type": "string", "format": "date-time"}, "Requests finished before then."),
                    _query("key_id", {"type": "integer"}, "Only this key's requests."),
                    _query("format", {"type": "string", "enum": ["json", "csv"], "default": "json"}, "The format."),
                ],
            ),
        },
        "/admin/v1/ledger": {
            "get": _operation(
                "The ledger's rows, oldest first",
                _responses(_json(_ref("LedgerPage")), 400),
                parameters=[
                    _query("key_id", {"type": "integer"}, "Only this key's requests."),
                    _query("since", {"type": "string", "format": "date-time"}, "Requests finished from then on."),
                    _query("until", {"type": "string", "format": "date-time"}, "Requests finished before then."),
                    *PAGE,
                ],
            ),
        },
        "/admin/v1/audit": {
            "get": _operation(
                "The audit log, newest first",
                _responses(_json(_ref("AuditPage")), 400),
                parameters=[
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "Entries."),
                    _query("before", {"type": "string"}, "The previous page's `next`."),
                ],
            ),
        },
        "/admin/v1/openapi.json": {
            "get": {
                "summary": "This document",
                "security": [],
                "responses": {"200": {"description": "OK", "content": {"application/json": {}}}},
            },
        },
    },
    "components": {
        "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer", "description": "ezat-admin-…"}},
        "schemas": SCHEMAS,
        "responses": {
            f"E{status}": {
                "description": reason,
                "content": {"application/json": {"schema": _ref("Error")}},
                **({"headers": RETRY_AFTER_HEADER} if status in (429, 503) else {}),
            }
            for status, reason in REASONS.items()
        },
    },
}
