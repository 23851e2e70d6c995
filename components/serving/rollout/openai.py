"""The rollout server's OpenAI-compatible endpoints, as vLLM's own server answers them, for clients that environments
use (the OpenAI python client, verifiers' chat-completions clients, prime-rl's token route):

  GET  /v1/models                   the served model (id, max_model_len)
  POST /v1/chat/completions         messages (+ tools) in; choices with message (content, tool_calls), logprobs
                                    (token, logprob, bytes, top_logprobs), finish_reason, `token_ids` and top-level
                                    `prompt_token_ids` with `return_token_ids`, usage
  POST /v1/chat/completions/tokens  the same with the prompt given as token ids (`tokens`: prime-rl's route that
                                    verifiers' `openai_chat_completions_token` client posts to)
  POST /tokenize                    messages (+ tools, add_generation_prompt) or a prompt -> tokens, count,
                                    max_model_len
  POST /inference/v1/generate       token ids in, token ids and logprobs out (vLLM 0.32 `--enable-scale-out`)

Requests and answers are vLLM's own pydantic models (vllm.entrypoints.*.protocol), its own `to_sampling_params`, and
its own error shape (`{"error": {message, type, param, code}}`, `param` naming the field). What differs from `vllm
serve`, on purpose:
- generation runs in this process's engine under the server's lock: a refit waits for a generation in flight and a
  request arriving during a refit waits for it; every answer names the weights version it was sampled with (the
  `X-Weights-Version` header, and `weights_version` in the body; /inference/v1/generate also in vLLM's own
  `weight_versions` spans); prompts' prefix-cache blocks are salted with that version.
- logprobs are of the distribution sampled from (the engine runs with `logprobs_mode="processed_logprobs"`).
- tool calls are parsed with the tokenizer's own response template (transformers' `parse_response`,
  models/chat.py, the trainer's too), not one of vLLM's named parsers; tools for a model without one are refused.
  `tool_choice` may be "auto" or "none". A completion whose tool-call markup does not parse comes back as content
  with its finish reason, `tool_parse_error` on the choice saying why, and is counted (/health).
- bounds as /generate: n x max_tokens per request, the JSON body's size (the Guard); no streaming, no beam search.

Runs in .venv-vllm: imports nothing from the project but models/chat.py (components/serving/rollout/__init__.py).
"""

from __future__ import annotations

import re
import time
import uuid
from types import SimpleNamespace
from typing import Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, create_model, model_validator
from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                              ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                              ChatCompletionResponse, ChatCompletionResponseChoice,
                                                              ChatMessage)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (GenerateLogProb, GenerateLogProbs,
                                                                     GenerateLogProbsContent, GenerateRequest,
                                                                     GenerateTokensChoice, GenerateTokensResponse)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList, UsageInfo
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse
from vllm.exceptions import VLLMClientError
from vllm.outputs import WeightVersionSpan

from models.chat import ChatTemplateError, parse_completion, render, response_template

OPENAI_PREFIXES = ("/v1/", "/tokenize", "/inference/")
VERSION_HEADER = "X-Weights-Version"
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
               409: "ConflictError", 422: "UnprocessableEntityError", 503: "ServiceUnavailableError"}
FIELDS = re.compile(r"[A-Za-z_][\w.\[\]-]*(, [A-Za-z_][\w.\[\]-]*)*")  # "tools", "messages[0].role", "n, max_tokens"


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIXES)


def error_body(status: int, message: str) -> dict:
    """vLLM's (and OpenAI's) error shape; `param` is the field(s) a message starts with ("tools: ...")."""
    head, sep, _ = message.partition(":")
    param = head if sep and FIELDS.fullmatch(head) else None
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


def client_error(exc: VLLMClientError) -> tuple[int, str]:
    """A request vLLM's own checks refuse (its request models' validators and `SamplingParams` raise these, past
    pydantic's validation, so FastAPI would answer 500): vLLM's status for it and our message, which starts with the
    field: the error's `parameter`, else the fields the message names (`tools`, "temperature must ...")."""
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    leading = re.match(r"([a-z][a-z0-9_]*(?:, [a-z][a-z0-9_]*)*) (?:must|cannot|contains|strings|entries|is|are) ",
                       message)
    field = (getattr(exc, "parameter", None) or ", ".join(dict.fromkeys(re.findall(r"`([A-Za-z_][\w.]*)`", message)))
             or (leading and leading[1])
             or ("structured_outputs" if re.search(r"structured output|JSON schema", message) else "body"))
    return create_error_response(exc).error.code, f"{field}: {message[:1000]}"


def refusing_malformed(model: type[BaseModel]) -> type[BaseModel]:
    """`model` (one of vLLM's request models: same name, fields and schema) where a body of the wrong shape that one of
    vLLM's own validators trips on (`structured_outputs: false`, read as a dict: AttributeError) is refused like any
    invalid body, a 400 naming the body, instead of a 500 (vLLM's server answers 500 there)."""

    def refuse(cls, data, handler):
        try:
            return handler(data)
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"the body does not have the shape of a {model.__name__} ({type(exc).__name__}: "
                             f"{exc})") from None

    return create_model(model.__name__, __base__=model, __module__=__name__,
                        __validators__={"refuse_malformed": model_validator(mode="wrap")(refuse)})


ChatCompletionRequest = refusing_malformed(ChatCompletionRequest)
GenerateRequest = refusing_malformed(GenerateRequest)
TokenizeChatRequest = refusing_malformed(TokenizeChatRequest)
TokenizeCompletionRequest = refusing_malformed(TokenizeCompletionRequest)


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """prime-rl's /v1/chat/completions/tokens: a chat request whose prompt is `tokens` (the messages and tools are
    still sent: the tools tell the parser what may be called)."""

    tokens: list[int] = Field(min_length=1, description="The prompt as token ids (used instead of rendering "
                                                         "`messages`).")


class OpenAIEndpoints:
    """The endpoints above on app.py's ServedModel: its engine, tokenizer, lock and weights version."""

    def __init__(self, served):
        self.served = served
        self.tokenizer = served.llm.get_tokenizer()
        self.model_id = served.model_dir
        config = served.llm.llm_engine.model_config
        self.template = response_template(self.tokenizer, getattr(config.hf_config, "model_type", None))
        self.default_sampling = dict(config.get_diff_sampling_param() or {})

    # -- shared checks
    def check_model(self, model: Optional[str]) -> None:
        if model not in (None, "", self.model_id):
            raise HTTPException(404, f"model: the model `{model}` does not exist; this server serves "
                                     f"`{self.model_id}` (GET /v1/models)")

    def check_ids(self, ids: list[int], field: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.served.vocab_size]
        if bad:
            raise HTTPException(400, f"{field}: token id {bad[0]} is outside the vocabulary [0, "
                                     f"{self.served.vocab_size})")

    def max_tokens(self, requested: Optional[int], prompt_len: int, n: int, field: str) -> int:
        """max_tokens as vLLM defaults it (the room left in the context), within the server's caps."""
        room = self.served.max_model_len - prompt_len
        if room <= 0 or (requested is not None and requested > room):
            raise HTTPException(400, f"{field}: this model's maximum context length is {self.served.max_model_len} "
                                     f"tokens; the prompt has {prompt_len}"
                                     + (f" and {requested} more were asked for" if requested is not None else ""))
        tokens = requested if requested is not None else room
        if n > self.served.max_sequences:
            raise HTTPException(400, f"n: {n} sequences exceed this server's cap of {self.served.max_sequences} "
                                     f"(deploy.rollout.max_request_sequences)")
        if n * tokens > self.served.max_tokens:
            raise HTTPException(400, f"{field}: n={n} x {tokens} new tokens exceed this server's cap of "
                                     f"{self.served.max_tokens} (deploy.rollout.max_request_tokens)")
        return tokens

    def render(self, messages, tools, add_generation_prompt: bool, continue_final_message: bool,
               chat_template: Optional[str], template_kwargs: Optional[dict]) -> list[int]:
        if chat_template is not None:
            raise HTTPException(400, "chat_template: this server renders with its model's own chat template only")
        try:
            return render(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message,
                          template_kwargs=template_kwargs)
        except ChatTemplateError as exc:
            raise HTTPException(400, str(exc)) from None

    def generate(self, prompt: list[int], params, salt: Optional[str]):
        try:
            outputs, version = self.served.sample([prompt], params, salt=salt)
        except ValueError as exc:  # the engine refused the sampling parameters (e.g. more logprobs than it keeps)
            raise HTTPException(400, f"sampling_params: {exc}") from None
        return outputs[0], version

    # -- /v1/models
    def models(self) -> dict:
        return ModelList(data=[ModelCard(id=self.model_id, root=self.model_id,
                                         max_model_len=self.served.max_model_len)]).model_dump()

    # -- /tokenize
    def tokenize(self, req: TokenizeChatRequest | TokenizeCompletionRequest) -> dict:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = self.render(req.messages, [t.model_dump() for t in req.tools] if req.tools else None,
                              req.add_generation_prompt, req.continue_final_message, req.chat_template,
                              req.chat_template_kwargs)
        else:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.served.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    # -- /v1/chat/completions and /v1/chat/completions/tokens
    def chat(self, req: ChatCompletionRequest, prompt: Optional[list[int]] = None) -> tuple[dict, int]:
        self.check_model(req.model)
        for name, bad in (("stream", req.stream), ("use_beam_search", req.use_beam_search), ("echo", req.echo)):
            if bad:
                raise HTTPException(400, f"{name}: not supported by this rollout server")
        tools = [t.model_dump() for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if tools and choice not in ("auto", "none"):
            raise HTTPException(400, f"tool_choice: {choice!r} is not supported; 'auto' (tool calls parsed from the "
                                     f"completion) or 'none'")
        parse_tools = bool(tools) and choice == "auto"
        if parse_tools and self.template is None:
            raise HTTPException(400, "tools: this model's tokenizer has no response template, so tool calls in its "
                                     "completions cannot be parsed; send no tools, or use a tokenizer whose "
                                     "tokenizer_config.json has a `response_template`")
        if prompt is None:
            prompt = self.render(req.messages, tools, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template, req.chat_template_kwargs)
        else:
            self.check_ids(prompt, "tokens")
        n = req.n or 1
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                                     else req.max_tokens, len(prompt), n, field)
        try:
            params = req.to_sampling_params(max_tokens, self.default_sampling)
        except ValueError as exc:
            raise HTTPException(400, f"sampling: {exc}") from None
        if params.seed is not None:
            params.seed &= (1 << 63) - 1  # the engine's seed is a non-negative int64
        output, version = self.generate(prompt, params, req.cache_salt)
        choices, generated = [], 0
        for out in sorted(output.outputs, key=lambda o: o.index):
            ids = list(out.token_ids)
            generated += len(ids)
            extra, message = {}, ChatMessage(role="assistant", content=out.text)
            if parse_tools:
                parsed = parse_completion(self.tokenizer, self.template, ids, prompt, tools, text=out.text)
                self.served.tool_stats["malformed" if parsed.error else "parsed" if parsed.tool_calls else "none"] += 1
                if parsed.error:
                    extra["tool_parse_error"] = parsed.error
                message = ChatMessage(role="assistant", content=parsed.content, reasoning=parsed.reasoning,
                                      tool_calls=[ToolCall(id=c["id"], function=FunctionCall(**c["function"]))
                                                  for c in parsed.tool_calls])
            called = bool(message.tool_calls) and out.finish_reason == "stop"
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=message,
                finish_reason="tool_calls" if called else (out.finish_reason or "stop"),
                stop_reason=out.stop_reason, token_ids=ids if req.return_token_ids else None,
                logprobs=self.chat_logprobs(ids, out.logprobs, req.top_logprobs, req.return_tokens_as_token_ids)
                if req.logprobs else None, **extra))
        usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated)
        answer = ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                        model=self.model_id,
                                        choices=choices, usage=usage,
                                        prompt_token_ids=prompt if req.return_token_ids else None,
                                        weights_version=version)
        return answer.model_dump(), version

    def chat_logprobs(self, ids: list[int], steps, top: Optional[int],
                      as_ids: Optional[bool]) -> ChatCompletionLogProbs:
        """vLLM's chat logprobs: per sampled token its text, logprob and UTF-8 bytes, and the `top` most likely."""
        def text(token_id, logprob) -> str:
            if as_ids:
                return f"token_id:{token_id}"
            return logprob.decoded_token if logprob is not None and logprob.decoded_token is not None \
                else self.tokenizer.decode([token_id])

        content = []
        for token_id, step in zip(ids, steps or [None] * len(ids)):
            mine = step.get(token_id) if step else None
            token = text(token_id, mine)
            tops = [ChatCompletionLogProb(token=(t := text(i, lp)), logprob=max(lp.logprob, -9999.0),
                                          bytes=list(t.encode("utf-8", errors="replace")))
                    for rank, (i, lp) in enumerate((step or {}).items()) if top is not None and rank < top]
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=max(mine.logprob, -9999.0) if mine is not None else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=tops))
        return ChatCompletionLogProbs(content=content)

    # -- /inference/v1/generate
    def generate_tokens(self, req: GenerateRequest) -> tuple[dict, int]:
        self.check_model(req.model)
        for name, bad in (("stream", req.stream), ("features", req.features), ("content_parts", req.content_parts)):
            if bad:
                raise HTTPException(400, f"{name}: not supported by this rollout server")
        if req.output_mode != "tokens":
            raise HTTPException(400, "output_mode: only 'tokens' is served here")
        self.check_ids(req.token_ids, "token_ids")
        params = req.sampling_params
        requested = params.max_tokens if req.is_sampling_param_provided("max_tokens") else None
        params.max_tokens = self.max_tokens(requested, len(req.token_ids), params.n, "sampling_params.max_tokens")
        params.detokenize = False
        output, version = self.generate(list(req.token_ids), params, req.cache_salt)
        choices, generated = [], 0
        for out in sorted(output.outputs, key=lambda o: o.index):
            ids = list(out.token_ids)
            generated += len(ids)
            logprobs = None
            if params.logprobs is not None:
                content = []
                for token_id, step in zip(ids, out.logprobs or [None] * len(ids)):
                    mine = step.get(token_id) if step else None
                    tops = [GenerateLogProb(token_id=i, logprob=max(lp.logprob, -9999.0), rank=lp.rank or None)
                            for rank, (i, lp) in enumerate((step or {}).items())
                            if params.logprobs == -1 or rank < max(params.logprobs, 1)]
                    content.append(GenerateLogProbsContent(
                        token_id=token_id, logprob=max(mine.logprob, -9999.0) if mine is not None else -9999.0,
                        rank=(mine.rank or None) if mine is not None else None, top_logprobs=tops))
                logprobs = GenerateLogProbs(content=content)
            choices.append(GenerateTokensChoice(
                index=out.index, logprobs=logprobs, finish_reason=out.finish_reason or "stop",
                stop_reason=out.stop_reason, token_ids=ids,
                weight_versions=[WeightVersionSpan(str(version), 0, len(ids))]))
        usage = UsageInfo(prompt_tokens=len(req.token_ids), completion_tokens=generated,
                          total_tokens=len(req.token_ids) + generated)
        answer = GenerateTokensResponse(request_id=req.request_id, model=self.model_id, created=int(time.time()),
                                        usage=usage, choices=choices,
                                        prompt_token_ids=list(req.token_ids) if req.return_token_ids else None)
        return answer.model_dump(mode="json"), version


def versioned(body: dict, version: int) -> JSONResponse:
    return JSONResponse(body, headers={VERSION_HEADER: str(version)})


def add_openai_endpoints(app: FastAPI, served) -> None:
    """The endpoints of this module on `app`; each is behind the app's Guard (the run's secret, the body's size)."""
    api = OpenAIEndpoints(served)
    app.state.args = SimpleNamespace(log_error_stack=False)  # what vLLM's validation handler reads

    @app.get("/v1/models")
    def models() -> JSONResponse:
        return JSONResponse(api.models())

    @app.post("/tokenize")
    def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        return JSONResponse(api.tokenize(request))

    @app.post("/v1/chat/completions")
    def chat(request: ChatCompletionRequest) -> JSONResponse:
        return versioned(*api.chat(request))

    @app.post("/v1/chat/completions/tokens")
    def chat_tokens(request: ChatCompletionTokensRequest) -> JSONResponse:
        return versioned(*api.chat(request, prompt=list(request.tokens)))

    @app.post("/inference/v1/generate")
    def generate(request: GenerateRequest) -> JSONResponse:
        return versioned(*api.generate_tokens(request))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body that fails its schema: vLLM's own answer on the OpenAI paths (400, the field named), FastAPI's
        (422, each error located) on the others."""
        if is_openai_path(request.url.path):
            return await validation_exception_handler(request, exc)
        return await request_validation_exception_handler(request, exc)
