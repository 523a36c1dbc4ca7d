"""Run lm-evaluation-harness (``lm-eval``) against a running server, in this process, on the tiny tasks in
``tests/data/lm_eval``: the multiple-choice task through ``local-completions`` (loglikelihood: one
``/v1/completions`` request per choice with ``echo``, ``logprobs=1``, ``max_tokens=1``) and the generation task
through ``local-chat-completions`` (``generate_until``: one ``/v1/chat/completions`` request per doc). Each returns
``simple_evaluate``'s results dict: ``results[task]`` holds the metrics (``acc,none``, ``exact_match,none``, ...) and
``samples[task]`` each doc's arguments and responses.

Offline: the data are local JSON lines loaded with the ``json`` builder, the tokenizer (when one is used) is a local
directory, and ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` are set before ``datasets`` is first imported (it reads
them at import). In-process rather than ``python -m lm_eval``: a subprocess costs seconds of imports per run and
would need the task YAMLs' relative data paths to match its working directory; in-process the task configs are
passed inline with absolute paths. lm-eval seeds Python's, NumPy's and torch's global generators on each run
(``random_seed`` and friends); these runs leave those seeds unset, so the calling test process is not reseeded.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "data" / "lm_eval"
MC_TASK = "compat_tiny_mc"
GEN_TASK = "compat_tiny_gen"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _offline() -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


_dataset_cache: tempfile.TemporaryDirectory | None = None


def _default_cache_dir() -> str:
    """One temporary dataset cache for the process, removed when it exits."""
    global _dataset_cache
    if _dataset_cache is None:
        _dataset_cache = tempfile.TemporaryDirectory(prefix="compat-server-lm-eval-")
    return _dataset_cache.name


def task_config(name: str, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The task's YAML as an inline config, its data file made absolute (``datasets`` resolves a relative one against
    the working directory) and its dataset cache put in ``cache_dir`` (by default one temporary directory for the
    process) rather than the user's ``~/.cache/huggingface/datasets``."""
    import yaml

    config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
    kwargs = config.setdefault("dataset_kwargs", {})
    kwargs["data_files"] = {split: str(TASKS_DIR / Path(path).name) for split, path in kwargs["data_files"].items()}
    kwargs["cache_dir"] = str(cache_dir or _default_cache_dir())
    return config


def _evaluate(model: str, model_args: dict[str, Any], task: str, *, limit: int | None, batch_size: int = 1,
              apply_chat_template: bool) -> dict[str, Any]:
    _offline()
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only this directory: the default manager indexes every built-in task's YAML (thousands of files) first.
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task_config(task)], task_manager=manager, limit=limit,
        batch_size=batch_size, apply_chat_template=apply_chat_template, bootstrap_iters=0,
        log_samples=True, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
    )
    assert results is not None, "lm-eval returned no results (not rank 0?)"
    return results


def _headers(api_key: str | None) -> dict[str, Any]:
    """lm-eval's API models send ``Authorization: Bearer $OPENAI_API_KEY`` (``Bearer `` and nothing when it is
    unset); a ``header`` model argument replaces those headers whole."""
    return {} if api_key is None else {"header": {"Authorization": f"Bearer {api_key}"}}


def run_multiple_choice(base_url: str, model: str, tokenizer: str | Path | None = None, *,
                        tokenizer_backend: str = "huggingface", tokenized_requests: bool = True,
                        batch_size: int = 1, num_concurrent: int = 1, max_length: int | None = None,
                        api_key: str | None = None, limit: int | None = None,
                        extra_model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The multiple-choice task through ``local-completions``. ``base_url`` is the server's root
    (``http://127.0.0.1:PORT``). ``tokenizer``: a local Hugging Face tokenizer directory (the tiny model's) for
    ``tokenizer_backend="huggingface"``; ``"remote"`` uses the server's ``/tokenizer_info``, ``/tokenize`` and
    ``/detokenize`` instead (``"auto"`` picks remote when those answer, as lm-eval does by default).
    ``tokenized_requests=True`` sends each prompt as token ids, ``False`` as the decoded text."""
    model_args: dict[str, Any] = {
        "base_url": f"{base_url.rstrip('/')}/v1/completions",
        "model": model,
        "tokenizer_backend": tokenizer_backend,
        "tokenized_requests": tokenized_requests,
        "num_concurrent": num_concurrent,
        "max_retries": 1,
        "timeout": 120,
        **_headers(api_key),
    }
    if tokenizer is not None:
        model_args["tokenizer"] = str(tokenizer)
    if max_length is not None:
        model_args["max_length"] = max_length
    if tokenizer_backend in ("remote", "auto") and api_key is not None:
        model_args["auth_token"] = api_key  # the remote tokenizer's own requests send only this
    model_args.update(extra_model_args or {})
    return _evaluate("local-completions", model_args, MC_TASK, limit=limit, batch_size=batch_size,
                     apply_chat_template=False)


def run_chat_generation(base_url: str, model: str, *, num_concurrent: int = 1, api_key: str | None = None,
                        limit: int | None = None, eos_string: str | None = None,
                        extra_model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The generation task through ``local-chat-completions``, with lm-eval's chat-template flag (so each doc goes
    as ``messages``, the server applying its own template). No tokenizer: the chat model sends text only."""
    model_args: dict[str, Any] = {
        "base_url": f"{base_url.rstrip('/')}/v1/chat/completions",
        "model": model,
        "num_concurrent": num_concurrent,
        "max_retries": 1,
        "timeout": 120,
        **_headers(api_key),
    }
    if eos_string is not None:
        model_args["eos_string"] = eos_string  # appended to the stop list (which is cut to its first 4)
    model_args.update(extra_model_args or {})
    return _evaluate("local-chat-completions", model_args, GEN_TASK, limit=limit, apply_chat_template=True)


def metric(results: dict[str, Any], task: str, name: str) -> float:
    """One aggregated metric as a float, e.g. ``metric(r, MC_TASK, "acc")`` (lm-eval keys them ``"acc,none"``;
    exact_match comes as a NumPy float)."""
    return float(results["results"][task][f"{name},none"])
