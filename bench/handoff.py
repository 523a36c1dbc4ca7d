"""The RL hand-off through the server: from ``save_weights_and_get_sampling_client`` to the first token sampled on
the new weights, for a small and a large adapter, and what unnamed hand-offs write under the data directory.

    python -m bench.handoff [--ranks 1 128] [--repeats 5] [--layers 4] [--modes memory disk] [--vllm]
                            [--server-flags="FLAGS"]

Model: a random-init Qwen3-MoE with 32 experts (top-4), hidden 256, expert width 128, ``--layers`` layers; every
weight group adapted (attention, every expert's gate/up/down, the head), so a rank-128 adapter is 80 MiB. Each
hand-off is one SDK round trip that saves (``save_weights_and_get_sampling_client``) and one that samples a token from
the returned client: the time is the two together, median of ``--repeats`` after one warm-up. Modes: ``memory`` is the
server's default (the weights reach the samplers in memory); ``disk`` is the same server started with
``--ephemeral-memory-mb 0``, which writes every unnamed save under the data directory. After each rank's hand-offs,
the bytes under ``DATA_DIR/ephemeral``. Then, on another run, a named save followed at once by a forward_backward:
how long each takes to be answered (``named_saves``). ``--vllm``: also the vLLM sampler in both modes (its CPU build
serves no MoE: on a random-init dense Qwen3 of 14 layers, hidden 512, whose rank-128 adapter is 81 MiB likewise).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import write

EXPERTS = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32,
           "num_experts_per_tok": 4, "moe_intermediate_size": 128, "intermediate_size": 512, "vocab_size": 8192}
DENSE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "intermediate_size": 2048, "vocab_size": 8192, "num_hidden_layers": 14}
PROMPT = [11, 42, 77, 103, 250, 19, 7]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    parser.add_argument("--vllm", action="store_true", help="also the vLLM sampler, on a dense model")
    parser.add_argument("--server-flags", default="", help='more flags for every server, as one string '
                        '(--server-flags="--ray-object-store-mb 3072")')
    args = parser.parse_args()
    moe = {**EXPERTS, "num_hidden_layers": args.layers}
    rows: list[dict] = []
    for backend, shape in [("transformers", moe), *([("vllm", DENSE)] if args.vllm else [])]:
        directory = build_model(shape)
        try:
            for mode in args.modes:
                flags = ("--sampler-backend", backend, *shlex.split(args.server_flags),
                         *(("--ephemeral-memory-mb", "0") if mode == "disk" else ()))
                rows += server_rows(str(directory), backend, mode, flags, shape, args)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    write("handoff", {**vars(args), "model": moe, "vllm_model": DENSE}, rows)


def build_model(shape: dict) -> Path:
    """The random-init MoE or dense model (seeded), with the tiny model's tokenizer files beside it."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from adapters.models.tiny import save_random_model

    if "num_experts" in shape:
        config = Qwen3MoeConfig(**shape, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    else:
        config = Qwen3Config(**shape, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    return save_random_model(config, Path(tempfile.mkdtemp(prefix="bench-handoff-")))


def server_rows(base_model: str, backend: str, mode: str, flags: tuple[str, ...], shape: dict, args) -> list[dict]:
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
                sampler = client.save_weights_and_get_sampling_client().result()
                sampler.sample(prompt, 1, one_token).result()
                seconds.append(time.perf_counter() - start)
            size = _adapter_mib(shape, rank)
            written = (_bytes(ephemeral) - written_before) / 2**20
            saved, next_request = named_saves(server.base_url, service, base_model, rank, datum, args.repeats)
            rows.append({"backend": backend, "mode": mode, "rank": rank, "adapter_mib": size,
                         "handoff_to_first_token_s": statistics.median(seconds[1:]),
                         "handoffs": args.repeats + 1, "written_mib": written,
                         "named_save_s": saved, "next_request_after_named_save_s": next_request})
        service.close("success")
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)
    return rows


def named_saves(url: str, service, base_model: str, rank: int, datum, repeats: int) -> tuple[float, float]:
    """A named ``save_weights_for_sampler`` followed at once by a ``forward_backward`` of the same run, sent back to
    back with their seq ids (raw HTTP: the SDK numbers a save only when its event loop sends it): the median seconds
    from sending the save to its answer (its files durable), and to the forward_backward's answer (what the run
    waited for the save)."""
    import httpx

    from tests.helpers import one_request, poll_future

    client = service.create_lora_training_client(base_model=base_model, rank=rank, seed=1).result()
    headers = {"X-API-Key": "tml-bench"}
    saved, following = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        answer = httpx.post(f"{url}/api/v1/save_weights_for_sampler", headers=headers, timeout=60,
                            json={"model_id": client.model_id, "path": f"named-{i}", "seq_id": 2 * i + 1})
        after = one_request(url, "tml-bench", client.model_id, 2 * i + 2, [datum])

        def answered(request_id: str, start: float = start) -> float:
            poll_future(url, request_id, "tml-bench", deadline_s=600)
            return time.perf_counter() - start

        with ThreadPoolExecutor(2) as polls:  # both polled at once: each one's own answer time
            save_s, after_s = polls.map(answered, [answer.json()["request_id"], after])
        saved.append(save_s)
        following.append(after_s)
    return statistics.median(saved[1:]), statistics.median(following[1:])


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def _adapter_mib(shape: dict, rank: int) -> float:
    """The adapter's float32 weights in MiB, from the model's shapes (every weight group adapted)."""
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    hidden = shape["hidden_size"]
    attention = (hidden + q) + 2 * (hidden + kv) + (q + hidden)
    if "num_experts" in shape:
        mlp = shape["num_experts"] * 3 * (hidden + shape["moe_intermediate_size"])
    else:
        mlp = 3 * (hidden + shape["intermediate_size"])
    head = hidden + shape["vocab_size"]
    return 4 * rank * (shape["num_hidden_layers"] * (attention + mlp) + head) / 2**20


if __name__ == "__main__":
    main()
