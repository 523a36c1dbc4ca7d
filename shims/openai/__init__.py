"""OpenAI's chat and text completions ↔ sampling jobs: request bodies and their checks, parameters, text ↔ tokens,
tool calls, response objects and the error shape."""
