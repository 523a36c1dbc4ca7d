"""The multi-LoRA trainer: one copy of a base model's weights, many adapters trained on it in mixed batches; its
typed interface, its adapter table, the model's passes, the mixed-adapter forward pass, checkpoint files and
optimizer steps (parts the trainer holds); a trainer split over several processes (``shards``: FSDP2 and the
collectives); its options (``options``); and its placement in Ray (``group``: one trainer's actors, started, called
and restarted together; ``pool``: every base model's trainer, with cross-run batching)."""
