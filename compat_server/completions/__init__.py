"""The OpenAI-compatible operations (models, chat and text completions, whole or streamed), over the same
sampling path as the Tinker routes; the Anthropic and Responses routes use them too."""
