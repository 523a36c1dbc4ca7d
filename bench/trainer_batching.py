"""Trainer tokens/s at equal total tokens: one adapter, N adapters in one mixed batch, N adapters one after another.

    python -m bench.trainer_batching [--shape tiny|qwen3-0.6b|qwen3-4b|qwen3-8b] [--adapters 8] [--rows 2]
                                     [--length 128] [--rank 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from adapters.trainer import AdamHyper, LoraSpec, MultiLoRATrainer, StepRequest
from bench.common import mfu, model_directory, non_embedding_params, write
from shims.training_wire import DatumArrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2, help="datums per adapter per step")
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    directory = model_directory(args.shape)
    trainer = MultiLoRATrainer(str(directory), max_adapters=args.adapters + 1)
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

    def one_adapter() -> None:
        trainer.forward_backward(ids[0], everything, "cross_entropy", {}, False)

    def mixed() -> None:
        trainer.forward_backward_batch([StepRequest(m, rows, "cross_entropy", {}, False)
                                        for m, rows in zip(ids, per_adapter, strict=True)])

    def sequential() -> None:
        for m, rows in zip(ids, per_adapter, strict=True):
            trainer.forward_backward(m, rows, "cross_entropy", {}, False)

    params = non_embedding_params(directory)
    rows = []
    for name, step in (("1 adapter", one_adapter), (f"{args.adapters} adapters, one mixed batch", mixed),
                       (f"{args.adapters} adapters, one after another", sequential)):
        step()  # warm-up
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            step()
            _sync()
            seconds.append(time.perf_counter() - started)
            for m in ids:
                trainer.adapters[m].optimizer.zero_grad(set_to_none=True)
        best = float(np.median(seconds))
        rate = total_tokens / best
        rows.append({"workload": name, "tokens_per_step": total_tokens, "seconds_per_step": best,
                     "tokens_per_second": rate, "mfu": mfu(params, rate), "peak_gb": _peak_gb()})
    trainer.optim_step(ids[0], AdamHyper())
    single = rows[0]["tokens_per_second"]
    for row in rows:
        row["relative_to_1_adapter"] = row["tokens_per_second"] / single
    write("trainer_batching", vars(args), rows)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
