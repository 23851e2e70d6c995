"""The critic and reward servers (PyTriton) and their clients.

    contract.py   the wire contract: model names, tensor specs, request checks; ServerSpec (a server process's JSON)
    critic.py     critic_infer / critic_train / critic_save callables, loading the critic, its ranks 1..N-1
    reward.py     reward_model / reward_text callables over a reward model or reward functions, loading them
    serve.py      the serve loop: Triton up, weights loaded, models bound, until a stop or a dead rank
    main.py       the entry point of a server process (`python -m components.serving.triton.main --spec ...`)
    clients.py    the HTTP clients (models/backends.py's CriticBackend / RewardBackend over these servers)
"""
