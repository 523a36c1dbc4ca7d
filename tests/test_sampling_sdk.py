"""The tinker SDK, unmodified, samples from base models and trained adapters on the real server, once per sampler
backend (transformers; vLLM, on CPU through its CPU build), and every number it gets back is checked against
transformers + peft run here, in the test, or against the trainer."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.helpers import (
    BASE_MODEL,
    MAIN_KEY,
    checkpoint_dir,
    forward_logprobs,
    make_datum,
    on_both_sampler_backends,
    reference_peft_model,
    train,
)

PROMPT = [11, 42, 77, 103, 250, 19, 7]
TARGET = [301, 17, 96, 45]
GREEDY = types.SamplingParams(max_tokens=len(TARGET), temperature=0.0)

server, service_client = on_both_sampler_backends()  # every test here runs once per sampler backend


@pytest.fixture(scope="module")
def base_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log-softmax at every position of ``tokens`` (row i = distribution over token i + 1), computed here."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(full_logprobs(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def base_sampler(service_client):
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()


@pytest.fixture(scope="module")
def memorized(service_client):
    """A training client that has learned PROMPT → TARGET, and its sampler checkpoint."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    losses = train(client, make_datum(PROMPT, TARGET), 20, types.AdamParams(learning_rate=3e-3))
    assert losses[-1] < 0.02 * losses[0], losses
    path = client.save_weights_for_sampler("memorized").result().path
    return client, path


def test_base_sampling_matches_reference_logprobs(base_sampler, base_reference):
    prompt = types.ModelInput.from_ints(PROMPT)
    result = base_sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    assert len(result.sequences) == 3
    assert len({s.sequence_id for s in result.sequences}) == 3 and all(s.sequence_id for s in result.sequences)
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 6 and seq.stop_reason in ("stop", "length")
        assert len(seq.logprobs) == len(seq.tokens)
        reference = full_logprobs(base_reference, PROMPT + seq.tokens)
        expected = [float(reference[len(PROMPT) - 1 + i, t]) for i, t in enumerate(seq.tokens)]
        np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)
    greedy = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
    assert greedy.sequences[0].tokens == greedy_reference(base_reference, PROMPT, 8)
    assert greedy.sequences[0].stop_reason == "length"


def test_adapter_greedy_continuation_is_the_memorized_target(service_client, base_sampler, memorized, server,
                                                             tiny_model_dir):
    _, path = memorized
    sampler = service_client.create_sampling_client(model_path=path).result()
    assert sampler.get_base_model() == BASE_MODEL
    tuned = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    base = base_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    assert tuned.tokens == TARGET
    assert base.tokens != TARGET
    reference = reference_peft_model(tiny_model_dir, checkpoint_dir(server.data_dir, path)).eval()
    expected = full_logprobs(reference, PROMPT + TARGET)
    np.testing.assert_allclose(tuned.logprobs, [float(expected[len(PROMPT) - 1 + i, t]) for i, t in enumerate(TARGET)],
                               atol=1e-4)
    record = httpx.get(f"{server.base_url}/api/v1/samplers/{sampler._sampling_session_id}",
                       headers={"X-API-Key": MAIN_KEY}).json()
    assert record["model_path"] == path and record["base_model"] == BASE_MODEL


def test_seed_gives_the_same_tokens(base_sampler):
    prompt = types.ModelInput.from_ints(PROMPT)

    def run(seed):
        params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=seed, stop=[])
        return [s.tokens for s in base_sampler.sample(prompt, 2, params).result().sequences]

    first, again, other = run(1234), run(1234), run(99)
    assert first == again
    assert first[0] != first[1]  # the samples of one request differ from each other
    assert first != other


def test_stop_token_ids_and_stop_strings(base_sampler, base_reference, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    continuation = greedy_reference(base_reference, PROMPT, 12)
    prompt = types.ModelInput.from_ints(PROMPT)

    stop_id = continuation[4]
    cut = continuation.index(stop_id) + 1
    by_id = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0,
                                                                stop=[stop_id])).result().sequences[0]
    assert by_id.tokens == continuation[:cut] and by_id.stop_reason == "stop"

    text = tokenizer.decode(continuation)
    stop_text = next(text[i:i + 2] for i in range(len(tokenizer.decode(continuation[:3])), len(text) - 1)
                     if text[i:i + 2].strip())
    expected = next(continuation[:n] for n in range(1, 13) if stop_text in tokenizer.decode(continuation[:n]))
    by_text = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0,
                                                                  stop=[stop_text])).result().sequences[0]
    assert by_text.tokens == expected and by_text.stop_reason == "stop"

    unstopped = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0,
                                                                    stop=[])).result().sequences[0]
    assert unstopped.tokens == continuation[:5] and unstopped.stop_reason == "length"


def test_prompt_logprobs_equal_trainer_forward(service_client, memorized):
    client, _ = memorized
    datum = make_datum(PROMPT, TARGET)
    trainer = forward_logprobs(client, datum)
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + TARGET)).result()
    assert prompt_logprobs[0] is None
    np.testing.assert_allclose(prompt_logprobs[1:], trainer, atol=1e-4)


def test_topk_prompt_logprobs_and_last_n(base_sampler, base_reference):
    prompt = types.ModelInput.from_ints(PROMPT)
    result = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                                 topk_prompt_logprobs=5).result()
    reference = full_logprobs(base_reference, PROMPT)
    assert result.topk_prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        values, ids = torch.topk(reference[position - 1], 5)
        got = result.topk_prompt_logprobs[position]
        assert [t for t, _ in got] == ids.tolist()
        np.testing.assert_allclose([v for _, v in got], values.numpy(), atol=1e-4)
        assert result.prompt_logprobs[position] == pytest.approx(float(reference[position - 1, PROMPT[position]]),
                                                                 abs=1e-4)
    last = base_sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * (len(PROMPT) - 2)
    np.testing.assert_allclose(last[-2:], result.prompt_logprobs[-2:], atol=1e-5)


def test_save_weights_and_get_sampling_client_sees_latest_weights(server, service_client):
    """Snapshots and inflight weights, each sampled as the trainer computes them. Both samplers get them in memory:
    nothing is written under the data directory."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    datum = make_datum(PROMPT, TARGET)
    prompt = types.ModelInput.from_ints(PROMPT + TARGET)
    snapshot = client.save_weights_and_get_sampling_client().result()
    before = snapshot.compute_logprobs(prompt).result()
    train(client, datum, 3, types.AdamParams(learning_rate=1e-2))
    after_sampler = client.save_weights_and_get_sampling_client().result()
    after = after_sampler.compute_logprobs(prompt).result()
    np.testing.assert_allclose(after[1:], forward_logprobs(client, datum), atol=1e-4)
    assert sum(after[len(PROMPT):]) > sum(before[len(PROMPT):]) + 0.1  # training raised the target's likelihood
    assert snapshot.compute_logprobs(prompt).result() == before  # a snapshot keeps the weights it captured
    # Inflight clients share the model's latest inflight weights: an older one follows a newer save.
    inflight = client.save_weights_and_get_sampling_client(kind="inflight").result()
    train(client, datum, 1, types.AdamParams(learning_rate=1e-2))
    newer = client.save_weights_and_get_sampling_client(kind="inflight").result()
    shared = inflight.compute_logprobs(prompt).result()
    np.testing.assert_allclose(shared[1:], newer.compute_logprobs(prompt).result()[1:], atol=1e-6)
    np.testing.assert_allclose(shared[1:], forward_logprobs(client, datum), atol=1e-4)
    assert [p for p in (server.data_dir / "ephemeral").rglob("*") if p.is_file()] == []
    assert f"sampler weights saved (inflight, in memory): {client.model_id}" in server.log()


def test_concurrent_samples_from_threads_all_correct(service_client, base_sampler, memorized, base_reference):
    _, path = memorized
    tuned = service_client.create_sampling_client(model_path=path).result()
    prompts = [PROMPT[: 3 + i % 5] for i in range(24)]
    expected = {}
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            sampler = tuned if i % 2 else base_sampler
            params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
            results[i] = sampler.sample(types.ModelInput.from_ints(prompts[i]), 1, params).result().sequences[0].tokens
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert sorted(results) == list(range(len(prompts)))
    for i, tokens in results.items():
        if i % 2 == 0:
            key = tuple(prompts[i])
            expected.setdefault(key, greedy_reference(base_reference, prompts[i], 4))
            assert tokens == expected[key], i
    for i in range(1, len(prompts), 2):  # the adapter's answers agree with a sequential call
        again = tuned.sample(types.ModelInput.from_ints(prompts[i]), 1,
                             types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result()
        assert again.sequences[0].tokens == results[i]


def test_metrics_report_batching_and_logprob_drift(server, base_sampler):
    prompt = types.ModelInput.from_ints(PROMPT)
    futures = [base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, seed=i)) for i in range(4)]
    for future in futures:
        future.result()
    metrics = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
    sampling = metrics["sampling"][BASE_MODEL]
    assert sampling["backend"] in ("transformers", "vllm") and sampling["requests"] >= 4
    assert sampling["device"] == "cpu" and sampling["dtype"] == "float32"
    assert sampling["sampled_tokens"] > 0 and sampling["sampled_tokens_per_second"] > 0
    replica = sampling["replicas"][0]
    assert replica["decoded_tokens"] > 0
    if sampling["backend"] == "transformers":
        assert replica["batches"] < sampling["requests"]  # concurrent requests shared batches
    drift = sampling["logprob_drift"]
    print(f"logprob drift, {sampling['backend']} sampler vs trainer (CPU, float32): max {drift['max_abs']:.2e} over "
          f"{drift['probes']} probes")
    assert drift["probes"] >= 1 and drift["max_abs"] < 1e-4


@pytest.mark.parametrize(("params", "prompt", "message"), [
    (types.SamplingParams(max_tokens=0), PROMPT, "max_tokens must be at least 1"),
    (types.SamplingParams(max_tokens=5000), PROMPT, "exceeds the model's context"),
    (types.SamplingParams(max_tokens=4), [], "prompt is empty"),
    (types.SamplingParams(max_tokens=4), [1, 2, 512], "outside the vocabulary"),
    (types.SamplingParams(max_tokens=4, top_p=0.0), PROMPT, "top_p"),
    (types.SamplingParams(max_tokens=4, temperature=-1), PROMPT, "temperature"),
])
def test_bad_sample_requests_are_user_errors(base_sampler, params, prompt, message):
    with pytest.raises(tinker.RequestFailedError) as failure:
        base_sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    assert failure.value.category == types.RequestErrorCategory.User
    assert message in str(failure.value)
    ok = base_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    assert len(ok.sequences[0].tokens) == len(TARGET)


def test_bad_sampling_sessions_are_refused(service_client, memorized):
    client, sampler_path = memorized
    state_path = client.save_state("not-for-sampling").result().path
    cases = [
        ("tinker://no-such-run:train:0/sampler_weights/x", "not found", tinker.NotFoundError),
        (state_path, "sampler_weights", tinker.BadRequestError),
        ("tinker://../sampler_weights/x", "unsupported tinker path", tinker.BadRequestError),
    ]
    for path, message, error in cases:
        with pytest.raises(error) as failure:
            service_client.create_sampling_client(model_path=path).result()
        assert message in str(failure.value), (path, str(failure.value))
    ok = service_client.create_sampling_client(model_path=sampler_path).result()
    assert ok.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0].tokens == TARGET


def test_another_tenant_cannot_sample_private_weights(server, memorized):
    _, path = memorized
    stranger = tinker.ServiceClient(base_url=server.base_url, api_key="tml-someone-else")
    try:
        with pytest.raises(tinker.NotFoundError) as failure:  # 404, exactly as for weights that do not exist
            stranger.create_sampling_client(model_path=path).result()
        assert "not found" in str(failure.value)
    finally:
        stranger.close("success")


def sampling_metrics(server) -> dict:
    return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()["sampling"][
        BASE_MODEL]


def test_topk_sample_logprobs_are_the_models_best(base_sampler, base_reference):
    result = base_sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                                 types.SamplingParams(max_tokens=5, temperature=1.0, seed=5),
                                 topk_sample_logprobs=4).result()
    for seq in result.sequences:
        reference = full_logprobs(base_reference, PROMPT + seq.tokens)
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for position, top in enumerate(seq.topk_logprobs):
            values, ids = torch.topk(reference[len(PROMPT) - 1 + position], 4)
            assert [t for t, _ in top] == ids.tolist()
            np.testing.assert_allclose([v for _, v in top], values.numpy(), atol=1e-4)


def test_many_concurrent_prompt_logprob_requests_on_mixed_adapters(service_client, server, base_sampler, memorized):
    """Prompt logprobs of several requests in one engine step crashed vLLM's engine (and, on a GPU, dropped an
    adapter's lm_head LoRA from them): each must equal the same request made alone, and the replica must live on."""
    _, path = memorized
    tuned = service_client.create_sampling_client(model_path=path).result()
    other_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
    train(other_client, make_datum(PROMPT[:4], TARGET[::-1]), 2, types.AdamParams(learning_rate=2e-2))
    other = other_client.save_weights_and_get_sampling_client().result()
    samplers = [base_sampler, tuned, other]
    sequence = PROMPT + TARGET + PROMPT
    prompts = [types.ModelInput.from_ints(sequence[: 3 + i // 3 % 11]) for i in range(18)]
    pid = sampling_metrics(server)["replicas"][0]["pid"]
    alone = [samplers[i % 3].compute_logprobs(prompt).result() for i, prompt in enumerate(prompts)]
    futures = [samplers[i % 3].compute_logprobs(prompt) for i, prompt in enumerate(prompts)]  # all in flight at once
    for i, (expected, future) in enumerate(zip(alone, futures)):
        got = future.result()
        assert got[0] is None and len(got) == len(expected), i
        np.testing.assert_allclose(got[1:], expected[1:], atol=1e-4, err_msg=f"request {i}")
    assert not np.allclose(alone[1][1:], alone[0][1:], atol=1e-3)  # the same prompt: the adapter's numbers differ
    assert sampling_metrics(server)["replicas"][0]["pid"] == pid  # the replica never died


def test_adapters_beyond_the_resident_limit_are_evicted_and_reloaded(service_client, server):
    limit = sampling_metrics(server)["replicas"][0]["resident_limit"]
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    paths = []
    for i in range(limit + 2):  # each save holds other weights
        train(client, make_datum(PROMPT, [TARGET[i % len(TARGET)]] * 3), 1, types.AdamParams(learning_rate=2e-2))
        paths.append(client.save_weights_for_sampler(f"evict-{i}").result().path)
    samplers = [service_client.create_sampling_client(model_path=path).result() for path in paths]
    prompt = types.ModelInput.from_ints(PROMPT + TARGET)
    first = [sampler.compute_logprobs(prompt).result() for sampler in samplers]
    assert len({tuple(np.round(lps[1:], 4)) for lps in first}) == len(first)  # every save differs
    assert sampling_metrics(server)["replicas"][0]["resident_adapters"] <= limit
    again = samplers[0].compute_logprobs(prompt).result()  # evicted by now: loaded again, transparently
    np.testing.assert_allclose(again[1:], first[0][1:], atol=1e-5)


def test_unreadable_or_missing_sampler_weights_are_a_user_error(service_client, server, memorized, base_sampler):
    import shutil

    client, _ = memorized
    prompt = types.ModelInput.from_ints(PROMPT)
    corrupt = client.save_weights_for_sampler("to-be-corrupted").result().path
    missing = client.save_weights_for_sampler("to-be-deleted").result().path
    corrupt_sampler = service_client.create_sampling_client(model_path=corrupt).result()
    missing_sampler = service_client.create_sampling_client(model_path=missing).result()
    (checkpoint_dir(server.data_dir, corrupt) / "adapter_model.safetensors").write_bytes(b"not safetensors" * 4)
    shutil.rmtree(checkpoint_dir(server.data_dir, missing))
    for sampler in (corrupt_sampler, missing_sampler):
        with pytest.raises(tinker.RequestFailedError) as failure:
            sampler.sample(prompt, 1, GREEDY).result()
        assert failure.value.category == types.RequestErrorCategory.User, str(failure.value)
    assert base_sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens  # the replica still serves


def test_fields_the_backend_cannot_serve_are_user_errors(server, base_sampler, base_reference):
    """vLLM scores given prompt tokens only in its V2 model runner, which vLLM's CPU build lacks and whose prompt
    LoRA mapping is wrong in 0.32: the vLLM backend refuses ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``
    with a clear user error (the manual's table of sampler backends says so); the transformers backend serves them."""
    prompt = types.ModelInput.from_ints(PROMPT)
    ids = np.tile(np.array([[5, 9]], dtype=np.int64), (len(PROMPT) - 1, 1))
    target = types.TensorData(data=ids.flatten().tolist(), dtype="int64", shape=list(ids.shape))
    asks = {"target_prompt_logprobs": target, "prompt_alt_tokens_k": 2}
    for field, value in asks.items():
        future = base_sampler.sample(prompt, 1, GREEDY, **{field: value})
        if sampling_metrics(server)["backend"] == "vllm":
            with pytest.raises(tinker.RequestFailedError) as failure:
                future.result()
            assert failure.value.category == types.RequestErrorCategory.User
            assert "not supported by the vLLM sampler" in str(failure.value)
        elif field == "target_prompt_logprobs":
            got = future.result().target_prompt_logprobs.to_numpy()
            expected = np.take_along_axis(full_logprobs(base_reference, PROMPT)[:-1].numpy(), ids, axis=1)
            np.testing.assert_allclose(got, expected, atol=1e-4)
        else:
            assert future.result().prompt_alt_tokens is not None


def engine_processes(replica_pid: int, deadline: float) -> list:
    """The vLLM engine processes under a replica. vLLM titles its engine VLLM::EngineCore (the kernel's name keeps 15
    characters; the command line has it whole); a process just spawned may not be titled yet, so look again until
    ``deadline``, then take the child that started the workers, and say what was seen if none ever is."""
    import time

    import psutil

    def title(process: psutil.Process) -> str:
        try:
            return " ".join([process.name(), *process.cmdline()[:2]])
        except psutil.Error:
            return ""

    while True:
        children = psutil.Process(replica_pid).children(recursive=True)
        engines = [p for p in children if "EngineCor" in title(p)]
        if not engines and time.monotonic() > deadline:  # its title not seen (once, in a full run): the replica's
            # child that started the workers (vLLM's engine core spawns them; the resource tracker spawns none)
            engines = [p for p in psutil.Process(replica_pid).children() if p.children()]
        if engines or time.monotonic() > deadline:
            assert engines, [(p.pid, title(p)) for p in children]
            return engines
        time.sleep(0.2)


def test_a_dead_vllm_engine_fails_its_request_as_a_server_error_and_the_replica_restarts(server, base_sampler):
    """Runs last in this module: it kills the vLLM engine process under a running request."""
    import time

    before = sampling_metrics(server)
    if before["backend"] != "vllm":
        pytest.skip("the transformers sampler has no engine process of its own; a killed sampler actor is tested in "
                    "test_reliability.py")
    replica = before["replicas"][0]
    prompt = types.ModelInput.from_ints(PROMPT)
    running = base_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1900, temperature=1.0, stop=[]))
    deadline = time.monotonic() + 60
    while sampling_metrics(server)["replicas"][0]["decoded_tokens"] == replica["decoded_tokens"]:
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.05)
    engines = engine_processes(replica["pid"], time.monotonic() + 30)
    assert len(engines) == 1, engines
    engines[0].kill()
    with pytest.raises(tinker.RequestFailedError) as failure:
        running.result()
    assert failure.value.category == types.RequestErrorCategory.Server
    assert "vLLM engine of this sampler died" in str(failure.value)
    # A request made now waits for the restarted replica instead of failing.
    again = base_sampler.sample(prompt, 1, GREEDY).result()
    assert len(again.sequences[0].tokens) == len(TARGET)
    after = sampling_metrics(server)["replicas"][0]
    assert after["pid"] != replica["pid"] and after["engine_dead"] is None
    assert "the vLLM engine died" in server.log()
