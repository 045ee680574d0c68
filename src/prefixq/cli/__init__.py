"""The `prefixq` command (`prefixq.cli:main`, the console script)."""

from prefixq.cli.main import main

__all__ = ["main"]
