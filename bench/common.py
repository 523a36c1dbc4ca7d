"""What every benchmark shares: the model to run on, the device's name, and writing the results."""

from __future__ import annotations

import json
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

SHAPES = {
    # Qwen3 architectures (random init is enough for throughput): hidden, layers, heads, kv heads, intermediate, vocab.
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936),
    "qwen3-4b": (2560, 36, 32, 8, 9728, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 12288, 151936),
    "cpu-mid": (1024, 4, 16, 8, 3072, 32000),
    "cpu-768": (768, 4, 6, 2, 2048, 32000),
    # Big enough on a CPU that arithmetic, not Python, dominates a step; small enough to train here in seconds.
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 peak per GPU, for MFU."""


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"CPU: {model}, {torch.get_num_threads()} threads"


def model_directory(shape: str) -> Path:
    """``tiny``: the built-in tiny model. Otherwise a random-init Qwen3 of that shape (with the tiny tokenizer's
    files beside it; benchmarks feed token ids directly)."""
    from adapters.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    if shape == "tiny":
        return tiny
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                                  intermediate_size=intermediate, max_position_embeddings=32768,
                                  tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    directory = Path(tempfile.mkdtemp(prefix=f"bench-{shape}-"))
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def non_embedding_params(directory: Path) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(directory)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attn + mlp)


def mfu(params: int, tokens_per_second: float) -> float | None:
    """6·N·tokens/s against the GPU's dense bf16 peak; None on CPU or an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return 6 * params * tokens_per_second / (peak * 1e12) if peak else None


def write(name: str, config: dict, rows: list[dict]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({"benchmark": name, "device": device_name(), "when": datetime.now(UTC).isoformat(),
                               "config": config, "rows": rows}, indent=1) + "\n")
    for row in rows:
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print("wrote", out)
    return out
