"""What the repository ships for a deployment beside the package: units, site configs, monitoring."""
