"""The data of the stages before RL (models/stages/data.py) and their builtin sets: TRL's row forms from files this
test writes, the RL stage's sequence layout, chat templates, length limits, bad rows refused naming the field and the
row, the gold preference of the builtin pairs, and the rows' digest. Plus the completion-only SFT loss of the tiny
policy against a float64 reference computed here token by token."""

import json
import math

import datasets
import pytest
import torch

from models.data import DataError, builtin_rows, encode
from models.losses import completion_mask, sft_loss
from models.policy import Policy, load_policy_tokenizer
from models.resolve import resolve_data
from models.stages.data import load_pairs, load_sequences, right_padded, rows_digest
from models.tasks import sentiment

# a chat template in the style of the common ones (role tags, an end-of-turn token: here EOS)
CHAT = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_policy_tokenizer(tiny_models["policy"])


@pytest.fixture
def chat_tokenizer(tiny_models):
    tok = load_policy_tokenizer(tiny_models["policy"])
    tok.chat_template = CHAT
    return tok


def test_prompt_completion_rows_take_the_rl_stages_layout(tmp_path, tokenizer):
    """prompt ids as data.prompts are encoded, then the completion's own ids, then EOS (added once)."""
    rows = [{"prompt": "tell me about the cat :", "completion": " the cat is good ."},
            {"prompt": "review the dog :", "completion": " i hate the dog . <eos>"}]
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "sft.jsonl"))
    found = load_sequences(resolve_data(str(tmp_path / "sft.jsonl"), "sft.data"), "train", tokenizer)
    for row, ids, prompt_length in zip(rows, found.ids, found.prompt_lengths):
        prompt = encode(tokenizer, [row["prompt"]], templated=False)[0]
        completion = tokenizer(row["completion"].replace(" <eos>", ""), add_special_tokens=False)["input_ids"]
        assert ids == prompt + completion + [tokenizer.eos_token_id] and prompt_length == len(prompt)


def test_chat_rows_are_rendered_and_the_completion_starts_after_the_prompt(tmp_path, chat_tokenizer):
    user = [{"role": "user", "content": "tell me about the cat"}]
    answer = [{"role": "assistant", "content": "the cat is good"}]
    datasets.Dataset.from_list([{"messages": user + answer}]).save_to_disk(str(tmp_path / "messages"))
    datasets.Dataset.from_list([{"prompt": user, "completion": answer}]).to_parquet(str(tmp_path / "pc.parquet"))
    whole = chat_tokenizer(chat_tokenizer.apply_chat_template(user + answer, tokenize=False),
                           add_special_tokens=False)["input_ids"]
    prompt = chat_tokenizer(chat_tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)["input_ids"]
    for source in (tmp_path / "messages", tmp_path / "pc.parquet"):
        found = load_sequences(resolve_data(str(source), "sft.data"), "train", chat_tokenizer)
        assert found.ids == [whole] and found.prompt_lengths == [len(prompt)] and found.mismatched == 0
        assert chat_tokenizer.decode(whole[len(prompt):]) == "the cat is good <eos>"


def test_long_rows_are_cut_or_dropped_and_counted(tokenizer):
    rows = builtin_rows("sentiment_sft", "train")[:50]
    longest = max(len(tokenizer(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows)
    found = load_sequences(resolve_data("builtin:sentiment_sft", "sft.data"), "test", tokenizer, max_length=8)
    assert all(len(ids) <= 8 for ids in found.ids) and found.truncated > 0
    assert all(p < 8 for p in found.prompt_lengths)  # a row whose prompt fills max_length is dropped, not kept
    pairs = load_pairs(resolve_data("builtin:sentiment_preference", "reward_model.data"), "test", tokenizer,
                       max_length=12)
    assert pairs.dropped > 0 and all(max(len(c), len(r)) <= 12 for c, r in zip(pairs.chosen, pairs.rejected))
    assert longest <= 64  # the tiny model's position limit holds every builtin row


def test_pairs_with_a_margin_column(tmp_path, tokenizer):
    rows = [{"prompt": "review the cat :", "chosen": " the cat is good .", "rejected": " the cat is bad .",
             "margin": 1.5, "extra": "ignored"}]
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    pairs = load_pairs(resolve_data(str(tmp_path / "pairs.json"), "reward_model.data"), "train", tokenizer)
    assert pairs.margin == [1.5] and len(pairs) == 1
    assert tokenizer.decode(pairs.chosen[0]) == "review the cat : the cat is good . <eos>"
    prompt = len(tokenizer("review the cat :")["input_ids"])  # where each completion starts (DPO scores from there)
    assert pairs.rows([0]) == {"chosen": pairs.chosen, "rejected": pairs.rejected, "margin": [1.5],
                               "prompt_lengths": [(prompt, prompt)]}


def test_bad_rows_are_refused_naming_the_field_and_the_row(tmp_path, tokenizer, chat_tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"sft.data: '.*a.jsonl' needs the columns 'prompt' and 'completion', or "
                                        r"'messages' .*its columns: \['question', 'answer'\]"):
        load_sequences(resolve_data(str(tmp_path / "a.jsonl"), "sft.data"), "train", tokenizer)
    with pytest.raises(DataError, match=r"reward_model.data: '.*a.jsonl' lacks the column\(s\) \['prompt', 'chosen', "
                                        r"'rejected'\]"):
        load_pairs(resolve_data(str(tmp_path / "a.jsonl"), "reward_model.data"), "train", tokenizer)
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "p", "chosen": " a", "rejected": " b", "margin": "x"})
                                      + "\n")
    with pytest.raises(DataError, match=r"row 0 of .*'margin' must be a number, got 'x'"):
        load_pairs(resolve_data(str(tmp_path / "b.jsonl"), "reward_model.data"), "train", tokenizer)
    talk = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": talk}) + "\n")
    with pytest.raises(DataError, match=r"row 0 of .*a conversation ending with an assistant turn"):
        load_sequences(resolve_data(str(tmp_path / "c.jsonl"), "sft.data"), "train", chat_tokenizer)
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": talk[:1] + [{"role": "assistant", "content": "x"}]})
                                      + "\n")
    with pytest.raises(DataError, match=r"holds chat messages, but the tokenizer has no chat template"):
        load_sequences(resolve_data(str(tmp_path / "d.jsonl"), "sft.data"), "train", tokenizer)
    with pytest.raises(DataError, match=r"builtin:sentiment_sft has no split 'validation'"):
        load_sequences(resolve_data("builtin:sentiment_sft", "sft.data"), "validation", tokenizer)


def test_builtin_preferences_follow_the_gold_reward_and_hold_out_their_test_split():
    train, test = builtin_rows("sentiment_preference", "train"), builtin_rows("sentiment_preference", "test")
    assert (len(train), len(test)) == (3000, 500)
    for row in train + test:  # the known function: the response with the higher gold reward is chosen
        chosen, rejected = sentiment.gold_reward([row["prompt"]] * 2, [row["chosen"], row["rejected"]])
        assert chosen > rejected
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}  # other templates: never trained on
    assert builtin_rows("sentiment_preference", "test") == test  # from a seed: the same rows every time
    sft = builtin_rows("sentiment_sft", "train")
    gold = sentiment.gold_reward([r["prompt"] for r in sft], [r["completion"] for r in sft])
    assert sum(gold) / len(gold) > 0.15  # demonstrations lean positive (the base policy's corpus is balanced)


def test_the_rows_digest_is_the_rows_not_the_file(tmp_path):
    rows = builtin_rows("sentiment_preference", "test")[:20]
    table = datasets.Dataset.from_list(rows)
    table.to_json(str(tmp_path / "p.jsonl"))
    table.to_parquet(str(tmp_path / "p.parquet"))
    digest = rows_digest(resolve_data(str(tmp_path / "p.jsonl"), "reward_model.data"), "train")
    assert rows_digest(resolve_data(str(tmp_path / "p.parquet"), "reward_model.data"), "train") == digest
    changed = [dict(r) for r in rows]
    changed[7]["chosen"] += " ."
    datasets.Dataset.from_list(changed).to_json(str(tmp_path / "q.jsonl"))
    assert rows_digest(resolve_data(str(tmp_path / "q.jsonl"), "reward_model.data"), "train") != digest
    datasets.Dataset.from_list(rows[::-1]).to_json(str(tmp_path / "r.jsonl"))
    # order is data too
    assert rows_digest(resolve_data(str(tmp_path / "r.jsonl"), "reward_model.data"), "train") != digest


def test_sft_loss_of_the_policy_matches_a_float64_reference(tiny_models, tokenizer):
    """Our completion-only loss on a batch of builtin rows (right-padded, prompts of different lengths) against the
    mean over completion tokens of -log softmax(logits)[next token], computed here in float64 one row at a time from
    each row's own, unpadded, forward pass: prompt tokens and padding carry no loss."""
    found = load_sequences(resolve_data("builtin:sentiment_sft", "sft.data"), "test", tokenizer)
    rows = found.rows(list(range(6)))
    policy = Policy.load(tiny_models["policy"], reference=False)
    tokens, lengths = right_padded(rows["ids"], tokenizer.pad_token_id)
    mask = completion_mask(torch.tensor(rows["prompt_lengths"]), lengths, tokens.shape[1])
    with torch.no_grad():
        ours, _ = sft_loss(policy.logprobs(tokens, lengths)[0], mask)
        model = policy.model.double()
        terms = []
        for ids, prompt_length in zip(rows["ids"], rows["prompt_lengths"]):
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            for t in range(prompt_length, len(ids)):  # predict token t from tokens[:t]
                terms.append(-(logits[t - 1].log_softmax(-1)[ids[t]]).item())
        every_position = float(-policy.logprobs(tokens, lengths)[0].double().mean())
    assert len(terms) == int(mask.sum())
    assert ours.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert not math.isclose(ours.item(), every_position, rel_tol=1e-3)  # the masks matter on these rows
