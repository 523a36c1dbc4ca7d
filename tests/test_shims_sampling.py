"""Sampling shims: request checks, the protobuf answer (read back with the SDK's own decoder), and the sampling
arithmetic, each against a reference written here in numpy."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from adapters.samplers.interface import (
    AdapterRef,
    AdapterTensors,
    AllAdaptersBusy,
    PeftTensors,
    ResidentAdapters,
    joined,
)
from shims.errors import UserError
from shims.sampling.arithmetic import (
    SeededStream,
    StopMatcher,
    choose_token,
    filtered_probs,
    penalized,
    score_prompt,
    sequence_streams,
)
from shims.sampling.job import PromptScores, SampleJob, SampleResult, SamplingLimits, SequenceResult
from shims.tinker.sampling_wire import decode_sample_request, encode_sample_response

LIMITS = SamplingLimits(vocab_size=50, max_context=64, max_num_samples=8, max_logprobs_k=5)


def wire(td: types.TensorData) -> dict:
    """The JSON form the SDK sends for a TensorData."""
    return {"data": td.data, "dtype": td.dtype, "shape": td.shape, "sparse_crow_indices": td.sparse_crow_indices,
            "sparse_col_indices": td.sparse_col_indices}


def request(prompt=(1, 2, 3, 4), **fields) -> types.SampleRequest:
    params = fields.pop("sampling_params", types.SamplingParams(max_tokens=4))
    return types.SampleRequest(prompt=types.ModelInput.from_ints(list(prompt)), sampling_params=params,
                               sampling_session_id="s", seq_id=0, **fields)


def test_decode_normalises_parameters():
    job = decode_sample_request(request(num_samples=3, sampling_params=types.SamplingParams(
        max_tokens=5, temperature=0.5, top_k=-1, top_p=0.9, seed=-7, stop="\n\n")), LIMITS)
    assert (job.prompt, job.num_samples, job.max_tokens, job.temperature) == ((1, 2, 3, 4), 3, 5, 0.5)
    assert job.top_k == 0 and job.top_p == 0.9 and job.seed == (-7) % 2**63
    assert job.stop_strings == ("\n\n",) and job.stop_token_ids == () and job.stop_at_eos
    assert decode_sample_request(request(sampling_params=types.SamplingParams(stop=[7, 9])), LIMITS).stop_token_ids \
        == (7, 9)
    default = decode_sample_request(request(sampling_params=types.SamplingParams()), LIMITS)
    assert default.stop_at_eos and default.max_tokens == LIMITS.max_context - 4  # None: up to the context's end
    assert not decode_sample_request(request(sampling_params=types.SamplingParams(stop=[])), LIMITS).stop_at_eos


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt": ()}, "prompt is empty"),
    ({"prompt": (1, 50)}, "token id 50 outside the vocabulary"),
    ({"prompt": tuple(range(1, 50)) + (1,) * 15}, "leaves no room"),
    ({"num_samples": 0}, "num_samples must be between 1 and 8"),
    ({"num_samples": 9}, "num_samples must be between 1 and 8"),
    ({"sampling_params": types.SamplingParams(max_tokens=0)}, "max_tokens must be at least 1"),
    ({"sampling_params": types.SamplingParams(max_tokens=61)}, "exceeds the model's context of 64"),
    ({"sampling_params": types.SamplingParams(temperature=float("nan"))}, "temperature"),
    ({"sampling_params": types.SamplingParams(top_p=1.5)}, "top_p"),
    ({"sampling_params": types.SamplingParams(top_k=-2)}, "top_k"),
    ({"sampling_params": types.SamplingParams(stop=[""])}, "empty string"),
    ({"sampling_params": types.SamplingParams(stop=[3, 99])}, "token id 99"),
    ({"topk_prompt_logprobs": 6}, "topk_prompt_logprobs must be between 0 and 5"),
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"prompt_logprobs_last_n": 2}, "set prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, "between 1 and len(prompt) - 1 = 3"),
    ({"target_prompt_logprobs": wire(types.TensorData(data=[1, 2], dtype="int64", shape=[2, 1]))}, "shape"),
    ({"target_prompt_logprobs": wire(types.TensorData(data=[-1, -1, -1], dtype="int64", shape=[3, 1]))}, "names no"),
    ({"target_prompt_logprobs": wire(types.TensorData(data=[1.0, 2.0, 3.0], dtype="float32", shape=[3, 1]))},
     "int64"),
])
def test_decode_rejects_bad_requests(fields, message):
    prompt = fields.pop("prompt", (1, 2, 3, 4))
    with pytest.raises(UserError) as failure:
        decode_sample_request(request(prompt, **fields), LIMITS)
    assert message in str(failure.value)


@pytest.mark.parametrize("columns", [51, 2**27, 2**40])
def test_a_sparse_target_shape_is_checked_before_it_is_allocated(columns):
    """A few bytes of sparse target_prompt_logprobs may state any shape; once, [1, 2**27] took 1.7 GiB and
    [1, 2**40] answered 500."""
    sparse = {"data": [1], "dtype": "int64", "shape": [1, columns], "sparse_crow_indices": [0, 1],
              "sparse_col_indices": [0]}
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"K may be at most the vocabulary size \(50\)"):
            decode_sample_request(request(prompt=(1, 2), target_prompt_logprobs=sparse), LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    too_many_cells = {**sparse, "shape": [62, 6], "sparse_crow_indices": [0, 1] + [1] * 61}
    with pytest.raises(UserError, match=r"at most 320 \(the model's context × --max-logprobs-k\)"):
        decode_sample_request(request(prompt=tuple(range(1, 49)) + (1,) * 15, sampling_params=types.SamplingParams(
            max_tokens=1), target_prompt_logprobs=too_many_cells), LIMITS)


def test_sparse_target_ids_keep_their_layout_in_the_answer():
    ids = torch.full((9, 4), -1, dtype=torch.int64)
    ids[0, 1], ids[2, 0] = 7, 9
    sparse = types.TensorData.from_torch_sparse(ids, pad_value=-1)  # sparse enough that the SDK keeps it CSR
    assert sparse.sparse_col_indices == [1, 0]
    job = decode_sample_request(request(prompt=tuple(range(1, 11)), target_prompt_logprobs=wire(sparse)), LIMITS)
    assert job.target.ids.tolist() == ids.tolist()
    logprobs = np.zeros((9, 4), dtype=np.float32)
    logprobs[0, 1], logprobs[2, 0] = -1.5, -2.5
    answer = deserialize_sample_response(encode_sample_response(
        SampleResult(sequences=[], prompt=PromptScores(target_logprobs=logprobs)), job))
    assert answer.target_prompt_logprobs.to_torch().to_dense().tolist() == logprobs.tolist()
    assert answer.target_prompt_logprobs.sparse_col_indices == [1, 0]


def test_encoded_response_reads_back_with_the_sdk():
    job = SampleJob(prompt=(1, 2, 3), num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2,
                    topk_sample_logprobs=1, prompt_alt_tokens_k=2)
    topk_ids = np.array([[0, 0], [4, 5], [6, 7]], dtype=np.int32)
    topk_lps = np.array([[-99999.0, -99999.0], [-0.1, -2.0], [-0.3, -1.0]], dtype=np.float32)
    result = SampleResult(
        sequences=[SequenceResult([5, 6], [-0.5, -0.25], "length", np.array([[5], [6]]), np.array([[-0.5], [-0.25]])),
                   SequenceResult([9], [-1.0], "stop", np.array([[9]]), np.array([[-1.0]]))],
        prompt=PromptScores(logprobs=np.array([np.nan, -1.0, -2.0], dtype=np.float32), topk_ids=topk_ids,
                            topk_logprobs=topk_lps, alt_tokens=np.array([[3, 4], [5, 5]]),
                            alt_logprobs=np.array([[-1.0, -2.0], [-0.5, -0.5]], dtype=np.float32)),
        prompt_cache_hit_tokens=2)
    answer = deserialize_sample_response(encode_sample_response(result, job))
    assert [s.tokens for s in answer.sequences] == [[5, 6], [9]]
    assert [s.stop_reason for s in answer.sequences] == ["length", "stop"]
    assert answer.sequences[0].logprobs == [-0.5, -0.25]
    assert answer.sequences[1].topk_logprobs == [[(9, -1.0)]]
    assert answer.prompt_logprobs == [None, -1.0, -2.0]
    assert answer.topk_prompt_logprobs[0] is None
    assert answer.topk_prompt_logprobs[1] == [(4, pytest.approx(-0.1)), (5, -2.0)]
    assert answer.prompt_alt_tokens.tokens.to_numpy().tolist() == [[3, 4], [5, 5]]
    assert answer.prompt_cache_hit_tokens == 2


def reference_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Independent formulation: sort once, keep the tokens of at least min_p × the top probability (at this
    temperature), then the top-k of those, then the shortest prefix with mass ≥ top_p."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    allowed = np.array([token for token in order if p[token] >= min_p * p.max()])
    allowed = allowed[:top_k] if top_k > 0 else allowed
    renorm = p[allowed] / p[allowed].sum()
    mass = 0.0
    for token, q in zip(allowed, renorm):
        keep[token] = True
        mass += q
        if mass >= top_p:
            break
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6),
                                                             (0.9, 8, 0.8), (2.0, 1, 1.0)])
def test_filtered_probs_match_reference(temperature, top_k, top_p):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(int(temperature * 10 + top_k)))
    got = filtered_probs(logits, temperature, top_k, top_p).numpy()
    np.testing.assert_allclose(got, reference_filter(logits.double().numpy(), temperature, top_k, top_p), atol=1e-6)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [(1.0, 0, 1.0, 0.1), (0.5, 0, 1.0, 0.1),
                                                                      (3.0, 0, 1.0, 0.1), (1.0, 6, 0.7, 0.05),
                                                                      (1.3, 20, 0.9, 0.3), (1.0, 0, 1.0, 1.0)])
def test_min_p_filters_after_temperature_and_before_top_k_and_top_p(temperature, top_k, top_p, min_p):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(int(temperature * 10 + top_k))) * 2
    got = filtered_probs(logits, temperature, top_k, top_p, min_p).numpy()
    expected = reference_filter(logits.double().numpy(), temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert 0 < np.count_nonzero(got) < logits.numel()  # the filter did something, and left something


def test_min_p_is_measured_at_the_sampling_temperature():
    """Relative to the top token, the others have e^(-2), e^(-4), e^(-7) of its probability at temperature 1, all
    below min_p 0.2; at temperature 3, e^(-2/3) ≈ 0.51 and e^(-4/3) ≈ 0.26 pass and e^(-7/3) ≈ 0.10 does not."""
    logits = torch.tensor([4.0, 2.0, 0.0, -3.0])
    cold, hot = filtered_probs(logits, 1.0, 0, 1.0, 0.2), filtered_probs(logits, 3.0, 0, 1.0, 0.2)
    assert cold.nonzero().flatten().tolist() == [0]
    assert hot.nonzero().flatten().tolist() == [0, 1, 2]


def reference_penalized(logits: np.ndarray, prompt, previous, bias, repetition: float, presence: float,
                        frequency: float) -> np.ndarray:
    """Written from vLLM's documentation: the logit bias first (a token named twice takes its last bias); then
    every token of the prompt or the output so far has a positive logit divided by the repetition penalty and a
    negative one multiplied by it; then the OpenAI penalties over the output's counts."""
    z = logits.astype(np.float64).copy()
    for token, value in dict(bias).items():
        z[token] += value
    for token in set(prompt) | set(previous):
        z[token] = z[token] / repetition if z[token] > 0 else z[token] * repetition
    for token in set(previous):
        z[token] -= frequency * previous.count(token) + presence
    return z


@pytest.mark.parametrize(("repetition", "bias", "presence", "frequency"), [
    (1.3, (), 0.0, 0.0), (0.6, (), 0.0, 0.0), (1.0, ((3, 2.5), (7, -1.0), (3, -4.0)), 0.0, 0.0),
    (2.0, ((0, 1.5), (12, -0.5)), 0.4, 0.3), (1.0, (), 0.5, 0.25),
])
def test_penalties_and_logit_bias_match_reference(repetition, bias, presence, frequency):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(9)) * 3
    prompt, previous = (1, 2, 3, 2, 15), [4, 3, 4, 9, 4]
    assert (logits[list(prompt + tuple(previous))] < 0).any() and (logits[list(prompt)] > 0).any()  # both signs
    job = SampleJob(prompt=prompt, repetition_penalty=repetition, logit_bias=bias, presence_penalty=presence,
                    frequency_penalty=frequency)
    before = logits.clone()
    expected = reference_penalized(logits.double().numpy(), prompt, previous, bias, repetition, presence, frequency)
    np.testing.assert_allclose(penalized(logits, job, previous).numpy(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(penalized(logits, job, previous, torch.tensor(prompt)).numpy(), expected, rtol=1e-6,
                               atol=1e-6)
    assert torch.equal(logits, before)  # the caller's logits are left as they were


def test_a_repetition_penalty_pushes_negative_logits_further_down():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    out = penalized(logits, SampleJob(prompt=(0, 1), repetition_penalty=2.0), [])
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]  # prompt tokens only: 2 / 2 and -2 × 2


def test_a_logit_bias_of_minus_100_excludes_a_token_and_plus_100_forces_one():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2)) * 3
    best, other = int(torch.argmax(logits)), int(torch.argmin(logits))
    for temperature in (0.0, 1.0, 2.0):
        banned = SampleJob(prompt=(1,), num_samples=4, seed=1, temperature=temperature, logit_bias=((best, -100.0),))
        forced = SampleJob(prompt=(1,), num_samples=4, seed=1, temperature=temperature, logit_bias=((other, 100.0),))
        assert all(choose_token(logits, banned, g) != best for g in sequence_streams(banned, 0) for _ in range(50))
        assert all(choose_token(logits, forced, g) == other for g in sequence_streams(forced, 0) for _ in range(50))


@pytest.mark.parametrize("repetition", [5e-324, 1e-45, 1e-40, 1e-30, 1e30, 1e300, 1.7e308])
def test_an_extreme_repetition_penalty_keeps_a_valid_distribution(repetition):
    """Found by the fuzz run: a repetition penalty of 1e-40 divided a positive logit past float32's range (+inf, then
    inf - inf = NaN), and one of 1e300 multiplied a logit of exactly 0 into NaN; the sampler raised (a 500). An
    extreme penalty is as strong as float32 can hold: a vanishing one makes the positive prompt tokens the likeliest,
    a huge one pushes the negative ones to the bottom."""
    logits = torch.tensor([3.0, 0.0, -2.0, 1.0, 5.0, -1.0])
    job = SampleJob(prompt=(0, 1, 2, 3), num_samples=4, seed=2, temperature=1.0, repetition_penalty=repetition)
    out = penalized(logits, job, [])
    assert not torch.isnan(out).any() and not torch.isposinf(out).any()
    probs = filtered_probs(out, job.temperature, 0, 1.0)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    chosen = {choose_token(logits, job, g) for g in sequence_streams(job, 0)}
    if repetition < 1:
        assert chosen <= {0, 3}  # the prompt's positive logits, grown past every other
    else:
        assert 2 not in chosen and float(out[2]) < -1e29  # the prompt's negative logit, pushed down


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 1e-6, 9.9e-6])
def test_a_vanishing_temperature_samples_greedily_instead_of_dividing_into_nan(temperature):
    """Found by the fuzz run: temperature 1e-300 made the probabilities NaN and the sampler raised (a 500)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 10
    job = SampleJob(prompt=(1,), num_samples=2, temperature=temperature, prompt_alt_tokens_k=3)
    best = int(np.argmax(logits.numpy()))
    assert {choose_token(logits, job, g) for g in sequence_streams(job, 0)} == {best}
    scores = score_prompt(torch.log_softmax(logits, dim=-1).unsqueeze(0), job, SeededStream(0))
    assert (scores.alt_tokens == best).all()


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-5, 1.0), (1e-4, 0.5), (2.0, 1e-300), (1.0, 1e-9)])
def test_extreme_temperature_and_top_p_keep_a_valid_distribution(temperature, top_p):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4)) * 30
    probs = filtered_probs(logits, temperature, 0, top_p)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert int(torch.argmax(probs)) == int(np.argmax(logits.numpy()))
    if top_p < 1e-6:  # a nucleus smaller than any token's mass is the most likely token alone
        assert float(probs.max()) == 1.0


def test_choose_token_is_greedy_at_zero_and_reproducible_with_a_seed():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    greedy = SampleJob(prompt=(1,), temperature=0.0)
    assert choose_token(logits, greedy, SeededStream(0)) == int(np.argmax(logits.numpy()))
    job = SampleJob(prompt=(1,), num_samples=3, seed=42, top_k=3)
    draws = [[choose_token(logits, job, g) for _ in range(20)] for g in sequence_streams(job, 0)]
    again = [[choose_token(logits, job, g) for _ in range(20)] for g in sequence_streams(job, 1)]
    assert draws == again  # the seed, not the fallback, decides
    allowed = set(np.argsort(-logits.numpy())[:3].tolist())
    assert {token for row in draws for token in row} <= allowed and draws[0] != draws[1]


def test_score_prompt_matches_reference():
    prompt = (3, 7, 1, 9, 4)
    logits = torch.randn(len(prompt) - 1, 12, generator=torch.Generator().manual_seed(1))
    logprobs = torch.log_softmax(logits, dim=-1)
    target = np.array([[1, -1], [2, 3], [-1, -1], [0, 11]])
    from shims.sampling.job import TargetIds

    job = SampleJob(prompt=prompt, prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=3,
                    target=TargetIds(ids=target), prompt_alt_tokens_k=4, temperature=1.0)
    scores = score_prompt(logprobs, job, SeededStream(0))
    ref = logprobs.numpy()
    expected = [np.nan, np.nan] + [ref[i - 1, prompt[i]] for i in range(2, 5)]
    np.testing.assert_allclose(scores.logprobs, expected, atol=1e-6)
    assert scores.topk_ids[:2].tolist() == [[0, 0, 0]] * 2 and (scores.topk_logprobs[:2] == -99999.0).all()
    for i in range(2, 5):
        assert scores.topk_ids[i].tolist() == np.argsort(-ref[i - 1])[:3].tolist()
    expected_target = np.where(target >= 0, np.take_along_axis(ref, np.maximum(target, 0), axis=1), 0.0)
    np.testing.assert_allclose(scores.target_logprobs, expected_target, atol=1e-6)
    assert scores.alt_tokens.shape == (4, 4)
    np.testing.assert_allclose(scores.alt_logprobs, np.take_along_axis(ref, scores.alt_tokens, axis=1), atol=1e-6)


def test_stop_matcher():
    def decode(tokens):
        return "".join(chr(ord("a") + t) for t in tokens)

    strings = StopMatcher(SampleJob(prompt=(0,), stop_strings=("cd",), stop_at_eos=False), [25], decode)
    assert [strings.done([0, 1, 2, 25][:n]) for n in (1, 2, 3, 4)] == [False, False, False, False]  # no eos stop
    strings = StopMatcher(SampleJob(prompt=(0,), stop_strings=("cd",), stop_at_eos=False), [25], decode)
    assert [strings.done([0, 1, 2, 3][:n]) for n in (1, 2, 3, 4)] == [False, False, False, True]  # "c" + "d"
    eos = StopMatcher(SampleJob(prompt=(0,)), [25], decode)
    assert eos.done([1, 25]) and not eos.done([1, 2])
    ids = StopMatcher(SampleJob(prompt=(0,), stop_token_ids=(4,), stop_at_eos=False), [25], decode)
    assert ids.done([4]) and not ids.done([25])


def test_resident_adapters_evict_least_recently_used_and_reload_changed_weights():
    lru = ResidentAdapters(2)
    a, b, c = (AdapterRef(k, f"/d/{k}") for k in "abc")
    first = lru.acquire(a)
    assert first.load and first.evicted == ()
    lru.release("a", first.slot_id)
    second = lru.acquire(b)
    assert second.load
    lru.release("b", second.slot_id)
    assert not lru.acquire(a).load  # resident: no reload, and now the most recently used
    lru.release("a", first.slot_id)
    third = lru.acquire(c)
    assert third.load and third.evicted == (second.slot_id,) and lru.keys() == ["a", "c"]  # b was least recent
    lru.release("c", third.slot_id)
    newer = lru.acquire(AdapterRef("a", "/d/a2", version=1))
    assert newer.load and newer.evicted == (first.slot_id,) and newer.slot_id != first.slot_id
    fourth = lru.acquire(b)
    assert fourth.evicted == (third.slot_id,)  # c was the only one not in use
    with pytest.raises(AllAdaptersBusy):
        lru.acquire(c)  # a and b both serve running requests


def test_newer_weights_arriving_while_old_ones_are_in_use():
    """An inflight save during sampling: the old slot keeps serving its request, then is unloaded."""
    lru = ResidentAdapters(2)
    old = lru.acquire(AdapterRef("k", "/v1", version=1))
    new = lru.acquire(AdapterRef("k", "/v2", version=2))
    assert new.load and new.slot_id != old.slot_id and new.evicted == ()
    assert lru.keys() == ["k"]
    lru.release("k", old.slot_id)  # the old request finishes: its slot is owed an unload
    other = lru.acquire(AdapterRef("x", "/x"))
    assert other.evicted == (old.slot_id,)


def test_a_sharded_trainers_parts_join_into_the_whole_adapter():
    """Each shard hands over its part (rank 0: all but the other shards' experts; the others: their experts): PEFT's
    per-expert names are merged, an expert slot's parts concatenated in rank order, everything else as rank 0's."""
    rng = np.random.default_rng(0)
    whole = {"attn": (rng.standard_normal((2, 8)), rng.standard_normal((8, 2))),
             "experts": (rng.standard_normal((5, 2, 8)), rng.standard_normal((5, 8, 2)))}
    parts = [AdapterTensors({"attn": whole["attn"], "experts": (whole["experts"][0][:3], whole["experts"][1][:3])},
                            0.5, 2),
             AdapterTensors({"experts": (whole["experts"][0][3:], whole["experts"][1][3:])}, 0.5, 2)]
    got = joined(parts)
    assert got.pairs.keys() == whole.keys() and (got.scaling, got.rank) == (0.5, 2)
    for key, (a, b) in whole.items():
        np.testing.assert_array_equal(got.pairs[key][0], a)
        np.testing.assert_array_equal(got.pairs[key][1], b)
    peft = joined([PeftTensors({"x": whole["attn"][0], "e.0": whole["experts"][0][0]}, {"r": 2}),
                   PeftTensors({"e.1": whole["experts"][0][1]}, {})])
    assert sorted(peft.state) == ["e.0", "e.1", "x"] and peft.config == {"r": 2}
    assert joined(parts[:1]) is parts[0]


def test_retired_slots_count_toward_capacity():
    """A slot replaced by newer weights while in use is still loaded: it counts toward the capacity, so a backend
    never holds more adapters than that (vLLM's CPU cache is that size, and would evict one on its own)."""
    lru = ResidentAdapters(2)
    old = lru.acquire(AdapterRef("k", "/v1", version=1))
    other = lru.acquire(AdapterRef("x", "/x"))
    with pytest.raises(AllAdaptersBusy):  # k's old slot and x both serve requests: no room for k's new weights
        lru.acquire(AdapterRef("k", "/v2", version=2))
    lru.release("x", other.slot_id)
    new = lru.acquire(AdapterRef("k", "/v2", version=2))
    assert new.load and new.evicted == (other.slot_id,)  # x goes; the old k stays loaded while its request runs
    lru.release("k", old.slot_id)
    assert lru.acquire(AdapterRef("y", "/y")).evicted == (old.slot_id,)


def _accelerators() -> dict[str, bool]:
    return {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}


@pytest.mark.parametrize("device", list(_accelerators()))
def test_the_sampling_arithmetic_runs_on_the_device_of_its_tensors(device):
    """A CPU run cannot see device bugs (a CPU ``torch.Generator`` drawing for a CUDA tensor failed every non-greedy
    sample on an H100), so the arithmetic runs here on each accelerator the machine has, against the same numbers
    computed on the CPU."""
    if not _accelerators()[device]:
        pytest.skip(f"this machine has no {device} device; this test runs where one exists (bench/gpu_smoke.py checks "
                    "the whole server on a GPU)")
    from shims.sampling.job import TargetIds

    cpu_logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)) * 3
    logits = cpu_logits.to(device)
    job = SampleJob(prompt=(3, 7, 1, 9, 4, 2, 8), num_samples=2, seed=11, top_k=5, top_p=0.9, temperature=0.8,
                    presence_penalty=0.5, repetition_penalty=1.4, logit_bias=((5, 2.0), (6, -1.0)), min_p=0.05,
                    prompt_logprobs=True, topk_prompt_logprobs=3, target=TargetIds(ids=np.array([[1, -1]] * 6)),
                    prompt_alt_tokens_k=4)
    cpu_penalized = penalized(cpu_logits[0], job, [1, 2])
    np.testing.assert_allclose(penalized(logits[0], job, [1, 2]).cpu().numpy(), cpu_penalized.numpy(), atol=1e-5)
    np.testing.assert_allclose(filtered_probs(logits[0], 0.8, 5, 0.9, 0.05).cpu().numpy(),
                               filtered_probs(cpu_logits[0], 0.8, 5, 0.9, 0.05).numpy(), atol=1e-5)
    draws = [[choose_token(logits[0], job, stream, [1, 2]) for _ in range(10)] for stream in sequence_streams(job, 0)]
    again = [[choose_token(logits[0], job, stream, [1, 2]) for _ in range(10)] for stream in sequence_streams(job, 0)]
    assert draws == again
    allowed = set(np.argsort(-cpu_penalized.numpy())[:5].tolist())
    assert {token for row in draws for token in row} <= allowed
    scores = score_prompt(torch.log_softmax(logits, dim=-1), job, SeededStream(1))
    reference = score_prompt(torch.log_softmax(cpu_logits, dim=-1), job, SeededStream(1))
    np.testing.assert_allclose(scores.logprobs[1:], reference.logprobs[1:], atol=1e-5)
    np.testing.assert_allclose(scores.topk_logprobs, reference.topk_logprobs, atol=1e-5)
    np.testing.assert_allclose(scores.target_logprobs, reference.target_logprobs, atol=1e-5)
    assert scores.alt_tokens.shape == (6, 4) and ((scores.alt_tokens >= 0) & (scores.alt_tokens < 40)).all()
