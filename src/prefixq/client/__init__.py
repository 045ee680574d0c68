"""Producer side of prefixq."""

from prefixq.client.producer import Producer, new_burst_id

__all__ = ["Producer", "new_burst_id"]
