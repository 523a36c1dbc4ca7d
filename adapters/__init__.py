"""Compute behind small interfaces: the multi-LoRA trainer, the samplers, model loading and the Ray pools that place
them."""

import warnings

# PEFT warns on every adapter touching the tied lm_head, on saves without embedding layers and when the active
# adapter is deleted; all are expected here (a tied model's unembedding LoRA is applied to both sides on purpose:
# adapters.lora.files) and would flood logs.
warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
warnings.filterwarnings("ignore", message=".*save_embedding_layers.*")
warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
