"""The built-in tiny base model: a Qwen3-architecture causal LM with a real byte-level BPE tokenizer.

No weights can be downloaded on the machines this project targets, so the default base model is built locally,
deterministically (fixed seeds, a fixed training corpus for the tokenizer), into a cache directory on first use.
Building twice gives byte-identical weights, so checkpoints trained on one machine load on another.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY_MODEL_NAME = "compat-server/tiny-qwen3"
"""The name under which the server advertises the built-in model."""

BUILD_VERSION = 2
"""Bumped whenever the recipe below changes, so a stale cache is rebuilt rather than silently reused."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Qwen3's tags, each one token that decoding keeps (added, not special), as in Qwen3's own tokenizer: the model
calls a tool by writing ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, which the server parses."""

VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    # Qwen3's chat format (ChatML, with hermes-style tools), written for this model: tools are listed in the system
    # turn, an assistant's tool calls follow its text, tool results go back in a user turn.
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call.name + '\\\", \\\"arguments\\\": ' }}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Same pre-tokenisation split as the Qwen2/Qwen3 tokenizers, so the tiny tokenizer behaves like a real one.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (  # noqa: SIM905 - one readable string of words; the tokenizer corpus is built from it
    "the of and to in is was for on that with as by at from it an be this are which or his her they have not had "
    "one but all were when there can been has more if who will their would what out about up into than them "
    "some time could other these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came "
    "right used take three capital France Paris city river water number answer question user assistant system "
    "hello thanks please model train sample token learning rate loss step weight adapter server client"
).split()


def _corpus() -> list[str]:
    """A fixed, varied text corpus: words, numbers, arithmetic, punctuation and chat-shaped lines."""
    lines = []
    for i, word in enumerate(_WORDS):
        nxt = _WORDS[(i * 7 + 3) % len(_WORDS)]
        third = _WORDS[(i * 13 + 5) % len(_WORDS)]
        lines.append(f"The {word} {nxt} and {third}. {word.capitalize()}, {nxt}? {third}!")
        lines.append(f"{i} + {i * 3 % 17} = {i + i * 3 % 17}; {word}: {i * 11 % 97}")
    lines += [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>"
              for a in range(20) for b in range(0, 20, 3)]
    lines += ["The capital of France is Paris.", "def f(x):\n    return x * 2\n", "{\"key\": [1, 2, 3]}"]
    return lines


def build_tokenizer(directory: Path) -> None:
    """Train a byte-level BPE tokenizer (vocab 512, Qwen3's tool tags included) on the fixed corpus and save it in HF
    format."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS), special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE,
    )
    fast.model_max_length = 2048
    fast.save_pretrained(str(directory))


def build_model(directory: Path, vocab_size: int, eos_token_id: int, pad_token_id: int) -> None:
    """Create the Qwen3 weights from a fixed seed and save them as safetensors."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    model.save_pretrained(str(directory), safe_serialization=True)


def default_cache_root() -> Path:
    """Where built models live: $COMPAT_SERVER_CACHE, else the user's cache directory."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("COMPAT_SERVER_CACHE") or user_cache_dir("compat-server"))


def ensure_tiny_model(cache_root: Path | None = None) -> Path:
    """Return the directory holding the tiny model, building it first if it is not there yet.

    Several processes may call this at once (a server and a test, say): each builds into its own temporary directory
    and renames it into place; the first rename wins and the others discard their copy.
    """
    root = cache_root or default_cache_root()
    target = root / "models" / f"tiny-qwen3-v{BUILD_VERSION}"
    if (target / "model.safetensors").exists():
        return target

    def build(staging: Path) -> None:
        build_tokenizer(staging)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(staging))
        build_model(staging, len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
        (staging / "compat_server_build.json").write_text(json.dumps({"name": TINY_MODEL_NAME, "version": BUILD_VERSION}))

    _publish_directory(target, "model.safetensors", build)
    return target


def _publish_directory(target: Path, marker: str, fill: Callable[[Path], None]) -> None:
    """Fill a private staging directory beside ``target`` and rename it into place. Processes racing to publish the
    same directory each stage their own copy: the first rename wins, the others (finding ``marker`` in the winner's
    copy) discard theirs."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        fill(staging)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def install_in_hf_cache(directory: Path, repo_id: str) -> Path:
    """Make ``repo_id`` load offline, like any downloaded model: a snapshot of ``directory`` in the Hugging Face hub
    cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) with ``refs/main`` pointing
    at it. Then ``AutoTokenizer.from_pretrained(repo_id)`` works with ``HF_HUB_OFFLINE=1`` on this machine, which is
    how Tinker clients (the SDK's ``get_tokenizer``, tinker-cookbook recipes) load a tokenizer by model name.

    The revision is a hash of the files, so a rebuilt model gets a new snapshot; concurrent installs are safe (each
    stages its own copy and renames it into place).
    """
    from huggingface_hub import constants

    files = sorted(f for f in directory.iterdir() if f.is_file())
    digest = hashlib.sha1()
    for file in files:
        digest.update(file.name.encode())
        digest.update(hashlib.sha1(file.read_bytes()).digest())
    revision = digest.hexdigest()
    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    if not (snapshot / "config.json").exists():
        def copy(staging: Path) -> None:
            for file in files:
                shutil.copy2(file, staging / file.name)

        _publish_directory(snapshot, "config.json", copy)
    refs = repo / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    ref = refs / f".main-{os.getpid()}"
    ref.write_text(revision)
    os.replace(ref, refs / "main")
    return snapshot


def save_random_model(config, directory: Path, dtype=None, device: str = "cpu") -> Path:
    """A random-init model of the transformers ``config`` (seed 0, built on ``device``; the caller's random state
    left as it was) saved into ``directory``, with the tiny model's tokenizer files beside it: a server loads and
    serves it as a base model with nothing downloaded (its samplers read a tokenizer; benchmarks and tests feed token
    ids). ``dtype``: float32 unless given."""
    import torch
    from transformers import AutoModelForCausalLM

    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.save_pretrained(directory)
    del model
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy2(tiny / name, directory / name)
    return directory
