"""Training runs and their checkpoints as the SDK's RestClient sees them: tinker:// paths ↔ directories,
publication, TTLs, signed download URLs and encrypted exports."""
