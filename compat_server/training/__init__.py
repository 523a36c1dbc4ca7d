"""The training operations behind the Tinker routes: what each request does to records, checkpoints and the
trainers, run as scheduler jobs; the custom losses a session uploads."""
