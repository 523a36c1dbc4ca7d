"""Base model names → where their weights and tokenizer live, and what the server advertises about them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapters.models.tiny import TINY_MODEL_NAME, ensure_tiny_model, install_in_hf_cache


@dataclass(frozen=True)
class BaseModelSpec:
    """A base model as the operator named it, and the location ``from_pretrained`` loads it from."""

    name: str
    """The name clients use (``base_model`` in create_model, ``model_name`` in capabilities)."""
    location: str
    """A local directory, or a Hugging Face repo id resolved from the local cache."""
    tokenizer: str | None = None
    """What clients pass to ``AutoTokenizer.from_pretrained`` (``get_info``'s ``tokenizer_id``); unset: the
    location."""

    @property
    def tokenizer_id(self) -> str:
        return self.tokenizer or self.location


def resolve_base_model(name: str, cache_root: Path | None = None) -> BaseModelSpec:
    """Resolve an operator-given model name: the built-in tiny model, a local directory, or a Hugging Face id."""
    if name == TINY_MODEL_NAME:
        # Also installed in the Hugging Face cache under its name, so clients load its tokenizer by name, offline.
        directory = ensure_tiny_model(cache_root)
        install_in_hf_cache(directory, TINY_MODEL_NAME)
        return BaseModelSpec(name=name, location=str(directory), tokenizer=TINY_MODEL_NAME)
    path = Path(name).expanduser()
    if path.is_dir():
        return BaseModelSpec(name=name, location=str(path.resolve()))
    return BaseModelSpec(name=name, location=name)


@dataclass(frozen=True)
class TextSettings:
    """What the server needs to know of a base model's text side."""

    vocab_size: int
    """The width of the model's logits (which may exceed the tokenizer's vocabulary)."""
    max_context: int
    """The longest sequence its positions cover (``max_position_embeddings``; 2048 when the config names none)."""


def text_settings(config) -> TextSettings:
    """The text settings of a transformers config. A vision-language checkpoint (Qwen3.5/3.6 as published) keeps
    them in its ``text_config``, not at the top, yet ``AutoModelForCausalLM`` loads it as its text model: this reads
    them where transformers itself looks (``get_text_config(decoder=True)``: the config itself for a text model)."""
    text = config.get_text_config(decoder=True)
    return TextSettings(vocab_size=int(text.vocab_size),
                        max_context=int(getattr(text, "max_position_embeddings", None) or 2048))


def is_vision_language(config) -> bool:
    """Whether the checkpoint is a vision-language one (its text settings in a ``text_config``): its language model's
    weights then sit under ``model.language_model.``, which vLLM and tinker-cookbook name adapters by."""
    return config.get_text_config(decoder=True) is not config


SAMPLER_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(requested: str, device_type: str, location: str) -> str:
    """The dtype a sampler holds the base model in. ``auto``: float32 on CPU (where bf16 is slow and imprecise, and
    fp32 makes sampler and trainer logprobs agree to ~1e-6); elsewhere the model's own dtype from its config, so a
    bf16 checkpoint stays bf16 (vLLM's own ``auto`` would turn an fp32 checkpoint into fp16)."""
    if requested not in SAMPLER_DTYPES:
        raise ValueError(f"sampler dtype must be one of {', '.join(SAMPLER_DTYPES)}; got {requested!r}")
    if requested != "auto":
        return requested
    if device_type == "cpu":
        return "float32"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(location)
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(own).removeprefix("torch.") if own is not None else "bfloat16"
    return name if name in SAMPLER_DTYPES else "bfloat16"
