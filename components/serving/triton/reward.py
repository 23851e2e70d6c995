"""The reward server's models as PyTriton callables (reward_model, reward_text), over a reward model or Python reward
functions (models/reward.py), on-policy distillation's teacher (teacher_logprobs), and how a reward server loads
them."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from components.serving.triton.contract import (ModelSpec, ServerSpec, check_positions, check_prompt_lengths,
                                                decode_columns, decode_texts, request_array, reward_specs,
                                                stack_requests, teacher_spec)
from models.critic import CriticInputError, validate_tokens
from models.loading import resolve_device
from models.scoring import load_teacher, teacher_logprobs
from models.reward import (load_reward_functions, load_reward_model, load_reward_tokenizer, reward_limit,
                           reward_model_scores, score_batches, text_batches)


class RewardCallables:
    """`reward_model` over a sequence-classification model, or over Python reward functions of decoded text.

    A function reward needs prompt and response text: they are decoded with the tokenizer from tokens[:prompt_length]
    and tokens[prompt_length:sequence_length]. NeMo-Aligner clients do not send `prompt_lengths`; the whole sequence
    is then the response and the prompt is empty. Reward functions (models/reward.WeightedRewards) also answer each
    function's scores (`function_rewards`).
    """

    def __init__(self, model=None, function=None, tokenizer=None, vocab_size: int | None = None, reward_tokenizer=None,
                 chat_template: bool = False, lock: threading.Lock | None = None, micro_batch_size: int = 64):
        if (model is None) == (function is None):
            raise ValueError("reward server: give exactly one of a reward model or a reward function")
        if function is not None and tokenizer is None:
            raise ValueError("reward server: a function reward needs a tokenizer (--tokenizer) to decode tokens")
        if model is not None and reward_tokenizer is None:
            raise ValueError("reward server: reward_text needs the reward model's tokenizer")
        self.model, self.function, self.tokenizer = model, function, tokenizer
        self.reward_tokenizer, self.chat_template = reward_tokenizer, chat_template
        self.vocab_size = vocab_size or (model.config.vocab_size if model is not None else len(tokenizer))
        self.lock = lock or threading.Lock()
        self.micro_batch_size = micro_batch_size

    def text(self, requests):
        """`reward_text`: (prompt, response) strings scored by the reward model with its own tokenizer (or the
        reward function). The texts are cut to what the model can score and tokenized before the lock is taken (a
        long text never holds up the critic's other requests)."""
        parts = []
        for request in requests:
            prompts = decode_texts(request_array(request, "prompts"), "prompts")
            responses = decode_texts(request_array(request, "responses"), "responses")
            if len(prompts) != len(responses):
                raise CriticInputError(f"responses: batch size {len(responses)} does not match prompts batch size "
                                       f"{len(prompts)}")
            parts.append((prompts, responses, decode_columns(request, len(prompts))))
        prompts = [p for ps, _, _ in parts for p in ps]
        responses = [r for _, rs, _ in parts for r in rs]
        columns = [c for _, _, cs in parts for c in cs]
        if self.model is not None:
            batches = text_batches(self.reward_tokenizer, prompts, responses, self.chat_template,
                                   reward_limit(self.model), self.micro_batch_size)
            with self.lock:
                scores, each = score_batches(self.model, batches).numpy(), None
        else:
            with self.lock:
                scores, each = self._score_functions(prompts, responses, columns)
        return self._answers([len(ps) for ps, _, _ in parts], scores, each)

    @property
    def functions(self) -> bool:
        """Whether this server scores with reward functions that answer each one's scores."""
        return hasattr(self.function, "score_all")

    def _score_functions(self, prompts, responses, columns) -> tuple[np.ndarray, np.ndarray | None]:
        """The score of each sample, and with reward functions each function's [B, F]."""
        if self.functions:
            total, each = self.function.score_all(prompts, responses, columns)
            return np.asarray(total, dtype=np.float32), np.asarray(each, dtype=np.float32).reshape(len(each), -1).T
        return np.asarray(self.function(prompts, responses, columns), dtype=np.float32), None

    def _answers(self, sizes: list[int], scores: np.ndarray, each: np.ndarray | None) -> list[dict]:
        """One response per request of a dynamic batch: its rows of `rewards` (and `function_rewards`)."""
        out, start = [], 0
        for size in sizes:
            answer = {"rewards": scores[start:start + size].astype(np.float32).reshape(-1, 1)}
            if each is not None:
                answer["function_rewards"] = np.ascontiguousarray(each[start:start + size], dtype=np.float32)
            out.append(answer)
            start += size
        return out

    def infer(self, requests):
        parts, prompt_parts, column_parts = [], [], []
        for request in requests:
            tokens, lengths = request_array(request, "tokens"), request_array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.vocab_size)
            lengths = lengths.reshape(-1)
            if self.model is not None:
                check_positions(tokens, self.model)
            prompt = request["prompt_lengths"] if "prompt_lengths" in request.keys() else None
            prompt_parts.append(check_prompt_lengths(np.asarray(prompt), lengths) if prompt is not None
                                else np.zeros_like(lengths))
            column_parts.append(decode_columns(request, len(lengths)))
            parts.append((tokens, lengths))
        with self.lock:
            each = None
            if self.model is not None:
                tokens, lengths, _ = stack_requests(parts)
                device = next(self.model.parameters()).device
                scores = reward_model_scores(self.model, tokens.to(device), lengths.to(device)).cpu().numpy()
            else:
                texts = [self._decode(t, ln, p) for (t, ln), p in zip(parts, prompt_parts)]
                scores, each = self._score_functions([p for ps, _ in texts for p in ps],
                                                     [r for _, rs in texts for r in rs],
                                                     [c for cs in column_parts for c in cs])
        return self._answers([tokens.shape[0] for tokens, _ in parts], scores, each)

    def _decode(self, tokens: np.ndarray, lengths: np.ndarray,
                prompt_lengths: np.ndarray) -> tuple[list[str], list[str]]:
        """The prompt and response texts of token rows (split at the prompt lengths)."""
        rows = tokens.tolist()
        prompts = [self.tokenizer.decode(r[:p], skip_special_tokens=True) for r, p in zip(rows, prompt_lengths)]
        responses = [self.tokenizer.decode(r[p:n], skip_special_tokens=True)
                     for r, p, n in zip(rows, prompt_lengths, lengths)]
        return prompts, responses

    def bindings(self, max_batch_size: int, max_queue_delay_us: int) -> list[tuple[ModelSpec, Callable]]:
        return list(zip(reward_specs(max_batch_size, max_queue_delay_us, self.functions), (self.infer, self.text)))


class TeacherCallable:
    """`teacher_logprobs` over on-policy distillation's teacher (a frozen causal LM of the policy's tokenizer)."""

    def __init__(self, model, temperature: float = 1.0, lock: threading.Lock | None = None, micro_batch_size: int = 64):
        self.model, self.temperature, self.micro_batch_size = model, temperature, micro_batch_size
        self.lock = lock or threading.Lock()

    def infer(self, requests):
        parts = []
        for request in requests:
            tokens, lengths = request_array(request, "tokens"), request_array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.model.config.vocab_size)
            check_positions(tokens, self.model)
            parts.append((tokens, lengths.reshape(-1)))
        tokens, lengths, _ = stack_requests(parts)
        with self.lock:
            logp = teacher_logprobs(self.model, tokens, lengths, self.temperature, self.micro_batch_size).numpy()
        out, start = [], 0
        for rows, _ in parts:
            out.append({"logprobs": np.ascontiguousarray(logp[start:start + rows.shape[0], :rows.shape[1] - 1],
                                                         dtype=np.float32)})
            start += rows.shape[0]
        return out


def load_reward(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    cfg = spec.config
    if cfg.reward.source == "model":
        path = cfg.local_path("model.reward")
        callables = RewardCallables(model=load_reward_model(path, cfg.model.dtype, resolve_device(cfg.deploy.device),
                                                            normalize=cfg.reward.normalize),
                                    reward_tokenizer=load_reward_tokenizer(path),
                                    chat_template=cfg.reward.chat_template)
    else:
        tokenizer = load_reward_tokenizer(cfg.local_path("model.policy"), "model.policy")
        callables = RewardCallables(function=load_reward_functions(cfg.reward, deploy=cfg.deploy), tokenizer=tokenizer)
    bindings = callables.bindings(spec.max_batch_size, cfg.deploy.reward.max_queue_delay_us)
    if spec.carries_teacher:
        teacher = load_teacher(cfg.local_path("model.teacher"), cfg.model.dtype, resolve_device(cfg.deploy.device))
        bindings.append((teacher_spec(spec.max_batch_size, cfg.deploy.reward.max_queue_delay_us),
                         TeacherCallable(teacher, cfg.generation.temperature, callables.lock,
                                         cfg.generation.micro_batch_size).infer))
    return bindings, None
