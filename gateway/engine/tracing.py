"""vLLM's own tracing, pointed at the gateway's collector: the flag and the environment the supervisor adds.

vLLM (0.32, CPU build) makes a request's span (`llm_request`: queue, prefill and decode times, token counts) in its
API server process, as a child of the `traceparent` the gateway's engine request carries, and exports it with the
OTLP exporter its `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` names (gRPC when unset: it reads neither
OTEL_EXPORTER_OTLP_PROTOCOL nor the endpoint's port), so that variable is set to the gateway's protocol. Seen here
with the engine core in its own process and in the API server's (the `cpu-dev` profile): the request span is the API
server's either way, so the process model needs nothing more. Its sampler follows the gateway's decision only:
`parentbased_always_off` traces exactly the requests the gateway sampled, never the gateway's probes or the
engine's start. Imports settings and the OTLP reading (a leaf).
"""

from __future__ import annotations

from gateway.settings import Settings, otel_variables
from gateway.tracing.otlp import HTTP_PROTOBUF, OtlpTraces

ENDPOINT_FLAG = "--otlp-traces-endpoint"


def with_tracing(settings: Settings, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """`argv` and `env` of the engine, with vLLM's tracing to the collector the OTEL_* variables name (unless
    tracing is off, `tracing.engine` is off, or the operator's flags already point vLLM somewhere)."""
    otlp = OtlpTraces.from_variables(otel_variables())
    if otlp.endpoint is None or not settings.tracing.engine:
        return argv, env
    if any(arg == ENDPOINT_FLAG or arg.startswith(ENDPOINT_FLAG + "=") for arg in argv):
        return argv, env
    argv = [*argv, ENDPOINT_FLAG, otlp.endpoint]
    env = {
        **env,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": HTTP_PROTOBUF,
        "OTEL_SERVICE_NAME": settings.tracing.engine_service_name,
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
    }
    return argv, env
