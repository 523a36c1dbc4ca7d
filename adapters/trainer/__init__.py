"""The multi-LoRA trainer: one copy of a base model's weights, many adapters trained on it in mixed batches; its
typed interface, its checkpoint files and optimizer steps, and the Ray pool that places it."""
