"""Hugging Face interoperability: import `save_pretrained` folders, export runs as one.

- `tessera.hf.families`: one table entry per supported HF architecture (config keys and weight names);
  torch-free.
- `tessera.hf.config`: HF ``config.json`` ↔ tessera `ModelConfig`, refusing what tessera cannot represent;
  torch-free (the config module uses it).
- `tessera.hf.weights`: the HF folder as a value source ``(global_name, slices) -> tensor`` read with
  safetensors' ``get_slice``, and the inverse mapping used by the export.
- `tessera.hf.export`: a streaming safetensors writer (``tessera export RUN --format hf --out DIR``).

This package imports nothing at the top so that `tessera.config` can use its torch-free parts.
"""
