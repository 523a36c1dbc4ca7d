"""The sampling operations behind the Tinker routes: sampling sessions, asample, ephemeral sampler weights, the
stability info recorded at sampling and the sampling counters."""
