"""The samplers: one interface both backends (transformers, vLLM) implement, the resident-adapter bookkeeping they
share, constrained decoding, and the Ray pool that places replicas and routes to them."""
