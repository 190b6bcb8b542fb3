"""ezat-gateway: OpenAI's Chat Completions and Responses APIs, and Anthropic's Messages API, in
front of Anthropic Messages upstreams."""

from __future__ import annotations

from pathlib import Path

DISTRIBUTION = "ezat-gateway"


def version() -> str:
    """The installed package's version; from a source tree that was never installed, the one its
    pyproject.toml declares (the metadata is what pip and a bug report see, so it comes first)."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with (Path(__file__).parent.parent / "pyproject.toml").open("rb") as file:
            return tomllib.load(file)["project"]["version"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return "unknown"
