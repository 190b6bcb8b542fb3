"""AWS Signature Version 4 for one POST with no query, as Bedrock's runtime takes it.

botocore finds and refreshes the credentials (bedrock.py); the signature itself is made here,
because botocore's signer builds a request object and re-parses its URL and headers on every
call, several times the work of the signature. The result is the same bytes: the tests check
it against botocore's own signer, and the mock Bedrock verifies every request with botocore.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from typing import NamedTuple
from urllib.parse import quote

from yarl import URL

ALGORITHM = "AWS4-HMAC-SHA256"
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Credentials(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None = None


class SigningKeys:
    """The day's signing key per (secret, day, region, service): four HMACs, made once a day."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str, str], bytes] = {}

    def __call__(self, secret: str, day: str, region: str, service: str) -> bytes:
        found = self._keys.get((secret, day, region, service))
        if found is None:
            if len(self._keys) > 16:  # yesterday's and rotated secrets' keys
                self._keys.clear()
            key = ("AWS4" + secret).encode()
            for part in (day, region, service, "aws4_request"):
                key = hmac.digest(key, part.encode(), "sha256")
            found = self._keys[(secret, day, region, service)] = key
        return found


def signed_headers(
    url: URL,
    headers: dict[str, str],
    body: bytes,
    credentials: Credentials,
    region: str,
    service: str,
    keys: SigningKeys,
    now: datetime | None = None,
) -> dict[str, str]:
    """`headers` (lower-case names) with the SigV4 headers for POSTing `body` to `url`."""
    amz_date = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    port = url.explicit_port
    host = url.raw_host if port is None or port == _DEFAULT_PORTS.get(url.scheme) else f"{url.raw_host}:{port}"
    sent = {**headers, "x-amz-date": amz_date}
    if credentials.token:
        sent["x-amz-security-token"] = credentials.token
    signing = {**sent, "host": str(host)}
    names = sorted(signing)
    canonical_headers = "".join(f"{name}:{' '.join(signing[name].split())}\n" for name in names)
    signed = ";".join(names)
    # Services other than S3 sign the path encoded once more, as sent.
    canonical = "\n".join(
        ("POST", quote(url.raw_path, safe="/~"), "", canonical_headers, signed, hashlib.sha256(body).hexdigest())
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = f"{ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    signature = hmac.new(keys(credentials.secret_key, day, region, service), to_sign.encode(), "sha256").hexdigest()
    sent["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
    )
    return sent
