"""Wire schemas pinned from the installed tinker and openai SDKs (their pydantic types, tinker's protobuf descriptor).

``python -m contract.generate`` rewrites ``contract/pinned/``; ``python -m contract.generate --check`` fails, showing
the diff, when the installed SDKs change a pinned schema, route or the protobuf descriptor; a new SDK version that
changes nothing on the wire passes. The contract tests run the same check.
"""
