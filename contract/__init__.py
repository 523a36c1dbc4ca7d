"""Wire schemas pinned from the installed tinker SDK (its pydantic types and protobuf descriptor).

``python -m contract.generate`` rewrites ``contract/pinned/``; ``python -m contract.generate --check`` fails when the
installed SDK no longer matches what is pinned. The contract tests run the same check.
"""
