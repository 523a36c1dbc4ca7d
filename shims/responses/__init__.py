"""OpenAI's Responses API ↔ chat completions: requests in, responses and stream events out."""
