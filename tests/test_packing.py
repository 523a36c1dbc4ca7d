"""Padding-free batches (``adapters.trainer.packing``), in-process: the length buckets keep padding within their
slack, the packed attention equals a dense block-diagonal causal reference, and on every model family a packed mixed
batch of two runs gives each datum the loss, logprobs and gradients it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters.trainer.actor import MultiLoRATrainer
from adapters.trainer.interface import LoraSpec, StepRequest
from adapters.trainer.packing import SLACK, Packing, buckets, packed_attention
from shims.tinker.training_wire import DatumArrays
from tests.families import FAMILIES, family_dir


@pytest.mark.parametrize("lengths", [[128] * 64, [8] * 1024, [1024] + [1] * 1023, [2] * 4096,
                                     np.random.default_rng(0).integers(32, 481, 34).tolist(),
                                     np.random.default_rng(1).integers(1, 3000, 500).tolist()])
def test_buckets_hold_every_datum_once_with_padding_within_the_slack(lengths):
    groups = buckets(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        real = sum(lengths[i] for i in group)
        assert len(group) * max(lengths[i] for i in group) <= (1 + SLACK) * real + 1e-9
        assert group == sorted(group)  # a batch sorted by adapter stays sorted in each bucket
    assert len(groups) <= len(set(lengths))


def _reference(query, key, value, lengths, window=None, sinks=None, scale=None):
    """Attention with a dense ``[tokens, tokens]`` mask: causal inside each datum, nothing across datums."""
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths])
    allowed = (owner[:, None] == owner[None, :]) & (position[None, :] <= position[:, None])
    if window is not None:
        allowed &= position[None, :] > position[:, None] - window
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ k.transpose(-1, -2)) * (scale or query.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(1, -1, scores.shape[2], 1)], -1)
    probs = scores.softmax(-1)[..., : k.shape[2]]
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (None, True), (4, True), (2, False)])
def test_packed_attention_equals_a_dense_block_diagonal_reference(window, sinks):
    """Values and gradients; lengths whose buckets pad (a window of 2 leaves padding queries no key of their own:
    they must not make the real ones' gradients NaN)."""
    lengths = [7, 1, 12, 3, 3, 9, 1, 20, 19, 18]
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    query = torch.randn(1, 4, tokens, 8, generator=generator, requires_grad=True)
    key = torch.randn(1, 2, tokens, 8, generator=generator, requires_grad=True)
    value = torch.randn(1, 2, tokens, 6, generator=generator, requires_grad=True)  # MLA: a narrower value head
    aux = torch.randn(4, generator=generator, requires_grad=True) if sinks else None
    out, _ = packed_attention(None, query, key, value, None, sliding_window=window, s_aux=aux,
                              packing=Packing(lengths, torch.device("cpu")))
    expected = _reference(query, key, value, lengths, window, aux)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    leaves = [query, key, value] + ([aux] if sinks else [])
    weights = torch.randn(out.shape, generator=generator)
    mine = torch.autograd.grad((out * weights).sum(), leaves)
    theirs = torch.autograd.grad((expected * weights).sum(), leaves)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _datum(n: int, seed: int) -> DatumArrays:
    ids = np.random.default_rng(seed).integers(1, 500, n + 1)
    return DatumArrays(tokens=ids[:-1], loss_fn_inputs={"target_tokens": ids[1:],
                                                        "weights": np.linspace(0.5, 1.5, n).astype(np.float32)})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_mixed_batch_equals_each_datum_alone(family, model_cache):
    """Two runs' requests of datums of 1 to 30 tokens (beyond gpt-oss's sliding window of 8) as one batch: each
    datum's logprobs, each request's loss and each run's gradients equal those of every datum run alone, on every
    family — packed for attention families, length buckets for the recurrent ones."""
    trainer = MultiLoRATrainer(str(family_dir(family)))
    assert trainer.passes.packs == (family in ("llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3"))
    for run, seed in (("a", 5), ("b", 6)):
        trainer.create(run, LoraSpec(rank=4, seed=seed))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in trainer.adapters[run].params:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    data = {"a": [_datum(n, i) for i, n in enumerate([5, 17, 1, 9, 30])],
            "b": [_datum(n, 10 + i) for i, n in enumerate([12, 3, 30, 1])]}
    alone: dict[str, tuple[list, list]] = {}
    for run, datums in data.items():
        results = [trainer.forward_backward_batch([StepRequest(run, [d], "cross_entropy", {}, False)])[0]
                   for d in datums]
        alone[run] = (results, [p.grad.clone() for p in trainer.adapters[run].params])
        for param in trainer.adapters[run].params:
            param.grad = None
    together = trainer.forward_backward_batch([StepRequest(run, datums, "cross_entropy", {}, False)
                                               for run, datums in data.items()])
    for run, result in zip(data, together, strict=True):
        assert not isinstance(result, Exception), result
        results, grads = alone[run]
        for i, one in enumerate(results):
            np.testing.assert_allclose(result.outputs[i]["logprobs"], one.outputs[0]["logprobs"], rtol=1e-5,
                                       atol=1e-6)
        assert result.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in results), rel=1e-5)
        for mine, theirs in zip([p.grad for p in trainer.adapters[run].params], grads, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=5e-5)
