"""Environment episodes in token ids (models/environments/): the chat format against TRL 1.16's own functions, the
token bookkeeping of an episode, the loss mask, the worker processes' deadlines and kills, and the refusals, on the
tiny chat model's tokenizer. The model's turns come from a scripted engine (what a policy would sample, given as
text): the bookkeeping around the engine is what is tested; the real engines sample in tests/models/
test_environment_runs.py. The environments and reward functions are tests/models/environments.py, written in TRL's
protocol."""

import copy
import json
import math
import re
import types
from pathlib import Path

import pytest
import torch

from models.config import Sampling, preset
from models.engines.base import Rollout, from_responses
from models.environments.chat import ChatFormat, ChatFormatError
from models.environments.episodes import episode_metrics, episode_rows, episode_stats, start_episodes
from models.tasks.arithmetic import CALCULATOR_TOOL

HERE = Path(__file__).parent
ENVS = HERE / "environments.py"
CALCULATOR = HERE.parent.parent / "examples" / "environments" / "calculator.py"
LOGP = -0.25  # what the scripted engine says each sampled token's logprob is


@pytest.fixture(scope="module")
def chat_dir(tiny_dir) -> str:
    return str(tiny_dir / "chat")


@pytest.fixture(scope="module")
def tokenizer(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def trl():
    """TRL 1.16's own chat-template functions and its GRPOTrainer (the reference the bookkeeping must equal)."""
    import trl.chat_template_utils as utils
    from trl.trainer.grpo_trainer import GRPOTrainer

    return types.SimpleNamespace(utils=utils, GRPOTrainer=GRPOTrainer)


class ScriptedEngine:
    """A rollout engine whose turns are given as text by `reply(context text)`; the turn is cut at its first
    end-of-turn token (kept) or at max_new_tokens, like a real engine's."""

    name, shares_actor_weights = "scripted", True

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, 0

    def generate(self, prompt_ids, n, sampling, generator=None) -> Rollout:
        self.calls += 1
        rows = [p for p in prompt_ids for _ in range(n)]
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        responses, ends = [], []
        header = self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        for ids in rows:
            starts = [i + len(header) for i in range(len(ids) - len(header) + 1) if ids[i:i + len(header)] == header]
            partial = ids[starts[-1]:]  # a turn an earlier call began (cut at its max_new_tokens) goes on
            whole = self.tokenizer(self.reply(self.tokenizer.decode(ids[:starts[-1]])), add_special_tokens=False)
            out = whole["input_ids"][len(partial):]
            end = next((i for i, t in enumerate(out) if t in stops), None)
            ended = end is not None and end < sampling.max_new_tokens
            responses.append(out[:end + 1] if ended else out[:sampling.max_new_tokens])
            ends.append(ended)
        return from_responses(rows, responses, [[LOGP] * len(r) for r in responses], ends, self.tokenizer.pad_token_id)


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


def echo_then_done(context: str) -> str:
    """Calls echo once (its argument from the question), then says done."""
    if "<tool_response>" in context:
        return "done<|im_end|>"
    return call("echo", text=re.findall(r"say (\w+)", context)[-1])


def config(chat_dir, factory, rewards=(), **environment):
    return preset("none",
                  **{"model.policy": chat_dir, "data.prompts": "builtin:arithmetic", "reward.source": "function",
                             "environment.factory": factory, "environment.workers": environment.pop("workers", 2),
                             **({"reward.functions": list(rewards)} if rewards else {}),
                             **{f"environment.{k}": v for k, v in environment.items()}})


@pytest.fixture(scope="module")
def runners(chat_dir, tokenizer):
    """start(factory, rewards, **environment) -> an EpisodeRunner on the chat model's tokenizer (one per settings in
    this module: starting workers is what takes time); all closed after the module."""
    from transformers import AutoConfig

    started = {}

    def start(factory, rewards=(), **environment):
        key = json.dumps([factory, list(rewards), environment], sort_keys=True)
        if key not in started:
            started[key] = start_episodes(config(chat_dir, factory, rewards, **environment), tokenizer,
                                          AutoConfig.from_pretrained(chat_dir))
        return started[key]

    yield start
    for runner in started.values():
        runner.close()


def echo_runner(runners):
    """The Echo environment with two reward functions and at most 2 rounds of tool calls (shared by the tests)."""
    return runners(f"{ENVS}:Echo", [f"{ENVS}:last_text", f"{ENVS}:tool_calls_made"], max_turns=2)


def play(runner, tokenizer, reply, rows, max_new_tokens=200):
    return runner.play(ScriptedEngine(tokenizer, reply), rows, Sampling(max_new_tokens=max_new_tokens), None,
                       max_new_tokens, tokenizer.pad_token_id)


# ---------------------------------------------------------------- the chat format is TRL's

def test_the_chat_format_is_trl_s(tokenizer, trl):
    """The tiny chat model carries Qwen2.5's template byte for byte (so TRL recognises it) and a response template;
    prompt ids, tool-reply suffix ids and parsed turns are what TRL's own code makes of them (parallel calls kept,
    malformed and truncated calls read as text); the prefix check agrees with TRL's."""
    utils = trl.utils
    assert tokenizer.chat_template == utils.qwen2_5_chat_template
    assert utils.is_chat_template_prefix_preserving(tokenizer) and utils.supports_tool_calling(tokenizer)
    chat = ChatFormat(tokenizer)
    chat.check("model.policy")
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    ids = chat.prompt_ids(prompt, [CALCULATOR_TOOL])
    theirs = tokenizer.apply_chat_template(conversation=[prompt], tools=[CALCULATOR_TOOL], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"][0]
    assert ids == list(theirs)
    trainer = types.SimpleNamespace(processing_class=tokenizer, chat_template=None, _is_vlm=False, _tokenizer=tokenizer,
                                    chat_template_kwargs={})
    for replies in (["3"], ["1", str({"error": "division by zero"})], ["a\nb" * 5]):
        messages = [{"role": "tool", "name": "calculate", "content": c} for c in replies]
        assert chat.suffix_ids(messages) == trl.GRPOTrainer._get_tool_suffix_ids(trainer, messages)
    turns = [call("calculate", expression="1 + 2"),
             call("calculate", expression="1 + 2")[:-len("<|im_end|>")] + "\n" + call("calculate", expression="3"),
             "3<|im_end|>", '<tool_call>\n{"name": "calculate", "argu<|im_end|>', '<tool_call>\n{"name": "calc',
             'so <tool_call>{"type":"function"</tool_call><|im_end|>']
    for text in turns:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert chat.parse(turn, ids, [CALCULATOR_TOOL]) == utils.parse_response(tokenizer, turn, prefix=ids,
                                                                                tools=[CALCULATOR_TOOL]), text
    assert len(chat.parse(tokenizer(turns[1], add_special_tokens=False)["input_ids"], ids, None)["tool_calls"]) == 2

    qwen3 = utils.qwen3_chat_template  # drops past reasoning: not prefix-preserving (prime-rl#1334)
    swapped = copy.deepcopy(tokenizer)
    swapped.chat_template = qwen3
    assert not utils.is_chat_template_prefix_preserving(swapped)
    with pytest.raises(ChatFormatError, match=r"environment.chat_template: .*not prefix-preserving.*qwen3_training"):
        ChatFormat(tokenizer, qwen3).check("environment.chat_template")
    training = (Path(utils.__file__).parent / "chat_templates" / "qwen3_training.jinja").read_text()
    ChatFormat(tokenizer, training).check("environment.chat_template")  # TRL's training template swapped in: accepted
    dropped = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # no tool calls rendered
    with pytest.raises(ChatFormatError, match="drops the tool call's name, key, value"):
        ChatFormat(tokenizer, dropped).check("environment.chat_template")
    bare = types.SimpleNamespace(**{k: getattr(tokenizer, k) for k in ("chat_template", "eos_token_id",
                                                                        "apply_chat_template")}, response_template=None)
    with pytest.raises(ChatFormatError, match="model.policy: .*no response template"):
        ChatFormat(bare, model_type="gpt2").check("model.policy")


def test_tool_schemas_are_get_json_schema_s(runners, tokenizer):
    """The calculator's tool, as the worker probes it, is transformers' get_json_schema of its method, and the task's
    SFT rows carry the same schema."""
    from transformers.utils import get_json_schema

    from models.specs import import_object

    runner = runners(f"{CALCULATOR}:Calculator", [f"{CALCULATOR}:correct"], workers=1)
    calculator = import_object(f"{CALCULATOR}:Calculator", "test", "class")()
    assert runner.environments[""]["tools"] == [get_json_schema(calculator.calculate)] == [CALCULATOR_TOOL]
    assert runner.environments[""]["has_reward"] is False and runner.names == ["correct"]


# ---------------------------------------------------------------- an episode in token ids

def test_an_episode_is_its_prompt_turns_and_tool_replies_in_token_ids(runners, tokenizer, trl):
    """prompt (reset's observation appended to the user message) + the model's tool call + the tool reply as TRL's
    suffix ids + the model's answer: the ids never re-tokenised, mask 1 and the engine's logprobs on the model's
    turns, 0 on the reply; the reward terms: the functions (one reading environments=), then get_reward named after
    the class (weight 1), summed."""
    runner = echo_runner(runners)
    rows = [{"prompt": [{"role": "user", "content": "please say "}], "observation": "hello"}]
    played = play(runner, tokenizer, echo_then_done, rows)
    episode = played.episodes[0]
    chat = ChatFormat(tokenizer)
    prompt = chat.prompt_ids([{"role": "user", "content": "please say hello"}], runner.environments[""]["tools"])
    turn1 = tokenizer(call("echo", text="hello"), add_special_tokens=False)["input_ids"]
    trainer = types.SimpleNamespace(processing_class=tokenizer, chat_template=None, _is_vlm=False, _tokenizer=tokenizer,
                                    chat_template_kwargs={})
    reply = trl.GRPOTrainer._get_tool_suffix_ids(trainer, [{"role": "tool", "name": "echo", "content": "hello"}])
    turn2 = tokenizer("done<|im_end|>", add_special_tokens=False)["input_ids"]
    assert episode.prompt_ids == prompt
    assert episode.ids == turn1 + reply + turn2
    assert episode.mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert episode.logprobs == [LOGP] * len(turn1) + [0.0] * len(reply) + [LOGP] * len(turn2)
    assert [m["role"] for m in episode.completion] == ["assistant", "tool", "assistant"]
    assert episode.completion[1] == {"role": "tool", "name": "echo", "content": "hello"}
    assert (episode.end, episode.turns, episode.rounds, episode.tool_calls) == ("stop", 2, 1, 1)
    assert runner.names == ["last_text", "tool_calls_made", "Echo"] and runner.weights == [1.0, 1.0, 1.0]
    assert episode.values == [1.0, 1.0, 1.0] and float(played.scores[0]) == 3.0

    rollout = played.rollout  # the engine layout: [prompt, completion, pad], the mask over actions
    p = len(prompt)
    assert rollout.tokens[0, :p + len(episode.ids)].tolist() == prompt + episode.ids
    assert rollout.loss_mask[0, p - 1:p - 1 + len(episode.ids)].tolist() == episode.mask
    assert float(rollout.loss_mask.sum()) == len(turn1) + len(turn2) == int(rollout.sampled_lengths[0])
    assert float(rollout.response_mask.sum()) == len(episode.ids)
    assert torch.equal(rollout.sample_logprobs * (1 - rollout.loss_mask), torch.zeros_like(rollout.sample_logprobs))
    m = episode_metrics(episode_stats(played.episodes))
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.0 and m["env/turns_mean"] == 2.0
    row = episode_rows(played.episodes, runner.names)[0]
    assert row["conversation"] == ("[assistant calls echo] {'text': 'hello'}\n[tool echo] hello\n[assistant] done")
    assert (row["turns"], row["tool_calls"], row["score"], row["reward/Echo"]) == (2, 1, 3.0, 1.0)


def test_limits_end_episodes_as_trl_does(runners, tokenizer):
    """environment.max_turns rounds of tool calls, then the episode ends on its call; a tool reply that does not fit
    generation.max_new_tokens is dropped and ends it ('overlong'); a turn cut at the budget ends it unended
    ('length'); a failing tool is the model's to see ({'error': ...}, a tool failure, not an environment error); a
    malformed call is text and ends it."""
    runner = echo_runner(runners)

    def always(context):
        return call("echo", text="again")

    played = play(runner, tokenizer, always, [{"prompt": "say again"}])
    episode = played.episodes[0]
    # the 3rd: not run
    assert (episode.end, episode.turns, episode.rounds, episode.tool_calls) == ("max_turns", 3, 2, 2)
    assert episode_metrics(episode_stats(played.episodes))["env/turn_limit_ratio"] == 1.0

    turn = len(tokenizer(call("echo", text="again"), add_special_tokens=False)["input_ids"])
    played = play(runner, tokenizer, always, [{"prompt": "say again"}], max_new_tokens=turn + 5)
    assert played.episodes[0].end == "overlong" and played.episodes[0].ids == played.episodes[0].ids[:turn]
    assert [m["role"] for m in played.episodes[0].completion] == ["assistant"]
    played = play(runner, tokenizer, always, [{"prompt": "say again"}], max_new_tokens=4)
    assert (played.episodes[0].end, played.episodes[0].is_end, len(played.episodes[0].ids)) == ("length", False, 4)
    assert bool(played.rollout.is_end[0]) is False

    runner.position_limit = None  # the engine's room: a turn cut by a neighbour's short room goes on at the next call
    short, long = [{"prompt": "say again"}], [{"prompt": "say again " + "and again " * 40}]
    long_prompt = len(ChatFormat(tokenizer).prompt_ids([{"role": "user", "content": long[0]["prompt"]}],
                                                     runner.environments[""]["tools"]))
    runner.position_limit = long_prompt + 6
    engine = ScriptedEngine(tokenizer, lambda c: "done<|im_end|>" if "and again" in c else call("echo", text="x"))
    played = runner.play(engine, short + long, Sampling(max_new_tokens=200), None, 200, tokenizer.pad_token_id)
    whole = tokenizer(call("echo", text="x"), add_special_tokens=False)["input_ids"]
    assert played.episodes[0].ids[:len(whole)] == whole and played.episodes[0].turns >= 1
    assert played.episodes[0].completion[0]["tool_calls"][0]["function"]["arguments"] == {"text": "x"}
    assert engine.calls > 2 and played.episodes[1].end == "stop"
    runner.position_limit = 512

    def failing(context):
        return "done<|im_end|>" if "<tool_response>" in context else call("echo", text="fail")

    episode = play(runner, tokenizer, failing, [{"prompt": "say fail"}]).episodes[0]
    assert episode.completion[1]["content"] == str({"error": "refusing to echo 'fail'"}) and episode.end == "stop"
    assert (episode.tool_failures, episode.error) == (1, "")

    def broken(context):
        return '<tool_call>\n{"name": "echo", "argu<|im_end|>'

    episode = play(runner, tokenizer, broken, [{"prompt": "say it"}]).episodes[0]
    assert (episode.end, episode.tool_calls, episode.completion[0].get("tool_calls")) == ("stop", 0, None)


def test_rows_pick_their_environment_and_rewards_take_trl_s_convention_and_ours(runners, tokenizer):
    """A mapping of factories: each row's `environment` column picks one, and get_reward scores only its own class's
    episodes (NaN elsewhere, left out of the sum); reward functions read columns, environments=, or (ours) texts."""
    runner = runners({"echo": f"{ENVS}:Echo", "calc": f"{CALCULATOR}:Calculator"},
                     [f"{ENVS}:answer_column", f"{ENVS}:plain_texts"])
    rows = [{"prompt": "say hi", "environment": "echo", "answer": "yes"},
            {"prompt": "say hi", "environment": "calc", "answer": "no"}]
    played = play(runner, tokenizer, lambda c: "done<|im_end|>", rows)
    assert runner.names == ["answer_column", "plain_texts", "Echo"]
    assert played.episodes[0].values == [1.0, 1.0, 0.0] and played.scores.tolist() == [2.0, 1.0]
    assert played.episodes[1].values[:2] == [0.0, 1.0] and math.isnan(played.episodes[1].values[2])
    assert played.episodes[0].tools != played.episodes[1].tools  # each prompt rendered with its own tools
    with pytest.raises(ValueError, match="environment.factory: a row asks for the environment 'nope'"):
        play(runner, tokenizer, lambda c: "done<|im_end|>", [{"prompt": "x", "environment": "nope", "answer": "y"}])


# ---------------------------------------------------------------- workers: deadlines, kills, failures

def test_a_hung_tool_is_killed_and_the_episodes_go_on(runners, tokenizer):
    """A tool that never returns: its worker is killed at the call deadline (SIGKILL) and replaced; that episode
    scores 0 as a timeout, the episode whose instance lived in the same worker is lost (an error), an episode in the
    other worker is scored; the next batch plays on the same pool. A tool that kills its process is an error."""
    runner = runners({"stall": f"{ENVS}:Stall", "echo": f"{ENVS}:Echo"}, [f"{ENVS}:last_text"], call_deadline_s=3)
    script = {"stall": lambda c: call("wait", seconds=1), "crash": lambda c: call("crash")}

    def reply(context):
        if "<tool_response>" in context:
            return "done<|im_end|>"
        for word, turn in script.items():
            if f"please {word}" in context:
                return turn(context)
        return call("echo", text="hi")

    rows = [{"prompt": "please stall", "environment": "stall"},  # stall#0 -> worker 0
            {"prompt": "say hi", "environment": "echo"},  # echo#0 -> worker 0: lost with it
            {"prompt": "say hi", "environment": "echo"}]  # echo#1 -> worker 1
    played = play(runner, tokenizer, reply, rows)
    assert [e.end for e in played.episodes] == ["timeout", "error", "stop"]
    assert "did not return within 3 s" in played.episodes[0].error and "lost" in played.episodes[1].error
    assert played.scores.tolist() == [0.0, 0.0, 2.0] and runner.pool.restarts == 1  # last_text + Echo
    assert float(played.rollout.loss_mask[:2].sum()) == 0  # the failures carry no loss
    m = episode_metrics(episode_stats(played.episodes))
    assert (m["env/timeouts"], m["env/errors"]) == (1.0, 1.0)
    again = play(runner, tokenizer, reply, [{"prompt": "say hi", "environment": "echo"}] * 2)
    assert again.scores.tolist() == [2.0, 2.0]
    crashed = play(runner, tokenizer, reply, [{"prompt": "please crash", "environment": "stall"}])
    assert crashed.episodes[0].end == "error" and "exited with code 9" in crashed.episodes[0].error
    assert runner.pool.restarts == 2


def test_reward_functions_that_raise_or_hang_score_zero_and_one_with_an_alarm_works(runners, tokenizer):
    """Three workers, an episode in each: a reward function that raises on the first worker's episodes makes them
    errors (0), one that never returns on the second's a timeout (its worker killed); on the third, a reward that
    sets signal.alarm (math_verify's way) works, for it runs in its worker's main thread."""
    runner = runners(f"{ENVS}:Echo", [f"{ENVS}:with_alarm", f"{ENVS}:raises_on_boom", f"{ENVS}:hangs_on_hang"],
                     workers=3, call_deadline_s=2)
    rows = [{"prompt": "say hi", "flag": flag} for flag in ("boom", "hang", "")]  # Echo#j lives in worker j
    played = play(runner, tokenizer, lambda context: "done<|im_end|>", rows)
    assert [e.end for e in played.episodes] == ["error", "timeout", "stop"]
    assert "reward function raises_on_boom: RuntimeError: this reward function is broken" in played.episodes[0].error
    assert played.scores.tolist() == [0.0, 0.0, 0.5] and played.episodes[2].values == [0.5, 0.0, 0.0, 0.0]
    m = episode_metrics(episode_stats(played.episodes))
    assert (m["env/errors"], m["env/timeouts"]) == (1.0, 1.0)


def test_an_environment_of_one_session_is_serialised_or_refused(runners, tokenizer, tmp_path, chat_dir):
    """SUPPORTS_CONCURRENT_SESSIONS = False: each episode runs alone (its reset and calls before the next one's
    reset), or the run is refused naming environment.single_session."""
    log = tmp_path / "calls.log"
    runner = runners(f"{ENVS}:OneSession", [f"{ENVS}:last_text"])

    def reply(c):
        return "done<|im_end|>" if "<tool_response>" in c else call("echo", text="x")

    engine = ScriptedEngine(tokenizer, reply)
    played = runner.play(engine, [{"prompt": "say x", "log": str(log)}] * 3, Sampling(max_new_tokens=100), None, 100,
                         tokenizer.pad_token_id)
    assert played.scores.tolist() == [1.0] * 3 and engine.calls == 6  # 3 waves of 2 turns
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [op for _, op in calls] == ["reset", "echo"] * 3
    assert all(calls[i][0] == calls[i + 1][0] for i in range(0, 6, 2))
    with pytest.raises(ValueError, match=r"OneSession\) serves one session at a time .*single_session='refuse'"):
        runners(f"{ENVS}:OneSession", [f"{ENVS}:last_text"], single_session="refuse", workers=1)


def test_environments_and_rewards_that_cannot_work_are_refused_naming_the_field(runners, chat_dir, tokenizer):
    with pytest.raises(ValueError, match="reward.functions: an environment run needs a reward source"):
        runners(f"{ENVS}:Stall", workers=1)
    with pytest.raises(Exception, match="environment.factory: cannot import 'nope.module:Env'"):
        runners("nope.module:Env", [f"{ENVS}:last_text"], workers=1)
    with pytest.raises(Exception, match=r"environment.factory: environment file .*missing.py' does not exist"):
        runners(f"{HERE}/missing.py:Env", [f"{ENVS}:last_text"], workers=1)
    with pytest.raises(Exception, match=r"reward.functions\[0\]: .*has no function 'nope'"):
        runners(f"{ENVS}:Echo", [f"{ENVS}:nope"], workers=1)
    with pytest.raises(ValueError, match="environment.factory must look like"):
        config(chat_dir, "not a spec")
    with pytest.raises(ValueError, match="reward.source: an environment run is scored by"):
        preset("none", **{"model.policy": chat_dir, "environment.factory": f"{ENVS}:Echo"})
    verifiers = {"model.policy": chat_dir, "reward.source": "function", "environment.verifiers": {"id": "calc_env"}}
    with pytest.raises(ValueError, match="rollout.engine: environment.verifiers runs verifiers' clients"):
        preset("none", **verifiers)
    with pytest.raises(ValueError, match="environment.factory and environment.verifiers are both set"):
        preset("none", **verifiers, **{"rollout.engine": "vllm", "environment.factory": f"{ENVS}:Echo"})
    with pytest.raises(ValueError, match="reward.functions: a verifiers environment's rubric scores"):
        preset("none", **verifiers, **{"rollout.engine": "vllm", "reward.functions": [f"{ENVS}:last_text"]})


def test_a_verifiers_rollout_record_is_one_episode_whose_loss_counts_the_model_s_turns():
    """models/environments/remote.episode_of on the worker's records (components/verifiers/worker.py: merge_steps
    joins turns whose prompt ids extend the previous turn's): two model turns and the tool's reply between them are
    one sequence, mask 1 on the model's tokens only, the server's logprobs kept; a rollout that errored, or whose
    turns are two sequences (messages in), scores 0 and is left out of the loss, naming why."""
    from components.verifiers.worker import merge_steps
    from models.environments.remote import episode_of

    def turn(prompt, ids):
        return {"prompt_ids": prompt, "completion_ids": ids, "completion_mask": [1] * len(ids),
                "completion_logprobs": [-0.5] * len(ids), "is_truncated": False}

    steps = [turn([1, 2], [3, 4]), turn([1, 2, 3, 4, 9, 9], [5])]  # the tool's reply: 9 9
    prompt = [{"role": "user", "content": "2 + 3?"}]
    messages = prompt + [{"role": "assistant", "tool_calls": ['{"function": {"name": "add", "arguments": "{}"}}']},
                         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    record = {"example_id": 0, "reward": 1.0, "turns": 2, "steps": steps, "samples": merge_steps(steps),
              "messages": messages, "error": None, "is_truncated": False, "stop_condition": "no_tools"}
    episode = episode_of("calc", {"prompt": prompt}, record)
    assert (episode.prompt_ids, episode.ids, episode.mask) == ([1, 2], [3, 4, 9, 9, 5], [1, 1, 0, 0, 1])
    assert episode.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert (episode.turns, episode.tool_calls, episode.end, episode.score, episode.failed) == (2, 1, "stop", 1.0, False)
    assert episode_rows([episode],
                        ["calc"])[0]["conversation"] == "[assistant calls add] {}\n[tool None] 5\n[assistant] 5"
    apart = [turn([1, 2], [3, 4]), turn([7, 7], [5])]  # re-rendered text: the second turn does not extend the first
    split = episode_of("calc", {"prompt": prompt}, {**record, "steps": apart, "samples": merge_steps(apart)})
    assert split.failed and "2 token sequences, not one" in split.error and split.score == 0.0
    failed = episode_of("calc", {"prompt": prompt},
                        {**record, "error": "ToolError: boom", "samples": merge_steps(steps, True)})
    assert failed.failed and failed.error == "ToolError: boom" and failed.score == 0.0 and set(failed.mask) == {0}


# ---------------------------------------------------------------- the loss counts the model's tokens only

def test_the_loss_counts_only_the_model_s_tokens(runners, tokenizer, chat_dir):
    """Two episodes alike but for the environment's reply (the tool answers 'aaaa' or 'bbbb'): the rollouts' tokens
    differ only where the loss mask is 0; the loss's token count (what the update weighs micro-batches by) is the
    model's tokens; the PPO and REINFORCE losses, the KL and the entropy terms are equal whatever the reply's
    tokens and their logprobs are, and their gradients on the reply's positions are exactly 0."""
    from models.advantages import kl_penalty, masked_mean
    from models.losses import Menu, aggregate, policy_objective
    from models.policy import Policy

    runner = echo_runner(runners)
    rollouts = []
    for word in ("aaaa", "bbbb"):
        reply = (lambda w: lambda c: "done<|im_end|>" if "<tool_response>" in c else call("echo", text=w))(word)
        rollouts.append(play(runner, tokenizer, reply, [{"prompt": "say it"}]).rollout)
    a, b = rollouts
    assert a.tokens.shape == b.tokens.shape and torch.equal(a.loss_mask, b.loss_mask)
    differs = (a.tokens[:, 1:] != b.tokens[:, 1:]).float()
    # the call's argument differs too (the model wrote it): compare what follows the tool call
    reply_positions = differs * (1 - a.loss_mask)
    assert reply_positions.sum() > 0
    mask = a.loss_mask
    assert int(mask.sum()) == int(a.sampled_lengths.sum()) < int(a.response_lengths.sum())

    policy = Policy.load(chat_dir, reference=False)
    with torch.no_grad():
        logp_a = policy.logprobs(a.tokens, a.lengths)[0]
        logp_b = policy.logprobs(b.tokens, b.lengths)[0]
    on = mask > 0
    # the same model-token logprobs, the reply's positions holding each rollout's own values
    base = torch.where(on, logp_a, torch.zeros_like(logp_a))
    old = base.detach() - 0.1 * on.float()
    results = []
    for reply_logp in (logp_a, logp_b, logp_b - 3.0):
        logp = torch.where(on, base, reply_logp).clone().requires_grad_(True)
        ppo = aggregate(policy_objective(logp, old, torch.ones_like(logp) * 0.7, mask, Menu())[0], mask,
                        "token-mean", 1)
        rf = aggregate(policy_objective(logp, old, torch.tensor([0.7]), mask, Menu(policy_loss="reinforce"))[0], mask,
                       "seq-mean-token-sum", 1)
        kl = kl_penalty(logp, old, "k3") * mask
        entropy = masked_mean(-logp, mask)
        total = ppo + rf + kl.sum() + entropy
        (grad,) = torch.autograd.grad(total, logp)
        results.append((float(total.detach()), grad))
        assert torch.equal(grad * (1 - mask), torch.zeros_like(grad))  # nothing flows to the reply's positions
    assert results[0][0] == results[1][0] == results[2][0]
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][1], results[2][1])


def test_a_single_turn_rollout_s_loss_mask_is_its_response_mask():
    rollout = from_responses([[5, 6], [7]], [[1, 2, 3], [4]], [[-1.0, -2.0, -3.0], [-4.0]], [True, False], 0)
    assert rollout.model_tokens is None
    assert torch.equal(rollout.loss_mask, rollout.response_mask)
    assert torch.equal(rollout.sampled_lengths, rollout.response_lengths)


# ---------------------------------------------------------------- the math

def test_gae_skips_the_environment_s_tokens():
    """GAE over a row whose actions are interrupted by environment tokens equals GAE over the actions alone, in
    float64 (the holes are skipped: the next action's value and advantage carry across them)."""
    from models.advantages import gae

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0]],
                        dtype=torch.float64)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8)):
        advantages, returns = gae(rewards, values, mask, gamma, lam)
        for row in range(2):
            on = mask[row].nonzero().flatten().tolist()
            expected, last = {}, 0.0
            for i in reversed(range(len(on))):
                t = on[i]
                next_value = float(values[row, on[i + 1]]) if i + 1 < len(on) else 0.0
                last = float(rewards[row, t]) + gamma * next_value - float(values[row, t]) + gamma * lam * last
                expected[t] = last
            for t in range(mask.shape[1]):
                assert float(advantages[row, t]) == pytest.approx(expected.get(t, 0.0), abs=1e-12)
                assert float(returns[row, t]) == pytest.approx((expected[t] + float(values[row, t])) if t in expected
                                                               else 0.0, abs=1e-12)


def test_pass_at_k_against_a_float64_reference():
    """eval/pass_at_<j>: Chen et al.'s unbiased estimator, checked against enumerating every j-subset."""
    from itertools import combinations

    from models.eval import eval_metrics, pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    scores = torch.tensor([0.2, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.9, 0.95, 1.0, 0.9], dtype=torch.float64)
    m = eval_metrics(scores, None, torch.ones(12), 4, success_threshold=0.9)
    assert m["eval/success"] == pytest.approx(5 / 12) and "eval/accuracy" not in m
    assert m["eval/pass_at_1"] == pytest.approx((1 / 4 + 0 + 4 / 4) / 3)
    assert m["eval/pass_at_2"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + 1) / 3)
    assert m["eval/pass_at_4"] == pytest.approx(2 / 3)


def test_reasoning_gym_rows_and_their_scorer():
    """reasoning_gym:<task> rows carry what the task's score_answer needs; the held-out split shares no question
    with the train split; the scorer reads <answer> tags."""
    from models.data import DataError, read_rows
    from models.resolve import resolve_data
    from models.tasks.reasoning import score

    options = {"size": 40, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train = read_rows(resolve_data("reasoning_gym:chain_sum", options=options), "train").to_list()
    test = read_rows(resolve_data("reasoning_gym:chain_sum", "eval.prompts", options=options), "test").to_list()
    assert len(train) == len(test) == 40 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    responses = [r["answer"] for r in train[:2]] + [f"so <answer>{train[2]['answer']}</answer>", "12345"]
    columns = {k: [r[k] for r in train[:4]] for k in ("answer", "metadata", "task")}
    assert score([r["prompt"] for r in train[:4]], responses, **columns) == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(DataError, match="data.prompts: reasoning_gym:no_such_task"):
        read_rows(resolve_data("reasoning_gym:no_such_task", options={"size": 2}), "train")
    with pytest.raises(ValueError, match="data.options: only a reasoning_gym:<task> source takes options"):
        resolve_data("builtin:arithmetic", options={"size": 2})


def test_a_worker_killed_at_its_deadline_takes_the_processes_its_tool_started(tmp_path, monkeypatch):
    """A tool that starts a process and hangs: at the call's deadline its worker is killed with its whole process
    group, so the tool's own process does not outlive it (orphaned to PID 1)."""
    from models.environments.pool import Request, WorkerPool
    from components.launch.processes import alive, wait_for

    pid_file = tmp_path / "spawned.pid"
    monkeypatch.setenv("SPAWNED_PID_FILE", str(pid_file))
    pool = WorkerPool(1, {"": f"{ENVS}:SpawningStaller"}, []).start()
    try:
        reset = Request(0, {"op": "reset", "key": "k", "env": "", "row": {}}, 30, "k")
        hung = Request(0, {"op": "call", "key": "k", "name": "run", "arguments": {"command": "x"}}, 3, "k")
        answers = pool.run([reset, hung])
        assert answers[0].status == "ok" and answers[1].status == "timeout", answers
        spawned = int(pid_file.read_text())
        assert wait_for(lambda: not alive(spawned), timeout=30), f"the tool's process {spawned} outlived its worker"
        assert pool.restarts == 1
    finally:
        pool.close()
