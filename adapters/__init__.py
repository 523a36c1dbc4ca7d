"""Compute behind small interfaces: the multi-LoRA trainer, model loading and the Ray pools that place them."""
