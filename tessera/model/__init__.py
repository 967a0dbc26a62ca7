"""Plain PyTorch GPT-2 and Llama models; parallelism is applied from outside (see tessera.parallel)."""
