"""The Grafana dashboard (nemotron-gateway.json) and its renderer from a Prometheus (dashboard.py)."""
