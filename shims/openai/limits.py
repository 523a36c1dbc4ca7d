"""What the OpenAI-style routes accept (``--max-logprobs``, ``--max-stop-strings``, ``--max-temperature``,
``--max-prompt-chars``): declared here once, each with its default, help and check (``shims.option``), apart from the
request translation itself, so that the CLI reads them without importing the tokenizers or the grammar engine.
``compat_server.config.ServerConfig`` holds them as ``openai``; the completions service is given them whole."""

from __future__ import annotations

from dataclasses import dataclass

from shims.option import at_least, option


@dataclass(frozen=True)
class OpenAILimits:
    """Server options bounding OpenAI requests. The defaults are vLLM's: at most 20 logprobs per position (vLLM's
    ``--max-logprobs``), no cap on the number of stop strings, a temperature of at most 2."""

    max_logprobs: int = option(
        20, check=at_least(0),
        help="OpenAI routes: most logprobs per position a request may ask for (completions' logprobs, chat's "
             "top_logprobs, prompt_logprobs); vLLM's default (default: %(default)s)")
    max_stop: int | None = option(
        None, "OpenAI routes: most stop strings in one request (default: no limit, as in vLLM)",
        flag="--max-stop-strings", check=at_least(0))
    max_temperature: float | None = option(
        2.0, check=at_least(0),
        help="OpenAI routes: highest temperature accepted, as in vLLM and OpenAI's API; a higher value works with "
             "--sampler-backend transformers only (default: %(default)s)")
    max_prompt_chars: int | None = option(
        None, check=at_least(1),
        help="longest prompt text /tokenize and the /v1 routes tokenize, in characters (a chat's as its template "
             "renders it); a longer one is refused before it is tokenized, as vLLM refuses it (default: the model's "
             "context × its longest token's characters, which only a text longer than the context can exceed)")
