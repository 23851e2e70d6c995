"""Reward functions that break the contract, for the bad-input tests."""


def wrong_length(prompts, responses):
    return [1.0]


def nan_reward(prompts, responses):
    return [float("nan")] * len(responses)


def length_reward(prompts, responses):
    return [float(len(r.split())) for r in responses]


not_callable = 3


def half_constant_reward(prompts, responses):
    """0 for every sample of a prompt of even length (its group's scores are all equal: dynamic sampling drops it),
    else the parity of the response's word count."""
    return [0.0 if len(p) % 2 == 0 else float(len(r.split()) % 2) for p, r in zip(prompts, responses)]
