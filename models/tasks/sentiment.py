"""The shipped task: review a thing positively.

A policy pretrained (by `rlhf models tiny`) on a balanced corpus of positive, negative and neutral reviews starts with a
mean gold reward near 0; RLHF against the reward model (trained on the gold function) should move it towards +1.
The gold reward is the sentiment polarity of the response: (#positive - #negative) / (#positive + #negative), in [-1,
1], 0 for a response with no sentiment word. Everything is generated from a seed: no data set is downloaded.
"""

from __future__ import annotations

import random

NOUNS = ["cat", "dog", "movie", "food", "song", "book", "city", "game", "park", "team"]
POSITIVE = ["good", "great", "happy", "lovely", "nice", "wonderful", "love", "like"]
NEGATIVE = ["bad", "awful", "sad", "terrible", "boring", "ugly", "hate", "dislike"]
NEUTRAL_ADJ = ["big", "small", "red", "old", "new", "blue"]
NEUTRAL_VERB = ["see", "know"]
ADVERBS = ["very", "really", "so", "quite"]
FUNCTION_WORDS = ["the", "a", "is", "was", "and", "but", "i", "it", "this", "tell", "me", "about", "what", "do",
                  "you", "think", "of", "describe", "review", ":", "."]
PROMPT_TEMPLATES = ["tell me about the {n} :", "what do you think of the {n} :", "describe the {n} :",
                    "review the {n} :"]
POS_ADJ, NEG_ADJ = POSITIVE[:6], NEGATIVE[:6]
POS_VERB, NEG_VERB = POSITIVE[6:], NEGATIVE[6:]


def vocabulary() -> list[str]:
    words = NOUNS + POSITIVE + NEGATIVE + NEUTRAL_ADJ + NEUTRAL_VERB + ADVERBS + FUNCTION_WORDS
    return list(dict.fromkeys(words))


# held-out prompts (the `test` split of the builtin tasks): the training templates' verbs with "this" for "the"
EVAL_TEMPLATES = ["tell me about this {n} :", "what do you think of this {n} :", "describe this {n} :",
                  "review this {n} :"]


def prompts(n: int = 200, seed: int = 0, templates: list[str] = PROMPT_TEMPLATES) -> list[str]:
    """All template x noun prompts, shuffled deterministically and cycled to n."""
    rng = random.Random(seed)
    base = [t.format(n=noun) for t in templates for noun in NOUNS]
    rng.shuffle(base)
    return [base[i % len(base)] for i in range(n)]


def _clause(rng: random.Random, noun: str, mood: str) -> str:
    adj = {"pos": POS_ADJ, "neg": NEG_ADJ, "neu": NEUTRAL_ADJ}[mood]
    verb = {"pos": POS_VERB, "neg": NEG_VERB, "neu": NEUTRAL_VERB}[mood]
    form = rng.randrange(4)
    if form == 0:
        adv = f"{rng.choice(ADVERBS)} " if rng.random() < 0.4 else ""
        return f"the {noun} is {adv}{rng.choice(adj)}"
    if form == 1:
        return f"i {rng.choice(verb)} the {noun}"
    if form == 2:
        return f"it was {rng.choice(adj)}"
    return f"this {noun} is {rng.choice(adj)}"


def sample_response(rng: random.Random, noun: str) -> str:
    """A review of 1-3 clauses; each clause's mood is drawn uniformly from positive/negative/neutral."""
    clauses = [_clause(rng, noun, rng.choice(["pos", "neg", "neu"])) for _ in range(rng.choice([1, 1, 2, 2, 3]))]
    joined = clauses[0]
    for clause in clauses[1:]:
        joined += f" {rng.choice(['and', 'but'])} {clause}"
    return joined + " ."


def corpus(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, response) pairs for pretraining the tiny policy and the reward model."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        noun = rng.choice(NOUNS)
        pairs.append((rng.choice(PROMPT_TEMPLATES).format(n=noun), sample_response(rng, noun)))
    return pairs


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Sentiment polarity of each response in [-1, 1]."""
    pos, neg = set(POSITIVE), set(NEGATIVE)
    scores = []
    for response in responses:
        words = response.split()
        p, q = sum(w in pos for w in words), sum(w in neg for w in words)
        scores.append((p - q) / (p + q) if p + q else 0.0)
    return scores


# ---------------------------------------------------------------- a task whose reward needs a dataset column


def targeted_rows(n: int = 200, seed: int = 0, templates: list[str] = PROMPT_TEMPLATES) -> list[dict]:
    """`builtin:sentiment_target`: the task's prompts, each with the thing it asks about in a `target` column (the
    "answer" a verifiable reward checks, as a math data set's solution column)."""
    return [{"prompt": prompt, "target": next(noun for noun in NOUNS if f" {noun} " in f" {prompt} ")}
            for prompt in prompts(n, seed, templates)]


def targeted_reward(prompts: list[str], responses: list[str], target: list[str]) -> list[float]:
    """A verifiable 0/1 reward reading the `target` column: 1 when the response is a positive review (gold_reward
    > 0) that names its target, else 0."""
    polarity = gold_reward(prompts, responses)
    return [1.0 if g > 0 and t in r.split() else 0.0 for g, t, r in zip(polarity, target, responses)]


# ---------------------------------------------------------------- data of the stages before RL (models/stages/)

# SFT demonstrations lean positive, as a demonstrator asked for helpful reviews would write them: the SFT policy starts
# above the base policy's gold reward, and RL against a reward model has room left above it
DEMONSTRATION_MOODS = ("pos", "pos", "neu", "neg")


def sft_rows(n: int, seed: int = 0, templates: list[str] = PROMPT_TEMPLATES) -> list[dict]:
    """`builtin:sentiment_sft`: prompt/completion rows (TRL's prompt-completion form); each completion a review of 1-3
    clauses whose moods are drawn from DEMONSTRATION_MOODS. The completion starts with a space, so prompt +
    completion reads as one text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        noun = rng.choice(NOUNS)
        clauses = [_clause(rng, noun, rng.choice(DEMONSTRATION_MOODS)) for _ in range(rng.choice([1, 2, 2, 3]))]
        text = clauses[0] + "".join(f" {rng.choice(['and', 'but'])} {c}" for c in clauses[1:])
        rows.append({"prompt": rng.choice(templates).format(n=noun), "completion": f" {text} ."})
    return rows


def _drift(rng: random.Random, noun: str) -> str:
    """A response as an over-optimised policy may write one: sentiment words piled up, with or without grammar."""
    pool = rng.choice([POSITIVE, NEGATIVE, POSITIVE + NEGATIVE])
    words = [rng.choice(pool + ["the", noun, "is", "and", "very"]) for _ in range(rng.randint(1, 10))]
    return " ".join(words) + (" ." if rng.random() < 0.7 else "")


def preference_rows(n: int, seed: int = 0, templates: list[str] = PROMPT_TEMPLATES) -> list[dict]:
    """`builtin:sentiment_preference`: prompt/chosen/rejected rows (TRL's preference form) whose preference is a known
    function: of two responses to a prompt, the one with the higher gold_reward is chosen (pairs of equal gold reward
    are drawn again). Responses are reviews like the pretraining corpus (80%) or drifts (20%), so the reward model also
    sees what a policy pushing on it writes. Responses start with a space, as sft_rows' completions."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        noun = rng.choice(NOUNS)
        prompt = rng.choice(templates).format(n=noun)
        a, b = (sample_response(rng, noun) if rng.random() < 0.8 else _drift(rng, noun) for _ in range(2))
        ga, gb = gold_reward([prompt, prompt], [a, b])
        if ga == gb:
            continue
        chosen, rejected = (a, b) if ga > gb else (b, a)
        rows.append({"prompt": prompt, "chosen": f" {chosen}", "rejected": f" {rejected}"})
    return rows
