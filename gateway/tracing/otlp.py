"""What the standard OpenTelemetry variables say about traces: whether they are on, the collector, the protocol, the
sampler, the service name and the batching (`OtlpTraces.from_variables`).

A leaf: imports nothing of ours and no OpenTelemetry package, so the supervisor reads it (to point vLLM at the same
collector) without loading the SDK. The variables come from `settings.otel_variables()`; the exporter reads the rest
of its own (headers, timeout, compression, certificates) as every OpenTelemetry SDK does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The one protocol the gateway's exporter speaks (and the specification's default): OTLP over HTTP, protobuf bodies.
HTTP_PROTOBUF = "http/protobuf"
TRACES_PATH = "/v1/traces"
DEFAULT_SERVICE_NAME = "nemotron-gateway"
# The sampler names of the specification's OTEL_TRACES_SAMPLER, and whether OTEL_TRACES_SAMPLER_ARG is their ratio.
SAMPLERS = {
    "always_on": False,
    "always_off": False,
    "traceidratio": True,
    "parentbased_always_on": False,
    "parentbased_always_off": False,
    "parentbased_traceidratio": True,
}
DEFAULT_SAMPLER = "parentbased_always_on"


class OtlpConfigError(ValueError):
    """The OTEL_* variables ask for something the gateway cannot do; the message names the variable."""


def _milliseconds(variables: Mapping[str, str], name: str, default: int) -> float:
    text = variables.get(name, "").strip()
    if not text:
        return default / 1000
    try:
        value = float(text)
    except ValueError:
        raise OtlpConfigError(f"{name}={text!r} is not a number of milliseconds") from None
    if value < 0:
        raise OtlpConfigError(f"{name}={text!r} is negative")
    return value / 1000


def _count(variables: Mapping[str, str], name: str, default: int) -> int:
    text = variables.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise OtlpConfigError(f"{name}={text!r} is not a positive whole number")
    return int(text)


def _ratio(variables: Mapping[str, str]) -> float:
    text = variables.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not text:
        return 1.0
    try:
        ratio = float(text)
    except ValueError:
        raise OtlpConfigError(f"OTEL_TRACES_SAMPLER_ARG={text!r} is not a ratio between 0 and 1") from None
    if not 0 <= ratio <= 1:
        raise OtlpConfigError(f"OTEL_TRACES_SAMPLER_ARG={text!r} is not a ratio between 0 and 1")
    return ratio


def _disabled(variables: Mapping[str, str]) -> bool:
    exporters = [name.strip() for name in variables.get("OTEL_TRACES_EXPORTER", "").lower().split(",") if name.strip()]
    if exporters and exporters != ["otlp"] and "none" not in exporters:
        raise OtlpConfigError(
            f"OTEL_TRACES_EXPORTER={variables['OTEL_TRACES_EXPORTER']!r}: the gateway exports traces with `otlp` only"
        )
    return variables.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or "none" in exporters


def traces_url(variables: Mapping[str, str]) -> str | None:
    """The traces endpoint the variables name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else
    OTEL_EXPORTER_OTLP_ENDPOINT with `/v1/traces` appended (the specification's rule); None when neither is set."""
    signal = variables.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if signal:
        return signal
    base = variables.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + TRACES_PATH if base else None


@dataclass(frozen=True, slots=True)
class OtlpTraces:
    """Where and how traces go, as the OTEL_* variables say; `endpoint` None: tracing is off."""

    endpoint: str | None = None
    sampler: str = DEFAULT_SAMPLER
    ratio: float = 1.0
    service_name: str = DEFAULT_SERVICE_NAME
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay: float = 5.0  # seconds
    export_timeout: float = 30.0  # seconds

    @property
    def enabled(self) -> bool:
        """Whether traces are exported."""
        return self.endpoint is not None

    @classmethod
    def from_variables(cls, variables: Mapping[str, str]) -> OtlpTraces:
        """Read the OTEL_* variables (names as the specification writes them); OtlpConfigError for a value the gateway
        cannot follow, so a bad configuration fails at start, named, instead of silently tracing nothing."""
        endpoint = traces_url(variables)
        if endpoint is None or _disabled(variables):
            return cls()
        if not endpoint.startswith(("http://", "https://")):
            raise OtlpConfigError(f"the OTLP traces endpoint {endpoint!r} is not an http:// or https:// URL")
        protocol = (
            variables.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
            or variables.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
            or HTTP_PROTOBUF
        )
        if protocol != HTTP_PROTOBUF:
            raise OtlpConfigError(
                f"OTLP protocol {protocol!r}: the gateway exports traces as {HTTP_PROTOBUF} (the collector's port 4318)"
            )
        sampler = variables.get("OTEL_TRACES_SAMPLER", "").strip().lower() or DEFAULT_SAMPLER
        if sampler not in SAMPLERS:
            raise OtlpConfigError(f"OTEL_TRACES_SAMPLER={sampler!r}: use one of {', '.join(SAMPLERS)}")
        queue = _count(variables, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        # A queue set below the default batch size makes the batch smaller; one set explicitly must fit.
        batch = _count(variables, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", min(512, queue))
        if batch > queue:
            raise OtlpConfigError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE is larger than OTEL_BSP_MAX_QUEUE_SIZE")
        return cls(
            endpoint=endpoint,
            sampler=sampler,
            ratio=_ratio(variables) if SAMPLERS[sampler] else 1.0,
            service_name=variables.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME,
            max_queue_size=queue,
            max_export_batch_size=batch,
            schedule_delay=_milliseconds(variables, "OTEL_BSP_SCHEDULE_DELAY", 5000),
            export_timeout=_milliseconds(variables, "OTEL_BSP_EXPORT_TIMEOUT", 30000),
        )
