"""Tracing: OpenTelemetry spans for every relayed request, joined with vLLM's own (`tracer`: the service, `request`:
one request's trace and its spans, `export`: the batching export thread, `content`: the opt-in prompt and completion
text, `otlp`: what the OTEL_* variables say, a leaf the supervisor reads too).

Re-exports nothing: the supervisor imports `otlp` to point vLLM at the collector without loading the OpenTelemetry
SDK."""
