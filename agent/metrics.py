"""Prometheus metrics of the agent, served on an optional port (``--metrics-port``).

Series are labelled by tier URL, credentials shown as ``***``."""

from __future__ import annotations

from flashckpt.storage_tiers.registry import redact


class Metrics:
    def __init__(self, port: int, addr: str = "127.0.0.1"):
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise SystemExit(
                "--metrics-port needs prometheus-client: pip install 'flashckpt[metrics]'"
            ) from exc
        self.registry = prom.CollectorRegistry()
        labels = ["tier"]
        self._bytes = prom.Counter(
            "flashckpt_persisted_bytes", "Bytes persisted", labels, registry=self.registry
        )
        self._snaps = prom.Counter(
            "flashckpt_persisted_snapshots", "Steps committed", labels, registry=self.registry
        )
        self._errors = prom.Counter(
            "flashckpt_tier_errors", "Failed persist rounds", labels, registry=self.registry
        )
        self._lag_steps = prom.Gauge("flashckpt_tier_lag_steps", "Newest step in memory minus last committed", labels, registry=self.registry)  # fmt: skip
        self._lag_s = prom.Gauge("flashckpt_tier_lag_seconds", "Age of the newest uncommitted snapshot", labels, registry=self.registry)  # fmt: skip
        self._refused = prom.Counter("flashckpt_replicas_refused", "Other nodes' replicas refused for want of shared memory", registry=self.registry)  # fmt: skip
        self.server, _ = prom.start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port

    def persisted(self, tier: str, nbytes: int) -> None:
        self._bytes.labels(redact(tier)).inc(nbytes)
        self._snaps.labels(redact(tier)).inc()

    def error(self, tier: str) -> None:
        self._errors.labels(redact(tier)).inc()

    def lag(self, tier: str, steps: int, seconds: float) -> None:
        self._lag_steps.labels(redact(tier)).set(steps)
        self._lag_s.labels(redact(tier)).set(seconds)

    def replica_refused(self) -> None:
        self._refused.inc()

    def close(self) -> None:
        self.server.shutdown()
