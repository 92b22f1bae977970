"""Running the stages: the executor (local, Dask, SLURM), shards, MLflow tracking, code dependencies and the cost model."""
