"""What the scrape endpoints answer and to whom: the gateway's registry (the machine's GPUs read through NVML as
Prometheus scrapes), the engine's own metrics relayed from 127.0.0.1, and the scrape access rule.

Why the engine's metrics are relayed at /metrics/engine rather than merged into /metrics: both processes export
`process_*` and `python_*` (one name, two meanings, in one exposition), and a slow or dead engine would stall or
fail the gateway's own scrape; relayed, each is its own Prometheus job and an engine that is down shows as that
job's `up == 0` while the gateway's figures keep coming. The engine's port stays on 127.0.0.1.

Imports settings, errors, the metric instruments, the multiprocess directory, engine.nvml (the one NVML wrapper) and the
relay's engine client.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.platform_collector import PlatformCollector

from gateway.engine.nvml import ActivityReader
from gateway.errors import EngineUnavailableError, GatewayError, MetricsForbiddenError
from gateway.metrics.instruments import GatewayMetrics, GpuCollector, WorkersCollector
from gateway.metrics.multiprocess import living_workers
from gateway.relay.client import EngineClient
from gateway.settings import MetricsSettings, Settings, metrics_dir

logger = logging.getLogger(__name__)

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[_Network, ...]:
    """`127.0.0.0/8, ::1/128, 10.1.2.3` as networks (a bare address is a /32 or /128)."""
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())


class ScrapeAccess:
    """Who may scrape: a client address in the allowed networks, or anyone with the metrics bearer token."""

    def __init__(self, settings: MetricsSettings) -> None:
        self._networks = parse_networks(settings.allowed_networks)
        self._token = None if settings.token is None else settings.token.get_secret_value().encode()

    def check(self, client: str | None, authorization: str | None) -> None:
        """MetricsForbiddenError (403) unless the scrape is allowed."""
        if self._token is not None and authorization is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token):
                return
        if client is not None and self._allowed(client):
            return
        raise MetricsForbiddenError(
            "Metrics are served to the monitoring networks (NEMOTRON_METRICS__ALLOWED_NETWORKS) or with the "
            "metrics token (NEMOTRON_METRICS__TOKEN) only."
        )

    def _allowed(self, client: str) -> bool:
        try:
            address = ipaddress.ip_address(client)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self._networks)


class Exposition:
    """Renders the gateway's metrics and relays the engine's; `stop` releases NVML."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics) -> None:
        self._engine_timeout = settings.metrics.engine_timeout
        self.engine_enabled = settings.metrics.engine
        self.access = ScrapeAccess(settings.metrics)
        # The engine's GPUs when the operator names them: the `gpu` label takes those values only.
        self._gpus = ActivityReader(settings.engine.gpus)
        multiproc = metrics_dir()
        if multiproc is None:
            self._registry = metrics.registry
        else:
            # Several worker processes: the registry of this scrape sums what every worker wrote to the shared
            # directory (prometheus_client's multiprocess mode), so any worker answers for all of them.
            self._registry = CollectorRegistry()
            shared = MultiProcessCollector(None, path=str(multiproc))  # type: ignore[no-untyped-call]  # untyped upstream
            self._registry.register(WorkersCollector(shared, metrics.forgotten, lambda: living_workers(multiproc)))
            self._registry.register(PlatformCollector(registry=None))
        self._registry.register(GpuCollector(self._gpus.read))

    async def gateway(self) -> tuple[bytes, str]:
        """The gateway's exposition and its content type. Rendered in a worker thread: the GPU readings take a few
        NVML calls (tens of ms) and must not hold the event loop that relays streams."""
        return await asyncio.to_thread(generate_latest, self._registry), CONTENT_TYPE_LATEST

    async def engine(self, replicas: Sequence[tuple[str, str | None, EngineClient]]) -> tuple[bytes, str]:
        """The engines' own /metrics: one replica's as it answered; several, merged into one exposition with each
        sample labelled by its `replica` (URL) and `model`, a replica that does not answer left out.
        EngineUnavailableError (503: the engine job is down) when none answers."""
        if len(replicas) == 1:
            body, content_type = await replicas[0][2].metrics(self._engine_timeout)
            return body, content_type or CONTENT_TYPE_LATEST
        answers = await asyncio.gather(
            *(client.metrics(self._engine_timeout) for _, _, client in replicas), return_exceptions=True
        )
        texts = [
            (url, model or "", answer[0].decode("utf-8", "replace"))
            for (url, model, _), answer in zip(replicas, answers, strict=True)
            if not isinstance(answer, BaseException)
        ]
        if not texts:
            failed = next((a for a in answers if isinstance(a, GatewayError)), None)
            raise failed or EngineUnavailableError("No replica answered /metrics.")
        return await asyncio.to_thread(merge_expositions, texts), CONTENT_TYPE_LATEST

    def stop(self) -> None:
        """Release NVML."""
        self._gpus.close()


class _Merged:
    """A collector that yields families already gathered (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_expositions(texts: Sequence[tuple[str, str, str]]) -> bytes:
    """Several engines' Prometheus texts (replica URL, model, text) as one exposition: each family once, its samples
    from every engine, each labelled `replica` and `model` (vLLM's own `model_name` label stays as it is)."""
    families: dict[str, Metric] = {}
    for replica, model, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica, "model": model}
                merged.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)
