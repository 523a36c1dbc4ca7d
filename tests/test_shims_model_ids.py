"""Hosted Tinker's three forms of OpenAI ``model`` value, parsed (``shims.openai.model_ids``)."""

from __future__ import annotations

import pytest

from shims.openai.model_ids import ModelId, parse_model_id

PATH = "tinker://run-1:train:0/sampler_weights/000080"
SERVED = {"Qwen/Qwen3-8B", "odd:peft:7"}


@pytest.mark.parametrize(("model", "parsed"), [
    ("Qwen/Qwen3-8B", ModelId("Qwen/Qwen3-8B")),
    ("Qwen/Qwen3-8B:peft:32768", ModelId("Qwen/Qwen3-8B", 32768)),
    (PATH, ModelId(None, None, PATH)),
    (f"Qwen/Qwen3-8B;{PATH}", ModelId("Qwen/Qwen3-8B", None, PATH)),
    (f"Qwen/Qwen3-8B:peft:262144;{PATH}", ModelId("Qwen/Qwen3-8B", 262144, PATH)),
    ("odd:peft:7", ModelId("odd:peft:7")),  # a served name is never split
    ("odd:peft:7:peft:9", ModelId("odd:peft:7", 9)),
    ("unknown", ModelId("unknown")),  # whether it exists is the service's to say
    ("Qwen/Qwen3-8B:peft:", ModelId("Qwen/Qwen3-8B:peft:")),
    ("Qwen/Qwen3-8B:peft:-1", ModelId("Qwen/Qwen3-8B:peft:-1")),
    ("a;b", ModelId("a;b")),  # no checkpoint after the ';': one (unknown) name
    (f";{PATH}", ModelId(None, None, PATH)),
    ("Qwen/Qwen3-8B:peft:0", ModelId("Qwen/Qwen3-8B:peft:0")),  # no context of 0: an (unknown) name
    ("Qwen/Qwen3-8B:peft:5\n", ModelId("Qwen/Qwen3-8B:peft:5\n")),
], ids=lambda value: value if isinstance(value, str) else "")
def test_each_form_parses_into_base_context_and_path(model, parsed):
    assert parse_model_id(model, SERVED) == parsed
