"""compat-server: a self-hosted, drop-in server for the Tinker fine-tuning API."""

__version__ = "0.1.0"
