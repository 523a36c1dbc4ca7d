"""What sampling did, counted per base model for the server and per API key for each tenant, and the rollout-vs-train
drift probe: every so often a sampled sequence is re-scored by the trainer with the same weights."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from adapters.samplers.interface import AdapterRef
from compat_server.telemetry import TOKENS_SAMPLED
from shims.sampling.job import SampleJob, SampleResult

log = logging.getLogger("compat_server.sampling")

Scorer = Callable[[str, AdapterRef | None, list[int]], Awaitable[list[float]]]
"""(base model, adapter, prompt + sampled tokens) → the trainer's logprob of each token after the first."""


@dataclass
class SamplingStats:
    """Counters for one base model (server-wide, or one key's), reported by ``GET /api/v1/metrics``."""

    requests: int = 0
    failed: int = 0
    sequences: int = 0
    sampled_tokens: int = 0
    prompt_tokens: int = 0
    busy_seconds: float = 0.0
    """Wall-clock time with at least one request of this base model running (overlaps counted once)."""
    _running: int = field(default=0, repr=False)
    _busy_since: float = field(default=0.0, repr=False)
    drift_probes: int = 0
    drift_last: float | None = None
    drift_max: float = 0.0
    drift_sum: float = 0.0
    _probing: bool = field(default=False, repr=False)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count one request for its whole run: busy time, and a failure if it raises."""
        if not self._running:
            self._busy_since = time.perf_counter()
        self._running += 1
        self.requests += 1
        try:
            yield
        except Exception:
            self.failed += 1
            raise
        finally:
            self._running -= 1
            if not self._running:
                self.busy_seconds += time.perf_counter() - self._busy_since

    def add_drift(self, gap: float) -> None:
        self.drift_probes += 1
        self.drift_last = gap
        self.drift_max = max(self.drift_max, gap)
        self.drift_sum += gap

    def as_dict(self) -> dict:
        return {
            "requests": self.requests, "failed": self.failed, "sequences": self.sequences,
            "sampled_tokens": self.sampled_tokens, "prompt_tokens": self.prompt_tokens,
            "sampled_tokens_per_second": self.sampled_tokens / self.busy_seconds if self.busy_seconds else 0.0,
            "logprob_drift": {
                "probes": self.drift_probes, "last_max_abs": self.drift_last, "max_abs": self.drift_max,
                "mean_of_max_abs": self.drift_sum / self.drift_probes if self.drift_probes else None,
            },
        }


class SamplingMeter:
    """The server's ``SamplingStats`` per base model and each key's own; drift probes every ``probe_every``
    requests of a base model (0: never), recorded for the server and for the key whose weights were probed."""

    def __init__(self, base_models: list[str], probe_every: int, score: Scorer) -> None:
        self.server = {name: SamplingStats() for name in base_models}
        self._keys: dict[tuple[str, str], SamplingStats] = {}
        self.probe_every = probe_every
        self._score = score
        self._probes: set[asyncio.Task] = set()

    def of_key(self, base_model: str, owner: str) -> SamplingStats:
        return self._keys.setdefault((base_model, owner), SamplingStats())

    @contextmanager
    def running(self, base_model: str, owner: str) -> Iterator[None]:
        with self.server[base_model].running(), self.of_key(base_model, owner).running():
            yield

    def count(self, base_model: str, owner: str, adapter: AdapterRef | None, job: SampleJob,
              result: SampleResult) -> None:
        sampled = sum(len(s.tokens) for s in result.sequences)
        for stats in (self.server[base_model], self.of_key(base_model, owner)):
            stats.sequences += len(result.sequences)
            stats.sampled_tokens += sampled
            stats.prompt_tokens += len(job.prompt)
        TOKENS_SAMPLED.add(sampled, {"base_model": base_model})
        self._maybe_probe(base_model, owner, adapter, job, result)

    def _maybe_probe(self, base_model: str, owner: str, adapter: AdapterRef | None, job: SampleJob,
                     result: SampleResult) -> None:
        stats = self.server[base_model]
        seq = next((s for s in result.sequences if s.tokens), None)
        if not self.probe_every or stats._probing or seq is None or (stats.requests - 1) % self.probe_every:
            return
        stats._probing = True
        task = asyncio.get_running_loop().create_task(
            self._probe(base_model, owner, adapter, job, seq.tokens, seq.logprobs))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, base_model: str, owner: str, adapter: AdapterRef | None, job: SampleJob,
                     tokens: list[int], sampler_logprobs: list[float]) -> None:
        try:
            trainer_logprobs = await self._score(base_model, adapter, [*job.prompt, *tokens])
            gap = max(abs(a - b) for a, b in zip(trainer_logprobs[len(job.prompt) - 1:], sampler_logprobs))
        except Exception as exc:  # noqa: BLE001 - a probe is best effort; the weights may have been superseded
            log.debug("logprob drift probe skipped: %s", exc)
            return
        finally:
            self.server[base_model]._probing = False
        self.server[base_model].add_drift(gap)
        self.of_key(base_model, owner).add_drift(gap)
        log.info("logprob drift %s (%s): max |sampler − trainer| = %.2e over %d sampled tokens", base_model,
                 adapter.key if adapter else "base", gap, len(tokens))
