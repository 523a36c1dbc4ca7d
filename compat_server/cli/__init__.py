"""The ``compat-server`` command: ``serve`` (its options generated from ``ServerConfig``) and ``keys``."""
