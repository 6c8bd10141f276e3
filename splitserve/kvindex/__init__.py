"""What a worker's prefix cache holds, keyed from token ids alone: the block keys (`keys`) that a
worker computes for the blocks its engine stores and that the router computes for a prompt, so
the two agree without sharing vLLM's hash function or `PYTHONHASHSEED`."""
