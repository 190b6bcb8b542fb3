"""The mock upstream: an Anthropic Messages API on loopback that answers from scripts, checks
requests as the real API does, and keeps a prompt cache. A test double shipped with the product,
because the CLI's embedded mode, the tests, the benchmarks and the deployment checks all run it."""
