"""The RL hand-off through the server: from ``save_weights_and_get_sampling_client`` to the first token sampled on
the new weights, for a small and a large adapter, and what unnamed hand-offs write under the data directory.

    python -m bench.handoff [--ranks 1 128] [--repeats 5] [--layers 4] [--modes memory disk] [--vllm]

Model: a random-init Qwen3-MoE with 32 experts (top-4), hidden 256, expert width 128, ``--layers`` layers; every
weight group adapted (attention, every expert's gate/up/down, the head), so a rank-128 adapter is ~100 MB. Each hand-off
is one SDK round trip that saves (``save_weights_and_get_sampling_client``) and one that samples a token from the
returned client: the time is the two together, median of ``--repeats`` after one warm-up. Modes: ``memory`` is the
server's default (the transformers sampler gets the weights in memory); ``disk`` is the same server started with
``--ephemeral-memory-mb 0``, which writes every unnamed save under the data directory as before. After each rank's
hand-offs, the bytes under ``DATA_DIR/ephemeral``. ``--vllm``: also the vLLM sampler (its CPU build serves no MoE: on
the built-in dense tiny model, whose adapters are small), which reads adapters from files.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write

EXPERTS = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32,
           "num_experts_per_tok": 4, "moe_intermediate_size": 128, "intermediate_size": 512, "vocab_size": 8192}
PROMPT = [11, 42, 77, 103, 250, 19, 7]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    parser.add_argument("--vllm", action="store_true", help="also the vLLM sampler, on the built-in dense tiny model")
    args = parser.parse_args()
    directory = build_model(args.layers)
    rows: list[dict] = []
    try:
        for mode in args.modes:
            flags = ("--ephemeral-memory-mb", "0") if mode == "disk" else ()
            rows += server_rows(str(directory), "transformers", mode, flags, args)
        if args.vllm:
            from adapters.models.tiny import TINY_MODEL_NAME

            rows += server_rows(TINY_MODEL_NAME, "vllm", "disk (vLLM reads files)", ("--sampler-backend", "vllm"), args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    write("handoff", {**vars(args), "model": {**EXPERTS, "num_hidden_layers": args.layers}}, rows)


def build_model(layers: int) -> Path:
    """The random-init MoE (seeded), with the tiny model's tokenizer files beside it."""
    from transformers import Qwen3MoeConfig

    from adapters.models.tiny import save_random_model

    config = Qwen3MoeConfig(**EXPERTS, num_hidden_layers=layers, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    return save_random_model(config, Path(tempfile.mkdtemp(prefix="bench-handoff-")))


def server_rows(base_model: str, backend: str, mode: str, flags: tuple[str, ...], args) -> list[dict]:
    """One server with its default flags plus ``flags``; per rank, the hand-off's median seconds and what the
    hand-offs wrote under the data directory."""
    import tinker
    from tinker import types

    from tests.server import start_server

    server = start_server(Path(tempfile.mkdtemp(prefix="bench-handoff-server-")), "--base-model", base_model,
                          "--max-lora-rank", str(max(args.ranks)), *flags, timeout=600)
    rows = []
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        one_token = types.SamplingParams(max_tokens=1, temperature=0.0)
        prompt = types.ModelInput.from_ints(PROMPT)
        for rank in args.ranks:
            client = service.create_lora_training_client(base_model=base_model, rank=rank, seed=0).result()
            datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]), loss_fn_inputs={
                "target_tokens": np.array(PROMPT[1:]), "weights": np.ones(len(PROMPT) - 1, np.float32)})
            client.forward_backward([datum], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            ephemeral = server.data_dir / "ephemeral"
            written_before = _bytes(ephemeral)
            seconds = []
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                sampler = client.save_weights_and_get_sampling_client()
                sampler.sample(prompt, 1, one_token).result()
                seconds.append(time.perf_counter() - start)
            size = _adapter_mib(base_model, rank, args.layers)
            rows.append({"backend": backend, "mode": mode, "rank": rank, "adapter_mib": size,
                         "handoff_to_first_token_s": statistics.median(seconds[1:]),
                         "handoffs": args.repeats + 1, "written_mib": (_bytes(ephemeral) - written_before) / 2**20})
        service.close("success")
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)
    return rows


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def _adapter_mib(base_model: str, rank: int, layers: int) -> float | None:
    """The adapter's float32 weights in MiB, from the MoE's shapes (every weight group adapted); None for another
    model."""
    if not Path(base_model).is_dir():
        return None
    e = EXPERTS
    q, kv, hidden, width = e["num_attention_heads"] * e["head_dim"], e["num_key_value_heads"] * e["head_dim"], \
        e["hidden_size"], e["moe_intermediate_size"]
    attention = (hidden + q) + 2 * (hidden + kv) + (q + hidden)
    experts = e["num_experts"] * 3 * (hidden + width)
    head = hidden + e["vocab_size"]
    return 4 * rank * (layers * (attention + experts) + head) / 2**20


if __name__ == "__main__":
    main()
