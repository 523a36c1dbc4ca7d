"""Part of issue 31's hostile-tenant tests: an output constraint that admits nothing fails its own request alone.

A tenant's JSON schema becomes a grammar that masks the logits of its own rows in a shared sampler batch. A schema
that can admit no value (``{"$ref": "#"}``, recursive definitions with no base case) sent every token of its rows to
-inf, and the NaN probabilities that followed failed every request in the batch with a 500. Here each hostile request
is sent while an honest one waits for the same batch (a long streamed request holds the sampler, so both queue behind
it), and the honest one must get exactly what it gets alone, while the hostile one gets a 400 in its SDK's shape.
Logits that are not finite in one row (a tenant's own weights can hold NaN) are the same kind of failure, tested in
the transformers sampler itself.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from adapters.samplers.interface import AdapterRef
from adapters.samplers.options import SamplerOptions
from shims.errors import UserError
from shims.sampling.job import SampleJob
from tests.helpers import BASE_MODEL, on_both_sampler_backends

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend

ASK = [{"role": "user", "content": "What is the capital of France?"}]
HONEST_TOKENS = 64
BLOCKER_TOKENS = 400
"""The streamed request that holds the sampler while the others queue: long enough (it ignores its end of
sequence) that both others arrive before it ends."""
SELF_REFERENCE = {"$ref": "#"}
NO_BASE_CASE = {"$ref": "#/$defs/Tree", "$defs": {"Tree": {"anyOf": [{"$ref": "#/$defs/Branch"}]},
                                                  "Branch": {"$ref": "#/$defs/Tree"}}}
"""Recursive definitions with no base case: a Tree is a Branch, which is a Tree…"""
EMPTY_PATTERN = {"type": "string", "pattern": "[^\\s\\S]"}
"""A string no character matches: nothing finds it empty before sampling, and its grammar admits no token once its
opening quote is written."""


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-test-honest", max_retries=0)


HOSTILE_KEY = "tml-test-hostile"
"""Another tenant than the honest one."""


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=HOSTILE_KEY, max_retries=0)


@pytest.fixture(scope="module")
def attacker(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=HOSTILE_KEY, max_retries=0)


def honest(oai) -> tuple[str, str]:
    chat = oai.chat.completions.create(model=BASE_MODEL, messages=ASK, max_tokens=HONEST_TOKENS, temperature=0)
    return chat.choices[0].message.content, chat.choices[0].finish_reason


@pytest.fixture(scope="module")
def alone(oai) -> tuple[str, str]:
    """The honest request's answer with nothing beside it."""
    return honest(oai)


def batches(server) -> int | None:
    """The transformers samplers' batch count (None on vLLM, which batches continuously)."""
    metrics = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
    counts = [replica.get("batches") for replica in metrics["sampling"][BASE_MODEL]["replicas"]]
    return None if None in counts else sum(counts)


def beside_honest(server, oai, hostile) -> tuple[tuple[str, str], Exception | None]:
    """The honest request and ``hostile`` (a call) sent together while a long streamed request holds the sampler,
    so that both wait for, and join, the same next batch. Returns the honest answer and what ``hostile`` raised."""
    before = batches(server)
    blocker = oai.chat.completions.create(model=BASE_MODEL, messages=ASK, max_tokens=BLOCKER_TOKENS, stream=True,
                                          temperature=0, extra_body={"ignore_eos": True})
    with blocker, ThreadPoolExecutor(2) as pool:
        chunks = iter(blocker)
        while not next(chunks).choices[0].delta.content:  # the role chunk comes first; then it is decoding
            pass
        answer, refusal = pool.submit(honest, oai), pool.submit(hostile)
        for _ in chunks:  # the blocker runs to its end meanwhile
            pass
        answer, error = answer.result(), refusal.exception()
    if before is not None:  # the blocker's batch and one more: the honest and hostile requests ran together
        assert batches(server) - before == 2, "the honest and hostile requests did not share a batch"
    return answer, error


def assert_openai_400(error, param: str, *fragments: str) -> None:
    assert isinstance(error, openai.BadRequestError), repr(error)
    body = error.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    for fragment in fragments:
        assert fragment in body["message"], body


def test_a_chat_schema_that_refers_only_to_itself_fails_alone(server, oai, attacker, alone):
    answer, error = beside_honest(server, oai, lambda: attacker.chat.completions.create(
        model=BASE_MODEL, messages=ASK, max_tokens=16, temperature=1,
        response_format={"type": "json_schema", "json_schema": {"name": "loop", "schema": SELF_REFERENCE}}))
    assert answer == alone
    assert_openai_400(error, "response_format.json_schema.schema", "admits no finite value", "$ref")


def test_a_responses_text_format_that_refers_only_to_itself_fails_alone(server, oai, attacker, alone):
    answer, error = beside_honest(server, oai, lambda: attacker.responses.create(
        model=BASE_MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=1,
        text={"format": {"type": "json_schema", "name": "loop", "schema": SELF_REFERENCE}}))
    assert answer == alone
    assert_openai_400(error, "text.format.schema", "admits no finite value", "$ref")


def test_anthropic_recursive_definitions_with_no_base_case_fail_alone(server, oai, claude, alone):
    answer, error = beside_honest(server, oai, lambda: claude.messages.create(
        model=BASE_MODEL, messages=ASK, max_tokens=16, extra_body={
            "temperature": 1, "output_config": {"format": {"type": "json_schema", "schema": NO_BASE_CASE}}}))
    assert answer == alone
    assert isinstance(error, anthropic.BadRequestError), repr(error)
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error", error.body
    assert "admits no finite value" in error.body["error"]["message"], error.body
    assert "$defs.Tree, $defs.Branch" in error.body["error"]["message"], error.body


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_grammar_that_runs_out_of_tokens_while_sampling_fails_alone(server, oai, attacker, alone, temperature):
    """No check before sampling finds this schema empty: the row fails in the batch, as the caller's error, when its
    grammar leaves it no token (greedy and sampled alike: never an argmax or a draw over nothing)."""
    answer, error = beside_honest(server, oai, lambda: attacker.chat.completions.create(
        model=BASE_MODEL, messages=ASK, max_tokens=16, temperature=temperature,
        response_format={"type": "json_schema", "json_schema": {"name": "nothing", "schema": EMPTY_PATTERN}}))
    assert answer == alone
    assert isinstance(error, openai.BadRequestError), repr(error)
    assert "admits no next token" in error.body["message"], error.body
    assert honest(oai) == alone  # and the server keeps serving



@pytest.fixture(scope="module")
def nan_adapter(tiny_model_dir, tmp_path_factory) -> AdapterRef:
    """Sampler weights whose unembedding LoRA holds NaN: every logit of a row sampled with them is NaN."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    directory = tmp_path_factory.mktemp("nan-adapter")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["lm_head"]}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.full((2, config.hidden_size), 0.01),
               "base_model.model.lm_head.lora_B.weight": torch.full((config.vocab_size, 2), float("nan"))},
              str(directory / "adapter_model.safetensors"))
    return AdapterRef("nan-weights", str(directory))


def test_a_row_whose_logits_are_not_finite_fails_alone_in_its_batch(tiny_model_dir, nan_adapter):
    """In the transformers sampler itself, where two requests submitted together are one batch: the request whose
    own weights make its logits NaN fails as its caller's error (never a draw from NaN probabilities, which failed
    the whole batch), and the other's tokens are those it gets alone."""
    from adapters.samplers.hf.sampler import TransformersSampler

    sampler = TransformersSampler(str(tiny_model_dir), SamplerOptions(max_resident=2, threads=1))
    honest_job = SampleJob(prompt=(11, 42, 77, 103), max_tokens=24, temperature=0.0, stop_at_eos=False)
    hostile_job = SampleJob(prompt=(5, 6, 7), max_tokens=8, temperature=1.0)

    async def together():
        return await asyncio.gather(sampler.sample(None, honest_job), sampler.sample(nan_adapter, hostile_job),
                                    return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        alone_tokens = loop.run_until_complete(sampler.sample(None, honest_job)).sequences[0].tokens
        before = sampler.batches
        honest_result, hostile_result = loop.run_until_complete(together())
        assert not isinstance(honest_result, Exception), repr(honest_result)
        assert honest_result.sequences[0].tokens == alone_tokens
        assert isinstance(hostile_result, UserError) and "not finite" in str(hostile_result), repr(hostile_result)
        assert sampler.batches == before + 1  # one batch held both
    finally:
        loop.run_until_complete(sampler.close())
        loop.close()
