"""Sampler tokens/s with the base model alone versus requests spread over N resident LoRA adapters, same load: the
sampler in-process, then through the server as users run it (``compat-server serve`` with its defaults and
``--sampler-backend``, the tinker SDK's sampling clients, the adapters trained and saved through the SDK).

    python -m bench.sampler_throughput [--adapters 8] [--requests 32] [--tokens 32] [--backend transformers]
                                       [--server-flag=--x ...] [--no-server]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from adapters.models.tiny import ensure_tiny_model
from adapters.samplers.interface import AdapterRef
from adapters.samplers.options import SamplerOptions
from adapters.trainer.actor import LoraSpec, MultiLoRATrainer
from bench.common import write
from shims.sampling.job import SampleJob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests, one sequence each")
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per sequence")
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="a flag for the server rows (repeatable; none: the server's defaults)")
    parser.add_argument("--no-server", action="store_true", help="in-process rows only")
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

        sampler = VLLMSampler(location, SamplerOptions(max_resident=args.adapters))
    else:
        from adapters.samplers.hf.sampler import TransformersSampler

        sampler = TransformersSampler(location, SamplerOptions(max_batch_sequences=args.requests,
                                                                max_resident=args.adapters))

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

    rows = [{"path": "in-process", **row} for row in asyncio.run(measure())]
    if not args.no_server:
        rows.extend({"path": "server", **row} for row in server_rows(location, args, job))
    for row in rows:
        base = next(r for r in rows if r["path"] == row["path"])
        row["relative_to_base"] = row["tokens_per_second"] / base["tokens_per_second"]
    write(f"sampler_throughput_{args.backend}", vars(args), rows)


def server_rows(location: str, args, job) -> list[dict]:
    """The same load through the server: ``--requests`` SDK ``sample`` calls at once, from a base-model sampling
    client or spread over the sampling clients of ``--adapters`` training runs' saved weights."""
    from tinker import types

    from bench.through_server import served, service_client, torch_threads

    flags = ["--sampler-backend", args.backend, *args.server_flag]
    with served(Path(location), *flags) as server:
        service = service_client(server)
        adapters = []
        for i in range(args.adapters):
            trainer = service.create_lora_training_client(base_model=location, rank=8, seed=i).result()
            adapters.append(trainer.save_weights_and_get_sampling_client(f"bench-{i}").result())
        base = service.create_sampling_client(base_model=location).result()

        def run(clients: list) -> float:
            started = time.perf_counter()
            futures = []
            for i in range(args.requests):
                j = job(i)
                futures.append(clients[i % len(clients)].sample(
                    types.ModelInput.from_ints(list(j.prompt)), 1,
                    types.SamplingParams(max_tokens=args.tokens, seed=j.seed, stop=[])))
            decoded = sum(len(f.result().sequences[0].tokens) for f in futures)  # a sequence may end at EOS
            return decoded / (time.perf_counter() - started)

        run(adapters)  # warm-up: loads every adapter
        rows = []
        threads = torch_threads(server)
        for name, clients in (("base model", [base]), ("1 adapter", adapters[:1]),
                              (f"{args.adapters} adapters, mixed", adapters)):
            rates = sorted(run(clients) for _ in range(7))
            rows.append({"workload": f"server ({' '.join(flags)}) via SDK, {name}", "tokens_per_second": rates[3],
                         "torch_threads": threads})
        service.close("success")
    return rows


if __name__ == "__main__":
    main()
