"""`ezat-gateway check-config` on deployments in Amazon Bedrock and Google Vertex AI, run as a user
runs it: every problem on a line of its own, named by its key path, and never a traceback."""

from __future__ import annotations

import json

from gateway.mock.vertex import service_account_key
from tests.support import run_command

PRICING = "pricing = { input = 3.0, output = 15.0, cache_write = 3.75, cache_read = 0.30 }"


async def test_check_config_names_every_cloud_problem(tmp_path):
    (tmp_path / "user.json").write_text(json.dumps({"type": "authorized_user", "client_id": "x"}))
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    path = tmp_path / "gateway.toml"
    path.write_text(f"""
[[deployments]]
name = "anthropic"
base_url = "https://api.anthropic.com"
api_key = "sk-ant"
region = "us-east-1"

[[deployments]]
name = "bedrock-no-region"
provider = "bedrock"

[[deployments]]
name = "bedrock-global"
provider = "bedrock"
region = "global"

[[deployments]]
name = "vertex-no-project"
provider = "vertex"
region = "europe-west1"

[[deployments]]
name = "vertex-no-region"
provider = "vertex"
project = "my-project"

[[deployments]]
name = "vertex-missing-key"
provider = "vertex"
region = "us-east5"
project = "my-project"
credentials_file = "{tmp_path}/missing.json"

[[deployments]]
name = "vertex-user-credentials"
provider = "vertex"
region = "us-east5"
project = "my-project"
credentials_file = "{tmp_path}/user.json"

[[deployments]]
name = "vertex-pem"
provider = "vertex"
region = "us-east5"
project = "my-project"
credentials_file = "{tmp_path}/key.pem"

[[deployments]]
name = "azure"
provider = "azure"
region = "eastus"

[[deployments]]
name = "bedrock-us"
provider = "bedrock"
region = "us-east-1"

[[deployments]]
name = "bedrock-eu"
provider = "bedrock"
region = "eu-west-1"

[[models]]
id = "anthropic/claude-sonnet-5-5"
upstream_model = "claude-sonnet-5-5"
deployments = ["anthropic", "bedrock-us"]
upstream_models = {{ "bedrock-us" = "claude-sonnet-5-5", "vertex-eu" = "claude-sonnet-5-5@20261001" }}
{PRICING}

[[models]]
id = "anthropic/claude-haiku-5"
upstream_model = "claude-haiku-5"
deployments = ["bedrock-eu"]
{PRICING}
""")
    status, output = await run_command("check-config", str(path))
    assert status == 1, output
    assert "Traceback" not in output
    assert sorted(output.splitlines()) == sorted(
        [
            "deployments[0].region: only for bedrock or vertex, not anthropic",
            "deployments[1].region: required for bedrock",
            'deployments[2].region: expected an AWS region such as us-east-1 ("global" is Vertex\'s)',
            "deployments[3].project: required for vertex",
            "deployments[4].region: required for vertex",
            f"deployments[5].credentials_file: cannot read {tmp_path}/missing.json: No such file or directory",
            f"deployments[6].credentials_file: {tmp_path}/user.json is not a service-account key"
            ' (its "type" is not "service_account")',
            f"deployments[7].credentials_file: {tmp_path}/key.pem is not JSON",
            'deployments[8].provider: expected "anthropic", "bedrock" or "vertex"',
            'models[0].upstream_models.vertex-eu: the model does not list deployment "vertex-eu"',
            'models[0].upstream_models.bedrock-us: "claude-sonnet-5-5" is not an Anthropic model\'s Bedrock id,'
            ' inference profile or ARN (such as "us.anthropic.claude-sonnet-5-5-v1:0"); give deployment "bedrock-us"'
            " its id in upstream_models",
            'models[1].upstream_model: "claude-haiku-5" is not an Anthropic model\'s Bedrock id, inference profile'
            ' or ARN (such as "us.anthropic.claude-sonnet-5-5-v1:0"); give deployment "bedrock-eu" its id in'
            " upstream_models",
        ]
    )


async def test_check_config_accepts_all_three_providers(tmp_path):
    """One model on Anthropic's API, Bedrock (an inference profile, an ARN) and Vertex AI (a real
    service-account key), with a price per deployment. check-config reads the key file but asks
    no cloud for credentials: no AWS or Google account is needed to check a config."""
    key, _ = service_account_key("my-project", "https://oauth2.googleapis.com/token")
    key_file = tmp_path / "vertex-sa.json"
    key_file.write_text(json.dumps(key))
    arn = "arn:aws:bedrock:eu-west-1:123456789012:inference-profile/eu.anthropic.claude-sonnet-5-5-v1:0"
    path = tmp_path / "gateway.toml"
    path.write_text(f"""
[[deployments]]
name = "anthropic"
base_url = "https://api.anthropic.com"
api_key = "${{ANTHROPIC_UPSTREAM_KEY}}"
betas = ["claude-code-20250219", "interleaved-thinking-2025-05-14"]

[[deployments]]
name = "bedrock-us"
provider = "bedrock"
region = "us-east-1"
aws_profile = "gateway"

[[deployments]]
name = "bedrock-eu"
provider = "bedrock"
region = "eu-west-1"
api_key = "${{AWS_BEARER_TOKEN_BEDROCK}}"
base_url = "https://vpce-0123.bedrock-runtime.eu-west-1.vpce.amazonaws.com"

[[deployments]]
name = "vertex-eu"
provider = "vertex"
project = "my-project"
region = "europe-west1"
credentials_file = "{key_file}"

[[deployments]]
name = "vertex-global"
provider = "vertex"
project = "my-project"
region = "global"
betas = ["interleaved-thinking-2025-05-14"]

[[models]]
id = "anthropic/claude-sonnet-5-5"
upstream_model = "claude-sonnet-5-5"
deployments = ["anthropic", "bedrock-us", "bedrock-eu", "vertex-eu", "vertex-global"]
upstream_models = {{ "bedrock-us" = "us.anthropic.claude-sonnet-5-5-v1:0", "bedrock-eu" = "{arn}", "vertex-eu" = "claude-sonnet-5-5@20261001" }}
{PRICING}
pricing_by_deployment = {{ "bedrock-eu" = {{ input = 3.3, output = 16.5, cache_write = 4.125, cache_read = 0.33 }} }}

[[keys]]
key = "sk-from-config"
name = "laptop"
""")
    env = {"ANTHROPIC_UPSTREAM_KEY": "sk-ant", "AWS_BEARER_TOKEN_BEDROCK": "ABSK-test"}
    status, output = await run_command("check-config", str(path), env=env)
    assert (status, output) == (0, f"{path}: ok (5 deployments, 1 model, 1 key)\n")


async def test_check_config_refuses_an_empty_region_or_project_and_a_malformed_project(tmp_path):
    """An empty region or project (a variable unset with an empty default, say) names no endpoint:
    the base URL would be https://bedrock-runtime..amazonaws.com. Each is a problem of its own,
    naming the deployment; a project id must be one Google could have made, or a project number."""
    path = tmp_path / "gateway.toml"
    path.write_text("""
[[deployments]]
name = "bedrock-empty"
provider = "bedrock"
region = "${AWS_REGION:-}"

[[deployments]]
name = "vertex-empty-region"
provider = "vertex"
region = ""
project = "my-project"

[[deployments]]
name = "vertex-empty-project"
provider = "vertex"
region = "us-east5"
project = ""

[[deployments]]
name = "vertex-upper"
provider = "vertex"
region = "us-east5"
project = "My_Project"

[[deployments]]
name = "vertex-short"
provider = "vertex"
region = "us-east5"
project = "proj"

[[deployments]]
name = "vertex-trailing-hyphen"
provider = "vertex"
region = "us-east5"
project = "my-project-"

[[deployments]]
name = "vertex-number"
provider = "vertex"
region = "global"
project = "123456789012"

[[deployments]]
name = "vertex-domain"
provider = "vertex"
region = "europe-west1"
project = "example.com:my-project"

[[deployments]]
name = "vertex-longest"
provider = "vertex"
region = "europe-west1"
project = "a23456789-123456789-123456789z"
""")
    status, output = await run_command("check-config", str(path))
    assert status == 1, output
    rule = (
        "is not a Google Cloud project id: 6 to 30 lowercase letters, digits and hyphens, starting with a letter"
        " and not ending with a hyphen (or the project's number)"
    )
    assert sorted(output.splitlines()) == sorted(
        [
            'deployments[0].region: empty; deployment "bedrock-empty" (bedrock) needs its region, such as us-east-1',
            'deployments[1].region: empty; deployment "vertex-empty-region" (vertex) needs its region,'
            ' such as europe-west1, or "global"',
            'deployments[2].project: empty; deployment "vertex-empty-project" (vertex) needs its Google Cloud'
            " project id",
            f'deployments[3].project: "My_Project" {rule}',
            f'deployments[4].project: "proj" {rule}',
            f'deployments[5].project: "my-project-" {rule}',
        ]
    )


async def test_check_config_takes_anthropics_bedrock_ids_and_arns_and_nothing_else(tmp_path):
    """A Bedrock deployment's id is Anthropic's model id there, alone or after any inference
    profile's geography, or a Bedrock ARN; another provider's model id (it takes no Messages
    body) or a dotted name that is no Bedrock id is refused."""
    accepted = [
        "anthropic.claude-sonnet-4-5-20250929-v1:0",
        *(f"{geo}.anthropic.claude-sonnet-4-5-20250929-v1:0" for geo in ("us", "eu", "apac", "global", "us-gov", "jp")),
        "arn:aws:bedrock:us-east-1::foundation-model/anthropic.claude-sonnet-4-5-20250929-v1:0",
        "arn:aws:bedrock:eu-west-1:123456789012:inference-profile/eu.anthropic.claude-sonnet-4-5-20250929-v1:0",
        "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3d4e5f6",
        "arn:aws-us-gov:bedrock:us-gov-west-1:123456789012:provisioned-model/abc123xyz",
    ]
    refused = ["meta.llama3-70b-instruct-v1:0", "claude.sonnet-5-5", "us.claude-sonnet-5-5", "Anthropic.claude-v2"]
    deployments = [f"bedrock-{i}" for i in range(len(accepted) + len(refused))]
    ids = ", ".join(f'"{name}" = "{id}"' for name, id in zip(deployments, accepted + refused, strict=True))
    path = tmp_path / "gateway.toml"
    path.write_text(
        "".join(
            f'[[deployments]]\nname = "{name}"\nprovider = "bedrock"\nregion = "us-east-1"\n\n' for name in deployments
        )
        + f"""
[[models]]
id = "anthropic/claude-sonnet-4-5"
deployments = {json.dumps(deployments)}
upstream_models = {{ {ids} }}
{PRICING}
"""
    )
    status, output = await run_command("check-config", str(path))
    assert status == 1, output
    first = len(accepted)
    assert output.splitlines() == [
        f'models[0].upstream_models.bedrock-{first + i}: "{id}" is not an Anthropic model\'s Bedrock id, inference'
        f' profile or ARN (such as "us.anthropic.claude-sonnet-5-5-v1:0"); give deployment "bedrock-{first + i}"'
        " its id in upstream_models"
        for i, id in enumerate(refused)
    ]
