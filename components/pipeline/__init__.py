"""The whole RLHF pipeline as one DAG: sft -> reward_model -> rl -> eval, each stage cached by what it was made from
(config.py: its config; cache.py: keys, records and the build lock; run.py: the pipeline; lineage.py: MLflow)."""
