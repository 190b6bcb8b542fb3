"""Administration: every change and its audit entry (changes), made by the CLI's admin commands
(commands), the admin API (api, with its input's parsing and its OpenAPI description) and the web
console (console/); admin tokens (tokens)."""
