"""What every sampler backend runs: the sample job, its arithmetic (filters, penalties, prompt scores, stops) and
the JSON-schema limits of constrained decoding."""
