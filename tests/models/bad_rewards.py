"""Reward functions that break the contract, for the bad-input tests."""


def wrong_length(prompts, responses):
    return [1.0]


def nan_reward(prompts, responses):
    return [float("nan")] * len(responses)


def length_reward(prompts, responses):
    return [float(len(r.split())) for r in responses]


not_callable = 3
