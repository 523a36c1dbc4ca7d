"""The vLLM sampler: vLLM's async engine with LoRA, its options and limits, the corrections it needs, and how
its outputs become sample results."""
