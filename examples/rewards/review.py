"""A reward file of a user's own, for builtin:sentiment_target (each prompt's `target` column names the thing it asks
about): `reward.function: examples/rewards/review.py:praise` (a graded score), or `names_and_praises` (a verifiable
0/1 one)."""

PRAISE = {"good", "great", "happy", "lovely", "nice", "wonderful", "love", "like"}
BLAME = {"bad", "awful", "sad", "terrible", "boring", "ugly", "hate", "dislike"}


def praise(prompts, responses, target):
    """In [-0.5, 1]: half the review's polarity ((praising - blaming words) / both, 0 with neither), plus a half when
    it names its target."""
    scores = []
    for response, thing in zip(responses, target):
        words = response.split()
        good, bad = sum(w in PRAISE for w in words), sum(w in BLAME for w in words)
        polarity = (good - bad) / (good + bad) if good + bad else 0.0
        scores.append(0.5 * polarity + (0.5 if thing in words else 0.0))
    return scores


def names_and_praises(prompts, responses, target):
    """1 when the response names its target, praises it and blames nothing, else 0."""
    scores = []
    for response, thing in zip(responses, target):
        words = set(response.split())
        scores.append(1.0 if thing in words and words & PRAISE and not words & BLAME else 0.0)
    return scores
