"""Base models: names → weights and tokenizer on disk, what the server advertises about them, and the built-in
tiny model."""
