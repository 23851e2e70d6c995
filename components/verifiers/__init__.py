"""verifiers environments (the classic API of verifiers 0.2.1) on the run's rollout server.

    worker.py   runs in .venv-verifiers (`make verifiers-venv`): loads an environment, runs a batch of rollouts with
                verifiers' own OpenAI clients against the rollout server, answers plain JSON (token ids, logprobs,
                masks, rewards per rollout); imports nothing of the project (this __init__ imports nothing either)
    rollouts.py the trainer's side (the project's environment): starts the worker with a deadline, reads its answer
"""
