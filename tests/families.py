"""Tiny random models of every family hosted Tinker trains, built from transformers' own config classes.

No weights can be downloaded here, so the family matrix (issue 32) builds its models at test time: each one from its
family's config class with tiny dimensions, fixed seeds, fp32 weights, the built-in tiny model's tokenizer and chat
template (``adapters.models.tiny``; vocabulary 512), saved with ``save_pretrained`` as a user's checkpoint would be.
Building twice gives identical files.

The dimensions keep a training step on CPU in milliseconds, yet no projection that can be rectangular is square and
no projection's input equals its output (hidden 48, 4 × 16 query heads and 2 × 16 key/value heads, dense
MLP 80, experts 40 wide, 4 experts, top-2): a transposed weight or LoRA pair fails loudly rather than passing by
coincidence.

Grouped matrix products (``torch.nn.functional.grouped_mm``, which transformers' default ``grouped_mm`` experts
implementation calls) need every row stride to be a multiple of 16 bytes: 4 elements in fp32, 8 in bf16. Every
dimension here is a multiple of 8 except one: ``qwen3_moe``'s experts are 18 wide (``moe_intermediate_size=18``), so
grouped-matmul code must take its fallback for dimensions that are not aligned. transformers itself has no such
fallback: loaded with its defaults, ``qwen3_moe`` fails its first forward with "strides should be multiple of 16
bytes"; ``reference_model`` loads any family with the plain per-expert loop instead.
The vision tower of ``qwen3_5_moe_vl`` has square matrices (its merger's shape is fixed by the config); no LoRA
adapts it.

The families (``FAMILIES``): name → the config class and the published models the layout stands for.

- ``llama3``: ``LlamaConfig``, tied embeddings like Llama 3.2 1B/3B.
- ``qwen3``: ``Qwen3Config``, dense, untied like Qwen3-8B.
- ``qwen3_moe``: ``Qwen3MoeConfig``, every layer MoE (no shared expert); experts 18 wide (see above).
- ``gpt_oss``: ``GptOssConfig``: biased attention with sinks, alternating sliding/full attention, experts with
  biases, ``gate_up_proj`` stored ``(E, hidden, 2·I)`` (the transpose of Qwen's) and interleaved.
- ``deepseek_v3``: ``DeepseekV3Config``: MLA (``q_lora_rank`` and ``kv_lora_rank`` set), layer 0 dense, layer 1 MoE
  with one shared expert.
- ``qwen3_5_moe``: ``Qwen3_5MoeTextConfig``, a text-only checkpoint: layer 0 Gated DeltaNet (``linear_attention``),
  layer 1 gated full attention; every layer MoE with a gated shared expert.
- ``qwen3_5_moe_vl``: ``Qwen3_5MoeConfig``, the same model as published: ``Qwen3_5MoeForConditionalGeneration``, keys
  under ``model.language_model.`` beside a tiny vision tower ``model.visual.``; its language model holds exactly
  ``qwen3_5_moe``'s weights, so the two layouts of one model can be compared.
- ``nemotron_h``: ``NemotronHConfig`` with layers Mamba-2, MoE (with a shared expert), attention, dense MLP.

Every config sets ``max_position_embeddings=3072``, unlike transformers' and the server's usual fallback of 2048, so
a test that the server reads the model's context sees the model's value, not a default.

In tests: ``family_dir(name)`` builds into the same cache root as the tiny model (``default_cache_root()``, which
honours ``$COMPAT_SERVER_CACHE``; the ``model_cache`` fixture in ``tests/conftest.py`` points it at the session's
cache, so ask for that fixture first), under ``models/families-v{BUILD_VERSION}/<name>``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

BUILD_VERSION = 1
"""Bumped whenever a recipe below changes, so a stale cached build is rebuilt rather than silently reused."""

VOCAB_SIZE = 512
MAX_CONTEXT = 3072
SEED = 4321
DONE = "compat_server_family.json"
"""Written last into a built directory: its presence means the build is complete."""

# Shared tiny dimensions (see the module docstring).
HIDDEN = 48
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 80
EXPERT_DIM = 40
EXPERTS = 4
TOP_K = 2


def _common(tokens: dict[str, int]) -> dict:
    """Settings every text config shares: the tiny tokenizer's vocabulary and special ids, fp32, the context."""
    return {"vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_CONTEXT, "dtype": "float32",
            "eos_token_id": tokens["eos"], "pad_token_id": tokens["pad"], "bos_token_id": None}


def _attention() -> dict:
    return {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}


def _llama3(tokens):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(tokens), **_attention(), intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                       tie_word_embeddings=True)


def _qwen3(tokens):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(tokens), **_attention(), intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                       tie_word_embeddings=False)


def _qwen3_moe(tokens):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(tokens), **_attention(), intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                          moe_intermediate_size=18, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def _gpt_oss(tokens):
    from transformers import GptOssConfig

    return GptOssConfig(**_common(tokens), **_attention(), intermediate_size=EXPERT_DIM, num_hidden_layers=2,
                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def _deepseek_v3(tokens):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_common(tokens), hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        intermediate_size=INTERMEDIATE, moe_intermediate_size=EXPERT_DIM, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
        n_group=1, topk_group=1, q_lora_rank=36, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=HEAD_DIM, num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False)


def _qwen3_5_text(tokens):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        **_common(tokens), **_attention(), num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
        moe_intermediate_size=EXPERT_DIM, shared_expert_intermediate_size=36, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, tie_word_embeddings=False)


def _qwen3_5_vl(tokens):
    from transformers import Qwen3_5MoeConfig

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
    return Qwen3_5MoeConfig(text_config=_qwen3_5_text(tokens).to_dict(), vision_config=vision,
                            tie_word_embeddings=False)


def _nemotron_h(tokens):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **_common(tokens), **_attention(), layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        intermediate_size=INTERMEDIATE, mamba_num_heads=4, mamba_head_dim=HEAD_DIM, n_groups=2, ssm_state_size=8,
        conv_kernel=4, chunk_size=16, moe_intermediate_size=EXPERT_DIM,
        moe_shared_expert_intermediate_size=36, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        n_shared_experts=1, n_group=1, topk_group=1, tie_word_embeddings=False)


FAMILIES: dict[str, Callable] = {
    "llama3": _llama3,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "qwen3_5_moe": _qwen3_5_text,
    "qwen3_5_moe_vl": _qwen3_5_vl,
    "nemotron_h": _nemotron_h,
}
"""Family name → a function of the tokenizer's special ids (``{"eos": …, "pad": …}``) giving its config."""


def _nemotron_h_dense(tokens):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **_common(tokens), hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=VLLM_HEAD_DIM,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], intermediate_size=INTERMEDIATE, mamba_num_heads=4,
        mamba_head_dim=HEAD_DIM, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        tie_word_embeddings=False)


def _qwen2(tokens):
    from transformers import Qwen2Config

    return Qwen2Config(**_common(tokens), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=INTERMEDIATE, num_hidden_layers=2, tie_word_embeddings=False)


VLLM_HEAD_DIM = 32
"""vLLM's CPU attention has no kernel for heads of 16 (``FAMILIES``'); 32 is its smallest."""

VLLM_FAMILIES: dict[str, Callable] = {
    "nemotron_h_dense": _nemotron_h_dense,
    "qwen2": _qwen2,
}
"""Tiny models vLLM's CPU build can serve with LoRA enabled (no MoE layers, heads of 32), for the vLLM column of the
family matrix: Nemotron-H without MoE layers (Mamba-2, attention, MLP) — vLLM takes its Mamba LoRA only on the fused
``in_proj`` — and Qwen2 (Qwen2.5's architecture), whose vLLM model class takes no LoRA on its head."""


def _seeded_causal_lm(config):
    """The text model of ``config`` with weights drawn from the fixed seed (the global RNG left as it was)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _vision_language(config, tokens):
    """The vision-language model, with the text-only family's weights in its language model: built the same way
    from the same seed, then copied in (so both layouts hold one model)."""
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    text = _seeded_causal_lm(_qwen3_5_text(tokens))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + 1)
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model


def _tokenizer_files(cache_root: Path | None) -> Path:
    """The tiny model's directory, whose tokenizer (and chat template) every family reuses."""
    from adapters.models.tiny import ensure_tiny_model

    return ensure_tiny_model(cache_root)


def build_family(name: str, root: Path, cache_root: Path | None = None) -> Path:
    """Write family ``name`` into ``root/<name>`` (once: a complete directory there is reused) and return it.
    ``cache_root``: where the tiny model whose tokenizer is copied lives (unset: its default cache)."""
    from transformers import GenerationConfig

    from adapters.models.tiny import _publish_directory

    recipes = FAMILIES | VLLM_FAMILIES
    if name not in recipes:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(recipes)}")
    target = Path(root) / name
    if (target / DONE).exists():
        return target
    tiny = _tokenizer_files(cache_root)
    tokenizer_names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    ids = json.loads((tiny / "generation_config.json").read_text())
    tokens = {"eos": ids["eos_token_id"], "pad": ids["pad_token_id"]}

    def fill(staging: Path) -> None:
        config = recipes[name](tokens)
        model = _vision_language(config, tokens) if name == "qwen3_5_moe_vl" else _seeded_causal_lm(config)
        model.generation_config = GenerationConfig(eos_token_id=tokens["eos"], pad_token_id=tokens["pad"])
        model.save_pretrained(str(staging), safe_serialization=True)
        for file in tokenizer_names:
            if (tiny / file).exists():
                shutil.copy2(tiny / file, staging / file)
        (staging / DONE).write_text(json.dumps({"family": name, "version": BUILD_VERSION}))

    _publish_directory(target, DONE, fill)
    return target


def family_dir(name: str, cache_root: Path | None = None) -> Path:
    """Family ``name`` built into the test session's model cache (see the module docstring), once per cache."""
    from adapters.models.tiny import default_cache_root

    root = (cache_root or default_cache_root()) / "models" / f"families-v{BUILD_VERSION}"
    return build_family(name, root, cache_root)


def reference_model(directory: Path):
    """``AutoModelForCausalLM.from_pretrained(directory)`` in fp32 on CPU, its experts run by transformers' plain
    per-expert loop (``experts_implementation="eager"``): an independent reference for tests, and one that runs on
    ``qwen3_moe``'s misaligned expert width (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, experts_implementation="eager")


def serve_families(data_dir: Path, directories: list[str], backend: str):
    """One server for all of ``directories`` (``--base-model DIR`` each) on sampler ``backend``, each trainer and
    sampler reserving a tenth of a CPU so that 2 cores place them all; a ``tests.server.RunningServer``."""
    from tests.server import start_server

    args = [arg for directory in directories for arg in ("--base-model", directory)]
    return start_server(data_dir, *args, "--trainer-cpus", "0.1", "--sampler-cpus", "0.1", "--sampler-backend",
                        backend, timeout=600)


def matrix_datum():
    """The datum the family matrix trains on and scores, and the tokens it covers (prompt and last target)."""
    from tests.helpers import make_datum

    datum = make_datum([1, 7, 30, 2, 99, 140], [3, 5, 260, 11, 8])
    return datum, datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
