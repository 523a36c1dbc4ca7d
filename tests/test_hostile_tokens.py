"""Part of issue 31's hostile-tenant tests (row 5): a huge prompt to ``/tokenize``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses`` or Anthropic's ``messages`` / ``count_tokens`` was tokenized on the event
loop, holding every route of every tenant for 17 s, only to be refused for its length afterwards. Now a prompt whose
text is too long for the model's context to hold is refused before it is tokenized, in the calling SDK's shape and in
vLLM's words; and tokenizing that is allowed runs off the event loop, so another tenant is answered meanwhile."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tests.helpers import BASE_MODEL

HUGE = 16 * 2**20
"""Characters in a hostile prompt (as in issue 31); Anthropic's ``count_tokens`` was tried with 4 MiB."""

KEY = "tml-hostile-tokens"


def _context(server) -> int:
    models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    return next(m["max_model_len"] for m in models["data"] if m["id"] == BASE_MODEL)


ROUTES = {"/tokenize prompt": "prompt", "/tokenize messages": "messages", "/v1/completions": "prompt",
          "/v1/completions, one prompt of two": "prompt", "/v1/chat/completions": "messages",
          "/v1/responses": "input", "/v1/messages/count_tokens": None, "/v1/messages": None}
"""Each route a prompt reaches, and the parameter its refusal names (Anthropic's errors name none)."""


def _refusal(server, route: str, text: str) -> tuple[str | None, str]:
    """The parameter and the message of the route's 400, as its SDK (or, for ``/tokenize``, plain HTTP) gets it."""
    if route.startswith("/tokenize"):
        field = {"messages": [{"role": "user", "content": text}]} if "messages" in route else {"prompt": text}
        answer = httpx.post(f"{server.base_url}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                            json={"model": BASE_MODEL, **field})
        assert answer.status_code == 400, answer.text[:300]
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        return error["param"], error["message"]
    messages = [{"role": "user", "content": text}]
    if route.startswith("/v1/messages"):
        claude = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
        with pytest.raises(anthropic.BadRequestError) as refused:
            if route.endswith("count_tokens"):
                claude.messages.count_tokens(model=BASE_MODEL, messages=messages)
            else:
                claude.messages.create(model=BASE_MODEL, max_tokens=1, messages=messages)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        return None, refused.value.body["error"]["message"]
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "/v1/completions":
            oai.completions.create(model=BASE_MODEL, prompt=text, max_tokens=1)
        elif route.startswith("/v1/completions"):
            oai.completions.create(model=BASE_MODEL, prompt=["a short one", text], max_tokens=1)
        elif route == "/v1/chat/completions":
            oai.chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=1)
        else:
            oai.responses.create(model=BASE_MODEL, input=text, max_output_tokens=16)
    assert refused.value.type == "invalid_request_error"
    return refused.value.param, refused.value.body["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ROUTES)
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server, route):
    """Refused in the route's SDK shape, naming its parameter, in vLLM's words: by its length in characters, which
    is known before tokenizing (a chat's as its template renders it: the text and the template's own)."""
    context = _context(server)
    chars = 4 * 2**20 if route.endswith("count_tokens") else HUGE
    text = ("the quick brown fox " * (chars // 20 + 1))[:chars]
    param, message = _refusal(server, route, text)
    assert param == ROUTES[route]
    said = f"This model's maximum context length is {context} tokens. However, your prompt contains "
    assert message.startswith(said), message
    assert int(message[len(said):].split()[0]) >= len(text), message
    # the server goes on serving the same tenant; a text as long as the context is within what it can hold
    fits = httpx.post(f"{server.base_url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": BASE_MODEL, "prompt": text[:context]})
    assert fits.status_code == 200 and fits.json()["count"] > 0


def test_another_tenant_is_answered_while_a_long_tokenization_runs(server):
    """One tenant's completion of many prompts, each as long as the context (and each allowed: a digit is a token
    here, so it is refused only once tokenized, for leaving no room to sample) takes seconds to tokenize. Another
    tenant's small requests, sent one after another once the big one's body is complete, are answered while the big
    one is still being worked on: before, every one of them waited until it was done."""
    context = _context(server)
    digits = ("0123456789" * (context // 10 + 1))[:context]
    small_body = {"model": BASE_MODEL, "prompt": "a small prompt"}
    premise = httpx.post(f"{server.base_url}/tokenize", json={"model": BASE_MODEL, "prompt": digits})
    assert premise.json()["count"] == context  # each prompt is as many tokens as the context
    payload = json.dumps({"model": BASE_MODEL, "prompt": [digits] * 1000, "max_tokens": 1}).encode()
    chunk = 1 << 16

    async def scenario() -> tuple[httpx.Response, int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     headers={"Authorization": "Bearer tml-hostile-big"}) as big_client, \
                httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                  headers={"Authorization": "Bearer tml-honest-small"}) as small_client:
            sent = asyncio.Event()

            async def small() -> None:
                answer = await small_client.post("/tokenize", json=small_body)
                assert answer.status_code == 200 and answer.json()["count"] > 0

            async def body():
                # Each piece is followed by one of the other tenant's requests, so the server has read every piece
                # when the last byte goes: the big request's work starts as soon as it is read.
                for start in range(0, len(payload) - 1, chunk):
                    yield payload[start:min(start + chunk, len(payload) - 1)]
                    await small()
                yield payload[-1:]
                sent.set()

            big = asyncio.ensure_future(big_client.post("/v1/completions", content=body(),
                                                        headers={"Content-Type": "application/json",
                                                                 "Content-Length": str(len(payload))}))
            await sent.wait()
            answered = 0
            while not big.done():
                await small()
                answered += not big.done()
            return await big, answered

    big, answered = asyncio.run(scenario())
    assert big.status_code == 400 and "no room to sample" in big.json()["error"]["message"], big.text[:300]
    assert answered >= 5, f"only {answered} of the other tenant's requests were answered during the big one"
