"""The vLLM rollout server: vLLM's own engine behind a small FastAPI app (uvicorn), run in its own environment, and its
client.

The server runs in `.venv-vllm` (Makefile `vllm-venv`), never in the project's: vLLM needs numpy >= 2, PyTriton pins
numpy < 2. So its modules (app, weights, body, main, group, openai) import nothing from the project but each other,
models/chat.py (the chat templates and tool-call parsing the trainer uses too), models/rendezvous.py (the weight
group's admission by the run's secret, the trainer's too), components/handshake.py (the run's proof and request
signatures) and components/serving/connections.py (its connections, bounded), which import nothing of the project
themselves (tests/test_imports.py checks it); this package's __init__ (like components/, components/serving/ and
models/) imports nothing. On a cluster the server is its own pod, from an image with `vllm`.

    app.py      the FastAPI app: endpoints, the Guard (proof, signatures, body sizes, requests in flight), ServedModel
    weights.py  the `dist` weight transfer: a torch.distributed group as a vLLM weight-transfer engine
    body.py     the `http` weight transfer's body: a streaming reader and the safetensors header
    group.py    the torch.distributed group both sides of the `dist` transfer join (actor's rank 0, engine's workers),
                admitted by the run's secret, and the tensors' digests
    openai.py   the OpenAI-compatible endpoints environments use (chat completions, tokenize, token generate)
    main.py     the entry point: `python -m components.serving.rollout.main --model DIR --port P ...`
    client.py   the client (rank 0 of the actor, in the project's environment): requests and the weight transfers
"""
