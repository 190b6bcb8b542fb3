"""Sign-in through the company's identity provider, as an OpenID Connect relying party: the
authorization-code flow with PKCE (RFC 7636), a nonce and a state.

`OidcClient.start` makes the provider's authorization URL and the values the caller keeps (in a
signed cookie) until the browser comes back; `finish` checks the callback, exchanges its code at
the token endpoint and verifies the ID token: its signature against the provider's published keys
(joserfc; never `none`, only the algorithms discovery declares), then iss, aud (and azp), exp, iat
and the nonce. What the ID token leaves out (the address, the name, the groups) is asked of the
userinfo endpoint, which must answer for the same subject. `refresh` renews a sign-in with its
refresh token, to see whether the person is still who they were (their groups, their address).

What the provider says is read defensively: discovery and the keys are fetched on first use and
kept (a failure is not kept: the next use fetches again); an ID token naming a key that is not
among those kept fetches the keys again, at most once a minute, so a forged `kid` cannot make the
gateway hammer the provider. Every request has a deadline, follows no redirect and reads at most
MAX_BODY bytes. Errors say what went wrong in words a person may be shown: never a token, a code
or the client secret."""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson
from authlib.common.security import generate_token
from authlib.oauth2.rfc6749.parameters import prepare_grant_uri, prepare_token_request
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jws, jwt
from joserfc.errors import (
    BadSignatureError,
    ClaimError,
    ExpiredTokenError,
    InvalidKeyIdError,
    JoseError,
    MissingClaimError,
)
from joserfc.jwk import JWKRegistry, Key, KeySet

from gateway.config import OidcConfig, is_loopback_url

log = logging.getLogger("ezat.oidc")

TIMEOUT = 10.0  # seconds for any one request to the provider, connecting and reading included
MAX_BODY = 1024 * 1024  # bytes: a discovery document, a key set or a token response is far smaller
LEEWAY = 60  # seconds of clock skew allowed on exp and iat
KEYS_REFETCH_AFTER = 60.0  # seconds: an unknown key fetches the keys again at most this often
MAX_PROVIDER_TEXT = 200  # characters of the provider's own error code or description shown

# ID tokens are signed with the provider's private key, published in its JWKS. The HMAC algorithms
# (keyed with the client secret) are left out: such a token proves only that someone holding the
# secret made it, and `none` proves nothing.
ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA", "Ed25519", "Ed448"}
)
# How this client authenticates at the token endpoint, in order of preference.
AUTH_METHODS = ("client_secret_basic", "client_secret_post")


class OidcError(Exception):
    """A sign-in that cannot complete; str(error) is safe to show the person (no secrets, no tokens)."""


class ProviderUnavailable(OidcError):
    """The provider could not be reached or answered garbage (discovery, JWKS, token endpoint down)."""


@dataclass(frozen=True)
class SignInStart:
    url: str  # where to send the browser: the provider's authorization endpoint and the request's parameters
    state: str
    nonce: str
    # The caller keeps state, nonce and code_verifier (in a signed cookie) until the callback.
    code_verifier: str = field(repr=False)


@dataclass(frozen=True)
class Identity:
    """Who signed in, as the provider vouches for them."""

    subject: str
    email: str  # "" if none, or not verified
    name: str  # "" if none
    groups: tuple[str, ...]  # from config.groups_claim
    refresh_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Provider:
    """What discovery says of the provider, checked."""

    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None
    algorithms: tuple[str, ...]  # the ID token's signing algorithms this client accepts
    auth_method: str  # one of AUTH_METHODS


class OidcClient:
    """The gateway as an OpenID Connect relying party of `config.issuer`. One per process: it
    keeps the provider's discovery document and keys."""

    def __init__(
        self,
        config: OidcConfig,
        session: aiohttp.ClientSession | None = None,
        *,
        clock: Callable[[], float] = time.time,
        timeout: float = TIMEOUT,
    ) -> None:
        self._config = config
        self._session = session
        self._owns_session = session is None
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._provider: _Provider | None = None
        self._discovering = asyncio.Lock()
        self._keys: KeySet | None = None
        self._keys_refetched_at = -math.inf  # by self._clock
        self._fetching_keys = asyncio.Lock()
        # Plain http is allowed only where the issuer itself is plain http on this machine (tests,
        # a provider beside the gateway): then its endpoints may be too, on a loopback address.
        self._insecure_loopback = urlsplit(config.issuer).scheme == "http" and is_loopback_url(config.issuer)

    async def close(self) -> None:
        """Closes the HTTP session if this client made it (one handed in is the caller's)."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # --- the flow

    async def start(self, redirect_uri: str) -> SignInStart:
        """The authorization request: where to send the browser, and what to keep until it comes
        back to `redirect_uri`."""
        provider = await self._discover()
        state, nonce = generate_token(43), generate_token(43)  # 43 of 62 characters: over 256 bits each
        code_verifier = generate_token(64)  # RFC 7636: 43 to 128 unreserved characters
        url = prepare_grant_uri(
            provider.authorization_endpoint,
            self._config.client_id,
            "code",
            redirect_uri=redirect_uri,
            scope=" ".join(self._config.scopes),
            state=state,
            nonce=nonce,
            code_challenge=create_s256_code_challenge(code_verifier),
            code_challenge_method="S256",
        )
        return SignInStart(url=url, state=state, nonce=nonce, code_verifier=code_verifier)

    async def finish(
        self, redirect_uri: str, params: Mapping[str, str], *, state: str, nonce: str, code_verifier: str
    ) -> Identity:
        """The callback: `params` is its query. Checks it against what `start` gave (`state`,
        `nonce`, `code_verifier`), exchanges its code and verifies the ID token; the person's
        identity, or OidcError saying why not."""
        if "error" in params:
            refusal = _provider_text(params.get("error", ""))
            description = _provider_text(params.get("error_description", ""))
            raise OidcError(
                f"the identity provider refused the sign-in: {refusal}" + (f" ({description})" if description else "")
            )
        returned = params.get("state", "")
        if not state or not hmac.compare_digest(returned.encode(), state.encode()):
            raise OidcError("the sign-in's state does not match this browser's: start the sign-in again")
        # RFC 9207: a provider that names itself in the response must be the one asked.
        if "iss" in params and params["iss"] != self._config.issuer:
            raise OidcError("the sign-in's answer names another identity provider")
        code = params.get("code", "")
        if not code:
            raise OidcError("the identity provider's answer carries no authorization code")
        if not nonce or not code_verifier:
            raise OidcError("the sign-in's saved values are missing: start the sign-in again")
        provider = await self._discover()
        tokens = await self._token_request(
            provider, "authorization_code", code=code, redirect_uri=redirect_uri, code_verifier=code_verifier
        )
        if not isinstance(tokens.get("id_token"), str):
            raise ProviderUnavailable("the identity provider's token endpoint answered without an ID token")
        claims = await self._verify_id_token(provider, tokens["id_token"], nonce=nonce)
        return await self._identity(provider, claims, tokens, refresh_token=None)

    async def refresh(self, refresh_token: str) -> Identity:
        """A sign-in renewed with its refresh token: the person as the provider sees them now. A
        refused grant (the person was removed, the token revoked) is OidcError; a provider out of
        reach, ProviderUnavailable. The caller compares the subject with the one it kept."""
        provider = await self._discover()
        tokens = await self._token_request(provider, "refresh_token", refresh_token=refresh_token)
        if isinstance(tokens.get("id_token"), str):
            claims = await self._verify_id_token(provider, tokens["id_token"], nonce=None)
            return await self._identity(provider, claims, tokens, refresh_token=refresh_token)
        # OpenID Connect allows a refresh without a new ID token: the person is then who the
        # userinfo endpoint says the new access token is for.
        claims = await self._userinfo(provider, tokens)
        if not isinstance(claims.get("sub"), str) or not claims["sub"]:
            raise ProviderUnavailable("the identity provider's userinfo answer names no subject")
        return await self._identity(provider, claims, tokens, refresh_token=refresh_token, from_userinfo=True)

    # --- discovery and keys

    async def _discover(self) -> _Provider:
        """The provider's discovery document, fetched and checked once; not kept when that fails."""
        if self._provider is not None:
            return self._provider
        async with self._discovering:
            if self._provider is None:
                url = self._config.issuer.rstrip("/") + "/.well-known/openid-configuration"
                self._provider = self._checked_discovery(await self._get_json(url, "discovery document"))
            return self._provider

    def _checked_discovery(self, document: dict[str, Any]) -> _Provider:
        def garbage(what: str) -> ProviderUnavailable:
            log.warning("the identity provider's discovery document is refused: %s", what)
            return ProviderUnavailable(f"the identity provider's discovery document is unusable: {what}")

        if document.get("issuer") != self._config.issuer:
            raise garbage(f"its issuer is not {self._config.issuer} exactly")
        endpoints: dict[str, str] = {}
        for name in ("authorization_endpoint", "token_endpoint", "jwks_uri", "userinfo_endpoint"):
            value = document.get(name)
            if value is None and name == "userinfo_endpoint":
                continue  # optional: the ID token then says all there is
            if not isinstance(value, str) or not self._endpoint_allowed(value):
                raise garbage(f"its {name} is missing or not an https URL")
            endpoints[name] = value
        response_types = document.get("response_types_supported")
        if isinstance(response_types, list) and "code" not in response_types:
            raise garbage("it does not offer the authorization-code flow")
        declared = document.get("id_token_signing_alg_values_supported", ["RS256"])  # RS256: the spec's default
        algorithms = tuple(a for a in declared if a in ASYMMETRIC_ALGORITHMS) if isinstance(declared, list) else ()
        if not algorithms:
            raise garbage("it signs ID tokens with no algorithm this gateway accepts (RS256, ES256, EdDSA, ...)")
        methods = document.get("token_endpoint_auth_methods_supported", ["client_secret_basic"])  # the default
        usable = [m for m in AUTH_METHODS if isinstance(methods, list) and m in methods]
        if not usable:
            raise garbage("its token endpoint takes neither client_secret_basic nor client_secret_post")
        return _Provider(
            authorization_endpoint=endpoints["authorization_endpoint"],
            token_endpoint=endpoints["token_endpoint"],
            jwks_uri=endpoints["jwks_uri"],
            userinfo_endpoint=endpoints.get("userinfo_endpoint"),
            algorithms=algorithms,
            auth_method=usable[0],
        )

    def _endpoint_allowed(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
        except ValueError:
            return False
        if not parts.hostname or parts.username is not None or parts.fragment:
            return False
        if parts.scheme == "https":
            return True
        return parts.scheme == "http" and self._insecure_loopback and is_loopback_url(url)

    async def _key_set(self, provider: _Provider, *, refetch: bool) -> KeySet:
        """The provider's signing keys: those kept, or fetched when there are none yet; fetched
        again when `refetch` asks, unless they were fetched again less than KEYS_REFETCH_AFTER
        seconds ago."""
        async with self._fetching_keys:
            if refetch and self._keys is not None:
                now = self._clock()
                if now - self._keys_refetched_at < KEYS_REFETCH_AFTER:
                    return self._keys
                self._keys_refetched_at = now  # before fetching: a failing provider is asked once a minute too
            elif self._keys is not None:
                return self._keys
            self._keys = _key_set(await self._get_json(provider.jwks_uri, "signing keys (JWKS)"))
            return self._keys

    # --- the ID token

    async def _verify_id_token(self, provider: _Provider, token: str, *, nonce: str | None) -> dict[str, Any]:
        """The ID token's claims, once its signature and its claims are checked."""
        try:
            header = jws.extract_compact(token.encode()).headers()
        except (JoseError, ValueError, TypeError, UnicodeError):
            raise OidcError("the identity provider's ID token is malformed") from None
        kid = header.get("kid")
        keys = await self._key_set(provider, refetch=False)
        if isinstance(kid, str) and not any(key.kid == kid for key in keys):
            keys = await self._key_set(provider, refetch=True)  # the provider may have rotated its keys
        elif kid is None and len(keys.keys) > 1:
            # OpenID Connect Core §10.1: a provider with several keys names the one it signed with.
            raise OidcError("the identity provider's ID token names no key (kid), and it publishes several")
        decoded = self._decode(token, keys, provider)
        if decoded is None and kid is None:
            # No kid: the token was checked with the one key kept, which may have been rotated since.
            fresh = await self._key_set(provider, refetch=True)
            decoded = self._decode(token, fresh, provider) if fresh is not keys else None
        if decoded is None:
            raise OidcError("the identity provider's ID token has a signature that does not verify")
        return self._checked_claims(decoded.claims, nonce)

    def _decode(self, token: str, keys: KeySet, provider: _Provider) -> jwt.Token | None:
        """The token, its signature verified with `keys`; None when the signature is wrong."""
        try:
            return jwt.decode(token, keys, algorithms=list(provider.algorithms))
        except BadSignatureError:
            return None
        except InvalidKeyIdError:
            raise OidcError("the identity provider's ID token is signed with a key it does not publish") from None
        except (JoseError, ValueError, TypeError) as exc:
            log.info("an ID token is refused: %s", type(exc).__name__)
            raise OidcError(
                "the identity provider's ID token is malformed, or signed with an algorithm it does not declare"
            ) from None

    def _checked_claims(self, claims: dict[str, Any], nonce: str | None) -> dict[str, Any]:
        issuer, client_id = self._config.issuer, self._config.client_id
        # The types first: joserfc's checks match a list claim by any of its members.
        for name, kind in (("iss", str), ("sub", str), ("nonce", str), ("azp", str)):
            if name in claims and not isinstance(claims[name], kind):
                raise OidcError(f"the identity provider's ID token has a malformed {name} claim")
        aud = claims.get("aud")
        if aud is not None and not (
            isinstance(aud, str) or (isinstance(aud, list) and all(isinstance(a, str) for a in aud))
        ):
            raise OidcError("the identity provider's ID token has a malformed aud claim")
        for name in ("exp", "iat"):
            value = claims.get(name)
            finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
            if value is not None and (isinstance(value, bool) or not finite):
                raise OidcError(f"the identity provider's ID token has a malformed {name} claim")
        options: dict[str, Any] = {
            "iss": {"essential": True, "value": issuer},
            "sub": {"essential": True},
            "aud": {"essential": True, "value": client_id},
            "exp": {"essential": True},
            "iat": {"essential": True},
        }
        if nonce is not None:
            options["nonce"] = {"essential": True, "value": nonce}
        registry = jwt.JWTClaimsRegistry(now=lambda: int(self._clock()), leeway=LEEWAY, **options)
        try:
            registry.validate(claims)
        except ExpiredTokenError:
            raise OidcError("the identity provider's ID token has expired: sign in again") from None
        except MissingClaimError as exc:
            raise OidcError(f"the identity provider's ID token lacks the {exc.claim} claim") from None
        except ClaimError as exc:
            what = {"iss": "another identity provider", "aud": "another application", "nonce": "another sign-in"}
            reason = f"is for {what[exc.claim]}" if exc.claim in what else f"has a wrong {exc.claim} claim"
            raise OidcError(f"the identity provider's ID token {reason}") from None
        except JoseError:  # not a claim error in joserfc's terms, but a refusal all the same
            raise OidcError("the identity provider's ID token has claims that are not valid") from None
        # An ID token for several audiences must name this client as the one it was issued to.
        azp = claims.get("azp")
        if (isinstance(aud, list) and len(aud) > 1 and azp is None) or (azp is not None and azp != client_id):
            raise OidcError("the identity provider's ID token is for another application")
        if not claims["sub"]:
            raise OidcError("the identity provider's ID token lacks the sub claim")
        return claims

    # --- the person

    async def _identity(
        self,
        provider: _Provider,
        claims: dict[str, Any],
        tokens: dict[str, Any],
        *,
        refresh_token: str | None,
        from_userinfo: bool = False,
    ) -> Identity:
        """The Identity of verified `claims`; what an ID token leaves out (an address, a name, the
        groups) is taken from the userinfo endpoint, which must answer for the same subject."""
        wanted = ("email", "name", self._config.groups_claim)
        lacking = any(name not in claims for name in wanted)
        if lacking and not from_userinfo and provider.userinfo_endpoint and tokens.get("access_token"):
            userinfo = await self._userinfo(provider, tokens)
            if userinfo.get("sub") != claims["sub"]:
                raise OidcError("the identity provider's userinfo answer is for another person")
            claims = _merged(claims, userinfo)
        email = _verified_email(claims)
        domains = self._config.allowed_email_domains
        if domains:
            if not email:
                accepted = ", ".join(f"@{d}" for d in domains)
                raise OidcError(
                    f"the identity provider vouches for no email address: this gateway accepts only {accepted}"
                )
            if email.rpartition("@")[2].lower() not in domains:
                raise OidcError(f"{email} is not an address this gateway accepts")
        renewed = tokens.get("refresh_token")
        return Identity(
            subject=claims["sub"],
            email=email,
            name=_name(claims),
            groups=_groups(claims.get(self._config.groups_claim), self._config.groups_claim),
            refresh_token=renewed if isinstance(renewed, str) and renewed else refresh_token,
        )

    async def _userinfo(self, provider: _Provider, tokens: dict[str, Any]) -> dict[str, Any]:
        access_token = tokens.get("access_token")
        if provider.userinfo_endpoint is None or not isinstance(access_token, str) or not access_token:
            raise ProviderUnavailable(
                "the identity provider renewed the sign-in without an ID token, and offers no userinfo endpoint"
            )
        return await self._get_json(
            provider.userinfo_endpoint, "userinfo", headers={"Authorization": f"Bearer {access_token}"}
        )

    # --- HTTP

    async def _token_request(self, provider: _Provider, grant_type: str, **params: str) -> dict[str, Any]:
        """POSTs a grant to the token endpoint, authenticated as the client; its answer, or
        OidcError with the provider's reason for refusing it."""
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}
        client_id, secret = self._config.client_id, self._config.client_secret
        if provider.auth_method == "client_secret_basic":
            # RFC 6749 §2.3.1: each form-urlencoded before the Basic encoding (Authlib's own encoder
            # leaves them as they are, which breaks a secret holding %, + or non-ASCII characters).
            pair = f"{quote(client_id, safe='')}:{quote(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            params |= {"client_id": client_id, "client_secret": secret}
        body: str = prepare_token_request(grant_type, **params)
        status, answer = await self._request("POST", provider.token_endpoint, "token endpoint", headers, body.encode())
        if status == 200 and isinstance(answer, dict):
            if not isinstance(answer.get("access_token"), str):
                raise ProviderUnavailable("the identity provider's token endpoint answered without an access token")
            return answer
        if 400 <= status < 500 and isinstance(answer, dict) and isinstance(answer.get("error"), str):
            refusal = _provider_text(answer["error"])
            description = answer.get("error_description")
            detail = _provider_text(description) if isinstance(description, str) else ""
            raise OidcError(
                f"the identity provider refused the sign-in: {refusal}" + (f" ({detail})" if detail else "")
            )
        raise self._unusable("token endpoint", provider.token_endpoint, status)

    async def _get_json(self, url: str, what: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        status, answer = await self._request("GET", url, what, {"Accept": "application/json", **(headers or {})})
        if status != 200 or not isinstance(answer, dict):
            raise self._unusable(what, url, status)
        return answer

    def _unusable(self, what: str, url: str, status: int) -> ProviderUnavailable:
        problem = f"answered {status}" if status != 200 else "answered something other than a JSON object"
        log.warning("the identity provider's %s at %s %s", what, _without_query(url), problem)
        return ProviderUnavailable(f"the identity provider's {what} {problem}")

    async def _request(
        self, method: str, url: str, what: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> tuple[int, Any]:
        """One request: its status and its body parsed as JSON (None when it is not JSON)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar())
        try:
            async with self._session.request(
                method, url, headers=headers, data=body, allow_redirects=False, timeout=self._timeout
            ) as response:
                if (response.content_length or 0) > MAX_BODY:
                    raise _too_large(what)
                read = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    read += chunk
                    if len(read) > MAX_BODY:
                        raise _too_large(what)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = (
                f"no answer within {self._timeout.total:g} s"
                if isinstance(exc, TimeoutError)
                else "could not connect"
                if isinstance(exc, aiohttp.ClientConnectionError)
                else type(exc).__name__
            )
            log.warning("the identity provider's %s at %s: %s", what, _without_query(url), reason)
            raise ProviderUnavailable(
                f"the identity provider could not be reached ({what} at {_without_query(url)}): {reason}"
            ) from None
        try:
            return status, orjson.loads(read)
        except orjson.JSONDecodeError:
            return status, None


def _too_large(what: str) -> ProviderUnavailable:
    return ProviderUnavailable(f"the identity provider's {what} is larger than {MAX_BODY // 1024} KB")


def _key_set(document: dict[str, Any]) -> KeySet:
    """The signing keys of a JWKS document: those joserfc can read, that are not for encryption."""
    keys: list[Key] = []
    entries = document.get("keys")
    for entry in entries if isinstance(entries, list) else ():
        # A symmetric key ("oct") has no place in a provider's published keys: it would be public.
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig" or entry.get("kty") == "oct":
            continue
        try:
            keys.append(JWKRegistry.import_key(entry))
        except (JoseError, ValueError, TypeError, KeyError):
            continue  # a key of a type or curve this client does not know: another key may do
    if not keys:
        log.warning("the identity provider's JWKS holds no signing key this client can read")
        raise ProviderUnavailable("the identity provider's signing keys (JWKS) hold no key this gateway can read")
    return KeySet(keys)


def _merged(claims: dict[str, Any], userinfo: dict[str, Any]) -> dict[str, Any]:
    """The ID token's claims, with what it lacks taken from userinfo; an address comes with its own
    email_verified."""
    merged = {**userinfo, **claims}
    if "email" not in claims and "email" in userinfo:
        merged["email_verified"] = userinfo.get("email_verified")
    return merged


def _verified_email(claims: dict[str, Any]) -> str:
    """The address the provider vouches for: "" when there is none, it is malformed, or the
    provider says it is not verified (false, or "false" as some providers write it)."""
    email = claims.get("email")
    if not isinstance(email, str):
        return ""
    email = email.strip()
    local, at, domain = email.rpartition("@")
    if not (local and at and domain) or not email.isprintable() or any(c.isspace() for c in email):
        return ""
    verified = claims.get("email_verified")
    if verified is False or (isinstance(verified, str) and verified.lower() == "false"):
        return ""
    return email


def _name(claims: dict[str, Any]) -> str:
    name = claims.get("name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    parts = [claims.get("given_name"), claims.get("family_name")]
    return " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())


def _groups(value: object, claim: str) -> tuple[str, ...]:
    """The groups claim: a list of strings (others in it are skipped), or a single string."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list):
        return tuple(dict.fromkeys(g for g in value if isinstance(g, str) and g))
    log.warning("the ID token's %s claim is neither a list nor a string: no groups read", claim)
    return ()


def _provider_text(value: str) -> str:
    """The provider's error code or description, as it may be shown: printable, and short."""
    printable = "".join(c if c.isprintable() else " " for c in value).strip()
    return printable if len(printable) <= MAX_PROVIDER_TEXT else printable[: MAX_PROVIDER_TEXT - 1] + "…"


def _without_query(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"
