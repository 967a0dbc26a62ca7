"""Training: data (tokenizers, token files, deterministic sampling), the trainer, checkpoints and metrics."""
