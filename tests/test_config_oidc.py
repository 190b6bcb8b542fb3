"""`[oidc]` as `ezat-gateway check-config` reads it: sign-in through an identity provider, run as a
user runs it, every problem on a line of its own and never a traceback nor the client secret."""

from __future__ import annotations

import hashlib

from gateway.config import MAX_PER_MINUTE, OidcConfig, OidcRole, load_config
from tests.support import run_command

SECRET = "oidc-client-secret-never-shown"
BASE = """
[[deployments]]
name = "primary"
base_url = "https://api.anthropic.com"
api_key = "sk-ant"

[[models]]
id = "claude"
upstream_model = "claude-sonnet-5-5"
deployments = ["primary"]
free = true
"""
ADMIN = f"""
[admin]
tokens = [{{ name = "ops", token_sha256 = "{hashlib.sha256(b"ops").hexdigest()}", role = "admin" }}]
"""


async def test_a_complete_oidc_table_loads(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        BASE
        + ADMIN
        + f"""
[oidc]
issuer = "https://company.okta.com"
client_id = "0oa1ezat"
client_secret = "{SECRET}"
allowed_email_domains = ["Example.COM"]
roles = [{{ group = "platform", role = "admin" }}, {{ group = "finance", role = "viewer" }}]
"""
    )
    oidc = load_config(path).oidc
    assert oidc == OidcConfig(
        issuer="https://company.okta.com",
        client_id="0oa1ezat",
        client_secret=SECRET,
        allowed_email_domains=("example.com",),
        roles=(OidcRole("platform", "admin"), OidcRole("finance", "viewer")),
    )
    assert (oidc.scopes, oidc.groups_claim, oidc.redirect_url) == (("openid", "email", "profile"), "groups", "")
    assert oidc.recheck_minutes == 60
    assert SECRET not in repr(oidc)


async def test_plain_http_only_on_loopback(tmp_path):
    for issuer in ("http://127.0.0.1:9400", "http://localhost:9400/realms/ezat", "http://[::1]:9400"):
        path = tmp_path / "gateway.toml"
        path.write_text(BASE + ADMIN + f'[oidc]\nissuer = "{issuer}"\nclient_id = "c"\nclient_secret = "s"\n')
        assert load_config(path).oidc.issuer == issuer


async def test_check_config_names_every_oidc_problem(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        BASE
        + ADMIN
        + f"""
[oidc]
issuer = "http://idp.example.com"
client_id = ""
client_secret = "{SECRET}"
scopes = ["email", "profile"]
allowed_email_domains = [""]
roles = [{{ group = "platform", role = "owner" }}, {{ group = "", role = "viewer" }}]
redirect_url = "not a url"
recheck_minutes = 0
"""
    )
    status, output = await run_command("check-config", str(path))
    assert status == 1 and "Traceback" not in output and SECRET not in output
    assert sorted(output.splitlines()) == sorted(
        [
            "oidc.issuer: expected https (plain http only on a loopback address)",
            "oidc.client_id: expected a non-empty string",
            'oidc.scopes: expected "openid" among them',
            "oidc.allowed_email_domains[0]: expected a non-empty string",
            'oidc.roles[0].role: expected "admin" or "viewer"',
            "oidc.roles[1].group: expected a non-empty string",
            "oidc.redirect_url: expected an http(s) URL with a host",
            "oidc.recheck_minutes: expected a positive integer",
        ]
    )


async def test_check_config_wants_the_console_and_the_secret(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(BASE + '[oidc]\nissuer = "https://accounts.google.com?x=1"\nclient_id = "c"\n')
    status, output = await run_command("check-config", str(path))
    assert status == 1 and "Traceback" not in output
    assert sorted(output.splitlines()) == sorted(
        [
            "oidc: people sign in to the console, which needs an [admin] table",
            "oidc.issuer: expected an https URL with a host, and no query or fragment",
            "oidc.client_secret: required",
        ]
    )


async def test_check_config_names_every_policy_problem(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        BASE
        + """
[[policies]]
group = ""
rpm = 0
key_ttl_hours = 5000
budget_period = "week"
"""
    )
    status, output = await run_command("check-config", str(path))
    assert status == 1 and "Traceback" not in output
    assert sorted(output.splitlines()) == sorted(
        [
            "policies: they govern people's keys, and people sign in with [oidc]",
            "policies[0].group: expected a non-empty string",
            f"policies[0].rpm: expected a positive integer up to {MAX_PER_MINUTE}",
            "policies[0].key_ttl_hours: expected hours from 1 to 2160",
            "policies[0].budget_period: a budget period (week) needs a budget to count over: give the policy a"
            " budget_usd too, or no budget_period",
        ]
    )
