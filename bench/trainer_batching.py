"""Trainer tokens/s for whole training steps (forward + backward + optimizer step) at equal total tokens: plain PEFT
on one adapter (the script a user moves here from), this trainer in-process with one adapter, N adapters in one mixed
batch, and N adapters one after another; then the same through the server as users run it (``compat-server serve``
with its defaults, or ``--server-flag``s, and the tinker SDK): one client sending every datum, and N clients at once,
each its own training run with its share of the datums. Ratios are against plain PEFT and against one adapter (one
client), measured in the same run, every row beside the same idle server.

    python -m bench.trainer_batching [--shape tiny|cpu-mid|qwen3-0.6b|qwen3-4b|qwen3-8b] [--adapters 8]
                                     [--rows 2] [--length 128] [--rank 32] [--repeats 5] [--server-flag=--x ...]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from adapters.trainer.actor import LORA_ALPHA, AdamHyper, LoraSpec, MultiLoRATrainer, StepRequest
from adapters.trainer.interface import OptimRequest
from adapters.trainer.options import TrainerOptions
from bench.common import mfu, model_directory, non_embedding_params, write
from bench.through_server import sdk_datums, sdk_step, served, service_client, torch_threads
from shims.tinker.training_wire import DatumArrays
from tests.server import RunningServer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2, help="datums per adapter per step")
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-flag", action="append", default=[],
                        help="a flag for the server rows (repeatable; none: the server's defaults)")
    parser.add_argument("--no-server", action="store_true", help="in-process rows only")
    args = parser.parse_args()

    directory = model_directory(args.shape)
    trainer = MultiLoRATrainer(str(directory), TrainerOptions(max_adapters=args.adapters + 1))
    vocab = trainer.facts.vocab_size
    rng = np.random.default_rng(0)

    def datum() -> DatumArrays:
        tokens = rng.integers(0, vocab, size=args.length + 1)
        return DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:],
                                                                "weights": np.ones(args.length, np.float32)})

    ids = [f"run-{i}" for i in range(args.adapters)]
    for i, model_id in enumerate(ids):
        trainer.create(model_id, LoraSpec(rank=args.rank, seed=i))
    per_adapter = [[datum() for _ in range(args.rows)] for _ in ids]
    everything = [d for rows in per_adapter for d in rows]
    total_tokens = len(everything) * args.length
    adam = AdamHyper(learning_rate=1e-5)

    def one_adapter() -> None:
        trainer.forward_backward(ids[0], everything, "cross_entropy", {}, False)
        trainer.optim_step(ids[0], adam)

    def mixed() -> None:  # what the trainer pool sends when every run's request waits together
        trainer.run_batch([StepRequest(m, rows, "cross_entropy", {}, False)
                           for m, rows in zip(ids, per_adapter, strict=True)])
        trainer.run_batch([OptimRequest(m, adam) for m in ids])

    def sequential() -> None:
        for m, rows in zip(ids, per_adapter, strict=True):
            trainer.forward_backward(m, rows, "cross_entropy", {}, False)
            trainer.optim_step(m, adam)

    params = non_embedding_params(directory)
    rows = []

    def measure(name: str, step: Callable[[], None], path: str = "in-process", adapters: int = 1,
                **extra) -> None:
        step()  # warm-up
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            step()
            _sync()
            seconds.append(time.perf_counter() - started)
        best = float(np.median(seconds))
        rate = total_tokens / best
        rows.append({"workload": name, "path": path, "adapters": adapters, "tokens_per_step": total_tokens,
                     "seconds_per_step": best, "tokens_per_second": rate, "mfu": mfu(params, rate),
                     "peak_gb": _peak_gb() if path == "in-process" else None, **extra})

    with contextlib.ExitStack() as stack:
        # Started first, so that every row runs beside the same idle server processes (Ray's, the samplers').
        server = None if args.no_server else stack.enter_context(served(directory, *args.server_flag))
        measure("plain PEFT, 1 adapter", plain_peft_step(str(directory), everything, args.rank, trainer.device))
        measure("this trainer in-process, 1 adapter", one_adapter)
        measure(f"this trainer in-process, {args.adapters} adapters, one mixed batch", mixed, adapters=args.adapters)
        measure(f"this trainer in-process, {args.adapters} adapters, one after another", sequential,
                adapters=args.adapters)
        if server is not None:
            server_rows(server, directory, per_adapter, args, measure)
    peft = rows[0]["tokens_per_second"]
    for row in rows:
        single = next(r for r in rows[1:] if r["path"] == row["path"] and r["adapters"] == 1)["tokens_per_second"]
        row["relative_to_plain_peft"] = row["tokens_per_second"] / peft
        row["relative_to_1_adapter"] = row["tokens_per_second"] / single
    flags = "".join(f"-{flag.lstrip('-')}" for flag in args.server_flag)  # e.g. -trainer-threads-1
    write(f"trainer_batching-{args.shape}{flags}", vars(args), rows)


def server_rows(server: RunningServer, directory: Path, per_adapter: list[list[DatumArrays]], args,
                measure: Callable[..., None]) -> None:
    """One SDK client sending every datum per step, then one client per adapter at once, each its own run with its
    datums (what the server may mix into one batch), against ``compat-server serve`` with its defaults (or the
    ``--server-flag``s); each client in its own thread, as separate scripts would be."""
    service = service_client(server)
    clients = [service.create_lora_training_client(base_model=str(directory), rank=args.rank, seed=i).result()
               for i in range(len(per_adapter))]
    shares = [sdk_datums(rows) for rows in per_adapter]
    everything = [d for share in shares for d in share]
    flags = " ".join(args.server_flag) or "defaults"
    threads = torch_threads(server)
    with ThreadPoolExecutor(len(clients)) as pool:
        def together() -> None:
            list(pool.map(sdk_step, clients, shares))

        measure(f"server ({flags}) via SDK, 1 client", lambda: sdk_step(clients[0], everything),
                path="server", adapters=1, torch_threads=threads)
        measure(f"server ({flags}) via SDK, {len(clients)} clients at once", together, path="server",
                adapters=len(clients), torch_threads=threads)
    service.close("success")


def plain_peft_step(location: str, data: list[DatumArrays], rank: int, device: torch.device) -> Callable[[], None]:
    """The baseline: what a PEFT user writes for the same step — one padded batch through ``get_peft_model`` (same
    rank, alpha, target modules), full logits, weighted token logprobs, backward, ``torch.optim.AdamW`` (its default
    implementation for the device)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(device)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=TARGETS))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    longest = max(d.tokens.size for d in data)
    ids = torch.zeros((len(data), longest), dtype=torch.long)
    mask, targets = torch.zeros_like(ids), torch.zeros_like(ids)
    weights = torch.zeros((len(data), longest))
    for i, d in enumerate(data):
        n = d.tokens.size
        ids[i, :n], mask[i, :n] = torch.as_tensor(d.tokens), 1
        targets[i, :n] = torch.as_tensor(d.loss_fn_inputs["target_tokens"])
        weights[i, :n] = torch.as_tensor(d.loss_fn_inputs["weights"])
    ids, mask, targets, weights = (t.to(device) for t in (ids, mask, targets, weights))

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(2, targets[..., None])[..., 0]
        (-(logprobs * weights).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
