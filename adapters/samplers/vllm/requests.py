"""A sampling job in vLLM's terms: its ``SamplingParams``, output constraint included."""

from __future__ import annotations

from shims.sampling.job import OutputConstraint, SampleJob


def sampling_params(job: SampleJob, streaming: bool):
    """vLLM's ``SamplingParams`` for ``job``: cumulative outputs when ``streaming``, else the final one alone."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    wants_prompt = job.prompt_logprobs or job.topk_prompt_logprobs > 0
    return SamplingParams(
        # vLLM raises a temperature in (0, 0.01) to 0.01; below GREEDY_TEMPERATURE every backend takes the argmax.
        # It refuses n > 1 when greedy: one sequence is decoded and ``CollectedOutputs`` copies it.
        n=1 if job.greedy else job.num_samples, temperature=0.0 if job.greedy else job.temperature,
        max_tokens=job.max_tokens, top_k=job.top_k or -1, top_p=job.top_p, min_p=job.min_p,
        seed=job.seed, stop=list(job.stop_strings) or None, stop_token_ids=list(job.stop_token_ids) or None,
        # A constrained text ends where its grammar does, on an end-of-sequence token (all the grammar allows once
        # the text is complete), whatever ``stop=[]`` said, as on the transformers sampler.
        ignore_eos=not job.stop_at_eos and job.constraint is None,
        include_stop_str_in_output=True, logprobs=job.topk_sample_logprobs,
        prompt_logprobs=job.topk_prompt_logprobs if wants_prompt else None,
        presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
        repetition_penalty=job.repetition_penalty, logit_bias=dict(job.logit_bias) or None,
        structured_outputs=_structured_outputs(job.constraint),
        output_kind=RequestOutputKind.CUMULATIVE if streaming else RequestOutputKind.FINAL_ONLY,
        detokenize=bool(job.stop_strings))


def _structured_outputs(constraint: OutputConstraint | None):
    """vLLM's form of an output constraint. Its ``json_object`` compiles
    ``adapters.samplers.grammar.JSON_OBJECT_SCHEMA``, as the transformers sampler does for a constraint without a
    schema."""
    from vllm.sampling_params import StructuredOutputsParams

    if constraint is None:
        return None
    if constraint.json_schema is None:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=constraint.json_schema)
