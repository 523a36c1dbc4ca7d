"""Futures and the scheduler: every asynchronous Tinker call answers a request id at once; its job runs in its
model's seq_id order and its result is stored, then long-polled. The jobs reach the trainers through the typed
trainer client."""
