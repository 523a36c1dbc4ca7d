"""HTTP only: every route parses its request, calls a service and answers in the shape its SDK expects."""
