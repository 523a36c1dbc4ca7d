"""The multi-LoRA trainer: one copy of a base model's weights, many adapters trained on it in mixed batches; its
typed interface, its adapter table, mixed-adapter forward pass, checkpoint files and optimizer steps (parts the
trainer holds), and the Ray pool that places it."""
