"""Training routes: create, inspect, train, save, load and unload LoRA models. Each answers a future at once."""

from __future__ import annotations

import asyncio
import io
from typing import Annotated

import zstandard
from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import Body
from pydantic import ValidationError
from tinker import types

from compat_server.services import Services
from shims.custom_loss.graph import compile_custom_loss
from shims.errors import UserError
from shims.tinker.training_wire import DatumLimits, ForwardBackwardBatch, RejectedRequest, decode_forward_backward

API = "/api/v1"


def idempotency_key(request: Request) -> str | None:
    """The SDK reuses one ``X-Idempotency-Key`` across retries of a submit; a retry must not run twice."""
    return request.headers.get("x-idempotency-key")


@post(f"{API}/create_model", status_code=200)
async def create_model(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[types.CreateModelRequest, Body()]) -> dict:
    return services.training.create_model(owner, data, idempotency_key(request))


@post(f"{API}/get_info", status_code=200)
async def get_info(owner: NamedDependency[str], services: NamedDependency[Services],
                   data: Annotated[types.GetInfoRequest, Body()]) -> dict:
    return services.training.get_info(owner, data.model_id)


def unzstd(body: bytes, max_mb: int) -> bytes:
    """Decompress a zstd body, refusing one that inflates past ``--max-body-mb``. Read in bounded steps: a frame's
    declared content size cannot be trusted (a tiny body may claim, or really hold, gigabytes)."""
    limit = max_mb * 1024 * 1024
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                out += chunk
                if len(out) > limit:
                    raise UserError(f"the zstd body inflates past the request size limit (--max-body-mb {max_mb})")
    except zstandard.ZstdError as exc:
        raise UserError(f"invalid zstd body: {exc}") from None
    return bytes(out)


def _decode(body: bytes, compressed: bool, services: Services) -> ForwardBackwardBatch:
    max_mb = services.config.max_body_mb
    limits = DatumLimits(max_context=max(facts.max_context for facts in services.trainers.facts.values()),
                         max_columns=services.config.sampling.max_logprobs_k,
                         max_datums=services.config.trainer.max_batch_datums)
    return decode_forward_backward(unzstd(body, max_mb) if compressed else body, limits)


@post(f"{API}/forward_backward", status_code=200)
async def forward_backward(request: Request, owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """The body is a protobuf ``ForwardBackwardRequest`` (zstd-compressed if the client says so). Decompressing and
    decoding up to ``--max-body-mb`` takes a while: it runs in a worker thread, so other requests are not held up."""
    body = await request.body()
    compressed = request.headers.get("content-encoding", "").lower() == "zstd"
    try:
        batch = await asyncio.to_thread(_decode, body, compressed, services)
    except RejectedRequest as exc:
        kind = "forward" if exc.forward_only else "forward_backward"
        return services.training.reject(owner, kind, exc.model_id, exc.seq_id, str(exc), idempotency_key(request))
    return services.training.forward_backward(owner, batch, idempotency_key(request))


def _read_custom_loss(body: bytes) -> types.CreateCustomLossRequest:
    """Parse an uploaded loss (in a worker thread, as its checking: a graph at the limits takes a while to read)."""
    try:
        data = types.CreateCustomLossRequest.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_input=False)[0]
        if error["type"] == "json_invalid" and "recursion" in error["msg"]:
            raise UserError("the request body is nested too deeply to decode; a custom loss graph's arguments nest "
                            "a few levels deep (--custom-loss-max-nesting)") from None
        where = ".".join(str(part) for part in error["loc"])
        raise UserError(f"invalid create_custom_loss request: {where}: {error['msg']}") from None
    return data


@post(f"{API}/create_custom_loss", status_code=200)
async def create_custom_loss(request: Request, owner: NamedDependency[str], services: NamedDependency[Services]) -> dict:
    """A traced loss (``ServiceClient.create_custom_loss``), checked and stored here: a graph this server will not
    run is a 400 saying why. Refused as a whole when custom losses run client-side (the SDK then never sends one).
    A body larger than any graph within the ``--custom-loss-max-*`` limits is refused before it is read."""
    config = services.config
    if not config.custom_loss_server_side:
        raise UserError("this server runs custom losses client-side (--client-side-custom-losses): its client "
                        "config says custom_loss_server_side=false, so the SDK does not upload them")
    limits = config.custom_loss
    body = await request.body()
    if len(body) > limits.encoded_bytes():
        raise UserError(f"this custom loss request is {len(body)} bytes; a graph within this server's limits "
                        f"(--custom-loss-max-nodes {limits.max_nodes}, --custom-loss-max-constants "
                        f"{limits.max_constants}) takes at most {limits.encoded_bytes()}")
    data = await asyncio.to_thread(_read_custom_loss, body)
    services.training.check_loss_session(owner, data.session_id)
    loss = await asyncio.to_thread(compile_custom_loss, data.name, data.inputs, data.graph.nodes, limits)
    return services.training.create_custom_loss(owner, data, loss, config.max_custom_losses_per_key,
                                                idempotency_key(request))


@post(f"{API}/optim_step", status_code=200)
async def optim_step(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                     data: Annotated[types.OptimStepRequest, Body()]) -> dict:
    return services.training.optim_step(owner, data, idempotency_key(request))


@post(f"{API}/save_weights", status_code=200)
async def save_weights(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[types.SaveWeightsRequest, Body()]) -> dict:
    return services.training.save_weights(owner, data, idempotency_key(request))


@post(f"{API}/save_weights_for_sampler", status_code=200)
async def save_weights_for_sampler(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                                   data: Annotated[types.SaveWeightsForSamplerRequest, Body()]) -> dict:
    return services.training.save_weights_for_sampler(owner, data, idempotency_key(request))


@post(f"{API}/load_weights", status_code=200)
async def load_weights(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[types.LoadWeightsRequest, Body()]) -> dict:
    return services.training.load_weights(owner, data, idempotency_key(request))


@post(f"{API}/unload_model", status_code=200)
async def unload_model(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                       data: Annotated[types.UnloadModelRequest, Body()]) -> dict:
    return services.training.unload_model(owner, data.model_id, idempotency_key(request))


@post(f"{API}/save_weights_external", status_code=200)
async def save_weights_external(request: Request, owner: NamedDependency[str], services: NamedDependency[Services],
                                data: Annotated[types.SaveWeightsExternalRequest, Body()]) -> dict:
    return services.training.save_weights_external(owner, data, idempotency_key(request))


TRAINING_ROUTES = [create_model, get_info, forward_backward, create_custom_loss, optim_step, save_weights,
                   save_weights_for_sampler, save_weights_external, load_weights, unload_model]
