"""A vision-language checkpoint as published (Qwen3.5/3.6: ``Qwen3_5MoeForConditionalGeneration``, the language
model's keys under ``model.language_model.``, its text settings in ``text_config``) serves as its text model.

The checkpoint is ``tests/families.py``'s ``qwen3_5_moe_vl``, whose language model holds exactly the text-only
``qwen3_5_moe`` family's weights. References are computed here, independently of the server's code: the checkpoint's
own config read by hand (``text_config``), and transformers' models loaded from the directory.
"""

from __future__ import annotations

import asyncio

import pytest
import tinker
import torch
from tinker import types
from transformers import AutoConfig

from adapters.samplers.options import SamplerOptions
from shims.sampling.job import SampleJob
from tests.families import family_dir, reference_model
from tests.helpers import expect_user_error, forward_logprobs, make_datum
from tests.server import start_server

PROMPT = (11, 42, 77, 103, 250, 7, 300)
SMALL = SamplerOptions(max_resident=2, threads=1)
"""The in-process samplers here: two adapters resident, one torch thread."""
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vl_dir(model_cache):
    return family_dir("qwen3_5_moe_vl", model_cache)


def greedy_reference(model, prompt: tuple[int, ...], steps: int) -> tuple[list[float], list[int], list[float]]:
    """The prompt's logprobs (position 1 on) and a greedy continuation with its logprobs, by full forward passes."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        prompt_lp = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        tokens, token_lp = [], []
        for _ in range(steps):
            last = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            token = int(last.argmax())
            tokens.append(token)
            token_lp.append(last[token].item())
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return prompt_lp, tokens, token_lp


def test_the_transformers_sampler_serves_a_vision_language_checkpoint_as_its_text_model(vl_dir):
    from adapters.samplers.hf.sampler import TransformersSampler

    config = AutoConfig.from_pretrained(vl_dir)
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"] and not hasattr(config, "vocab_size")
    text = config.text_config
    reference = reference_model(vl_dir)
    # The reference is the checkpoint's language model, not fresh weights: the vision-language class itself, loaded
    # from the same directory, gives the same logits.
    from transformers import Qwen3_5MoeForConditionalGeneration

    whole = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        torch.testing.assert_close(reference(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=1e-5)
    prompt_lp, tokens, token_lp = greedy_reference(reference, PROMPT, NEW_TOKENS)

    sampler = TransformersSampler(str(vl_dir), SMALL)
    loop = asyncio.new_event_loop()
    try:
        facts = sampler.facts()
        assert (facts.vocab_size, facts.max_context) == (text.vocab_size, text.max_position_embeddings)
        job = SampleJob(prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, stop_at_eos=False, prompt_logprobs=True)
        result = loop.run_until_complete(sampler.sample(None, job))
    finally:
        loop.run_until_complete(sampler.close())
        loop.close()
    sequence = result.sequences[0]
    assert sequence.tokens == tokens
    assert sequence.logprobs == pytest.approx(token_lp, abs=1e-5)
    assert result.prompt.logprobs[1:].tolist() == pytest.approx(prompt_lp, abs=1e-5)


def _gemma3_checkpoint(directory, tokenizer_dir) -> None:
    """A tiny Gemma 3 vision-language checkpoint: ``AutoModelForCausalLM`` loads it as the whole
    ``Gemma3ForConditionalGeneration``, whose config keeps the text settings in ``text_config`` only."""
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {"vocab_size": 512, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 3072,
            "sliding_window": 8, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 4}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=1000,
                          boi_token_index=1001, eoi_token_index=1002)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        Gemma3ForConditionalGeneration(config).save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy2(tokenizer_dir / name, directory / name)


def test_the_transformers_sampler_reads_the_text_settings_of_a_composite_config(tiny_model_dir, tmp_path):
    """Where ``AutoModelForCausalLM`` gives the vision-language class itself (Gemma 3), the sampler used to fail at
    start (``'Gemma3Config' object has no attribute 'vocab_size'``)."""
    from transformers import AutoModelForCausalLM

    from adapters.samplers.hf.sampler import TransformersSampler

    _gemma3_checkpoint(tmp_path, tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert not hasattr(reference.config, "vocab_size")
    _, tokens, token_lp = greedy_reference(reference, PROMPT, NEW_TOKENS)

    sampler = TransformersSampler(str(tmp_path), SMALL)
    loop = asyncio.new_event_loop()
    try:
        facts = sampler.facts()
        text = AutoConfig.from_pretrained(tmp_path).text_config
        assert (facts.vocab_size, facts.max_context) == (text.vocab_size, text.max_position_embeddings)
        job = SampleJob(prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, stop_at_eos=False)
        sequence = loop.run_until_complete(sampler.sample(None, job)).sequences[0]
    finally:
        loop.run_until_complete(sampler.close())
        loop.close()
    assert sequence.tokens == tokens
    assert sequence.logprobs == pytest.approx(token_lp, abs=1e-5)


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("vl-server"), "--base-model", str(vl_dir))
    yield running
    running.stop()


def test_the_server_starts_on_a_vision_language_checkpoint_and_trains_its_text_model(vl_server, vl_dir):
    """The trainer used to fail at start (``'Qwen3_5MoeConfig' object has no attribute 'vocab_size'``): the server
    starts, advertises the checkpoint, samples and scores as the text model does, and bounds token ids by the text
    model's vocabulary."""
    base = str(vl_dir)
    caps = tinker.RestClient(base_url=vl_server.base_url, api_key="tml-vl").get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [base]

    service = tinker.ServiceClient(base_url=vl_server.base_url, api_key="tml-vl")
    vocab = AutoConfig.from_pretrained(vl_dir).text_config.vocab_size
    prompt_lp, tokens, token_lp = greedy_reference(reference_model(vl_dir), PROMPT, NEW_TOKENS)
    sampler = service.create_sampling_client(base_model=base).result()
    greedy = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[])
    sequence = sampler.sample(types.ModelInput.from_ints(list(PROMPT)), num_samples=1,
                              sampling_params=greedy).result().sequences[0]
    assert sequence.tokens == tokens
    assert sequence.logprobs == pytest.approx(token_lp, abs=1e-5)
    outside = sampler.sample(types.ModelInput.from_ints([*PROMPT[:-1], vocab]), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=2, temperature=0.0))
    expect_user_error(outside, f"outside the vocabulary [0, {vocab})")

    trainer = service.create_lora_training_client(base_model=base, rank=4, seed=3).result()
    datum = make_datum(list(PROMPT[:1]), list(PROMPT[1:]))  # every target weighted
    # A fresh adapter's B is zero: the trainer's logprobs are the base text model's.
    assert forward_logprobs(trainer, datum).tolist() == pytest.approx(prompt_lp, abs=1e-5)
    service.close("success")
