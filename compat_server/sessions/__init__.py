"""Sessions: what ``ServiceClient()`` opens, and what a key's training runs and sampling clients are created in.

``service.py`` (``SessionService``, ``services.sessions``) creates a session, keeps it alive (heartbeats), gets, lists
and searches a key's sessions and moves one to a project; ``limits.py`` bounds what a session's fields may hold
(``--max-session-…``). Their routes are ``compat_server.routes.tinker.sessions``.

Elsewhere, for a reason:

- Ending a session (closed by its client, or expired by the sweep after ``--session-timeout`` without a heartbeat) is
  ``TrainingService.end_session`` / ``expire_sessions`` in ``compat_server.training.service``: it unloads the
  session's training runs from the trainers and drops its custom losses, state that service holds.
- A session's trace export (a signed URL of its requests) is ``AccountService.trace_url`` / ``trace`` in
  ``compat_server.account.service``, signed like the key's other downloads.
- The session tables' accessors are ``records.sessions`` (``compat_server/records/sessions.py``), with the rest of
  the code that touches SQLite.
"""
