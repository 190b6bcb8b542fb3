"""The mock upstream as Google Vertex AI serves Claude: rawPredict, streamRawPredict and the
count-tokens model, behind OAuth2 access tokens that its own token endpoint issues.

A thin layer over `MockUpstream`: a request's body is Anthropic's without `model` (the path names
it) and with `anthropic_version`, its betas in the `anthropic-beta` header, and the answer is
exactly Anthropic's JSON or SSE. The mock makes a service-account key file whose `token_uri` is
its own `/token`: a client exchanges a JWT signed with that key for an access token, and the
endpoint checks the JWT's signature with the key's public half (google-auth's verifier).
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth import exceptions as google_exceptions
from google.auth import jwt

from gateway import runtime
from gateway.mock.cache import prompt_tokens
from gateway.mock.upstream import ANTHROPIC_VERSIONS, Credential, MockUpstream, RecordedRequest
from gateway.mock.validation import ALLOWED_FIELDS, COUNT_TOKENS_FIELDS, Invalid, validate, validate_betas

# The SDK's Vertex client sends its own API version (2026-10-21) where the documented
# "vertex-2023-10-16" is not given.
VERTEX_VERSIONS = frozenset({"vertex-2023-10-16"}) | ANTHROPIC_VERSIONS
# The beta flags Vertex AI knows for Claude; any other is refused ("invalid beta flag"), unlike
# Anthropic's API, which ignores a well-formed name it does not know.
VERTEX_BETAS = frozenset(
    {
        "computer-use-2024-10-22",
        "computer-use-2025-01-24",
        "computer-use-2025-11-24",
        "interleaved-thinking-2025-05-14",
        "context-1m-2025-08-07",
        "context-management-2025-06-27",
        "tool-search-tool-2025-10-19",
        "web-search-2025-03-05",
        "mid-conversation-system-2026-04-07",
    }
)
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_BEARER_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
# The audience google-auth puts in a service account's assertion, whatever the key's token_uri.
GOOGLE_TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"
GOOGLE_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
}
_MODELS = "/v1/projects/{project}/locations/{region}/publishers/{publisher}/models/{target}"


class VertexRefusal(Exception):
    """A request Vertex refuses in Google's envelope (auth and routing): its status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def service_account_key(project: str, token_uri: str) -> tuple[dict, str]:
    """A new RSA service-account key as Google's JSON key file has it, and its public key (PEM)."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    public_pem = (
        private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    email = f"mock-gateway@{project}.iam.gserviceaccount.com"
    key = {
        "type": "service_account",
        "project_id": project,
        "private_key_id": secrets.token_hex(20),
        "private_key": private_pem,
        "client_email": email,
        "client_id": str(secrets.randbelow(10**21)),
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
        "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
        "client_x509_cert_url": f"https://www.googleapis.com/robot/v1/metadata/x509/{email}",
        "universe_domain": "googleapis.com",
    }
    return key, public_pem


class VertexMock(MockUpstream):
    """Vertex AI's Claude endpoints on loopback, for `project` in any region. `start()` writes
    the service-account key file (`key_file`); `token_requests` counts the token endpoint's
    calls, and a token lives `token_lifetime` seconds. A beta flag not in `betas` is refused."""

    def __init__(
        self, *, project: str = "mock-project", token_lifetime: int = 3600, betas: frozenset[str] = VERTEX_BETAS
    ):
        self.project = project
        self.betas = betas
        self.token_lifetime = token_lifetime
        self.token_requests = 0
        self.tokens: dict[str, float] = {}  # access token → when it expires (time.time())
        self.key_file: Path | None = None  # set by start()
        self.client_email = ""
        self._public_key = ""
        self._token_uri = ""
        self._key_dir: str | None = None
        super().__init__()

    def _add_routes(self, router: web.UrlDispatcher, fast: bool) -> None:
        router.add_post("/token", self._token)
        router.add_post(_MODELS, self._predict)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        url = await super().start(host, port)
        self._token_uri = f"{url}/token"
        key, self._public_key = service_account_key(self.project, self._token_uri)
        self.client_email = key["client_email"]
        self._key_dir = tempfile.mkdtemp(prefix="ezat-vertex-mock-")
        self.key_file = Path(self._key_dir) / "service-account.json"
        self.key_file.write_text(json.dumps(key, indent=2))
        return url

    async def close(self) -> None:
        await super().close()
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None

    # -- OAuth2 -------------------------------------------------------------------------------

    async def _token(self, request: web.Request) -> web.Response:
        """Google's token endpoint for the JWT-bearer grant: the assertion must be signed by the
        generated key, for Google's token endpoint (or this one), by its service account, asking
        for cloud-platform."""
        self.token_requests += 1
        form = await request.post()
        if form.get("grant_type") != JWT_BEARER_GRANT:
            return _oauth_error("unsupported_grant_type", f"Invalid grant_type: {form.get('grant_type')!r}")
        assertion = form.get("assertion")
        if not isinstance(assertion, str):
            return _oauth_error("invalid_request", "Missing required parameter: assertion")
        try:
            claims = jwt.decode(assertion, certs=self._public_key)  # its signature, iat and exp
        except (ValueError, google_exceptions.GoogleAuthError) as exc:
            return _oauth_error("invalid_grant", f"Invalid JWT Signature. ({exc})")
        if claims.get("aud") not in (GOOGLE_TOKEN_AUDIENCE, self._token_uri):
            return _oauth_error(
                "invalid_grant", f"Invalid JWT: the audience {claims.get('aud')!r} is not this endpoint."
            )
        if claims.get("iss") != self.client_email:
            return _oauth_error("invalid_grant", "Invalid JWT: the issuer is not this key's service account.")
        if CLOUD_PLATFORM_SCOPE not in str(claims.get("scope", "")).split():
            return _oauth_error("invalid_scope", "Invalid OAuth scope or ID token audience provided.")
        token = "ya29.mock-" + secrets.token_urlsafe(48)
        self.tokens[token] = time.time() + self.token_lifetime
        return web.json_response({"access_token": token, "expires_in": self.token_lifetime, "token_type": "Bearer"})

    def _authenticate(self, request: web.Request, recorded: RecordedRequest) -> None:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        expires = self.tokens.get(token)
        if expires is None or expires <= time.time():
            raise VertexRefusal(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie "
                "or other valid authentication credential.",
            )
        recorded.auth = Credential("oauth", token)

    # -- the model's endpoints ----------------------------------------------------------------

    async def _predict(self, request: web.Request) -> web.StreamResponse:
        recorded, body = await self._record(request)
        try:
            self._authenticate(request, recorded)
            model, action = self._route(request)
        except VertexRefusal as refusal:
            return self._google_error(refusal.status, str(refusal))
        counting = model == "count-tokens"
        if not isinstance(body, dict):
            return self._error(400, "There was an error parsing the body of your request as JSON")
        version = body.get("anthropic_version")
        if version not in VERTEX_VERSIONS:
            return self._error(400, f"anthropic_version: invalid or missing version {version!r}")
        anthropic = {k: v for k, v in body.items() if k != "anthropic_version"}
        if not counting:
            anthropic["model"] = model
        try:
            betas = validate_betas(request.headers.get("anthropic-beta", ""))
            unknown = sorted(betas - self.betas)
            if unknown:
                raise Invalid(f"invalid beta flag: {', '.join(unknown)}")
            validate(anthropic, COUNT_TOKENS_FIELDS if counting else ALLOWED_FIELDS, betas)
        except Invalid as exc:
            return self._error(400, str(exc))
        if counting:
            if self.count_tokens_status != 200:
                return self._error(self.count_tokens_status, "mock error")
            return web.json_response({"input_tokens": prompt_tokens(anthropic)})
        return await self._answer(request, anthropic, stream=bool(anthropic.get("stream")))

    def _route(self, request: web.Request) -> tuple[str, str]:
        """The model and the method a path names, or Google's 403 or 404."""
        info = request.match_info
        model, _, action = info["target"].rpartition(":")
        if info["publisher"] != "anthropic" or not model or action not in ("rawPredict", "streamRawPredict"):
            raise VertexRefusal(404, f"Publisher model `{request.path}` not found.")
        if model == "count-tokens" and action != "rawPredict":
            raise VertexRefusal(404, f"Publisher model `{request.path}` not found.")
        if info["project"] != self.project:
            raise VertexRefusal(
                403,
                f"Permission 'aiplatform.endpoints.predict' denied on resource '{request.path}' (or it may not exist).",
            )
        return model, action

    # -- errors -------------------------------------------------------------------------------

    def _google_error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        error = {"code": status, "message": message, "status": GOOGLE_STATUSES.get(status, "UNKNOWN")}
        return web.json_response({"error": error}, status=status, headers=headers)

    def _error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        """Quota (429) is Vertex's own, in Google's envelope; the model's errors are Anthropic's."""
        if status == 429:
            return self._google_error(429, f"Quota exceeded for aiplatform.googleapis.com: {message}", headers)
        return super()._error(status, message, headers)

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._google_error(404, f"The requested URL {request.path} was not found on this server.")

    def describe(self) -> str:
        """What a client needs to call this mock, one setting a line."""
        return "\n".join(
            (
                f"  project: {self.project}, any region; base URL: {self.url}/v1",
                f"  service-account key file: {self.key_file} (its token_uri is {self._token_uri})",
            )
        )


def _oauth_error(error: str, description: str) -> web.Response:
    return web.json_response({"error": error, "error_description": description}, status=400)


def run(host: str, port: int, *, project: str = "mock-project") -> None:
    """Serve the Vertex mock until Ctrl-C or SIGTERM (`ezat-gateway mock-upstream --provider vertex`)."""

    async def serve() -> None:
        mock = VertexMock(project=project)
        url = await mock.start(host, port)
        print(f"Mock Google Vertex AI listening on {url} (POST /v1/projects/{project}/locations/{{region}}", end="")
        print(
            "/publishers/anthropic/models/{model}:rawPredict, :streamRawPredict, count-tokens:rawPredict, and", end=""
        )
        print(" POST /token):", flush=True)
        print(mock.describe(), flush=True)
        await runtime.until_stopped()
        await mock.close()

    runtime.run(serve())
