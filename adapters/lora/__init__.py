"""LoRA itself: where it goes in a model of any family (``targets``), the multi-adapter modules that run it
(``linear``, ``experts``, routed by row: ``routing``), the one LoRA model the trainer and the transformers sampler
share (``model``), and an adapter's files in both namings, PEFT's and hosted Tinker's (``files``)."""
