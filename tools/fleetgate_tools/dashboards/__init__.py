"""Grafana dashboards as code (grafana-foundation-sdk), shipped in the Helm chart."""
