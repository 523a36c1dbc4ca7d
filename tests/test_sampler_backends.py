"""Each sampler backend that can run on this machine, in-process: adapters against a transformers + peft reference,
mixed-adapter batches, LRU eviction with transparent reload, and batching of concurrent requests."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

from adapters.sampler import AdapterRef
from adapters.trainer import AdamHyper, LoraSpec, MultiLoRATrainer
from shims.sampling_wire import SampleJob
from shims.training_wire import DatumArrays
from tests.helpers import reference_peft_model

PROMPT = (11, 42, 77, 103, 250, 19, 7)
BACKENDS = ["transformers", "vllm"]


def _vllm_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "the vLLM backend needs a CUDA GPU; this machine has none (it runs on GPU machines with the [gpu] extra)"
    if importlib.util.find_spec("vllm") is None:
        return "the vLLM backend needs the [gpu] extra: pip install -e '.[gpu]'"
    return None


@pytest.fixture(scope="module", params=BACKENDS)
def make_sampler(request, tiny_model_dir):
    if request.param == "vllm" and (reason := _vllm_unavailable()):
        pytest.skip(reason)
    made = []

    def make(max_resident: int = 4):
        if request.param == "vllm":
            from adapters.vllm_sampler import VLLMSampler

            sampler = VLLMSampler(str(tiny_model_dir), max_resident=max_resident, gpu_memory_utilization=0.3)
        else:
            from adapters.hf_sampler import TransformersSampler

            sampler = TransformersSampler(str(tiny_model_dir), max_resident=max_resident, threads=2)
        made.append(sampler)
        return sampler

    make.backend = request.param
    yield make
    for sampler in made:
        run(sampler.close())


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> list[AdapterRef]:
    """Two trained adapters (different ranks and targets) saved as sampler checkpoints."""
    trainer = MultiLoRATrainer(str(tiny_model_dir), threads=2)
    tokens = np.array([*PROMPT, 301, 17, 96])
    data = [DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:],
                                                            "weights": np.ones(tokens.size - 1, dtype=np.float32)})]
    refs = []
    for name, spec in [("a", LoraSpec(rank=8, seed=1)), ("b", LoraSpec(rank=4, seed=2, train_unembed=False))]:
        trainer.create(name, spec)
        for _ in range(3):
            trainer.forward_backward(name, data, "cross_entropy", {}, False)
            trainer.optim_step(name, AdamHyper(learning_rate=1e-2))
        directory = tmp_path_factory.mktemp(f"adapter-{name}")
        trainer.save_for_sampler(name, str(directory))
        refs.append(AdapterRef(key=name, directory=str(directory)))
    return refs


def scoring_job(**fields) -> SampleJob:
    return SampleJob(prompt=PROMPT, max_tokens=6, temperature=0.0, stop_at_eos=False, prompt_logprobs=True, **fields)


_LOOP = asyncio.new_event_loop()  # one loop for the module: a vLLM engine stays bound to the loop it first ran in


def run(coro):
    return _LOOP.run_until_complete(coro)


def test_adapter_logprobs_match_peft_reference(make_sampler, adapters, tiny_model_dir):
    sampler = make_sampler()
    for ref in adapters:
        result = run(sampler.sample(ref, scoring_job()))
        seq = result.sequences[0]
        model = reference_peft_model(tiny_model_dir, ref.directory).eval()
        tokens = [*PROMPT, *seq.tokens]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
        expected = [float(logprobs[i - 1, tokens[i]]) for i in range(1, len(tokens))]
        tolerance = 1e-4 if make_sampler.backend == "transformers" else 5e-2  # bf16 on GPU
        np.testing.assert_allclose(result.prompt.logprobs[1:], expected[: len(PROMPT) - 1], atol=tolerance)
        np.testing.assert_allclose(seq.logprobs, expected[len(PROMPT) - 1:], atol=tolerance)
        assert seq.tokens == [int(logprobs[i - 1].argmax()) for i in range(len(PROMPT), len(tokens))]


def test_mixed_adapter_batch_equals_separate_requests(make_sampler, adapters):
    sampler = make_sampler()
    refs = [adapters[0], None, adapters[1], adapters[0]]
    alone = [run(sampler.sample(ref, scoring_job())) for ref in refs]

    async def together():
        return await asyncio.gather(*(sampler.sample(ref, scoring_job()) for ref in refs))

    mixed = run(together())
    for a, b in zip(alone, mixed):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        np.testing.assert_allclose(a.sequences[0].logprobs, b.sequences[0].logprobs, atol=1e-4)
        np.testing.assert_allclose(a.prompt.logprobs[1:], b.prompt.logprobs[1:], atol=1e-4)
    assert alone[0].sequences[0].tokens != alone[2].sequences[0].tokens or \
        not np.allclose(alone[0].sequences[0].logprobs, alone[2].sequences[0].logprobs)
    if make_sampler.backend == "transformers":
        assert sampler.batches == len(refs) + 1  # the concurrent four ran as one batch


def test_evicted_adapter_reloads_transparently(make_sampler, adapters):
    sampler = make_sampler(max_resident=1)
    a, b = adapters
    first = run(sampler.sample(a, scoring_job()))
    assert sampler.resident() == ["a"]
    other = run(sampler.sample(b, scoring_job()))
    assert sampler.resident() == ["b"]  # a was evicted to make room
    again = run(sampler.sample(a, scoring_job()))
    assert sampler.resident() == ["a"]
    assert again.sequences[0].tokens == first.sequences[0].tokens
    np.testing.assert_allclose(again.prompt.logprobs[1:], first.prompt.logprobs[1:], atol=1e-5)
    assert not np.allclose(other.prompt.logprobs[1:], first.prompt.logprobs[1:], atol=1e-4)


def test_changed_weights_under_one_key_are_reloaded(make_sampler, adapters):
    sampler = make_sampler()
    a, b = adapters
    first = run(sampler.sample(AdapterRef("shared", a.directory, version=1), scoring_job()))
    stale = run(sampler.sample(AdapterRef("shared", b.directory, version=1), scoring_job()))
    newer = run(sampler.sample(AdapterRef("shared", b.directory, version=2), scoring_job()))
    direct = run(sampler.sample(b, scoring_job()))
    np.testing.assert_allclose(stale.prompt.logprobs[1:], first.prompt.logprobs[1:], atol=1e-6)  # same version
    np.testing.assert_allclose(newer.prompt.logprobs[1:], direct.prompt.logprobs[1:], atol=1e-5)


def test_seeded_samples_do_not_depend_on_batch_company(make_sampler):
    sampler = make_sampler()
    job = SampleJob(prompt=PROMPT, num_samples=3, max_tokens=8, temperature=1.0, seed=7, stop_at_eos=False)
    alone = run(sampler.sample(None, job))

    async def crowded():
        others = [SampleJob(prompt=PROMPT[:3], max_tokens=5, temperature=1.0, seed=i) for i in range(3)]
        results = await asyncio.gather(sampler.sample(None, job), *(sampler.sample(None, o) for o in others))
        return results[0]

    together = run(crowded())
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in together.sequences]


def test_a_cancelled_request_stops_decoding_and_its_batch_company_finishes(make_sampler):
    if make_sampler.backend != "transformers":
        pytest.skip("decoded_tokens is the transformers sampler's own counter (vLLM aborts a cancelled request itself)")
    sampler = make_sampler()
    long = SampleJob(prompt=PROMPT, max_tokens=1500, stop_at_eos=False, seed=1)
    short = SampleJob(prompt=PROMPT, max_tokens=40, stop_at_eos=False, seed=2)
    alone = run(sampler.sample(None, short)).sequences[0].tokens

    async def cancel_after_first_token():
        loop, started = asyncio.get_running_loop(), asyncio.Event()
        abandoned = asyncio.create_task(sampler.sample(None, long, lambda _: loop.call_soon_threadsafe(started.set)))
        company = asyncio.create_task(sampler.sample(None, short))  # queued with it: the same batch
        await started.wait()
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        return await company

    before, batches = sampler.decoded_tokens, sampler.batches
    company = run(cancel_after_first_token())
    assert sampler.batches == batches + 1
    assert company.sequences[0].tokens == alone
    decoded = sampler.decoded_tokens - before
    assert len(alone) < decoded < len(alone) + 200, f"{decoded} tokens decoded"  # not 1,540


def test_vllm_results_give_a_greedy_jobs_one_sequence_to_every_sample():
    """vLLM refuses n > 1 when greedy, so the backend decodes one sequence and reports it as each sample (whole and
    streamed). Checked on stand-ins for vLLM's output objects: this part needs no GPU."""
    from types import SimpleNamespace

    from adapters.vllm_sampler import _announce, _result

    steps = [{token: SimpleNamespace(logprob=-0.25 * token, rank=1)} for token in (5, 6)]
    output = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[5, 6], logprobs=steps,
                                                      finish_reason="length")],
                             prompt_logprobs=None, num_cached_tokens=0)
    for temperature in (0.0, 1e-7):
        job = SampleJob(prompt=PROMPT, num_samples=3, max_tokens=2, temperature=temperature)
        result = _result(output, job)
        assert [(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences] == [([5, 6], [-1.25, -1.5],
                                                                                      "length")] * 3
        events = []
        _announce(output, job, [0] * 3, events.append)
        assert sorted((e.index, e.token, e.logprob) for e in events) == sorted(
            (i, t, -0.25 * t) for i in range(3) for t in (5, 6))
    sampled = SampleJob(prompt=PROMPT, num_samples=1, max_tokens=2, temperature=1.0)
    assert len(_result(output, sampled).sequences) == 1


def test_pool_routes_an_adapter_to_the_replica_that_holds_it():
    """Routing only (no actors): affinity wins unless that replica is much busier than the least busy one."""
    from adapters.sampler_pool import SamplerPlacement, SamplerPool, _BaseReplicas, _Replica

    pool = SamplerPool([], SamplerPlacement(count=2, max_batch_sequences=4))
    base = _BaseReplicas([_Replica(actor=None), _Replica(actor=None)])
    a, b = AdapterRef("a", "/a"), AdapterRef("b", "/b")
    assert pool._route(base, a) == 0
    base.replicas[0].in_flight = 1
    assert pool._route(base, b) == 1  # new adapter: the least busy replica
    base.replicas[0].in_flight = 3
    assert pool._route(base, a) == 0  # still within the slack: stays where it is resident
    base.replicas[0].in_flight = 9
    assert pool._route(base, a) == 1  # too busy: moves, and the affinity follows
    base.replicas[0].in_flight = 0
    assert pool._route(base, a) == 1
    assert pool._route(base, None) == 0


def test_one_unloadable_adapter_fails_only_its_own_request(make_sampler, adapters, tmp_path):
    from shims.errors import UserError

    sampler = make_sampler()
    missing = AdapterRef("missing", str(tmp_path / "nothing-here"))
    expected = run(sampler.sample(adapters[0], scoring_job()))

    async def together():
        return await asyncio.gather(sampler.sample(missing, scoring_job()), sampler.sample(adapters[0], scoring_job()),
                                    return_exceptions=True)

    bad, good = run(together())
    assert isinstance(bad, UserError) and "missing" in str(bad)
    assert good.sequences[0].tokens == expected.sequences[0].tokens


def test_two_versions_of_one_key_in_flight_together(make_sampler, adapters):
    sampler = make_sampler()
    a, b = adapters
    direct = [run(sampler.sample(ref, scoring_job())) for ref in adapters]

    async def together():
        return await asyncio.gather(sampler.sample(AdapterRef("inflight", a.directory, version=1), scoring_job()),
                                    sampler.sample(AdapterRef("inflight", b.directory, version=2), scoring_job()))

    old, new = run(together())
    np.testing.assert_allclose(old.prompt.logprobs[1:], direct[0].prompt.logprobs[1:], atol=1e-5)
    np.testing.assert_allclose(new.prompt.logprobs[1:], direct[1].prompt.logprobs[1:], atol=1e-5)
