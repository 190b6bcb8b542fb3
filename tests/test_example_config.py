"""The shipped example config and the configuration reference stay true to the code: the example
passes the real `check-config`, and docs/configuration.md names every config key and every
command-line option there is."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_args, get_origin

import pytest

from gateway.cli import main
from gateway.config import Config, parse_config
from tests.support import run_command

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "gateway.example.toml"
REFERENCE = ROOT / "docs" / "configuration.md"


async def test_the_example_config_passes_check_config_with_a_word_on_its_placeholder(tmp_path):
    status, output = await run_command(
        "check-config", str(EXAMPLE), env={"ANTHROPIC_API_KEY": "sk-ant-example"}, cwd=tmp_path
    )
    # Valid, and so status 0; but its key's digest is a placeholder no key matches, and one copying
    # the file must hear of it before a client gets 401.
    assert (status, output.splitlines()) == (
        0,
        [
            f"{EXAMPLE}: ok (1 deployment, 1 model, 1 key)",
            'keys[0] (laptop): key_sha256 is a placeholder ("0" 64 times), no key\'s digest, so no request can use '
            'this entry; put your key\'s there (printf %s "$THE_KEY" | sha256sum), or use key = "${ENV_VAR}"',
        ],
    )


async def test_the_example_config_takes_the_upstream_key_from_the_environment(tmp_path):
    status, output = await run_command("check-config", str(EXAMPLE), cwd=tmp_path)
    assert (status, output) == (1, "deployments[0].api_key: environment variable ANTHROPIC_API_KEY is not set\n")


def test_the_optional_settings_the_example_shows_are_valid_too():
    """Its lines commented out with "# " are settings (alternatives and commands are indented
    after the "#"): uncommented, all together, they make a valid config."""
    lines = EXAMPLE.read_text().splitlines()
    uncommented = [re.sub(r"^# (?=\[|\w+ = )", "", line) for line in lines]
    assert uncommented != lines
    config = parse_config(
        "\n".join(uncommented), env={"ANTHROPIC_API_KEY": "sk-ant-example", "EZAT_METRICS_TOKEN": "example"}
    )
    assert config.ratelimit.url and config.images.ports and config.keys[0].expires_at  # they were read
    assert config.metrics.token and config.tracing.endpoint
    assert [deployment.provider for deployment in config.deployments] == ["anthropic", "bedrock", "vertex"]


def config_keys(cls: type = Config, path: str = "") -> list[str]:
    """Every key path the config file may hold, tables first: "server", "server.host", …"""
    found = []
    for f in dataclasses.fields(cls):
        table = get_args(f.type)[0] if get_origin(f.type) is tuple else f.type  # [[deployments]]: Deployment
        name = f"{path}.{f.name}" if path else f.name
        found += [name, *config_keys(table, name)] if dataclasses.is_dataclass(table) else [name]
    return found


def test_the_reference_describes_every_config_key():
    text = REFERENCE.read_text()
    # A table is named as [server] or [[keys]]; a key as `name` in its table's part of the text.
    sections = re.split(r"^## ", text, flags=re.M)
    for path in config_keys():
        table, _, key = path.rpartition(".")
        if not table:  # a top-level table
            assert re.search(rf"\[\[?{path}\]\]?", text), path
            continue
        part = next((s for s in sections if re.match(rf"`?\[\[?{table.split('.')[0]}\]\]?", s)), None)
        assert part is not None, f"no section for [{table}]"
        assert f"`{key}`" in part, path
    assert "`key`" in next(s for s in sections if s.startswith("`[[keys]]`"))  # the plaintext alternative


COMMANDS = [
    ["serve"],
    ["check-config"],
    ["mock-upstream"],
    ["keys", "create"],
    ["keys", "list"],
    ["keys", "revoke"],
    ["keys", "update"],
    ["orgs", "create"],
    ["orgs", "list"],
    ["orgs", "suspend"],
    ["orgs", "update"],
    ["usage"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_the_reference_describes_every_command_and_option(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help"}
    text = REFERENCE.read_text()
    assert f"ezat-gateway {' '.join(command)}" in text
    missing = [option for option in sorted(options) if f"`{option}" not in text]
    assert not missing, f"{' '.join(command)}: {missing}"
