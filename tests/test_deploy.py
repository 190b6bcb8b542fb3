"""The deployment files' gateway configs load as the gateway reads them, and the manifests agree
with them and with the image (make deploy-check validates the files themselves offline, and make
image-check runs the image). What the image's environment and compose's health checks promise is
proven here by running the real command with them."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import parse_config
from tests.support import MODEL, SERVE_CONFIG, ServeProcess, free_port, spawn

DEPLOY = Path(__file__).parent.parent / "deploy"
ENV = {
    "EZAT_API_KEY": "sk-test",
    "EZAT_DB_PASSWORD": "pw",
    "ANTHROPIC_API_KEY": "sk-ant-test",
    "EZAT_DATABASE_URL": "postgresql://ezat:pw@postgres:5432/ezat",
    "EZAT_REDIS_URL": "redis://redis:6379/0",
}


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("gateway.toml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_each_shipped_config_loads(path):
    config = parse_config(path.read_text(), env=ENV)
    assert config.models and config.deployments


def test_compose_uses_the_mock_unless_anthropic_is_named():
    config = (DEPLOY / "compose" / "gateway.toml").read_text()
    assert parse_config(config, env=ENV).deployments[0].base_url == "http://mock-upstream:8081"
    with_key = parse_config(config, env={**ENV, "EZAT_UPSTREAM_URL": "https://api.anthropic.com"})
    assert with_key.deployments[0].base_url == "https://api.anthropic.com"


def test_kubernetes_gives_the_gateway_longer_to_stop_than_it_takes():
    config = parse_config((DEPLOY / "kubernetes" / "base" / "gateway.toml").read_text(), env=ENV)
    deployment = (DEPLOY / "kubernetes" / "base" / "deployment.yaml").read_text()
    grace = int(re.search(r"terminationGracePeriodSeconds: (\d+)", deployment)[1])
    pause = int(re.search(r'command: \["sleep", "(\d+)"\]', deployment)[1])
    assert grace > pause + config.server.shutdown_timeout_seconds + config.server.drain_seconds
    sidecar = parse_config((DEPLOY / "kubernetes" / "sidecar" / "gateway.toml").read_text(), env=ENV)
    pod = (DEPLOY / "kubernetes" / "sidecar" / "pod.yaml").read_text()
    assert int(re.search(r"terminationGracePeriodSeconds: (\d+)", pod)[1]) > sidecar.server.shutdown_timeout_seconds
    assert sidecar.server.host == "127.0.0.1"  # the pod's own containers only


def manifests(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def hardened(container: dict) -> None:
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_kubernetes_base_runs_replicas_hardened_and_scraped():
    base = DEPLOY / "kubernetes" / "base"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"deployment.yaml", "service.yaml", "hpa.yaml", "pdb.yaml"}
    assert kustomization["configMapGenerator"][0]["files"] == ["gateway.toml"]
    deployment = manifests(base / "deployment.yaml")["Deployment"]
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]
    assert (
        pod["spec"]["securityContext"]["runAsNonRoot"]
        and pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    )
    [gateway] = pod["spec"]["containers"]
    hardened(gateway)
    assert gateway["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert manifests(base / "hpa.yaml")["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
    assert manifests(base / "pdb.yaml")["PodDisruptionBudget"]["spec"]["minAvailable"] >= 1


def test_the_sidecar_serves_its_app_on_localhost_with_sqlite_on_the_pods_volume():
    pod = manifests(DEPLOY / "kubernetes" / "sidecar" / "pod.yaml")["Pod"]["spec"]
    app, gateway = pod["containers"]
    hardened(gateway)
    env = {item["name"]: item.get("value") for item in app["env"]}
    assert (
        env["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/openai/v1"
        and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    )
    data = next(mount for mount in gateway["volumeMounts"] if mount["mountPath"] == "/var/lib/ezat")
    assert next(volume for volume in pod["volumes"] if volume["name"] == data["name"])["emptyDir"] == {}
    config = parse_config((DEPLOY / "kubernetes" / "sidecar" / "gateway.toml").read_text(), env=ENV)
    assert config.storage.url == "sqlite:////var/lib/ezat/gateway.db" and config.server.port == 8080


# --- The image's environment, and compose's health checks


def dockerfile() -> list[tuple[str, str]]:
    """The final stage's instructions, as (INSTRUCTION, its arguments), continued lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_stage = max(i for i, (instruction, _) in enumerate(lines) if instruction == "FROM")
    return [(instruction, arguments) for instruction, arguments in lines[last_stage:]]


def image_environment() -> dict[str, str]:
    return dict(
        pair.split("=", 1)
        for instruction, arguments in dockerfile()
        if instruction == "ENV"
        for pair in shlex.split(arguments)
    )


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]


async def test_the_image_logs_json_whatever_command_it_runs(tmp_path, upstream):
    environment = image_environment()
    assert environment["EZAT_LOG_FORMAT"] == "json"
    [command] = [json.loads(arguments) for instruction, arguments in dockerfile() if instruction == "CMD"]
    assert command == ["serve"]  # the format is not CMD's to give: any other command would lose it
    assert "--log-format" not in str(compose_services()["gateway"]["entrypoint"])
    # The image's variable, a config that says nothing of the format (text), other arguments.
    served = ServeProcess(
        tmp_path,
        "gateway",
        SERVE_CONFIG,
        env={"EZAT_LOG_FORMAT": environment["EZAT_LOG_FORMAT"]},
        storage_url=f"sqlite:///{tmp_path / 'db'}",
        upstream_url=upstream.url,
    )
    try:
        await served.start("--host", "127.0.0.1", "--port", str(served.port))
        await served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    finally:
        await served.stop()
    lines = [json.loads(line) for line in served.log.read_text().splitlines()]  # every line
    assert [line["logger"] for line in lines].count("ezat.access") == 1
    assert any(line["message"].startswith("ezat-gateway listening on") for line in lines)


def test_every_compose_service_has_a_health_check_the_gateway_waits_for():
    services = compose_services()
    assert all(service.get("healthcheck", {}).get("test") for service in services.values())
    others = {name for name in services if name != "gateway"}
    assert services["gateway"]["depends_on"] == {name: {"condition": "service_healthy"} for name in others}


async def test_the_mock_upstreams_health_check_passes_once_it_serves():
    mock = compose_services()["mock-upstream"]
    port = mock["command"][mock["command"].index("--port") + 1]
    kind, program, *arguments = mock["healthcheck"]["test"]
    assert (kind, program) == ("CMD", "python3") and port in " ".join(arguments)
    here = free_port()  # the probe as compose runs it, on a port free here
    probe = [sys.executable, *(argument.replace(port, str(here)) for argument in arguments)]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # nothing serves yet
    process = await spawn("mock-upstream", "--host", "127.0.0.1", "--port", str(here))
    try:
        for _ in range(100):
            if subprocess.run(probe, capture_output=True).returncode == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the mock upstream's health check never passed")
    finally:
        process.terminate()
        await process.communicate()
