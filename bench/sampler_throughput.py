"""Sampler tokens/s with the base model alone versus requests spread over N resident LoRA adapters, same load.

    python -m bench.sampler_throughput [--adapters 8] [--requests 32] [--tokens 32] [--backend transformers]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from adapters.models.tiny import ensure_tiny_model
from adapters.samplers.interface import AdapterRef
from adapters.trainer.actor import LoraSpec, MultiLoRATrainer
from bench.common import write
from shims.sampling.job import SampleJob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests, one sequence each")
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per sequence")
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    args = parser.parse_args()
    location = str(ensure_tiny_model())

    trainer = MultiLoRATrainer(location)  # writes N different adapters to sample with
    refs = []
    for i in range(args.adapters):
        trainer.create(f"run-{i}", LoraSpec(rank=8, seed=i))
        directory = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
        trainer.save_for_sampler(f"run-{i}", str(directory))
        refs.append(AdapterRef(f"adapter-{i}", str(directory)))

    if args.backend == "vllm":
        from adapters.samplers.vllm.sampler import VLLMSampler

        sampler = VLLMSampler(location, max_resident=args.adapters)
    else:
        from adapters.samplers.hf.sampler import TransformersSampler

        sampler = TransformersSampler(location, max_batch_sequences=args.requests, max_resident=args.adapters)

    def job(i: int) -> SampleJob:
        return SampleJob(prompt=tuple(range(10 + i % 7, 30 + i % 7)), max_tokens=args.tokens, seed=i,
                         stop_at_eos=False)

    async def run(adapters: list[AdapterRef | None]) -> float:
        started = time.perf_counter()
        results = await asyncio.gather(*(sampler.sample(adapters[i % len(adapters)], job(i))
                                         for i in range(args.requests)))
        assert all(len(r.sequences[0].tokens) == args.tokens for r in results)
        return args.requests * args.tokens / (time.perf_counter() - started)

    async def measure() -> list[dict]:
        await run(refs)  # warm-up: loads every adapter
        rows = []
        for name, adapters in (("base model", [None]), ("1 adapter", refs[:1]),
                               (f"{args.adapters} adapters, mixed", refs)):
            rates = sorted([await run(adapters) for _ in range(7)])  # this machine's timings vary ±2× run to run
            rows.append({"workload": name, "tokens_per_second": rates[3]})
        await sampler.close()
        return rows

    rows = asyncio.run(measure())
    for row in rows:
        row["relative_to_base"] = row["tokens_per_second"] / rows[0]["tokens_per_second"]
    write(f"sampler_throughput_{args.backend}", vars(args), rows)


if __name__ == "__main__":
    main()
