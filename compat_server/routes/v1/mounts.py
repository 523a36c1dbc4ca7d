"""Where the OpenAI- and Anthropic-compatible routes are served: vLLM's paths (``/v1/…``, and ``/tokenize`` & co.
at the root), and hosted Tinker's, so that a client configured for hosted Tinker needs only its host changed:
``{TINKER_BASE_URL}/oai/api/v1`` for the OpenAI SDK (hosted Tinker's documented base URL, used by OpenCode and
others) and ``{TINKER_BASE_URL}/anthropic/api`` for the Anthropic SDK, which appends ``/v1/messages``. The same
handlers are mounted under each prefix: one implementation, answering in the same shapes."""

from __future__ import annotations

from litestar import Router

from compat_server.routes.serving import detokenize_route, tokenize_route, tokenizer_info_route
from compat_server.routes.v1.answers import ERROR_CLASSES, openai_error
from compat_server.routes.v1.anthropic import ANTHROPIC_ROUTER, anthropic_error, count_tokens, create_message
from compat_server.routes.v1.openai import OPENAI_ROUTER, chat_completions, completions, list_models, retrieve_model
from compat_server.routes.v1.responses import RESPONSES_ROUTER, create_response

HOSTED_OPENAI_PREFIX = "/oai/api/v1"
"""Hosted Tinker's OpenAI-compatible base path."""
HOSTED_ANTHROPIC_PREFIX = "/anthropic/api/v1"
"""Hosted Tinker's Anthropic-compatible base path (``/anthropic/api``) with the ``/v1`` its SDK appends."""

OPENAI_PREFIXES = ("/v1", HOSTED_OPENAI_PREFIX)
"""Paths under which an error answers in OpenAI's shape (``compat_server.app``), whatever the route..."""
ANTHROPIC_PREFIXES = ("/v1/messages", "/anthropic/api")
"""… but these, in Anthropic's (checked first)."""

HOSTED_OPENAI_ROUTER = Router(
    path=HOSTED_OPENAI_PREFIX,
    route_handlers=[chat_completions, completions, list_models, retrieve_model, create_response, tokenize_route,
                    detokenize_route, tokenizer_info_route],
    exception_handlers={cls: openai_error for cls in ERROR_CLASSES},
)
HOSTED_ANTHROPIC_ROUTER = Router(
    path=HOSTED_ANTHROPIC_PREFIX, route_handlers=[create_message, count_tokens],
    exception_handlers={cls: anthropic_error for cls in ERROR_CLASSES},
)

ROUTERS = [OPENAI_ROUTER, RESPONSES_ROUTER, ANTHROPIC_ROUTER, HOSTED_OPENAI_ROUTER, HOSTED_ANTHROPIC_ROUTER]
"""Every OpenAI / Anthropic router, vLLM's paths first."""
