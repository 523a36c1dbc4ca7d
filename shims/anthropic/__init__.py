"""Anthropic's Messages API ↔ OpenAI chat completions: requests in, answers and stream events out."""
