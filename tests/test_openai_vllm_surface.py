"""What clients coming from vLLM's OpenAI server rely on, through the real ``openai`` SDK (and raw HTTP where a tool
sends raw HTTP) against the real server, once per sampler backend: echo and prompt logprobs, vLLM's sampling
extensions, unknown fields, tool calls in the chat template's format, and the routes beside ``/v1``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import BASE_MODEL, MAIN_KEY, make_datum, on_both_sampler_backends, train

server, service_client = on_both_sampler_backends()

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The base model in plain transformers: the independent reference for logprobs."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tool_adapter(service_client, tokenizer) -> str:
    """An adapter trained (tinker SDK) to answer ASK, with TOOLS offered, by calling get_weather in the template's
    format: ``<tool_call>{…}</tool_call>``, then the end of its turn."""
    prompt = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion = tokenizer.encode(f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", add_special_tokens=False)
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=2).result()
    train(client, make_datum(list(prompt), completion + [tokenizer.eos_token_id]), 40,
          types.AdamParams(learning_rate=3e-3))
    return client.save_weights_for_sampler("calls-tools").result().path


def prompt_logprobs(model, tokens: list[int]) -> tuple[list[float], torch.Tensor]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    table = torch.log_softmax(logits, dim=-1)
    return [float(table[i - 1, t]) for i, t in enumerate(tokens) if i > 0], table


def test_echo_gives_the_prompts_logprobs_as_lm_eval_reads_them(oai, tokenizer, reference):
    """lm-eval's loglikelihood request: ``echo``, ``logprobs``, ``max_tokens`` 0 or 1, token-id prompts."""
    prompt = tokenizer.encode("The capital of France is Paris", add_special_tokens=False)
    expected, table = prompt_logprobs(reference, prompt)
    for max_tokens in (0, 1):
        reply = oai.completions.create(model=BASE_MODEL, prompt=[prompt], echo=True, logprobs=2, max_tokens=max_tokens,
                                       temperature=0)
        choice = reply.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + max_tokens and choice.text.startswith(tokenizer.decode(prompt))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(prompt)] == pytest.approx(expected, abs=2e-4)
        for i in range(1, len(prompt)):
            # vLLM's shape: the token itself, then its top 2, keyed by text (the first of two that decode alike)
            want = {lp.tokens[i]: expected[i - 1]}
            best = torch.topk(table[i - 1], 2)
            for token, value in zip(best.indices.tolist(), best.values.tolist()):
                want.setdefault(tokenizer.decode([token]), value)
            assert lp.top_logprobs[i] == pytest.approx(want, abs=2e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == max_tokens
    streamed = list(oai.completions.create(model=BASE_MODEL, prompt=[prompt], echo=True, max_tokens=3, temperature=0,
                                           stream=True))
    whole = oai.completions.create(model=BASE_MODEL, prompt=[prompt], echo=True, max_tokens=3, temperature=0)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_logprobs_under_a_json_constraint_are_the_models_own(oai, tokenizer, reference):
    """A grammar decides which tokens may come next, but the logprobs reported stay the model's own (vLLM's
    ``raw_logprobs``): the numbers the trainer computes for the same tokens, so the drift probe and an RL loop's
    importance weights see no difference. Masked logprobs would put the only allowed token near 0."""
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    reply = oai.completions.create(model=BASE_MODEL, prompt=[prompt], max_tokens=6, temperature=0, logprobs=2,
                                   extra_body={"structured_outputs": {"json_object": True}})
    lp = reply.choices[0].logprobs
    by_text: dict[str, int] = {}
    for token in range(len(tokenizer)):
        by_text.setdefault(tokenizer.decode([token]), token)
    sampled = [by_text[text] for text in lp.tokens]
    _, table = prompt_logprobs(reference, prompt + sampled)
    unconstrained_best = int(torch.argmax(table[len(prompt) - 1]))
    assert sampled[0] != unconstrained_best, "the grammar should have overruled the model's first choice"
    for i, (token, logprob, top) in enumerate(zip(sampled, lp.token_logprobs, lp.top_logprobs)):
        row = table[len(prompt) - 1 + i]
        assert logprob == pytest.approx(float(row[token]), abs=2e-4)
        want = {lp.tokens[i]: float(row[token])}
        best = torch.topk(row, 2)
        for other, value in zip(best.indices.tolist(), best.values.tolist()):
            want.setdefault(tokenizer.decode([other]), value)
        assert top == pytest.approx(want, abs=2e-4)


def test_a_schema_constrained_decoding_cannot_enforce_is_a_400_and_the_server_keeps_serving(oai):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=BASE_MODEL, messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema" and "multipleOf at properties.n" in error["message"]
    assert oai.chat.completions.create(model=BASE_MODEL, messages=ASK, max_tokens=2).choices[0].message is not None


def test_with_disable_any_whitespace_greedy_json_is_compact_and_complete(keyed_server, tokenizer):
    """``--disable-any-whitespace`` (the keyed server runs with it): the tiny random model, greedy, with nothing
    keeping it off whitespace, answers JSON that parses; under the default grammar it writes whitespace until
    ``max_tokens`` (the other tests here ban whitespace tokens with ``logit_bias`` for that reason)."""
    server, issued = keyed_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=issued["alice"], max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
              "required": ["city"]}
    quote = str(tokenizer.convert_tokens_to_ids('"'))
    reply = client.chat.completions.create(model=BASE_MODEL, messages=ASK, max_tokens=40, temperature=0,
                                           logit_bias={quote: 5}, response_format={
                                               "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and json.loads(text)["city"] in ("Paris", "London"), text
    assert text == json.dumps(json.loads(text), separators=(",", ":")), text


def test_vllms_prompt_logprobs_extension(oai, tokenizer, reference):
    prompt = tokenizer.encode("hello model", add_special_tokens=False)
    expected, table = prompt_logprobs(reference, prompt)
    body = oai.completions.create(model=BASE_MODEL, prompt=[prompt], max_tokens=1, extra_body={"prompt_logprobs": 1})
    entries = body.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:], start=1):
        own = entry[str(prompt[i])]
        assert own["logprob"] == pytest.approx(expected[i - 1], abs=2e-4)
        assert own["rank"] == int((table[i - 1] > table[i - 1, prompt[i]]).sum()) + 1
        top = int(torch.argmax(table[i - 1]))
        assert entry[str(top)]["rank"] == 1


def test_sampling_extensions_take_effect(oai, tokenizer):
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    biased = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100}, logprobs=0)
    assert biased.choices[0].text == tokenizer.decode([forced] * 3)
    stop_id = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=5, temperature=0,
                                     logit_bias={str(forced): 100}, extra_body={"stop_token_ids": [forced]})
    assert stop_id.choices[0].finish_reason == "stop" and stop_id.usage.completion_tokens == 1
    plain = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=12, temperature=0)
    stop = plain.choices[0].text[4:7]
    cut = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=12, temperature=0, stop=[stop])
    kept = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and plain.choices[0].text.startswith(kept.choices[0].text)
    eos = str(tokenizer.eos_token_id)
    ignoring = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=4, temperature=0,
                                      logit_bias={eos: 100}, extra_body={"ignore_eos": True})
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 4
    special = oai.completions.create(model=BASE_MODEL, prompt="The", max_tokens=2, temperature=0,
                                     logit_bias={eos: 100}, extra_body={"ignore_eos": True,
                                                                        "skip_special_tokens": False})
    assert special.choices[0].text == tokenizer.eos_token * 2 and ignoring.choices[0].text == ""


def test_unknown_fields_are_ignored_and_reported(server):
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 2, "store": False, "metadata": {"run": "x"}, "service_tier": "auto",
        "parallel_tool_calls": True, "made_up_field": 1})
    assert raw.status_code == 200, raw.text
    assert raw.headers["x-ignored-fields"] == "made_up_field, metadata, service_tier, store"
    assert raw.json()["model"] == BASE_MODEL  # model is optional: the one base model
    refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "best_of": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_auto_tool_calls_are_parsed_whole_and_streamed(oai, tool_adapter):
    reply = oai.chat.completions.create(model=tool_adapter, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]
    calls, finish = {}, None
    for chunk in oai.chat.completions.create(model=tool_adapter, messages=ASK, tools=TOOLS, temperature=0,
                                             max_tokens=80, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == CALL["name"] and json.loads(calls[0]["arguments"]) == CALL["arguments"]
    text = oai.chat.completions.create(model=tool_adapter, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=80).choices[0]
    assert text.message.tool_calls is None and "<tool_call>" in text.message.content
    # The call and its result go back in the next turn, rendered by the template
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    assert oai.chat.completions.create(model=tool_adapter, messages=follow, tools=TOOLS, max_tokens=3).choices


def test_tokenizer_routes_health_and_metrics(server, tokenizer):
    text = "The capital of France is Paris."
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert tokens["max_model_len"] == 2048
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                                          tokenize=True)["input_ids"]
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert f'compat_server_sampling_requests{{base_model="{BASE_MODEL}"}}' in metrics.text
    card = httpx.get(f"{server.base_url}/v1/models/{BASE_MODEL}").json()
    assert card["id"] == BASE_MODEL and card["max_model_len"] == 2048
    missing = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
