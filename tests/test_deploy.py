"""The deployment files' gateway configs load as the gateway reads them, and the manifests agree
with them and with the image (make deploy-check validates the files themselves offline, and make
image-check runs the image)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.config import parse_config

DEPLOY = Path(__file__).parent.parent / "deploy"
ENV = {"EZAT_API_KEY": "sk-test", "EZAT_DB_PASSWORD": "pw", "ANTHROPIC_API_KEY": "sk-ant-test",
       "EZAT_DATABASE_URL": "postgresql://ezat:pw@postgres:5432/ezat", "EZAT_REDIS_URL": "redis://redis:6379/0"}


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
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
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
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/openai/v1" and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    data = next(mount for mount in gateway["volumeMounts"] if mount["mountPath"] == "/var/lib/ezat")
    assert next(volume for volume in pod["volumes"] if volume["name"] == data["name"])["emptyDir"] == {}
    config = parse_config((DEPLOY / "kubernetes" / "sidecar" / "gateway.toml").read_text(), env=ENV)
    assert config.storage.url == "sqlite:////var/lib/ezat/gateway.db" and config.server.port == 8080
