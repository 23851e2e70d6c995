"""Every metric a job logs to MLflow, what it means, and when a run logs it: the one list docs/metrics.md is generated
from (tools/docs.py), a sweep checks its metric against before any trial starts (components/sweep/space.py), and the
tests check what the runs they make log against (every name logged is here).

A name may hold a placeholder: `<name>` (a reward function's name), `<phase>`, `<k>`, or end in `*` (system metrics).
`needs` says when an RL run logs it (a sweep refuses a metric its trials' config cannot produce): 'critic' (an
algorithm with a critic: PPO), 'rloo' (the REINFORCE family), 'vllm' (an engine with its own weights), 'eval' (the
held-out eval: eval.prompts and eval.every), 'gold' (a gold reward: reward.gold, or the shipped task's on its data),
'functions' (reward functions), 'binary' (held-out scores all 0 or 1, or eval.success_threshold set), 'async'
(rollout.max_off_policy_steps > 0), 'environment' (an environment run: environment.factory or .verifiers), 'kl' (a
KL to the reference: kl.beta > 0), 'kl_loss' (the KL in the loss), 'ratio_clip' (a clipped ratio:
loss.policy_loss ppo), 'dual_clip' (loss.clip_ratio_c), 'vespo', 'dynamic' (loss.dynamic_sampling), 'opd' (a
teacher). Each name is listed once for each job that logs it: one quantity, one name (the eval job's policy under
test and an RL run's held-out eval share theirs).
Light: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.kinds import KINDS
from models.kinds import STAGES as TRAINED_ON_RANKS


@dataclass(frozen=True)
class Metric:
    names: tuple[str, ...]
    what: str
    trl: str | None = None  # TRL 1.x's name for it ('same' when it is ours too), None when TRL has none
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Group:
    title: str
    jobs: tuple[str, ...]  # the jobs that log it ('rl', 'sft', 'reward_model', 'dpo', 'eval', 'pipeline')
    intro: str
    metrics: tuple[Metric, ...]


M = Metric
EVERY_ITERATION = Group("Every iteration (PPO and RLOO)", ("rl",),
                        "At step = the iteration, over the rollouts of all actor ranks.", (
    M(("reward",),
      "Mean score of the iteration's rollouts as the objective sees them (reward model or the weighted sum of the "
      "reward functions, after `loss.missing_eos_penalty` and the soft overlong punishment). No KL in it.", "same"),
    M(("reward_std",), "Standard deviation of those scores.", "same"),
    M(("rewards/<name>/mean", "rewards/<name>/std"),
      "Each reward function's own scores (reward.function / reward.functions; `<name>` = the function's name, `_2`... "
      "when two share one). `reward` is their weighted sum.", "same", ("functions",)),
    M(("frac_reward_zero_std",),
      "The critic-free recipes (k > 1 samples per prompt): share of the trained prompts whose k samples all scored the "
      "same (no learning signal from that group).", "same", ("rloo",)),
    M(("dynamic_sampling/rounds", "dynamic_sampling/extra_rounds"),
      "Dynamic sampling (`loss.dynamic_sampling`): the generation rounds this iteration took (batches of the stream "
      "sampled and scored), and how many beyond the first.", None, ("dynamic",)),
    M(("dynamic_sampling/kept_groups", "dynamic_sampling/filled_groups", "dynamic_sampling/dropped_share"),
      "Dynamic sampling: the trained prompts whose k scores differ, the prompts of equal scores the batch was topped "
      "up with after the last round, and the share of all sampled prompts dropped.", None, ("dynamic",)),
    M(("kl",),
      "Mean per-token KL of the policy to the frozen reference over the response tokens (k1: log pi - log pi_ref, at "
      "the behaviour policy); not logged when `kl.beta` is 0 (no reference pass).", "same", ("kl",)),
    M(("objective/kl",),
      "The same KL summed per sequence, averaged over sequences: the unit of `kl.target` for the adaptive controller.",
      None, ("kl",)),
    M(("objective/kl_coef",), "The KL coefficient beta used this iteration (`kl.beta`, or the adaptive controller's)."),
    M(("kl_loss",),
      "With the KL in the loss (`kl.placement=loss`): the mean per-token KL estimate the loss adds (kl.estimator, "
      "times the ratio as TRL), averaged over the update.", None, ("kl_loss",)),
    M(("objective/non_score_reward",), "Mean of -beta x KL per sequence: the KL part of the shaped reward."),
    M(("objective/rlhf_reward",), "Mean of score - beta x KL per sequence: what the policy maximises."),
    M(("objective/entropy",),
      "Mean over sequences of the summed -log pi of the sampled tokens (a per-sequence entropy estimate)."),
    M(("objective/gold_reward",), "Mean gold reward (reward.gold, or the shipped task's own on builtin data).", None,
      ("gold",)),
    M(("entropy",),
      "Mean per-token entropy of the policy's distribution over the response tokens, from the update's forward passes "
      "(averaged over minibatches).", "same"),
    M(("loss",),
      "The actor's loss (the recipe's policy term, KL in the loss and entropy bonus, aggregated by "
      "`loss.loss_agg_mode` over each minibatch), averaged over optimizer steps.", "same"),
    M(("grad_norm",), "The actor's global gradient norm before clipping, averaged over optimizer steps.", "same"),
    M(("policy/skipped_steps",),
      "The actor's optimizer steps skipped this iteration because the loss or the gradient norm was not finite "
      "(weights and optimizer state left as they were)."),
    M(("clip_ratio/region_mean",),
      "Share of response tokens whose ratio to the behaviour policy was clipped (outside [1 - epsilon, 1 + "
      "epsilon_high] on the side the advantage pushes; cispo: its weight capped).", "same"),
    M(("clip_ratio/low_mean", "clip_ratio/high_mean"),
      "The same below 1 - epsilon (A < 0) and above 1 + epsilon_high (A > 0).", "same", ("ratio_clip",)),
    M(("clip_ratio/dual_mean",),
      "Share of tokens whose negative-advantage loss the dual clip capped (`loss.clip_ratio_c`).", None,
      ("dual_clip",)),
    M(("vespo/phi_seq_mean",), "vespo: the mean Gamma weight of the sequences.", "same", ("vespo",)),
    M(("learning_rate",), "The actor's learning rate after this iteration's steps.", "same"),
    M(("policy/approxkl_avg",),
      "Approximate KL(old, new) of the update (k3), averaged over steps (CleanRL's approx_kl)."),
    M(("val/ratio",), "Mean ratio new / behaviour policy over the response tokens during the update."),
    M(("completions/mean_length", "completions/min_length", "completions/max_length"),
      "Mean, shortest and longest response length in tokens.", "same"),
    M(("completions/clipped_ratio",), "Share of responses cut at `generation.max_new_tokens` without a stop token.",
      "same"),
    M(("completions/mean_terminated_length",),
      "Mean length of the responses that ended with a stop token (0 when none did).", "same"),
    M(("step_time",), "Wall-clock seconds of the iteration (rollout, scoring, update, refit), the slowest rank's.",
      "same"),
    M(("time/<phase>",),
      "Seconds in a phase of the iteration, the slowest rank's: `generate`, `logprobs`, `reference`, `critic_wait` "
      "(PPO) / `reward_wait` (RLOO), `train`, `critic_train_wait` (PPO), `refit` (vLLM engine)."),
    M(("throughput/generate_tokens_per_s",), "Response tokens generated per second of `time/generate`."),
    M(("tokens/generated",), "Response tokens this iteration."),
    M(("episode",), "Rollouts consumed so far, all ranks."),
    M(("iteration",), "The iteration just finished."),
    M(("dist/world_size",), "Actor ranks."),
))
OPD = Group("On-policy distillation (`algorithm: opd`)", ("rl",),
            "The teacher (`model.teacher`) on the student's own samples.", (
    M(("opd/reverse_kl", "opd/reverse_kl_seq"),
      "The reverse KL to the teacher, log pi_student - log pi_teacher of the sampled tokens: per token, and summed per "
      "sequence.", None, ("opd",)),
    M(("opd/teacher_logp",), "The teacher's mean log-probability of the student's tokens.", None, ("opd",)),
))
PPO_ONLY = Group("PPO only", ("rl",), "With a critic.", (
    M(("loss/value_avg",), "The critic's clipped value loss, averaged over its steps.", None, ("critic",)),
    M(("val/clipfrac_avg",), "Share of value predictions clipped by `critic.loss_clip_val`.", None, ("critic",)),
    M(("val/explained_variance",),
      "1 - Var(returns - values) / Var(returns) over the response tokens, before the critic's update.", None,
      ("critic",)),
    M(("val/return_mean", "val/value_mean"), "Means over the response tokens of the returns and the critic's values.",
      None, ("critic",)),
    M(("critic/step",), "The critic's optimizer steps so far.", None, ("critic",)),
    M(("critic/skipped_steps",),
      "The critic's optimizer steps skipped in this `critic_train` because the loss or the gradient norm was not "
      "finite.", None, ("critic",)),
))
BOTH_ADVANTAGES = Group("Advantages", ("rl",),
                        "Of the advantages the loss uses (after whitening, when `loss.whiten_advantages`).", (
    M(("val/advantage_mean",), "Mean advantage over the response tokens."),
    M(("val/advantage_std",), "The critic-free recipes: standard deviation of the sequences' mean advantages.", None,
      ("rloo",)),
))
VLLM = Group("The vLLM engine (`rollout.engine=vllm`)", ("rl",), "An engine with its own copy of the weights.", (
    M(("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"),
      "abs(trainer logprob - engine logprob) of the sampled tokens, over the response tokens.", "same", ("vllm",)),
    M(("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
       "sampling/importance_sampling_ratio/max"),
       "The mismatch weights pi_trainer / pi_engine the loss uses (`loss.vllm_importance_sampling_mode`: per token or "
       "per sequence, truncated or masked), 1 with the correction off.", "same", ("vllm",)),
    M(("mismatch/token_mult_prob_error",),
      "The token mean of exp(abs(log p_trainer - log p_engine)): 1 when the engine and the trainer agree (NeMo-RL's "
      "gate: < 1.1).", None, ("vllm",)),
    M(("mismatch/gen_kl",),
      "k3 estimate of KL(engine || trainer) per token, from the engine's samples (NeMo-RL's gen_kl_error: < 0.001).",
      None, ("vllm",)),
    M(("mismatch/masked_frac", "mismatch/clipped_frac"),
      "Share of tokens (token modes) or sequences (sequence modes) whose weight was outside [clip_min, clip_max]: set "
      "to 0 (`*_mask`) or truncated (`*_truncate`).", None, ("vllm",)),
    M(("rollout/staleness_mean", "rollout/staleness_max"),
      "Weight versions between the rollouts and the weights trained from (asynchronous rollouts).", None, ("vllm",)),
    M(("time/rollout_wait", "time/engine_idle", "time/refit_wait"),
      "Waiting for rollouts asked for ahead; the server's idle time between refits; a refit waiting for a generation "
      "in flight.", None, ("vllm", "async")),
))
ENVIRONMENT = Group("Environment runs (`environment.factory` or `environment.verifiers`: [Environments and "
                    "tools](environments.md))", ("rl",),
                    "Over the episodes of all actor ranks. `completions/*` count the model-sampled tokens only (the "
                    "environment's replies are not the model's), as TRL counts them.", (
    M(("tools/call_frequency",), "Tool calls per episode.", "same", ("environment",)),
    M(("tools/failure_frequency",), "Tool calls that failed (the tool raised, or is unknown) per tool call.", "same",
      ("environment",)),
    M(("env/turns_mean", "env/turns_max"), "Model turns per episode.", None, ("environment",)),
    M(("env/tool_use_ratio",), "Share of episodes with at least one tool call.", None, ("environment",)),
    M(("env/turn_limit_ratio",), "Share of episodes ended by `environment.max_turns` with a tool call unanswered.",
      None, ("environment",)),
    M(("env/overlong_ratio",),
      "Share of episodes ended because a tool reply did not fit `generation.max_new_tokens` (or the model's "
      "positions).", None, ("environment",)),
    M(("env/errors",),
      "Episodes that failed this iteration (an exception in reset or get_reward, a worker that died, a reward function "
      "that raised or returned a bad value, an instance lost with its worker): scored 0, left out of the loss.", None,
      ("environment",)),
    M(("env/timeouts",),
      "Episodes that missed `environment.call_deadline_s` or `episode_deadline_s` (their worker killed): scored 0, "
      "left out of the loss.", None, ("environment",)),
))
SAMPLING = tuple(kind.job for kind in KINDS if not kind.trains_on_ranks)  # an RL run and the eval: they sample policies
HELD_OUT = Group("Held-out eval (`eval.*` of an RL run; the eval job's policy under test)", (*SAMPLING, "pipeline"),
                 "An RL run's at step = the iteration it ran before (a pipeline's run logs its RL stage's at their "
                 "iterations); the eval job's (`rlhf eval`, a pipeline's eval stage) at step 0, of the policy under "
                 "test, with the reference's beside them (below). TRL's evaluation logs its training names with an "
                 "`eval_` prefix; ours use `eval/`.", (
    M(("eval/reward",),
      "Mean score of the eval samples: by the run's reward (the eval job: by its reward model, or as its `run` "
      "scores).", "eval_reward", ("eval",)),
    M(("eval/rewards/<name>/mean", "eval/rewards/<name>/std"), "Each reward function's (with reward functions).", None,
      ("eval", "functions")),
    M(("eval/gold_reward",), "Mean gold reward (when the run has one; the eval job: `eval.gold`).", None,
      ("eval", "gold")),
    M(("eval/completions/mean_length",), "Mean response length in tokens.", "eval_completions/mean_length", ("eval",)),
    M(("eval/success", "eval/pass_at_<k>"),
      "When every score is 0 or 1, or `eval.success_threshold` is set (a sample succeeds when its score reaches it): "
      "the share of samples that succeed, and for k = 1, 2, 4, ... up to `eval.samples_per_prompt` the chance that one "
      "of k samples of a prompt succeeds (Chen et al. 2021's unbiased estimator from all its samples), averaged over "
      "prompts.", None, ("eval", "binary")),
    M(("eval/accuracy",), "When every score is 0 or 1: the share of samples scoring 1.", None, ("eval", "binary")),
    M(("eval/samples",), "Eval samples scored.", None, ("eval",)),
    M(("eval/tools/*", "eval/env/*"), "An environment run's episode metrics (above), over the eval's episodes.", None,
      ("eval", "environment")),
))
ONCE = Group("Once per run", tuple(kind.job for kind in KINDS), "At step 0, and at each checkpoint.", (
    M(("data/rows", "data/filtered_rows", "data/truncated_rows"),
      "Training prompts read, dropped or cut as longer than `data.max_prompt_length` (RL).", None, ("never",)),
    M(("data/dropped_rows",), "A stage's rows (pairs) dropped as longer than its max_length.", None, ("never",)),
    M(("eval/rows", "eval/filtered_rows"), "The same for the eval prompts (rows).", None, ("never",)),
    M(("checkpoint/iteration",), "The iteration (step) of each checkpoint saved.", None, ("never",)),
    M(("system/*",),
      "CPU, memory, disk, network (GPU when present) from MLflow's system metrics (`deploy.tracking.system_metrics`).",
      None, ("never",)),
))
STAGES = Group("The stages (`rlhf sft`, `rlhf reward-model`, `rlhf dpo`, `rlhf kto`, the pipeline)", TRAINED_ON_RANKS,
               "At step = the optimizer step; the held-out eval's at the step it ran after (0: before the first).", (
    M(("train/loss", "train/grad_norm", "train/skipped_steps"),
      "Of the step's optimizer update: the mean loss (SFT: -log p over completion tokens; reward model: Bradley-Terry; "
      "DPO, KTO: theirs), the gradient norm before clipping, steps skipped for a non-finite loss or norm."),
    M(("learning_rate", "step", "rows"),
      "The learning rate after the step, optimizer steps so far, rows (SFT) or pairs (reward model, DPO) consumed."),
    M(("train/accuracy", "train/margin", "train/min_reward", "train/mean_reward", "train/max_reward"),
      "Reward model, the step's pairs, as TRL's RewardTrainer names them: the share with r(chosen) > r(rejected), mean "
      "r(chosen) - r(rejected), the rewards' range and mean.", "same"),
    M(("eval/loss", "eval/num_tokens"),
      "SFT, held out: the mean -log p over the completion tokens, and how many there were. Reward model, DPO and KTO: "
      "their loss over the held-out pairs (rows).", "eval_loss"),
    M(("eval/accuracy", "eval/margin", "eval/min_reward", "eval/mean_reward", "eval/max_reward", "eval/pairs"),
      "Reward model, held out, as TRL's RewardTrainer names them (above), and the pairs scored (DPO too).",
      "eval_accuracy"),
    M(("reward_mean", "reward_std"),
      "Reward model: the statistics of its held-out rewards, stored in its config.json (`reward.normalize`)."),
    M(("train/rewards/chosen", "train/rewards/rejected", "eval/rewards/chosen", "eval/rewards/rejected"),
      "DPO and KTO (held out): the mean implicit reward beta x (log pi(y) - log pi_ref(y)) of the chosen (desirable) "
      "and of the rejected (undesirable) completions (log-probabilities summed over the completion's tokens).",
      "rewards/chosen"),
    M(("train/rewards/accuracies", "eval/rewards/accuracies"),
      "DPO: the share of pairs whose chosen completion's implicit reward exceeds the rejected one's.",
      "rewards/accuracies"),
    M(("train/rewards/margins", "eval/rewards/margins"),
      "DPO and KTO (held out): the mean implicit reward of the chosen minus the rejected completions.",
      "rewards/margins"),
    *(M(*metric) for kind in KINDS if kind.trains_on_ranks for metric in kind.metrics),  # each kind's own
    M(("train/logps/chosen", "train/logps/rejected", "eval/logps/chosen", "eval/logps/rejected"),
      "DPO and KTO (held out): the mean log-probability of the chosen and of the rejected completions under the "
      "policy, summed over their tokens.", "logps/chosen"),
))
EVAL_JOB = Group("The eval (`rlhf eval`, a pipeline's eval stage)", ("eval",),
                 "At step 0: the policy under test (a pipeline's RL or DPO policy) against the reference policy (its "
                 "SFT policy), each sampling the same held-out prompts with one seed (the j-th samples paired), judged "
                 "by a reward model and `eval.gold`, or (`run`: a pipeline whose RL stage scores with reward functions "
                 "or environments) as that run's held-out eval judges. The policy's metrics are the held-out eval's "
                 "(above).", (
    M(("eval/reference/*",),
      "The held-out eval's metrics (above) of the reference policy: `eval/reference/reward`, "
      "`eval/reference/gold_reward`, `eval/reference/completions/mean_length`, ..."),
    M(("eval/win_rate",),
      "Share of paired samples where the policy's score is higher than the reference's (a tie counts one half)."),
    M(("eval/gold_win_rate",), "The same by the gold reward (proxy and gold side by side).", None, ("gold",)),
    M(("eval/success_gain",), "The policy's eval/success minus the reference's.", None, ("binary",)),
))
PIPELINE = Group("A pipeline's run", ("pipeline",),
                 "Its MLflow parent run: at step 0, each stage's last metrics as `<stage>/<name>` (`sft/eval/loss`, "
                 "`reward_model/eval/accuracy`, `rl/reward`, `dpo/eval/rewards/accuracies`, `eval/eval/win_rate`); the "
                 "RL stage's held-out evals at their iterations, by their own names (above).", (
    # a kind that publishes no model (the eval) only measures: its metrics are all held-out ones, eval/*
    M(tuple(f"{kind.job}/*" if kind.publishes else f"{kind.job}/eval/*" for kind in KINDS),
      "A stage's last metrics (its record's)."),
))
GROUPS = (EVERY_ITERATION, PPO_ONLY, OPD, BOTH_ADVANTAGES, VLLM, ENVIRONMENT, HELD_OUT, ONCE, STAGES, EVAL_JOB,
          PIPELINE)


def pattern(name: str) -> re.Pattern:
    """A metric name (with its placeholders) as a regular expression."""
    text = re.escape(name).replace(r"\*", ".+")
    return re.compile("^" + re.sub(r"<[a-z]+>", "[^/]+", text) + "$")


def entries(job: str) -> list[tuple[str, Metric]]:
    """(name, its entry) of every metric the job `job` logs."""
    return [(name, metric) for group in GROUPS if job in group.jobs for metric in group.metrics
            for name in metric.names]


def find(name: str, job: str) -> Metric | None:
    """The entry of a logged metric name of a job (a name listed as it is before one a placeholder matches), None
    when the job logs no such metric."""
    listed = entries(job)
    exact = next((metric for known, metric in listed if known == name), None)
    return exact or next((metric for known, metric in listed if pattern(known).match(name)), None)


def names(job: str) -> list[str]:
    """Every name (with its placeholders) a job logs, in the documented order."""
    return list(dict.fromkeys(name for name, _ in entries(job)))
