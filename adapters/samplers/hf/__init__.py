"""The transformers sampler: the CPU default and GPU fallback, decoding mixed-adapter batches itself."""
