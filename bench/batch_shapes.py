"""Trainer tokens/s by the shape of a batch: the same real tokens per step sent as the batches users send — long
rows, many short ones, an RL group of varied lengths, one long datum among many one-token ones — through the server
with its default flags and the unmodified tinker SDK (``forward_backward`` + ``optim_step`` per step). A trainer
whose cost is its real tokens gives every shape about the same tokens/s; each row's ratio is against the best one.

    python -m bench.batch_shapes [--shape cpu-768] [--tokens 8192] [--repeats 3] [--server-flag=--x ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import model_directory, write
from bench.through_server import sdk_datums, sdk_step, served, service_client
from shims.tinker.training_wire import DatumArrays


def shapes(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Datum lengths of each shape, ``tokens`` real tokens each (the one-long row: its own count, as the issue sent)."""
    rng = np.random.default_rng(seed)
    rl: list[int] = []
    while sum(rl) < tokens:  # an RL group: lengths 32–480, the last one trimmed to the total
        rl.append(int(rng.integers(32, 481)))
    rl[-1] -= sum(rl) - tokens
    if rl[-1] < 1:
        rl.pop()
    return {"64 x 128": [128] * (tokens // 128), "256 x 32": [32] * (tokens // 32), "1,024 x 8": [8] * (tokens // 8),
            f"RL group, {len(rl)} datums of 32-480": rl, "1 x 1,024 + 1,023 x 1": [1024] + [1] * 1023,
            "4,096 x 2": [2] * (tokens // 2)}


def datums(lengths: list[int], vocab: int, seed: int) -> list[DatumArrays]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, vocab, n + 1)
        out.append(DatumArrays(tokens=ids[:-1], loss_fn_inputs={"target_tokens": ids[1:],
                                                               "weights": np.ones(n, dtype=np.float32)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="cpu-768")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per shape (the shapes taking turns), "
                        "after one not timed; the median is reported")
    parser.add_argument("--server-flag", action="append", default=[])
    parser.add_argument("--only", action="append", default=[], help="run only shapes whose name contains this")
    args = parser.parse_args()

    from transformers import AutoConfig

    directory = model_directory(args.shape)
    vocab = AutoConfig.from_pretrained(directory).vocab_size
    rows = []
    with served(directory, *args.server_flag) as server:
        service = service_client(server)
        client = service.create_lora_training_client(base_model=str(directory), rank=args.rank)
        picked = {name: lengths for name, lengths in shapes(args.tokens).items()
                  if not args.only or any(part in name for part in args.only)}
        data = {name: sdk_datums(datums(lengths, vocab, index)) for index, (name, lengths) in enumerate(picked.items())}
        for name in picked:
            sdk_step(client, data[name])  # not timed: the first step of each shape
        # The shapes take turns, repeat after repeat: this machine's speed drifts by ±15% over minutes, and running
        # each shape's steps together would hand one shape a slow minute.
        times: dict[str, list[float]] = {name: [] for name in picked}
        for _ in range(args.repeats):
            for name in picked:
                started = time.perf_counter()
                sdk_step(client, data[name])
                times[name].append(time.perf_counter() - started)
        for name, lengths in picked.items():
            seconds = float(np.median(times[name]))
            rows.append({"shape": name, "datums": len(lengths), "real_tokens": sum(lengths), "seconds": seconds,
                         "tokens_per_s": sum(lengths) / seconds, "all_seconds": [round(t, 3) for t in times[name]]})
            print(rows[-1], flush=True)
    best = max(row["tokens_per_s"] for row in rows)
    for row in rows:
        row["vs_best"] = row["tokens_per_s"] / best
    write(f"batch_shapes-{args.shape}", {"tokens": args.tokens, "rank": args.rank, "repeats": args.repeats,
                                         "server_flags": args.server_flag}, rows)


if __name__ == "__main__":
    main()
