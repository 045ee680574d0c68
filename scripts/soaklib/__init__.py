"""The parts of scripts/soak.py: the deployment (Redis, worker processes), the workload, the
faults, the accounting, and the submit process of the Python API."""
