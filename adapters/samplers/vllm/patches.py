"""Three corrections to vLLM 0.32 that the vLLM sampler needs, installed in vLLM's worker process.

**Base-model rows on CPU get no LoRA.** vLLM marks a row without an adapter with the LoRA index -1. Its GPU kernels
skip such rows; the plain-torch ops its CPU build uses index the stacked adapter weights with it, and -1 is the last
slot. So once every adapter slot of an engine has held an adapter, a base-model request batched on CPU beside others
is sampled with the last slot's adapter (found here: greedy base answers turned into an adapter's; vLLM PR #48421,
not in 0.32). The correction zeroes the inputs of -1 rows before those ops, so their LoRA delta is zero.

**Prompt logprobs with each request's own LoRA.** vLLM's V1 model runner scores prompts
(``_get_prompt_logprobs_dict``) by passing each request's slice of the step's hidden states through
``compute_logits``. With LoRA enabled, the logits layer applies the adapters by the step's
*sampling* mapping (one entry per request in the batch), not one entry per prompt row. So:

- on CPU, a step holding more than one request crashes the engine (``einsum(): subscript b has size 4 ...``);
- on GPU, an adapter's ``lm_head`` delta is silently missing or misplaced in prompt logprobs (vLLM issues #16668,
  #51594; fixes proposed upstream, not in 0.32).

Tinker's ``compute_logprobs``, ``include_prompt_logprobs`` and ``topk_prompt_logprobs`` all rest on these numbers,
and adapters trained here have LoRA on ``lm_head`` by default (``train_unembed=True``). The correction: around each
of those ``compute_logits`` calls, point the LoRA mapping at the adapters of exactly the rows being scored (taken
from the step's per-token mapping, which already has one entry per hidden-state row), then restore the step's
mapping. It goes through ``set_adapter_mapping``, the call vLLM itself makes every step, so the same code is right
for the CPU and the GPU kernels.

**Logprobs under a grammar are the model's own.** The sampler runs vLLM with ``logprobs_mode="raw_logprobs"`` (the
model's logprobs before penalties, biases or temperature; the transformers sampler reports the same). But the model
runner applies a structured-output grammar's bitmask to the logits *in place* before the sampler sees them, so a
constrained request's "raw" logprobs were the masked ones: an only-allowed token got 0.0 where the model gave it
-6.5, and the drift probe reported a gap of 6.9 between sampler and trainer. The correction keeps a copy of the
step's logits before the mask and has the sampler compute its raw logprobs from that copy (sampling still uses the
masked logits).

The vLLM sampler names ``VLLMCorrections`` as vLLM's ``worker_extension_cls``: vLLM imports this module in its worker
process, and importing it installs the corrections there. The sampler also runs vLLM with its V1 model runner
(``VLLM_USE_V2_MODEL_RUNNER=0``), the runner the second correction is for, on CPU and GPU alike (the V2 runner, vLLM's
default on a GPU, has the same fault in another place). Tests: ``tests/test_sampler_backends.py``
``::test_mixed_adapter_batch_equals_separate_requests``, ``::test_base_rows_stay_base_once_every_adapter_slot_has
_been_used`` and ``tests/test_openai_vllm_surface.py::test_logprobs_under_a_json_constraint_are_the_models_own``, each
failing without its correction.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("compat_server.sampler")


def _rows_of(part, whole) -> int:
    """Index of the first row of ``part`` within ``whole``, when ``part`` is a slice of ``whole``'s rows (which is
    how the model runner hands each request's prompt rows to ``compute_logits``)."""
    row_bytes = whole.stride(0) * whole.element_size()
    offset = part.data_ptr() - whole.data_ptr()
    if part.stride() != whole.stride() or offset % row_bytes or not 0 <= offset // row_bytes <= whole.shape[0]:
        raise RuntimeError("vLLM handed compute_logits prompt rows that are not a row slice of the step's hidden "
                           "states; the prompt-logprobs LoRA correction does not fit this vLLM version")
    return offset // row_bytes


def _without_rows_of_no_lora(op):
    """``op`` (a torch LoRA op: inputs, weights, output, indices, ...) with the inputs of rows whose index is -1 (no
    adapter) zeroed, so it adds nothing to them, as vLLM's GPU kernels do."""

    @functools.wraps(op)
    def wrapped(inputs, weights, output, indices, *args, **kwargs):
        no_lora = indices == -1
        if bool(no_lora.any()):
            inputs = inputs.masked_fill(no_lora.view(-1, *([1] * (inputs.dim() - 1))), 0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    wrapped.compat_server_fix = True
    return wrapped


def _install_cpu_no_lora_rows() -> None:
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.ops.torch_ops.lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(ops.bgmv_shrink, "compat_server_fix", False):
        return
    # The sgmv_* ops call these through lora_ops' globals; the CPU punica wrapper and the package hold their own names.
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        fixed = _without_rows_of_no_lora(getattr(ops, name))
        for module in (ops, package, punica_cpu):
            setattr(module, name, fixed)


def _install_prompt_logprobs_loras() -> None:
    from vllm.lora.layers import LoRAMapping
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._get_prompt_logprobs_dict
    if getattr(original, "compat_server_fix", False):
        return

    @functools.wraps(original)
    def prompt_logprobs_with_row_loras(self, hidden_states, num_scheduled_tokens):
        manager = getattr(getattr(self, "lora_manager", None), "_adapter_manager", None)
        step = getattr(manager, "_last_mapping", None)
        if step is None or not self.num_prompt_logprobs:
            return original(self, hidden_states, num_scheduled_tokens)
        model = self.model
        compute_logits = model.compute_logits

        def compute_logits_for_rows(rows):
            first = _rows_of(rows, hidden_states)
            loras = step.index_mapping[first:first + rows.shape[0]]
            manager.set_adapter_mapping(LoRAMapping(loras, loras, is_prefill=step.is_prefill, type=step.type))
            return compute_logits(rows)

        model.compute_logits = compute_logits_for_rows  # an instance attribute, shadowing the method for this call
        try:
            return original(self, hidden_states, num_scheduled_tokens)
        finally:
            del model.compute_logits
            manager.set_adapter_mapping(step)

    prompt_logprobs_with_row_loras.compat_server_fix = True
    GPUModelRunner._get_prompt_logprobs_dict = prompt_logprobs_with_row_loras


def _install_raw_logprobs_under_grammar() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    apply_mask = runner_module.apply_grammar_bitmask
    original_sample = runner_module.GPUModelRunner._sample
    if getattr(apply_mask, "compat_server_fix", False):
        return

    @functools.wraps(apply_mask)
    def apply_mask_keeping_logits(scheduler_output, grammar_output, input_batch, logits):
        metadata = input_batch.sampling_metadata
        if metadata.max_num_logprobs is not None or metadata.logprob_token_ids:  # the copy only when it is read
            input_batch.compat_server_unmasked_logits = logits.clone()
        apply_mask(scheduler_output, grammar_output, input_batch, logits)

    @functools.wraps(original_sample)
    def sample_with_unmasked_logprobs(self, logits, spec_decode_metadata):
        unmasked = getattr(self.input_batch, "compat_server_unmasked_logits", None)
        self.input_batch.compat_server_unmasked_logits = None  # one step's copy, never carried into the next
        sampler = self.sampler
        # Only the plain sampler in raw_logprobs mode (what the vLLM sampler runs) calls compute_logprobs once, on
        # the logits it was given, for its raw logprobs; speculative decoding's rejection sampler calls it on others.
        if (unmasked is None or logits is None or unmasked.shape != logits.shape or spec_decode_metadata is not None
                or sampler.logprobs_mode != "raw_logprobs"):
            return original_sample(self, logits, spec_decode_metadata)
        compute = type(sampler).compute_logprobs
        sampler.compute_logprobs = lambda _masked: compute(unmasked)
        try:
            return original_sample(self, logits, spec_decode_metadata)
        finally:
            del sampler.compute_logprobs

    apply_mask_keeping_logits.compat_server_fix = True
    sample_with_unmasked_logprobs.compat_server_fix = True
    runner_module.apply_grammar_bitmask = apply_mask_keeping_logits
    runner_module.GPUModelRunner._sample = sample_with_unmasked_logprobs


class VLLMCorrections:
    """vLLM worker extension (``worker_extension_cls``): its import installs the corrections in the worker."""

    def compat_server_corrections(self) -> dict[str, bool]:
        """Which corrections are in place in this worker (a ``collective_rpc`` target, for checks)."""
        import vllm.v1.worker.gpu_model_runner as runner_module
        from vllm.lora.punica_wrapper import punica_cpu

        return {"prompt_logprobs_loras": getattr(runner_module.GPUModelRunner._get_prompt_logprobs_dict,
                                                 "compat_server_fix", False),
                "cpu_no_lora_rows": getattr(punica_cpu.bgmv_shrink, "compat_server_fix", False),
                "raw_logprobs_under_grammar": all(getattr(fn, "compat_server_fix", False) for fn in (
                    runner_module.apply_grammar_bitmask, runner_module.GPUModelRunner._sample))}

    def compat_server_torch_threads(self) -> int:
        """The torch threads this worker computes with (vLLM sets them from its CPU binding)."""
        import torch

        return torch.get_num_threads()


_install_prompt_logprobs_loras()
_install_cpu_no_lora_rows()
_install_raw_logprobs_under_grammar()
log.debug("vLLM corrections installed (prompt-logprobs LoRA mapping, CPU no-LoRA rows, raw logprobs under a grammar)")
