"""Custom losses uploaded by ``create_custom_loss``: the allow-listed operations, the untrusted graph checked into
plain data, its size limits, its interpreter, and one request's loss over its datums (``batch``)."""
