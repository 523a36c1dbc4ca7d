"""Compute behind small interfaces: the multi-LoRA trainer, the samplers, model loading and the Ray pools that place
them."""
