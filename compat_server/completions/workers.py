"""The threads that tokenize, render chat templates and decode for the OpenAI-style routes, so that this work never
runs on the event loop: a 16 MiB prompt tokenized there held every route of every tenant for 17 s (issue 31).

Hugging Face fast tokenizers let go of the GIL while their Rust code encodes (``encode`` goes through
``encode_batch``; ``Vocabulary.decode`` uses ``decode_batch`` for the same reason), so the event loop keeps serving
while a worker tokenizes; Python work in a worker (a chat template, building token lists) gives the loop its turn at
every GIL switch interval.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("compat_server.openai")

T = TypeVar("T")

TRIM_GROWTH_MIB = 64
"""Work that leaves the server's resident memory this much above its level after the last trim is followed by one."""

TRIM_DELAY = 1.0
"""Seconds from such work to the trim: by then its request is over, and its body and answer are freed too."""


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:  # glibc (malloc_trim) means Linux
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class TokenWorkers:
    """A bounded pool of threads for tokenizer work (``--tokenizer-threads``). Callers cut their work into pieces
    (one prompt, one stream step) so that one tenant's request of many long prompts takes turns with the others'
    work rather than holding a thread for its whole length.

    glibc keeps the memory a large request freed (token lists, the tokenizer's buffers, the body) in its arenas, one
    per thread that allocated: the server's resident size stayed at its peak (456 MB → 2.8 GB, kept). So after work
    that leaves the process more than ``TRIM_GROWTH_MIB`` above its lowest level after a trim, ``malloc_trim`` hands
    the free pages back, a second later and in a worker (it walks every arena): at most one trim is pending at a time.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenizer")
        self._trim = _malloc_trim()
        self._trim_due = False
        self._floor: float | None = None
        """The least resident size seen after a trim, in MiB."""

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread; its result or its exception."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            if self._trim is not None and not self._trim_due and \
                    (self._floor is None or _rss_mib() > self._floor + TRIM_GROWTH_MIB):
                self._trim_due = True
                loop.call_later(TRIM_DELAY, self._start_trim, loop)

    def _start_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_in_executor(self._pool, self._trim_now)
        except RuntimeError:  # the server is stopping: its pool takes no more work
            pass

    def _trim_now(self) -> None:
        before = _rss_mib()
        self._trim(0)
        after = _rss_mib()
        self._floor = after if self._floor is None else min(self._floor, after)
        self._trim_due = False
        log.debug("malloc_trim: resident %.0f → %.0f MiB", before, after)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
