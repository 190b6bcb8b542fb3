"""The gateway's SigV4 signature is botocore's, byte for byte: for every kind of Bedrock model id
in the path (profiles, versions with ":", ARNs with "/"), ports, bodies and temporary
credentials. (Every cloud test also has the mock Bedrock verify it with botocore.)"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotocoreCredentials
from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from gateway.upstream.sigv4 import Credentials, SigningKeys, signed_headers

NOW = datetime(2026, 12, 7, 8, 30, 15, tzinfo=UTC)
HEADERS = {"content-type": "application/json", "accept": "application/json"}


def botocore_headers(url: URL, body: bytes, credentials: Credentials, region: str) -> dict[str, str]:
    request = AWSRequest(method="POST", url=str(url), data=body, headers=dict(HEADERS))
    request.context["timestamp"] = NOW.strftime("%Y%m%dT%H%M%SZ")
    signer = SigV4Auth(BotocoreCredentials(*credentials), "bedrock", region)
    signer._modify_request_before_signing(request)
    canonical = signer.canonical_request(request)
    signature = signer.signature(signer.string_to_sign(request, canonical), request)
    return {name.lower(): value for name, value in request.headers.items()} | {
        "signature": signature,
        "signed": signer.signed_headers(signer.headers_to_sign(request)),
    }


def ours(url: URL, body: bytes, credentials: Credentials, region: str) -> dict[str, str]:
    sent = signed_headers(url, HEADERS, body, credentials, region, "bedrock", SigningKeys(), NOW)
    authorization = sent["authorization"]
    return sent | {
        "signature": authorization.rpartition("Signature=")[2],
        "signed": authorization.partition("SignedHeaders=")[2].partition(",")[0],
    }


MODEL_IDS = [
    "anthropic.claude-sonnet-5-5-v1:0",
    "us.anthropic.claude-sonnet-5-5-v1:0",
    "global.anthropic.claude-sonnet-5-5-v1:0",
    "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-sonnet-5-5-v1:0",
    "arn:aws:bedrock:eu-west-1:123456789012:provisioned-model/abc+def=",
]


@pytest.mark.parametrize("model", MODEL_IDS)
@pytest.mark.parametrize(
    "base", ["https://bedrock-runtime.us-east-1.amazonaws.com", "http://127.0.0.1:8123", "https://vpce.example:443"]
)
@pytest.mark.parametrize("token", [None, "IQoJb3JpZ2luX2VjEJr//////////wEaCXVzLWVhc3QtMSJH"])
def test_the_signature_is_botocores(model, base, token):
    url = URL(f"{base}/model/{quote(model, safe=':')}/invoke-with-response-stream", encoded=True)
    credentials = Credentials("ASIAEXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", token)
    body = b'{"anthropic_version":"bedrock-2023-05-31","max_tokens":10}'
    expected = botocore_headers(url, body, credentials, "us-east-1")
    got = ours(url, body, credentials, "us-east-1")
    assert got["signature"] == expected["signature"]
    assert got["signed"] == expected["signed"]
    assert got["x-amz-date"] == expected["x-amz-date"]
    assert got.get("x-amz-security-token") == expected.get("x-amz-security-token")


@given(body=st.binary(max_size=2000), region=st.sampled_from(["us-east-1", "eu-central-2", "ap-southeast-4"]))
def test_any_body_and_region_sign_alike(body, region):
    url = URL("https://bedrock-runtime.example.com/model/anthropic.claude-sonnet-5-5-v1:0/invoke", encoded=True)
    credentials = Credentials("AKIAEXAMPLE", "secret/with+signs")
    assert (
        ours(url, body, credentials, region)["signature"]
        == botocore_headers(url, body, credentials, region)["signature"]
    )
