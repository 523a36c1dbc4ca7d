"""What the vLLM sampler can serve per model family (``adapters.samplers.vllm.support``): the decisions, on the
configs transformers itself writes for each family, and one real vLLM run showing the gravest refusal is needed.

The function is pure, so most tests call it directly on ``config.to_dict()`` of transformers' config classes (what
``config.json`` holds) — the model is never built. The measurements the decisions rest on are in the module's
docstring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from adapters.samplers.vllm.support import GROUPS, has_routed_experts, vllm_base_refusal, vllm_lora_refusal
from tests.helpers import skip_without_vllm

ALL = set(GROUPS)
SMALL = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64}


def _config(name: str, **overrides) -> dict:
    """``config.json`` of a tiny model of family ``name``, as transformers writes it."""
    import transformers as tf

    classes = {"llama3": (tf.LlamaConfig, "LlamaForCausalLM"), "qwen3": (tf.Qwen3Config, "Qwen3ForCausalLM"),
               "qwen3_moe": (tf.Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
               "gpt_oss": (tf.GptOssConfig, "GptOssForCausalLM"),
               "deepseek_v3": (tf.DeepseekV3Config, "DeepseekV3ForCausalLM"),
               "qwen3_5": (tf.Qwen3_5TextConfig, "Qwen3_5ForCausalLM"),
               "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"),
               "nemotron_h": (tf.NemotronHConfig, "NemotronHForCausalLM")}
    cls, architecture = classes[name]
    settings = dict(SMALL)
    if name == "deepseek_v3":  # MLA: no head_dim of its own; DeepSeek-V3's latent (512 + 64) unless overridden
        settings.pop("head_dim")
        settings.update(kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=64, n_routed_experts=4)
    if name == "nemotron_h":  # its layer count is that of its layer pattern
        settings.pop("num_hidden_layers")
    settings.update(overrides)
    config = cls(**settings)
    config.architectures = [architecture]
    return config.to_dict()


def _vision_language(text: dict) -> dict:
    """A Qwen3.5-MoE checkpoint as published: the text settings under ``text_config``."""
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig(text_config=text)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return config.to_dict()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_dense_transformers_are_served_with_every_group(family, device):
    config = _config(family)
    assert vllm_base_refusal(config, device) is None
    assert vllm_lora_refusal(config, ALL - {"experts"}, device) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_mixture_of_experts_on_cpu_is_refused_at_start_naming_the_transformers_backend(family):
    """The engine dies at the first sample of any MoE model once LoRA is enabled (measured: Triton fused-MoE)."""
    config = _config(family)
    reason = vllm_base_refusal(config, "cpu")
    assert reason is not None and "mixture-of-experts" in reason and "--sampler-backend transformers" in reason
    # Every adapter is refused too, even one on attention alone: the engine dies whatever the adapter.
    assert vllm_lora_refusal(config, {"attn"}, "cpu") == reason


def test_mixture_of_experts_on_a_gpu_is_not_refused_by_the_cpu_rule():
    config = _config("qwen3_moe")
    assert vllm_base_refusal(config, "cuda") is None
    assert vllm_lora_refusal(config, ALL, "cuda") is None


def test_gpt_oss_adapters_with_head_or_experts_are_refused_naming_the_training_options():
    config = _config("gpt_oss")
    assert vllm_lora_refusal(config, {"attn"}, "cuda") is None
    head = vllm_lora_refusal(config, {"attn", "unembed"}, "cuda")
    assert "lm_head" in head and "train_unembed=False" in head and "train_mlp" not in head
    experts = vllm_lora_refusal(config, {"attn", "mlp", "experts"}, "cuda")
    assert "expert" in experts and "train_mlp=False" in experts and "train_unembed" not in experts
    both = vllm_lora_refusal(config, ALL, "cuda")
    assert "train_unembed=False and train_mlp=False" in both and "--sampler-backend transformers" in both


def test_deepseek_head_is_refused_and_its_mla_latent_must_fit_the_cpu_kernel():
    config = _config("deepseek_v3")
    assert "train_unembed=False" in vllm_lora_refusal(config, {"attn", "unembed"}, "cuda")
    assert vllm_lora_refusal(config, {"attn", "mlp", "experts"}, "cuda") is None
    small_latent = _config("deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=8)
    assert "this model's is 40" in vllm_base_refusal(small_latent, "cpu")
    assert vllm_base_refusal(small_latent, "cuda") is None


def test_qwen3_5_on_cpu_needs_bfloat16_and_qwen3_5_sized_linear_attention_heads():
    dense = _config("qwen3_5")  # transformers' default linear-attention heads: 128, Qwen3.5's
    assert vllm_base_refusal(dense, "cpu", "bfloat16", torchvision=True) is None
    assert vllm_lora_refusal(dense, ALL - {"experts"}, "cpu", "bfloat16", torchvision=True) is None
    assert vllm_base_refusal(dense, "cpu", "float32", torchvision=True).endswith(
        "Start the server with --sampler-dtype bfloat16 (or with --sampler-backend transformers).")
    assert vllm_base_refusal(dense, "cuda", "float32", torchvision=True) is None
    small_heads = _config("qwen3_5", linear_key_head_dim=32, linear_value_head_dim=32)
    assert "linear-attention heads of 32" in vllm_base_refusal(small_heads, "cpu", "bfloat16", torchvision=True)


def test_the_head_of_qwen3_5_as_published_is_refused_and_of_its_text_model_served():
    """vLLM serves a vision-language checkpoint with its ``…ForConditionalGeneration`` class, which has no LoRA on
    ``lm_head`` (and takes routed-expert LoRA only in 3-D); its text-only class has both."""
    text = _config("qwen3_5_moe")
    published = _vision_language(text)
    assert vllm_lora_refusal(text, ALL, "cuda", torchvision=True) is None
    reason = vllm_lora_refusal(published, ALL, "cuda", torchvision=True)
    assert "Qwen3_5MoeForConditionalGeneration" in reason
    assert "train_unembed=False and train_mlp=False" in reason
    assert vllm_lora_refusal(published, {"attn", "mlp"}, "cuda", torchvision=True) is None


def test_architectures_without_head_lora_or_without_lora_are_refused_by_vllms_own_tables():
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "head_dim": 64}
    assert vllm_lora_refusal(qwen2, {"attn", "mlp"}, "cpu") is None
    assert "train_unembed=False" in vllm_lora_refusal(qwen2, {"attn", "mlp", "unembed"}, "cpu")
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}
    assert "no LoRA support" in vllm_base_refusal(kimi, "cuda")


def test_attention_heads_the_cpu_kernels_lack_are_refused_at_start():
    assert "this model's is 16" in vllm_base_refusal(_config("llama3", head_dim=16), "cpu")
    assert vllm_base_refusal(_config("llama3", head_dim=32), "cpu") is None
    assert vllm_base_refusal(_config("llama3", head_dim=16), "cuda") is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_needs_torchvision_in_every_layout(family):
    text = _config(family)
    layouts = [text, _vision_language(text)] if family == "qwen3_5_moe" else [text]
    for config in layouts:
        reason = vllm_base_refusal(config, "cuda", torchvision=False)
        assert "torchvision" in reason and "--sampler-backend transformers" in reason
        assert vllm_lora_refusal(config, {"attn"}, "cuda", torchvision=False) == reason
        assert vllm_base_refusal(config, "cuda", torchvision=True) is None
    assert vllm_base_refusal(_vision_language(_config("qwen3_5_moe")), "cpu", torchvision=True) is not None  # MoE


def test_nemotron_h_is_refused_on_cpu_only_with_moe_layers():
    dense = _config("nemotron_h", layers_block_type=["mamba", "mlp", "attention", "mlp"])
    hybrid_moe = _config("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"])
    assert not has_routed_experts(dense) and has_routed_experts(hybrid_moe)
    assert vllm_base_refusal(dense, "cpu") is None
    assert vllm_lora_refusal(dense, ALL - {"experts"}, "cpu") is None  # Mamba in/out_proj LoRA: measured to work
    assert "mixture-of-experts" in vllm_base_refusal(hybrid_moe, "cpu")
    # Published checkpoints' config.json name the layers by a pattern string (E: MoE).
    assert has_routed_experts({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-ME", "n_routed_experts": 8})
    assert not has_routed_experts({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-M-",
                                   "n_routed_experts": 8})


def test_unknown_groups_are_a_programming_error():
    with pytest.raises(ValueError, match="unknown LoRA weight groups"):
        vllm_lora_refusal(_config("llama3"), {"attention"}, "cpu")


_ENGINE_DIES = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    def main(root, outcome):
        config = Qwen3MoeConfig(vocab_size=512, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=64, intermediate_size=128, moe_intermediate_size=64,
                                num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                tie_word_embeddings=False, eos_token_id=2)
        config.architectures = ["Qwen3MoeForCausalLM"]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=root, skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_lora_rank=8,
                  max_model_len=256, kv_cache_memory_bytes=2**28, enforce_eager=True)
        try:
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1, detokenize=False),
                         use_tqdm=False)
            outcome.write_text(json.dumps({"outcome": "sampled"}))
        except Exception as exc:
            outcome.write_text(json.dumps({"outcome": type(exc).__name__}))

    if __name__ == "__main__":
        # The outcome goes to a file: the engine's processes share stdout and write to it without ending their lines.
        from pathlib import Path
        main(sys.argv[1], Path(sys.argv[2]))
""")


def test_the_cpu_engine_dies_at_the_first_sample_of_a_moe_model_with_lora_enabled(tmp_path):
    """Why ``vllm_base_refusal`` refuses MoE models on CPU: vLLM 0.32's CPU engine, with LoRA enabled as the sampler
    runs it, dies at its first sample of a tiny Qwen3-MoE, without any adapter. When this test fails, vLLM has fixed
    it: lift the refusal (``adapters.samplers.vllm.support``)."""
    skip_without_vllm()
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        pytest.skip("measures vLLM's CPU build")
    script = tmp_path / "engine_dies.py"
    script.write_text(_ENGINE_DIES)
    outcome = tmp_path / "outcome.json"
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), str(outcome)], capture_output=True,
                         text=True, timeout=600, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    said = json.loads(outcome.read_text()) if outcome.exists() else None
    assert said == {"outcome": "EngineDeadError"}, run.stdout[-2000:] + run.stderr[-4000:]
    assert "triton" in run.stderr  # the cause measured: Triton fused-MoE kernels the CPU build lacks
    assert vllm_base_refusal(json.loads((tmp_path / "model" / "config.json").read_text()), "cpu") is not None


def test_the_architecture_tables_are_vllms_own():
    """``HEAD_LORA_ARCHITECTURES``, ``NO_LORA_ARCHITECTURES`` and ``EXPERTS_3D_ARCHITECTURES`` restate attributes of
    vLLM's model classes (``supports_lora``, ``lm_head`` in ``embedding_modules``, ``is_3d_moe_weight``): checked
    against the installed vLLM for every class that imports here (those needing torchvision do not on CPU), so an
    upgrade that changes them fails here rather than in a user's sampler."""
    skip_without_vllm()
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    from adapters.samplers.vllm.support import (
        EXPERTS_3D_ARCHITECTURES,
        HEAD_LORA_ARCHITECTURES,
        NO_LORA_ARCHITECTURES,
    )

    named = HEAD_LORA_ARCHITECTURES | NO_LORA_ARCHITECTURES | EXPERTS_3D_ARCHITECTURES
    checked, wrong = 0, []
    for architecture in sorted(named | {"Qwen2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"}):
        assert architecture in _VLLM_MODELS, f"vLLM no longer has {architecture}"
        module, name = _VLLM_MODELS[architecture]
        try:
            cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
        except ModuleNotFoundError:  # torchvision, removed by the CPU install
            continue
        checked += 1
        lora = bool(getattr(cls, "supports_lora", False))
        if lora == (architecture in NO_LORA_ARCHITECTURES):
            wrong.append(f"{architecture}: supports_lora={lora}")
        head = "lm_head" in (getattr(cls, "embedding_modules", None) or {})
        if lora and head != (architecture in HEAD_LORA_ARCHITECTURES):
            wrong.append(f"{architecture}: LoRA on lm_head={head}")
        experts_3d = bool(getattr(cls, "is_3d_moe_weight", False))
        if lora and experts_3d != (architecture in EXPERTS_3D_ARCHITECTURES):
            wrong.append(f"{architecture}: is_3d_moe_weight={experts_3d}")
    assert not wrong, wrong
    assert checked > len(named) // 2, f"only {checked} of {len(named)} classes could be imported"
