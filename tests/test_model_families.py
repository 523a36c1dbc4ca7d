"""Every model family hosted Tinker trains, through the real server and the unmodified SDK (issue 32's matrix).

One server serves all the tiny families of ``tests/families.py`` (``--base-model DIR`` each, the transformers
sampler). For each: the capabilities say what a LoRA adapts; a run trains a few steps; its forward logprobs equal
transformers' own model with the saved adapter merged as ``W + s·B·A`` (per matrix, per expert) by this test; the
sampler scores the same tokens through the saved sampler weights as the trainer does; tinker-cookbook's unmodified
``weights.build_hf_model`` merges the export into a model with the same logprobs, and its ``build_lora_adapter``
converts the export into the adapter the server stored. The in-process loss and
gradient checks are in ``tests/test_lora_families.py``.
"""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.cookbook_env import cookbook_python
from tests.families import FAMILIES, family_dir, matrix_datum, reference_model, serve_families
from tests.helpers import checkpoint_dir, forward_logprobs, train
from tests.test_cookbook_weights import EXPORT, KEY, run_cookbook


pytestmark = pytest.mark.timeout(1200)

DATUM, TOKENS = matrix_datum()
FAST = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def families(model_cache) -> dict[str, str]:
    return {name: str(family_dir(name)) for name in FAMILIES}


@pytest.fixture(scope="module")
def server(families, tmp_path_factory):
    running = serve_families(tmp_path_factory.mktemp("families"), list(families.values()), "transformers")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield service
    service.close("success")


@pytest.fixture(scope="module")
def trained(client, families):
    """One run per family, LoRA rank 4 on every group, trained 3 steps."""
    runs = {}
    for name, directory in families.items():
        run = client.create_lora_training_client(base_model=directory, rank=4, seed=11).result()
        train(run, DATUM, 3, FAST)
        runs[name] = run
    return runs


def _merged_reference(base_dir: str, adapter_dir) -> torch.nn.Module:
    """transformers' model with the stored adapter (PEFT naming, one 2-D pair per expert, a fused projection's pair
    at the rank and alpha of ``rank_pattern`` / ``alpha_pattern``) merged as ``W + s·B·A``, independently of the
    server's code."""
    import json

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = reference_model(base_dir)
    state = load_file(adapter_dir / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in [n for n in state if n.endswith("lora_A.weight")]:
            path = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            path = path.replace("model.language_model.", "model.", 1)  # a vision-language checkpoint's text model
            leaf = path.rsplit(".", 1)[-1]
            scale = (config["alpha_pattern"].get(leaf, config["lora_alpha"])
                     / config["rank_pattern"].get(leaf, config["r"]))
            delta = scale * state[name.replace("lora_A", "lora_B")] @ state[name]
            expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)", path)
            if expert:
                owner, e, projection = model.get_submodule(expert[1]), int(expert[2]), expert[3]
                if projection == "down_proj" or not owner.has_gate:
                    weight = getattr(owner, projection)[e]
                    weight += delta.T if owner.is_transposed else delta
                    continue
                part, half = (0 if projection == "gate_proj" else 1), delta.shape[0]
                rows = slice(part, None, 2) if not owner.is_concatenated else slice(part * half, (part + 1) * half)
                if owner.is_transposed:
                    owner.gate_up_proj[e][:, rows] += delta.T
                else:
                    owner.gate_up_proj[e][rows] += delta
            elif path == "lm_head" and "lm_head.weight" not in params:  # tied to the input embedding
                model.get_output_embeddings().weight += delta
            else:
                params[f"{path}.weight"] += delta
    return model


def _logprobs(model) -> np.ndarray:
    """``model``'s logprobs of ``DATUM``'s targets."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def test_capabilities_say_what_a_lora_adapts_on_each_model(server, families):
    reply = httpx.get(f"{server.base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).json()
    by_name = {model["model_name"]: model for model in reply["supported_models"]}
    for name, directory in families.items():
        targets = by_name[directory]["lora_targets"]
        assert targets["unembed"] == ["lm_head"] and targets["attn"], (name, targets)
        assert by_name[directory]["sampler_backend"] == "transformers"
        if name not in ("llama3", "qwen3"):
            assert any("experts" in t for t in targets["mlp"]), (name, targets)
    assert any("kv_b_proj" in t for t in by_name[families["deepseek_v3"]]["lora_targets"]["attn"])
    assert any("in_proj_q" in t for t in by_name[families["qwen3_5_moe"]]["lora_targets"]["attn"])
    assert any("x_proj" in t for t in by_name[families["nemotron_h"]]["lora_targets"]["attn"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trained_adapter_equals_the_merged_reference_in_trainer_and_sampler(name, trained, server, families):
    run = trained[name]
    ours = forward_logprobs(run, DATUM)
    path = run.save_weights_for_sampler(f"{name}-sampler").result().path
    stored = checkpoint_dir(server.data_dir, path)
    state = load_file(stored / "adapter_model.safetensors")
    if name not in ("llama3", "qwen3"):
        assert any(".experts.0." in key for key in state), "routed experts carry no LoRA"
    fused = {"qwen3_5_moe": ".in_proj_qkv.lora_A.weight", "nemotron_h": ".mixer.in_proj.lora_A.weight"}.get(name)
    if fused:  # stored as the model's fused module, as PEFT and vLLM load it (exported as parts)
        assert any(key.endswith(fused) for key in state), sorted(state)
    reference = _merged_reference(families[name], stored)
    base = _logprobs(reference_model(families[name]))
    expected = _logprobs(reference)
    assert np.abs(expected - base).max() > 1e-2, "training moved nothing"
    np.testing.assert_allclose(ours, expected, atol=1e-4)

    sampler = run.create_sampling_client(model_path=path)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), ours, atol=1e-4)


@pytest.mark.parametrize(("name", "rank"), [("qwen3_moe", 128), ("gpt_oss", 64)])
def test_a_lora_of_rank_above_32_on_a_mixture_of_experts_trains_saves_exports_and_samples(name, rank, client, server,
                                                                                           families):
    """Hosted Tinker refuses ranks above 32 on MoE models; here a rank-128 (and 64) LoRA on every expert trains, its
    sampler weights equal the merged reference in trainer and sampler, and its export holds hosted Tinker's 3-D
    expert tensors of that rank."""
    run = client.create_lora_training_client(base_model=families[name], rank=rank, seed=12).result()
    train(run, DATUM, 2, types.AdamParams(learning_rate=1e-3))
    ours = forward_logprobs(run, DATUM)
    path = run.save_weights_for_sampler(f"{name}-rank-{rank}").result().path
    stored = checkpoint_dir(server.data_dir, path)
    expected = _logprobs(_merged_reference(families[name], stored))
    assert np.abs(expected - _logprobs(reference_model(families[name]))).max() > 1e-3, "training moved nothing"
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    scored = run.create_sampling_client(model_path=path).compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), ours, atol=1e-4)
    exported = checkpoint_dir(server.data_dir, run.save_weights_external(f"{name}-rank-{rank}").result().path)
    experts = [t for k, t in load_file(exported / "adapter_model.safetensors").items() if ".experts." in k]
    assert experts and all(t.dim() == 3 and rank in t.shape[1:] for t in experts)


@pytest.fixture(scope="module")
def python():
    return cookbook_python()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_cookbook_merges_and_converts_the_export_as_the_server_trained_and_stores_it(name, python, trained, server, families, tmp_path):
    """``weights.download`` of a training checkpoint gives hosted Tinker's layout (3-D experts, split projections,
    ``unembed_tokens``); the unmodified ``weights.build_hf_model`` merges it into the model the server trained, and
    ``weights.build_lora_adapter`` converts it into the adapter the server stores for samplers (DeepSeek-V3 aside,
    which the cookbook refuses to convert: vLLM and SGLang serve no LoRA on it)."""
    if name == "qwen3_5_moe":
        pytest.skip("tinker-cookbook 0.6.1 knows Qwen3.5 only as published, a vision-language checkpoint (model_type "
                    "qwen3_5_moe, tested as qwen3_5_moe_vl); for a text-only checkpoint (qwen3_5_moe_text) it picks "
                    "its default merge profile, which cannot merge the split in_proj_q/k/v hosted Tinker trains")
    run = trained[name]
    state = run.save_state(f"{name}-merge").result().path
    adapter, merged_dir, peft = tmp_path / "adapter", tmp_path / "merged", tmp_path / "peft"
    # DeepSeek-V3 aside: the cookbook's own refusal to convert, as vLLM and SGLang serve no DeepSeek-V3 LoRA.
    run_cookbook(python, server, EXPORT, state, str(adapter), families[name], str(merged_dir),
                 "" if name == "deepseek_v3" else str(peft))
    exported = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.unembed_tokens.lora_A.weight" in exported
    if name not in ("llama3", "qwen3"):
        assert any(v.dim() == 3 for k, v in exported.items() if ".experts." in k), "experts are not 3-D"
    merged = reference_model(merged_dir)
    trained = forward_logprobs(run, DATUM)
    np.testing.assert_allclose(_logprobs(merged), trained, atol=1e-4)

    if name == "deepseek_v3":
        return
    # The cookbook's converter to a PEFT adapter for vLLM / SGLang gives what the server itself stores for samplers
    # (per-expert pairs, Nemotron's Mamba parts fused at rank_pattern), and that scores as the trainer does.
    converted = _fused_as_vllm_loads_them(load_file(peft / "adapter_model.safetensors"))
    stored_dir = checkpoint_dir(server.data_dir, state)
    stored = load_file(stored_dir / "adapter_model.safetensors")
    # The other difference: the cookbook names a tied head's LoRA after the one matrix (embed_tokens, as lora_A/B);
    # the server names it lm_head and adds PEFT's embedding LoRA for the input side.
    tied = {k.replace("model.embed_tokens", "lm_head"): k for k in converted if ".embed_tokens." in k}
    ours = {tied.get(k, k): v for k, v in stored.items() if "lora_embedding" not in k}
    assert set(converted) == set(ours)
    for key, tensor in converted.items():
        torch.testing.assert_close(tensor, ours[key], rtol=0, atol=0, msg=key)
    np.testing.assert_allclose(_logprobs(_merged_reference(families[name], stored_dir)), trained, atol=1e-4)


def _fused_as_vllm_loads_them(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tinker-cookbook 0.6.1's converter leaves Qwen3.5's DeltaNet ``in_proj_q/k/v`` split, which vLLM 0.32 refuses
    (it takes LoRA only on the fused ``in_proj_qkv``, which it packs with ``in_proj_z``); the server stores them as
    that one pair (A stacked, B block-diagonal). The cookbook's pairs, fused so."""
    out = dict(state)
    for key in [k for k in state if ".in_proj_q.lora_A." in k]:
        parts = [key.replace(".in_proj_q.", f".in_proj_{part}.") for part in "qkv"]
        out[key.replace(".in_proj_q.", ".in_proj_qkv.")] = torch.cat([out.pop(k) for k in parts])
        b_parts = [out.pop(k.replace("lora_A", "lora_B")) for k in parts]
        out[key.replace(".in_proj_q.", ".in_proj_qkv.").replace("lora_A", "lora_B")] = torch.block_diag(*b_parts)
    return out
