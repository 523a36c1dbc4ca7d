"""LoRA itself: the multi-adapter layers the trainer and the transformers sampler run, and an adapter's files on
disk in both namings (PEFT's and hosted Tinker's)."""
