"""The OpenAI-API tools people point at a vLLM server, unchanged, against this one (both sampler backends):
lm-evaluation-harness (loglikelihood through ``local-completions``, generation through ``local-chat-completions``),
langchain-openai, litellm, and the ``openai`` SDK's ``parse``.

Constrained outputs from the tiny random model: a schema of enums, and ``logit_bias`` banning every token that holds
whitespace, so greedy decoding writes compact JSON and ends (with whitespace allowed, a random model may write
whitespace until ``max_tokens``, which the grammar permits)."""

from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import BASE_MODEL, on_both_sampler_backends
from tests.lm_eval_run import GEN_TASK, MC_TASK, metric, run_chat_generation, run_multiple_choice

server, service_client = on_both_sampler_backends()
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm otherwise fetches its cost map from GitHub


class Weather(BaseModel):
    city: Literal["Paris", "London"]
    unit: Literal["C", "F"]


def get_weather(city: Literal["Paris", "London"], unit: Literal["C", "F"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def no_whitespace(tokenizer) -> dict[str, int]:
    return {str(i): -100 for i in range(len(tokenizer)) if any(c.isspace() for c in tokenizer.decode([i]))}


def test_lm_eval_loglikelihood_through_local_completions(server, tiny_model_dir, tokenizer):
    """Each choice's loglikelihood as lm-eval computes it from the server's echoed logprobs equals the model's own,
    computed here with transformers; token-id and text prompts, and the server's remote tokenizer, agree."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runs = [run_multiple_choice(server.base_url, BASE_MODEL, tiny_model_dir, limit=2),
            run_multiple_choice(server.base_url, BASE_MODEL, tiny_model_dir, tokenized_requests=False, limit=2),
            run_multiple_choice(server.base_url, BASE_MODEL, tokenizer_backend="remote", limit=2)]
    for results in runs:
        assert 0 <= metric(results, MC_TASK, "acc") <= 1
        for sample in results["samples"][MC_TASK]:
            for (context, continuation), (loglikelihood, greedy) in zip(
                    (a for a in sample["arguments"]), (r[0] for r in sample["resps"])):
                whole = tokenizer.encode(context + continuation, add_special_tokens=False)
                start = len(tokenizer.encode(context, add_special_tokens=False))
                with torch.no_grad():
                    table = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
                expected = sum(float(table[i - 1, whole[i]]) for i in range(start, len(whole)))
                assert loglikelihood == pytest.approx(expected, abs=1e-3)
                assert greedy == all(int(table[i - 1].argmax()) == whole[i] for i in range(start, len(whole)))


def test_lm_eval_generation_through_local_chat_completions(server):
    results = run_chat_generation(server.base_url, BASE_MODEL, limit=2, eos_string="<|im_end|>")
    assert 0 <= metric(results, GEN_TASK, "exact_match") <= 1
    assert all(isinstance(s["resps"][0][0], str) for s in results["samples"][GEN_TASK])


def test_openai_parse_gives_the_pydantic_object(server, no_whitespace, tokenizer):
    """``parse`` with a pydantic schema, and ``json_object`` mode: any JSON object, here with quotes and the closing
    brace made likely so that the random model's strings and object end well within ``max_tokens``."""
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0)
    parsed = oai.chat.completions.parse(model=BASE_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                        response_format=Weather, temperature=0, max_tokens=40, logit_bias=no_whitespace)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    likely = {str(tokenizer.convert_tokens_to_ids('"')): 6, str(tokenizer.convert_tokens_to_ids("}")): 4}
    mode = oai.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=60,
                                       logit_bias={**no_whitespace, **likely}, seed=1)
    assert mode.choices[0].finish_reason == "stop", mode
    assert isinstance(json.loads(mode.choices[0].message.content), dict)


def test_langchain_chat_stream_tools_and_structured_output(server, no_whitespace):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", model=BASE_MODEL, temperature=0,
                     max_tokens=8)
    reply = llm.invoke("Hello there")
    assert reply.content and reply.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in llm.stream("Hello there")) == reply.content
    strict = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", model=BASE_MODEL, temperature=0,
                        max_tokens=40, logit_bias=no_whitespace)
    (call,) = strict.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and Weather(**call["args"])
    assert isinstance(strict.with_structured_output(Weather, method="json_schema").invoke("Weather?"), Weather)


def test_litellm_completion_tools_and_json_mode(server, no_whitespace):
    import litellm

    common = {"model": f"openai/{BASE_MODEL}", "api_base": f"{server.base_url}/v1", "api_key": "EMPTY",
              "temperature": 0}
    reply = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, **common)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": Weather.model_json_schema()}}]
    called = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                tool_choice="required", max_tokens=60, logit_bias=no_whitespace, **common)
    assert called.choices[0].finish_reason == "tool_calls"
    for call in called.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), Weather.model_json_schema())
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    structured = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], response_format=schema,
                                    max_tokens=40, logit_bias=no_whitespace, **common)
    Weather.model_validate_json(structured.choices[0].message.content)
