"""Linear probes: protocols and splits (IS, IOCD, MOCV, LOOO), the batched L-BFGS engine, scores and their statistics."""
