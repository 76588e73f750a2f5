"""Metrics: every Prometheus object the gateway exports (`instruments`, a leaf), the scrape answers
(`exposition`) and the directory several workers share (`multiprocess`).

Re-exports nothing: importing `multiprocess` must not import prometheus_client, which fixes its
multiprocess mode when first imported."""
