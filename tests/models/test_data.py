"""Prompt data sets (models/data.py): every source form from files this test writes, chat messages, long prompts,
bad data refused with the file and the problem named, the seeded order and its resume, and columns reaching reward
functions."""

import json

import datasets
import pytest

from models.config import preset
from models.data import Batch, DataError, PromptSet, PromptStream, builtin_rows, encode, load_prompt_set, read_rows
from models.loop import Leader, build_actor, build_local_reward, restore_actor, save_actor
from models.policy import Policy, load_policy_tokenizer
from models.resolve import pin, resolve_data
from models.reward import load_reward_function
from models.step import prompt_ids
from models.tasks import sentiment

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

ROWS = [{"question": f"tell me about the {noun} :", "answer": i, "target": "positive" if i % 2 else "negative"}
        for i, noun in enumerate(sentiment.NOUNS)]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_policy_tokenizer(tiny_models["policy"])


def load(source, tokenizer, split="train", key="question", field="data.prompts", subset=None, **kwargs) -> PromptSet:
    """The prompts of `source` as a job reads them: pinned (models/resolve.py), then read."""
    return load_prompt_set(resolve_data(str(source), field, subset=subset), split, key, tokenizer, **kwargs)


def expect_rows(found: PromptSet, rows=ROWS):
    assert found.prompts == [r["question"] for r in rows]
    assert found.columns == [{"answer": r["answer"], "target": r["target"]} for r in rows]


def test_every_source_form_loads_with_its_columns(tmp_path, tokenizer):
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.to_json(str(tmp_path / "rows.jsonl"))
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    for name in ("rows.parquet", "rows.jsonl", "rows.json", "rows.csv"):
        expect_rows(load(tmp_path / name, tokenizer))
    # arrow, as datasets writes it
    arrow = tmp_path / "arrow"
    table.save_to_disk(str(arrow))
    (tmp_path / "rows.arrow").write_bytes(next(arrow.glob("*.arrow")).read_bytes())
    expect_rows(load(tmp_path / "rows.arrow", tokenizer))
    # a save_to_disk folder: a Dataset, and a DatasetDict whose split is chosen by data.split
    expect_rows(load(arrow, tokenizer))
    split = tmp_path / "dict"
    datasets.DatasetDict({"train": table.select(range(6)), "test": table.select(range(6, 10))}).save_to_disk(str(split))
    expect_rows(load(split, tokenizer, split="test"), ROWS[6:])
    # a folder of data files: file names decide the splits
    folder = tmp_path / "folder"
    folder.mkdir()
    table.select(range(7)).to_parquet(str(folder / "train.parquet"))
    table.select(range(7, 10)).to_parquet(str(folder / "test.parquet"))
    expect_rows(load(folder, tokenizer), ROWS[:7])
    expect_rows(load(folder, tokenizer, split="test"), ROWS[7:])
    # today's forms: .txt one prompt a line, .jsonl with a prompt field, builtin tasks
    (tmp_path / "p.txt").write_text("tell me about the cat :\n\nreview the dog :\n")
    assert load(tmp_path / "p.txt", tokenizer, key="prompt").prompts == ["tell me about the cat :", "review the dog :"]
    assert load("builtin:sentiment", tokenizer, key="prompt").prompts == sentiment.prompts(200, seed=0)
    targeted = load("builtin:sentiment_target", tokenizer, split="test", key="prompt")
    assert len(targeted) == 40 and all(f" {c['target']} " in p for p, c in zip(targeted.prompts, targeted.columns))
    assert not set(targeted.prompts) & set(sentiment.prompts(200, seed=0))  # held out from the training prompts


def test_bad_data_is_refused_naming_the_file_and_the_problem(tmp_path, tokenizer):
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(DataError, match=r"data.prompts: '.*rows.parquet' has no column 'prompt' \(the prompt_key\); "
                                        r"its columns: \['question', 'answer', 'target'\]"):
        load(tmp_path / "rows.parquet", tokenizer, key="prompt")
    (tmp_path / "broken.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"data.prompts: cannot read '.*broken.parquet': "):
        load(tmp_path / "broken.parquet", tokenizer)
    with pytest.raises(FileNotFoundError, match=r"^data.prompts: '.*missing.jsonl' does not exist"):
        load(tmp_path / "missing.jsonl", tokenizer)
    (tmp_path / "rows.xlsx").write_bytes(b"")
    with pytest.raises(DataError, match=r"unknown extension '.xlsx'"):
        load(tmp_path / "rows.xlsx", tokenizer)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"has no split 'validation' \(data.split\); its splits: \['train'\]"):
        load(tmp_path / "dict", tokenizer, split="validation")
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(DataError, match=r"split 'train' of '.*empty.parquet' is empty"):
        load(tmp_path / "empty.parquet", tokenizer)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"question": " "}) + "\n")
    with pytest.raises(DataError, match=r"must hold non-empty strings or chat messages; rows \[0\]"):
        load(tmp_path / "blank.jsonl", tokenizer)
    with pytest.raises(DataError, match=r"unknown builtin task 'math'; known: sentiment, sentiment_target"):
        load("builtin:math", tokenizer)
    with pytest.raises(FileNotFoundError, match=r"^data.prompts: 'someone/some-data-set' is not in the Hugging Face "
                                                r"cache .*`hf download someone/some-data-set --repo-type dataset`"):
        resolve_data("someone/some-data-set")  # nothing downloads here: said so, with the command that fetches it


def test_chat_messages_are_rendered_with_the_policys_chat_template(tmp_path, tokenizer, tiny_models):
    rows = [{"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "review the cat :"}],
             "target": "positive"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="holds chat messages, but the policy's tokenizer has no chat template"):
        load(tmp_path / "chat.jsonl", tokenizer, key="messages")
    templated = load_policy_tokenizer(tiny_models["policy"])
    templated.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}assistant :{% endif %}")
    found = load(tmp_path / "chat.jsonl", templated, key="messages")
    assert found.templated and found.columns == [{"target": "positive"}]
    assert found.prompts == ["system : be kind user : review the cat : assistant :"]
    assert encode(templated, found.prompts,
                  templated=True) == [templated(found.prompts[0], add_special_tokens=False)["input_ids"]]


def test_a_prompt_longer_than_max_prompt_length_errors_is_filtered_or_cut(tmp_path, tokenizer, tiny_models):
    rows = [{"prompt": "review the cat :"}, {"prompt": "tell me about the very very big red old dog :"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    n_long = len(tokenizer(rows[1]["prompt"])["input_ids"])
    limit = n_long - 3
    with pytest.raises(DataError, match=rf"1 of 2 prompts .* longer than max_prompt_length={limit} tokens \(row 1: "
                                        rf"{n_long} tokens\)"):
        load(tmp_path / "p.jsonl", tokenizer, key="prompt", max_prompt_length=limit)
    filtered = load(tmp_path / "p.jsonl", tokenizer, key="prompt", max_prompt_length=limit, long_prompts="filter")
    assert filtered.prompts == [rows[0]["prompt"]] and filtered.filtered == 1
    cut = load(tmp_path / "p.jsonl", tokenizer, key="prompt", max_prompt_length=limit, long_prompts="truncate_left")
    assert len(cut) == 2 and cut.truncated == 1
    cfg = preset("tiny", **{"data.max_prompt_length": limit, "data.long_prompts": "truncate_left"})
    ids = prompt_ids(Policy.load(tiny_models["policy"]), cut.prompts, False, cfg)
    full = tokenizer(rows[1]["prompt"])["input_ids"]
    assert ids == [tokenizer(rows[0]["prompt"])["input_ids"], full[-limit:]]  # the last tokens kept


def test_epochs_are_seeded_permutations_and_a_resumed_stream_goes_on_with_the_next_rows():
    rows = PromptSet([f"p{i}" for i in range(10)], [{"i": i} for i in range(10)], "test")
    stream = PromptStream(rows, batch_size=4, seed=3)
    batches = [next(stream) for _ in range(5)]  # 20 rows: two epochs, batches cross the epoch boundary
    seen = [c["i"] for b in batches for c in b.columns]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))  # none skipped or repeated
    assert seen[:10] != seen[10:]  # each epoch its own order
    assert [b.prompts for b in batches] == [[f"p{c['i']}" for c in b.columns] for b in batches]  # columns stay aligned
    again = PromptStream(rows, batch_size=4, seed=3)
    assert [next(again).prompts for _ in range(5)] == [b.prompts for b in batches]  # the seed decides
    # a run stopped after 3 batches (mid-epoch 1) resumes with exactly the rows the uninterrupted run reads next
    first = PromptStream(rows, batch_size=4, seed=3)
    for _ in range(3):
        next(first)
    saved = json.loads(json.dumps(first.state()))  # as a checkpoint keeps it
    assert saved == {"epoch": 1, "position": 2, "rows": 10}
    resumed = PromptStream.resume(rows, 4, 3, saved, iteration=3)
    assert [next(resumed).prompts for _ in range(2)] == [b.prompts for b in batches[3:]]
    # a checkpoint without a saved position: iteration x batch size rows consumed
    assert next(PromptStream.resume(rows, 4, 3, None, iteration=3)).prompts == batches[3].prompts
    with pytest.raises(DataError, match="the checkpoint was made on 10 rows, the source now has 9"):
        PromptStream.resume(PromptSet(rows.prompts[:9], rows.columns[:9], "test"), 4, 3, saved, iteration=3)


def test_reward_functions_get_the_columns_they_name():
    targeted = load_reward_function("models.tasks.sentiment:targeted_reward")  # needs `target`: no probe
    columns = [{"target": "cat", "answer": 1}, {"target": "dog", "answer": 2}]
    responses = ["the cat is good .", "the cat is good ."]  # positive, but only the first names its target
    assert targeted(["a", "b"], responses, columns) == [1.0, 0.0]
    assert targeted(["a", "b"], ["the cat is bad .", "i love the dog ."], columns) == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['target'\]; the rows have \['answer'\]"):
        targeted(["a"], ["good"], [{"answer": 1}])
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['target'\], which data.prompts 'x' does not have"):
        targeted.check_columns(["answer"], "data.prompts 'x'")
    plain = load_reward_function("models.tasks.sentiment:gold_reward")  # (prompts, responses): no column passed
    assert plain(["a", "b"], ["good .", "bad ."], columns) == [1.0, -1.0]


def everything(prompts, responses, **columns):
    return [float(a) for a in columns["answer"]]


def test_a_reward_function_with_kwargs_gets_every_column_repeated_for_each_sample():
    fn = load_reward_function("tests.models.test_data:everything")
    batch = Batch(["p", "q"], [{"answer": 3, "target": "x"}, {"answer": 5, "target": "y"}])
    k = 2
    columns = [c for c in batch.columns for _ in range(k)]  # as the step repeats them for k samples
    assert fn(["p", "p", "q", "q"], ["r"] * 4, columns) == [3.0, 3.0, 5.0, 5.0]
    assert builtin_rows("sentiment_target", "train")[0].keys() == {"prompt", "target"}


def test_the_stream_position_travels_with_the_actor_checkpoint(tiny_models, tmp_path):
    """Three iterations mid-epoch, an actor checkpoint, a fresh actor restored from it: the resumed stream hands out
    exactly the rows the uninterrupted run reads next (what the flow does on resume: models/loop.py)."""
    cfg = pin(preset("tiny", **{"deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"],
                                "algorithm": "rloo", "model.reward": tiny_models["reward"],
                                "reinforce.rollout_batch_size": 4, "reinforce.minibatch_size": 16,
                                "generation.max_new_tokens": 4}))
    rows = PromptSet(sentiment.prompts(10, seed=1), [{"i": i} for i in range(10)], "test")
    stream, reward = PromptStream(rows, 4, seed=5), build_local_reward(cfg)
    actor = Leader(cfg, build_actor(cfg))
    for _ in range(3):
        actor.step(next(stream), None, reward, stream.state())
    save_actor(actor.state, tmp_path / "ckpt")
    fresh = Leader(cfg, build_actor(cfg))
    restore_actor(fresh.state, tmp_path / "ckpt")
    assert fresh.state.iteration == 3 and fresh.state.data == {"epoch": 1, "position": 2, "rows": 10}
    resumed = PromptStream.resume(rows, 4, 5, fresh.state.data, fresh.state.iteration)
    assert [next(resumed).columns for _ in range(3)] == [next(stream).columns for _ in range(3)]
    reward.close()


def test_a_subset_picks_a_configuration_of_a_folder_that_declares_them(tmp_path, tokenizer):
    """data.subset / eval.subset: a folder whose README declares `configs` as a hub data set does (GSM8K's `main` and
    `socratic`) is read at the configuration asked for; leaving it out, or naming one it has not, says which it has;
    a source without configurations refuses a subset, naming the field."""
    main, other = ROWS[:6], ROWS[6:]
    for name, rows in (("main", main), ("socratic", other)):
        (tmp_path / "ds" / name).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_json(str(tmp_path / "ds" / name / "train.jsonl"))
    datasets.Dataset.from_list(other[:2]).to_json(str(tmp_path / "ds" / "main" / "test.jsonl"))
    (tmp_path / "ds" / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n- config_name: socratic\n  data_files:\n  - split: train\n"
        "    path: socratic/train.jsonl\n---\n")
    expect_rows(load(tmp_path / "ds", tokenizer, subset="main"), main)
    expect_rows(load(tmp_path / "ds", tokenizer, subset="socratic"), other)
    expect_rows(load(tmp_path / "ds", tokenizer, split="test", subset="main", field="eval.prompts"), other[:2])
    for kwargs, message in (({}, "data.subset: '{ds}' has several configurations ['main', 'socratic']: choose one"),
                            ({"subset": "nope"}, "data.subset: '{ds}' has no configuration 'nope'; its "
                                                 "configurations: ['main', 'socratic']"),
                            ({"subset": "socratic", "split": "test"}, "data.prompts: configuration 'socratic' of "
                                                                      "'{ds}' has no split 'test'")):
        with pytest.raises(DataError) as failure:
            load(tmp_path / "ds", tokenizer, **kwargs)
        assert str(failure.value).startswith(message.format(ds=tmp_path / "ds")), str(failure.value)
    with pytest.raises(DataError, match="^eval.subset: 'builtin:sentiment' has no configurations"):
        read_rows(resolve_data("builtin:sentiment", "eval.prompts", subset="main"), "test")
    with pytest.raises(DataError, match="^data.subset: .* has no configurations"):
        read_rows(resolve_data(str(tmp_path / "ds" / "main" / "train.jsonl"), "data.prompts", subset="main"), "train")
