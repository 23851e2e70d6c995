"""Environments and tools: multi-turn episodes in token ids (episodes.py), their chat format (chat.py), and the worker
processes that run the environments and reward functions with deadlines (pool.py, worker.py). Light on purpose: a
worker process imports this package without torch."""
