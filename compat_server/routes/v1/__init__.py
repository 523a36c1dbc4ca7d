"""The ``/v1`` routes vLLM's server users call: OpenAI chat and text completions, Anthropic Messages and
OpenAI Responses, all answering errors in their own SDK's shape over one completions service; mounted again under
hosted Tinker's paths (``mounts``)."""
