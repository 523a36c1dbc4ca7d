"""The command line and the built-in tiny model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from adapters.models.tiny import ensure_tiny_model


def test_help_explains_every_serve_option():
    top = subprocess.run([sys.executable, "-m", "compat_server.cli", "--help"], capture_output=True, text=True, check=False)
    serve = subprocess.run([sys.executable, "-m", "compat_server.cli", "serve", "--help"], capture_output=True,
                           text=True, check=False)
    assert top.returncode == 0 and serve.returncode == 0
    for option in ["--host", "--port", "--base-model", "--data-dir", "--ray-address", "--trainer-gpus",
                   "--poll-hold-seconds", "--seq-gap-timeout", "--max-body-mb", "--log-level", "--samplers",
                   "--sampler-backend", "--sampler-gpus", "--sampler-batch", "--max-resident-adapters",
                   "--max-lora-rank", "--sampler-dtype", "--max-model-len", "--vllm-max-loras",
                   "--vllm-gpu-memory-utilization", "--vllm-kv-cache-gb", "--max-num-samples", "--max-logprobs-k", "--drift-probe-every",
                   "--ephemeral-keep"]:
        assert option in top.stdout and option in serve.stdout
    assert "default: 127.0.0.1" in serve.stdout and "default: 8000" in serve.stdout


def test_the_cli_and_the_keys_command_load_no_machine_learning_libraries(tmp_path):
    """``compat-server keys`` and ``--help`` are operator commands that answer at once: the CLI, the config and the
    records load neither torch nor vLLM, the grammar engine or transformers (once, ``keys`` imported them all)."""
    heavy = ("torch", "vllm", "xgrammar", "transformers")
    probe = ("import sys, runpy\n"
             "sys.argv = ['compat-server', 'keys', '--data-dir', sys.argv[1], 'create', '--name', 'probe']\n"
             "try:\n    runpy.run_module('compat_server.cli.main', run_name='__main__')\n"
             "except SystemExit as done:\n    assert not done.code, done.code\n"
             f"print('loaded:', sorted(m for m in {heavy!r} if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "loaded: []", run.stdout
    assert run.stdout.startswith("tml-")  # the key itself was made


def test_invalid_option_values_are_refused_with_the_option_named():
    done = subprocess.run([sys.executable, "-m", "compat_server.cli", "serve", "--samplers", "0",
                           "--max-resident-adapters", "0"], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "--samplers must be at least 1" in done.stderr and "--max-resident-adapters must be at least 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "compat_server.cli", "serve", "--vllm-max-loras", "0"],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "COMPAT_SERVER_MAX_LORA_RANK": "100", "COMPAT_SERVER_SAMPLER_DTYPE": "fp8"})
    assert done.returncode == 2
    for message in ("--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512",
                    "--sampler-dtype must be one of auto, float32, bfloat16, float16",
                    "--vllm-max-loras must be at least 1"):
        assert message in done.stderr, done.stderr


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_builds_deterministically_with_a_real_chat_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    again = ensure_tiny_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(tiny_model_dir / name) == digest(again / name), name
    assert ensure_tiny_model(tmp_path) == again  # second call reuses the cache

    config = AutoConfig.from_pretrained(str(again))
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(str(again))
    text = "Hello world, the answer is 42!"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text)  # real merges, not bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and len(tok) == config.vocab_size


def test_the_built_in_model_never_sends_the_server_to_the_hub(server):
    """Without HF_HUB_OFFLINE (as a user would run it, and as the shared test server runs), nothing the server does
    for the built-in model asks the Hugging Face hub: no network is needed, and none is tried (here it would mean
    half a minute of retries, and the hub's address in the log)."""
    import openai

    from tests.helpers import BASE_MODEL

    assert server.env.get("HF_HUB_OFFLINE") == "0"
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="tml-test-offline")
    reply = chat.chat.completions.create(model=BASE_MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens > 0
    assert "huggingface.co" not in server.log()


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """httpx (under the openai, anthropic and tinker SDKs) keeps an idle connection for 5 s; a server that closes
    its own at 5 s (uvicorn's default) races the client's next request on it, which a client with retries off saw as
    ``APIConnectionError``. Idle for 6 s, the connection still answers (``--keep-alive-seconds``, 75 by default)."""
    import socket
    import time
    from urllib.parse import urlsplit

    address = urlsplit(server.base_url)
    request = f"GET /health HTTP/1.1\r\nHost: {address.hostname}\r\n\r\n".encode()
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        for _ in range(2):
            connection.sendall(request)
            answer = connection.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            time.sleep(6)
