"""Prefix affinity: block hashing, the shared prefix map, placement."""
