"""The proxy handler and the upstream it calls: the connection pool and the stream reader
(client), the upstream's errors in the client's envelope (errors), a request fitted to a fallback
model (shape), the choice of deployment (routing), their cooldowns (health) and the open streams
(streams). A provider other than Anthropic's API gets a module of its own here."""
