"""Adapter upload (SDK 0.39's ``external_weights_upload_start`` → PUT → ``…_finish``) and checkpoint search, through
the real servers: an adapter trained and exported by the tinker SDK on one server is uploaded to another, where a
training client loads it with the original's logprobs and the OpenAI routes sample it; an adapter saved by the
``peft`` library itself uploads, matches peft's own forward and trains on; bad uploads get clear 4xx and leave
nothing behind. The installed SDK (0.38) has no methods for these routes, so they are called as 0.39/0.40 call
them, over HTTP, and answers are read with the documented types (``contract.documented``)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest
import tinker
import torch
from safetensors.torch import load, save
from tinker import types
from transformers import AutoTokenizer

from contract import documented
from tests.helpers import (
    BASE_MODEL,
    MAIN_KEY,
    finish,
    forward_logprobs,
    make_datum,
    put_urls,
    reference_logprobs,
    start,
    train,
    upload,
)

MESSAGES = [{"role": "user", "content": "Name a fruit."}]
TARGET = "Plum, ripe and dark."
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
UPLOAD_TTL = 30
"""``--upload-ttl`` of the keyed server (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tenants(keyed_server):
    server, issued = keyed_server
    return server, issued


@pytest.fixture(scope="module")
def exported(server, tiny_model_dir) -> dict:
    """On the shared server (another server than the keyed one): an adapter trained with the tinker SDK to answer
    MESSAGES with TARGET, exported with save_weights_external and downloaded through its signed URLs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    datum = make_datum(list(prompt), completion)
    service = tinker.ServiceClient(base_url=server.base_url, api_key=MAIN_KEY)
    rest = tinker.RestClient(base_url=server.base_url, api_key=MAIN_KEY)
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
    train(client, datum, 25, types.AdamParams(learning_rate=3e-3))
    path = client.save_weights_external("for-upload").result().path
    urls = rest.get_external_weights_urls(path).result().urls
    files = {name: httpx.get(url).raise_for_status().content for name, url in urls.items()}
    assert sorted(files) == [CONFIG, WEIGHTS], "a download lists the checkpoint's own files only"
    yield {"files": files, "datum": datum, "logprobs": forward_logprobs(client, datum)}
    service.close("success")


def search(server, key: str, **fields) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/checkpoints/search", headers={"X-API-Key": key},
                      json=documented.CheckpointSearchRequest(**fields).model_dump(mode="json", exclude_none=True))


def stored(server) -> set[str]:
    """Every file under the keyed server's checkpoint directory (what an upload must not add to when refused)."""
    return {str(p) for p in (server.data_dir / "checkpoints").rglob("*") if p.is_file()}


def test_an_exported_adapter_uploads_to_another_server_trains_on_and_samples_through_the_hosted_openai_path(
        tenants, exported):
    server, issued = tenants
    alice = issued["alice"]
    lora = {"rank": 8}
    finished = upload(server, alice, exported["files"], lora, sdk="0.39.0")  # 0.39: each URL a string
    assert finished.status_code == 200, finished.text
    path = documented.ExternalWeightsUploadFinishResponse.model_validate(finished.json()).tinker_path
    assert path.startswith("tinker://") and "/external_weights/" in path

    service = tinker.ServiceClient(base_url=server.base_url, api_key=alice)
    try:
        client = service.create_training_client_from_state(path).result()
        np.testing.assert_allclose(forward_logprobs(client, exported["datum"]), exported["logprobs"], atol=1e-6)
        sampler = service.create_sampling_client(model_path=path)  # the Tinker SDK's sampling path takes it too
        tokens = exported["datum"].model_input.to_ints() + [int(exported["datum"].loss_fn_inputs["target_tokens"].data[-1])]
        sampled = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        np.testing.assert_allclose(sampled, exported["logprobs"], atol=1e-4)
        chat = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=alice, max_retries=0)
        for model in (path, f"{BASE_MODEL};{path}"):
            reply = chat.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24)
            assert reply.choices[0].message.content == TARGET, model
        assert path in [model.id for model in chat.models.list().data]
        assert chat.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, temperature=0,
                                            max_tokens=24).choices[0].message.content != TARGET
        before = forward_logprobs(client, exported["datum"])
        losses = train(client, exported["datum"], 2, types.AdamParams(learning_rate=1e-2))
        assert all(np.isfinite(losses)) and not np.allclose(forward_logprobs(client, exported["datum"]), before)

        rest = tinker.RestClient(base_url=server.base_url, api_key=alice)
        listed = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
        assert listed[path].checkpoint_type == "external"
        info = rest.get_weights_info_by_tinker_path(path).result()
        assert (info.base_model, info.lora_rank) == (BASE_MODEL, 8)
    finally:
        service.close("success")
    again = finish(server, alice, finished.extensions["upload_id"])  # a retried finish answers the same path
    assert again.status_code == 200 and again.json()["tinker_path"] == path


def test_an_uploaded_adapter_samples_on_vllm(vllm_server, exported):
    """vLLM loads the samplers' copy of an uploaded adapter (PEFT's naming) as it loads sampler weights."""
    finished = upload(vllm_server, MAIN_KEY, exported["files"], {"rank": 8})
    assert finished.status_code == 200, finished.text
    chat = openai.OpenAI(base_url=f"{vllm_server.base_url}/oai/api/v1", api_key=MAIN_KEY, max_retries=0)
    reply = chat.chat.completions.create(model=finished.json()["tinker_path"], messages=MESSAGES, temperature=0,
                                         max_tokens=24)
    assert reply.choices[0].message.content == TARGET


def peft_adapter(base_dir: Path, out: Path, rank: int = 4) -> Path:
    """An adapter made and saved by the peft library itself: attention only, its B random (not PEFT's zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    model.save_pretrained(str(out))
    return out


def test_an_adapter_saved_by_peft_uploads_matches_peft_and_trains_on(tenants, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    server, issued = tenants
    alice = issued["alice"]
    adapter = peft_adapter(tiny_model_dir, tmp_path / "peft")
    files = {name: (adapter / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    finished = upload(server, alice, files, {"rank": 4, "train_mlp": False, "train_unembed": False},
                      project="peft-imports")
    assert finished.status_code == 200, finished.text
    path = finished.json()["tinker_path"]

    datum = make_datum([5, 17, 33, 2, 90, 14], [61, 7, 3])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir),
                                                                               dtype=torch.float32), str(adapter))
    with torch.no_grad():
        expected = reference_logprobs(reference, datum).numpy()
    service = tinker.ServiceClient(base_url=server.base_url, api_key=alice)
    try:
        client = service.create_training_client_from_state(path).result()
        got = forward_logprobs(client, datum)
        np.testing.assert_allclose(got, expected, atol=1e-4)
        train(client, datum, 3, types.AdamParams(learning_rate=1e-2))
        assert forward_logprobs(client, datum).mean() > got.mean()  # it learns from where peft's adapter left off
        info = tinker.RestClient(base_url=server.base_url, api_key=alice).get_weights_info_by_tinker_path(path).result()
        assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (4, True, False, False)
    finally:
        service.close("success")
    found = search(server, alice, project_ids=["peft-imports"])
    assert [c["tinker_path"] for c in found.json()["checkpoints"]] == [path]


def announce(url: str, length: int) -> http.client.HTTPResponse:
    """A PUT that announces ``length`` bytes and sends none: the answer comes from the headers alone."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.putrequest("PUT", f"{parts.path}?{parts.query}")
    connection.putheader("Content-Length", str(length))
    connection.endheaders()
    return connection.getresponse()


def corrupted(files: dict[str, bytes], change) -> dict[str, bytes]:
    tensors = load(files[WEIGHTS])
    change(tensors)
    return {**files, WEIGHTS: save(tensors)}


def test_bad_uploads_get_clear_4xx_and_nothing_is_stored(tenants, exported):
    server, issued = tenants
    alice, bob = issued["alice"], issued["bob"]
    before = stored(server)
    first = next(name for name in load(exported["files"][WEIGHTS]) if "lora_A" in name)

    def with_nan(tensors):
        tensors[first][0, 0] = float("nan")

    def wrong_shape(tensors):
        tensors[first] = torch.zeros(tensors[first].shape[0], tensors[first].shape[1] + 1)

    def wrong_dtype(tensors):
        tensors[first] = tensors[first].to(torch.int32)

    def one_dimensional(tensors):
        tensors[first] = tensors[first][0].contiguous()

    for change, says in ((with_nan, "NaN"), (wrong_shape, "shapes"), (wrong_dtype, "floating point"),
                         (one_dimensional, "dimensions")):
        refused = upload(server, alice, corrupted(exported["files"], change), {"rank": 8})
        assert refused.status_code == 400 and says in refused.json()["detail"], refused.text
        assert "Nothing was kept" in refused.json()["detail"]
    wrong_rank = upload(server, alice, exported["files"], {"rank": 4})
    assert wrong_rank.status_code == 400 and "rank" in wrong_rank.json()["detail"]
    no_mlp = upload(server, alice, exported["files"], {"rank": 8, "train_mlp": False})
    assert no_mlp.status_code == 400 and "mlp" in no_mlp.json()["detail"]
    bad_config = upload(server, alice, {**exported["files"], CONFIG: b"{not json"}, {"rank": 8})
    assert bad_config.status_code == 400
    config = json.loads(exported["files"][CONFIG])
    for alpha in (float("nan"), float("inf"), -1.0):
        scaled = upload(server, alice, {**exported["files"], CONFIG: json.dumps({**config, "lora_alpha": alpha})},
                        {"rank": 8})
        assert scaled.status_code == 400 and "scale" in scaled.json()["detail"], scaled.text

    answer = start(server, alice, {"rank": 1})
    urls, upload_id = put_urls(answer), answer.json()["upload_id"]
    announced = announce(urls[WEIGHTS], 10 << 30)
    assert announced.status == 413 and "at most" in json.loads(announced.read())["detail"]  # refused before the body
    streamed = httpx.put(urls[WEIGHTS], content=(b"\0" * (64 << 10) for _ in range(32)))  # chunked: counted as it comes
    assert streamed.status_code == 413
    missing = finish(server, alice, upload_id)
    assert missing.status_code == 400 and WEIGHTS in missing.json()["detail"]
    assert httpx.put(urls[CONFIG], content=exported["files"][CONFIG]).status_code == 200
    reused = httpx.put(urls[CONFIG], content=exported["files"][CONFIG])
    assert reused.status_code == 409 and "one PUT" in reused.json()["detail"]
    assert finish(server, bob, upload_id).status_code == 404  # another key's upload looks missing
    tampered = urls[WEIGHTS].replace("signature=", "signature=0")
    assert httpx.put(tampered, content=b"x").status_code == 403
    bad_start = start(server, alice, {"rank": 0})
    assert bad_start.status_code == 400
    assert start(server, alice, {"rank": 8} | {"unknown": 1}).status_code == 400

    assert [p for p in stored(server) - before if "/upload-" in p] == []  # no refused upload became a checkpoint
    assert sorted(p.name for p in (server.data_dir / "uploads").iterdir()) == [upload_id]  # refused ones deleted

    time.sleep(UPLOAD_TTL + 1)
    expired = httpx.put(urls[WEIGHTS], content=exported["files"][WEIGHTS])
    assert expired.status_code == 403 and "expired" in expired.json()["detail"]
    assert finish(server, alice, upload_id).status_code == 404


def test_checkpoint_search_filters_and_pages_newest_first(tenants, exported):
    server, issued = tenants
    alice, bob = issued["alice"], issued["bob"]
    paths = []
    for project in ("search-a", "search-a", "search-b"):
        finished = upload(server, alice, exported["files"], {"rank": 8}, project=project)
        assert finished.status_code == 200, finished.text
        paths.append(finished.json()["tinker_path"])

    def found(key: str = alice, **fields) -> list[str]:
        answer = search(server, key, **fields)
        assert answer.status_code == 200, answer.text
        return [c.tinker_path for c in documented.CheckpointSearchResponse.model_validate(answer.json()).checkpoints]

    assert found(project_ids=["search-a", "search-b"]) == paths[::-1]  # newest first
    assert found(project_ids=["search-a"]) == paths[1::-1]
    assert found(project_ids=["search-b"], checkpoint_type="external", base_models=[BASE_MODEL]) == [paths[2]]
    assert found(project_ids=["search-a"], base_models=[]) == []
    assert found(project_ids=["search-a"], checkpoint_type="sampler") == []
    assert found(project_ids=["search-a"], user_metadata={"missing": "x"}) == []
    assert not set(paths) & set(found(bob, owner=types.AccessibleSearchOwner()))  # none published yet
    walked, cursor = [], None
    while True:
        page = documented.CheckpointSearchResponse.model_validate(search(
            server, alice, project_ids=["search-a", "search-b"], limit=1,
            cursor=cursor and cursor.model_dump()).json())
        walked += [c.tinker_path for c in page.checkpoints]
        assert all(c.base_model == BASE_MODEL for c in page.checkpoints)
        if (cursor := page.next_cursor) is None:
            break
    assert walked == paths[::-1]
    unknown = search(server, alice, project_ids=["someone-elses"])
    assert unknown.status_code == 404
    too_many = httpx.post(f"{server.base_url}/api/v1/checkpoints/search", headers={"X-API-Key": alice},
                          json={"limit": 201})
    assert too_many.status_code == 400 and "limit" in too_many.text

    run, name = paths[2].removeprefix("tinker://").split("/", 1)
    assert httpx.post(f"{server.base_url}/api/v1/training_runs/{run}/checkpoints/{name}/publish",
                      headers={"X-API-Key": alice}).status_code == 200
    assert paths[2] in found(bob, owner=types.AccessibleSearchOwner())
    assert paths[2] not in found(bob)


def test_an_upload_answers_url_objects_to_sdk_040_and_to_clients_that_do_not_say(tenants):
    server, issued = tenants
    for sdk in ("0.40.0", None):
        answer = start(server, issued["bob"], {"rank": 2}, sdk=sdk)
        urls = documented.ExternalWeightsUploadStartResponse.model_validate(answer.json()).urls
        assert sorted(urls) == [CONFIG, WEIGHTS]
        assert json.loads(answer.text)["expires"]


def test_uploads_can_be_turned_off_and_the_url_form_follows_the_sdk_version(tmp_path):
    from litestar.exceptions import PermissionDeniedException

    from compat_server.records import Records
    from compat_server.runs.checkpoint_store import CheckpointStore
    from compat_server.runs.downloads import UrlSigner
    from compat_server.runs.options import UploadOptions
    from compat_server.runs.uploads import UploadService, _older_than

    service = UploadService(Records(tmp_path / "records.sqlite3"), CheckpointStore(tmp_path / "checkpoints", 1),
                            UrlSigner(tmp_path / "key", 60), None, {BASE_MODEL: None}, UploadOptions(enabled=False),
                            tmp_path / "uploads", 32, False)
    request = documented.ExternalWeightsUploadStartRequest(base_model=BASE_MODEL, lora_config=types.LoraConfig(rank=4))
    with pytest.raises(PermissionDeniedException, match="--no-external-uploads"):
        service.start("owner", request, "http://127.0.0.1", None)
    limited = UploadService(service.records, service.checkpoints, service.signer, None, {BASE_MODEL: None},
                            UploadOptions(max_open_per_key=1), tmp_path / "uploads", 32, False)
    answer = limited.start("owner", request, "http://127.0.0.1", "0.39.1")
    assert isinstance(answer, documented.ExternalWeightsUploadStartResponseV039)
    with pytest.raises(ValueError, match="--max-open-uploads-per-key"):
        limited.start("owner", request, "http://127.0.0.1", None)
    assert limited.start("another-owner", request, "http://127.0.0.1", None).urls  # per key
    with pytest.raises(ValueError, match="--max-lora-rank 32"):
        limited.start("third-owner", request.model_copy(update={"lora_config": types.LoraConfig(rank=64)}),
                      "http://127.0.0.1", None)
    assert [_older_than(v, (0, 40)) for v in ("0.39.0", "0.39.2rc1", "0.40.0", "1.0", None, "garbage")] == \
        [True, True, False, False, False, False]
