"""Tinker ``SampleRequest`` (JSON) → a checked :class:`SampleJob`, and sampler results → protobuf ``SampleResponse``.

Every check that needs only the request and the base model's vocabulary and context size happens here, so a bad
request fails before it reaches a sampler, with a message naming the field.
"""

from __future__ import annotations

import math

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from shims.errors import UserError
from shims.sampling.job import SampleJob, SampleResult, SamplingLimits, TargetIds

STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# ---- request → job ------------------------------------------------------------------------------------------------
def prompt_tokens(model_input: types.ModelInput) -> list[int]:
    """The prompt's token ids. Only text chunks: the served models are text-only, so other chunks are refused."""
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if chunk.type != "encoded_text":
            raise UserError(f"prompt chunk of type {chunk.type!r} is not supported: the served models are text-only")
        tokens.extend(chunk.tokens)
    return tokens


def _check_k(name: str, value: int, limits: SamplingLimits) -> int:
    if not 0 <= value <= min(limits.max_logprobs_k, limits.vocab_size):
        raise UserError(f"{name} must be between 0 and {min(limits.max_logprobs_k, limits.vocab_size)}, got {value}")
    return value


def _check_token_ids(what: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")


def _stop(params: types.SamplingParams, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = params.stop
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = [stop]
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise UserError("sampling_params.stop contains an empty string")
        return tuple(stop), ()
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        _check_token_ids("sampling_params.stop", stop, vocab_size)
        return (), tuple(stop)
    raise UserError("sampling_params.stop must be a string, a list of strings, or a list of token ids")


def _disables_all_stops(stop) -> bool:
    return stop is not None and not isinstance(stop, str) and len(stop) == 0


def _target_ids(td, prompt_len: int, limits: SamplingLimits) -> TargetIds:
    if td.dtype != "int64":
        raise UserError(f"target_prompt_logprobs must be an int64 tensor of token ids, got {td.dtype}")
    shape = list(td.shape or [])
    if len(shape) != 2 or shape[0] != prompt_len - 1 or shape[1] < 1:
        raise UserError(f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{prompt_len - 1}, K], "
                        f"got {shape}")
    rows, cols = shape
    cells = limits.max_context * limits.max_logprobs_k
    if cols > limits.vocab_size or rows * cols > cells:  # before a sparse tensor's stated shape is allocated
        raise UserError(f"target_prompt_logprobs has shape {shape}: K may be at most the vocabulary size "
                        f"({limits.vocab_size}) and (len(prompt) - 1) × K at most {cells} (the model's context × "
                        "--max-logprobs-k)")
    values = np.asarray(td.data, dtype=np.int64)
    crow = col = None
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        crow = np.asarray(td.sparse_crow_indices or [], dtype=np.int64)
        col = np.asarray(td.sparse_col_indices or [], dtype=np.int64)
        if (len(crow) != rows + 1 or len(col) != len(values) or crow[0] != 0 or crow[-1] != len(values)
                or np.any(np.diff(crow) < 0) or np.any(col < 0) or np.any(col >= cols)):
            raise UserError(f"target_prompt_logprobs: inconsistent sparse CSR indices for shape {shape}")
        ids = np.full((rows, cols), -1, dtype=np.int64)
        ids[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    else:
        if values.size != rows * cols:
            raise UserError(f"target_prompt_logprobs: shape {shape} does not match its {values.size} values")
        ids = values.reshape(rows, cols)
    asked = ids[ids != -1]
    if asked.size == 0:
        raise UserError("target_prompt_logprobs names no token id (every cell is -1)")
    _check_token_ids("target_prompt_logprobs", asked.tolist(), limits.vocab_size)
    distinct = int(np.unique(asked).size)
    if prompt_len * distinct > limits.max_context * limits.max_logprobs_k:
        raise UserError(f"target_prompt_logprobs asks for {distinct} distinct ids over {prompt_len} positions; "
                        f"len(prompt) × distinct ids may be at most {limits.max_context * limits.max_logprobs_k}")
    return TargetIds(ids=ids, crow=crow, col=col)


def decode_sample_request(req: types.SampleRequest, limits: SamplingLimits) -> SampleJob:
    """Check a ``SampleRequest`` against the base model and the server's limits; returns the job to run."""
    prompt = prompt_tokens(req.prompt)
    if not prompt:
        raise UserError("the prompt is empty; give at least one token")
    _check_token_ids("the prompt", prompt, limits.vocab_size)
    room = limits.max_context - len(prompt)
    if room < 1:
        raise UserError(f"the prompt has {len(prompt)} tokens; the model's context is {limits.max_context}, "
                        "which leaves no room to sample")
    if not 1 <= req.num_samples <= limits.max_num_samples:
        raise UserError(f"num_samples must be between 1 and {limits.max_num_samples}, got {req.num_samples}")
    params = req.sampling_params
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens must be at least 1, got {max_tokens}")
    if max_tokens > room:
        raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
                        f"{limits.max_context} tokens")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise UserError(f"sampling_params.temperature must be ≥ 0, got {params.temperature}")
    if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise UserError(f"sampling_params.top_k must be -1 (no limit) or ≥ 1, got {params.top_k}")
    stop_strings, stop_tokens = _stop(params, limits.vocab_size)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise UserError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if not 1 <= last_n <= len(prompt) - 1:
            raise UserError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}, "
                            f"got {last_n}")
    target = None
    if req.target_prompt_logprobs is not None:
        target = _target_ids(req.target_prompt_logprobs, len(prompt), limits)
    return SampleJob(
        prompt=tuple(prompt), num_samples=req.num_samples, max_tokens=max_tokens, temperature=params.temperature,
        top_k=max(params.top_k, 0), top_p=params.top_p,
        seed=None if params.seed is None else params.seed % 2**63,
        stop_strings=stop_strings, stop_token_ids=stop_tokens, stop_at_eos=not _disables_all_stops(params.stop),
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=_check_k("topk_prompt_logprobs", req.topk_prompt_logprobs, limits),
        topk_sample_logprobs=_check_k("topk_sample_logprobs", req.topk_sample_logprobs, limits),
        prompt_logprobs_last_n=last_n, target=target,
        prompt_alt_tokens_k=_check_k("prompt_alt_tokens_k", req.prompt_alt_tokens_k, limits),
        record_stability_info=bool(req.record_stability_info),
    )


# ---- result → protobuf --------------------------------------------------------------------------------------------
def _topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    n, k = ids.shape
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                           logprobs=np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(), k=k, length=n)


def _dense(array: np.ndarray, dtype: int) -> pb.Tensor:
    np_dtype = np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64
    return pb.Tensor(dense=np.ascontiguousarray(array, dtype=np_dtype).tobytes(), dtype=dtype,
                     shape=list(array.shape))


def _target_tensor(logprobs: np.ndarray, target: TargetIds) -> pb.Tensor:
    if target.crow is None:
        return _dense(logprobs, pb.DTYPE_FLOAT32)
    rows = np.repeat(np.arange(target.ids.shape[0]), np.diff(target.crow))
    values = logprobs[rows, target.col].astype(np.float32)
    return pb.Tensor(sparse_csr=pb.SparseCsr(values=values.tobytes(), crow_indices=target.crow.tobytes(),
                                             col_indices=target.col.tobytes()),
                     dtype=pb.DTYPE_FLOAT32, shape=list(target.ids.shape))


def encode_sample_response(result: SampleResult, job: SampleJob) -> bytes:
    """Serialize to ``tinker_public.SampleResponse``, the form the SDK requires for sampling results."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        out = msg.sequences.add(stop_reason=STOP_REASONS[seq.stop_reason],
                                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                                logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
        if job.topk_sample_logprobs and seq.topk_ids is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_ids, seq.topk_logprobs))
    scores = result.prompt
    if job.prompt_logprobs and scores.logprobs is not None:
        msg.prompt_logprobs = np.asarray(scores.logprobs, dtype=np.float32).tobytes()
    if job.topk_prompt_logprobs and scores.topk_ids is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(scores.topk_ids, scores.topk_logprobs))
    if job.target is not None and scores.target_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_tensor(scores.target_logprobs, job.target))
    if job.prompt_alt_tokens_k and scores.alt_tokens is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(_dense(scores.alt_tokens, pb.DTYPE_INT64))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_dense(scores.alt_logprobs, pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


def masked_topk(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k matrices with every row masked (the SDK reads a row of id 0 / logprob -99999 as "not computed")."""
    return np.zeros((n, k), dtype=np.int32), np.full((n, k), MASK_LOGPROB, dtype=np.float32)
