"""Who may call and how much: API keys → tenants, the short-lived tokens the SDK exchanges its key for, and the
per-key quota of unfinished requests."""
