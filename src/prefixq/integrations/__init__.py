"""What plugs into prefixq from outside: RQ jobs and completion callbacks, Prometheus metrics."""
