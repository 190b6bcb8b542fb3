"""Sizes every stage agrees on."""

MiB = 1024 * 1024
# The largest request body: what a client may send, and what the Anthropic Messages API takes
# (its edge answers 413 above it). Images downloaded and inlined count toward the upstream's.
MAX_BODY_BYTES = 32 * MiB
# The output limit of a request that sets none: 32,000 tokens, or the model's maximum if lower.
DEFAULT_MAX_TOKENS = 32_000
