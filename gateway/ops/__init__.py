"""What an operator sees of a running gateway: the access log and its format, Prometheus metrics
and OpenTelemetry traces. Each is a stage or a service the app wires in; none changes what a
client gets."""
