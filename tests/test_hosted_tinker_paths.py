"""Clients configured for hosted Tinker need only its host changed: the OpenAI SDK and litellm at
``{base}/oai/api/v1``, the Anthropic SDK at ``{base}/anthropic/api``, with each of hosted Tinker's model ids (a base
model, ``:peft:<n>`` for its context, a sampler checkpoint's path, ``<base>;<path>``), against the real server and an
adapter trained in the same run by the real ``tinker`` SDK."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from tinker import types
from transformers import AutoTokenizer

from tests.helpers import BASE_MODEL, MAIN_KEY, make_datum, train

MESSAGES = [{"role": "user", "content": "Name a color."}]
TARGET = "Teal, like the sea."
HOSTED_OPENAI = "/oai/api/v1"


@pytest.fixture(scope="module")
def adapter_path(service_client, tiny_model_dir) -> str:
    """A LoRA adapter trained with the tinker SDK to answer MESSAGES with TARGET, saved for sampling."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
    train(client, make_datum(list(prompt), completion), 25, types.AdamParams(learning_rate=3e-3))
    return client.save_weights_for_sampler("hosted-paths").result().path


@pytest.fixture(scope="module")
def vllm_paths(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=MAIN_KEY, max_retries=0)


@pytest.fixture(scope="module")
def hosted(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}{HOSTED_OPENAI}", api_key=MAIN_KEY, max_retries=0)


@pytest.fixture(scope="module")
def context(vllm_paths) -> int:
    """The base model's context as this server serves it."""
    return vllm_paths.models.retrieve(BASE_MODEL).model_extra["max_model_len"]


def reply(client: openai.OpenAI, model: str, **fields) -> str:
    return client.chat.completions.create(model=model, messages=MESSAGES, **{"temperature": 0, "max_tokens": 24,
                                                                             **fields}).choices[0].message.content


def test_every_model_id_form_samples_the_same_weights_at_hosted_tinkers_base_url(hosted, vllm_paths, adapter_path,
                                                                                 context):
    for model in (adapter_path, f"{BASE_MODEL};{adapter_path}", f"{BASE_MODEL}:peft:{context};{adapter_path}",
                  f"{BASE_MODEL}:peft:64;{adapter_path}"):
        assert reply(hosted, model) == TARGET, model
    base = reply(vllm_paths, BASE_MODEL)
    assert base != TARGET
    assert reply(hosted, BASE_MODEL) == base == reply(hosted, f"{BASE_MODEL}:peft:{context}")
    text = hosted.completions.create(model=adapter_path, prompt="Colors:", temperature=0, max_tokens=8)
    assert text.choices[0].text == vllm_paths.completions.create(model=adapter_path, prompt="Colors:", temperature=0,
                                                                 max_tokens=8).choices[0].text
    answered = hosted.responses.create(model=adapter_path, input=MESSAGES[0]["content"], temperature=0,
                                       max_output_tokens=24)
    assert answered.output_text == TARGET
    assert [m.id for m in hosted.models.list().data] == [m.id for m in vllm_paths.models.list().data]
    assert adapter_path in [m.id for m in hosted.models.list().data]
    for model in (adapter_path, f"{BASE_MODEL};{adapter_path}", f"{BASE_MODEL}:peft:64;{adapter_path}"):
        card = hosted.models.retrieve(model)  # the SDK sends the path's "//" as "%2F%2F", which the route collapses
        assert card.id == model and card.model_extra["root"] == BASE_MODEL
    assert hosted.models.retrieve(f"{BASE_MODEL}:peft:64;{adapter_path}").model_extra["max_model_len"] == 64


def test_a_context_suffix_sets_the_context_and_one_longer_than_served_is_refused(hosted, server, adapter_path,
                                                                                 context):
    card = hosted.models.retrieve(f"{BASE_MODEL}:peft:16")
    assert card.id == f"{BASE_MODEL}:peft:16" and card.model_extra["max_model_len"] == 16
    assert card.model_extra["root"] == BASE_MODEL
    with pytest.raises(openai.BadRequestError, match="the model.s context is 16"):
        reply(hosted, f"{BASE_MODEL}:peft:16;{adapter_path}", max_tokens=4)  # the chat's prompt alone is longer
    for model in (f"{BASE_MODEL}:peft:{context + 1}", f"{BASE_MODEL}:peft:{context + 1};{adapter_path}"):
        with pytest.raises(openai.BadRequestError) as refused:
            reply(hosted, model)
        assert f"context of {context} tokens" in str(refused.value) and f":peft:{context} or less" in str(refused.value)
    with pytest.raises(openai.BadRequestError, match=f"context of {context} tokens"):
        hosted.models.retrieve(f"{BASE_MODEL}:peft:{context + 1}")
    tokenized = httpx.post(f"{server.base_url}{HOSTED_OPENAI}/tokenize", headers={"Authorization": f"Bearer {MAIN_KEY}"},
                           json={"model": f"{BASE_MODEL}:peft:16", "prompt": "Colors"}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["max_model_len"] == 16


def test_a_checkpoint_on_another_base_or_an_unknown_model_is_refused_in_openais_shape(hosted, server, adapter_path):
    with pytest.raises(openai.BadRequestError, match=f"was trained on {BASE_MODEL}"):
        reply(hosted, f"another-base;{adapter_path}")
    with pytest.raises(openai.NotFoundError):
        reply(hosted, "no-such-model:peft:64")
    with pytest.raises(openai.NotFoundError):
        reply(hosted, f"{adapter_path}-gone")
    answer = httpx.get(f"{server.base_url}{HOSTED_OPENAI}/no/such/route", timeout=30,
                       headers={"Authorization": f"Bearer {MAIN_KEY}"})
    assert answer.status_code == 404 and answer.json()["error"]["message"]
    answer = httpx.get(f"{server.base_url}/anthropic/api/v1/no/such/route", timeout=30,
                       headers={"x-api-key": MAIN_KEY})
    assert answer.status_code == 404 and answer.json()["type"] == "error" and answer.json()["error"]["message"]
    answer = httpx.get(f"{server.base_url}/anthropic/api/v1/messages", timeout=30, headers={"x-api-key": MAIN_KEY})
    assert answer.status_code == 405 and answer.json()["type"] == "error"  # a wrong method, in Anthropic's shape


def test_the_anthropic_sdk_and_litellm_at_hosted_tinkers_base_urls(server, adapter_path, context):
    import litellm

    claude = anthropic.Anthropic(base_url=f"{server.base_url}/anthropic/api", api_key=MAIN_KEY, max_retries=0)
    for model in (adapter_path, f"{BASE_MODEL}:peft:{context};{adapter_path}"):
        message = claude.messages.create(model=model, messages=MESSAGES, max_tokens=24,
                                         extra_body={"temperature": 0})  # this SDK has no temperature argument
        assert message.content[0].text == TARGET and message.stop_reason == "end_turn"
    counted = claude.messages.count_tokens(model=adapter_path, messages=MESSAGES)
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match=f"context of {context} tokens"):
        claude.messages.create(model=f"{BASE_MODEL}:peft:{context + 1}", messages=MESSAGES, max_tokens=4)
    answer = litellm.completion(model=f"openai/{adapter_path}", api_base=f"{server.base_url}{HOSTED_OPENAI}",
                                api_key=MAIN_KEY, messages=MESSAGES, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == TARGET
