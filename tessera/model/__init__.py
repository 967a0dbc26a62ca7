"""Plain PyTorch GPT-2, Llama, Qwen2 and Qwen3 models; parallelism is applied from outside (see tessera.parallel)."""

INIT_BLOCK_ELEMENTS = 1 << 20
"""Elements of one row block drawn at once by the initialiser (tessera.model.init; torch-free, for the estimator)."""
