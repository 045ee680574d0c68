"""The client side: `Producer` submits a burst and hands back its `Burst`; results are read
through the handle (or prefixq.client.results for a bare id)."""

from prefixq.client.burst import Burst
from prefixq.client.producer import Producer
from prefixq.client.submit_args import new_burst_id

__all__ = ["Burst", "Producer", "new_burst_id"]
