"""`prefixq bench`: the finite-burst benchmark, pipeline vs standalone vLLM."""
