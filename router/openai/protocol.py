"""OpenAI request JSON → a typed `GenerationRequest` (prompt ids + `SamplingParams`).

Everything a client can get wrong is found here, before any worker is involved, and
raised as `InvalidRequest` (400) / `ModelNotFound` (404) naming the field and its value.
Fields we do not implement are refused when set to anything but their neutral value, so
a request never silently means something else than what its sender asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from tandem.engine.sampling_params import (
    MAX_BAD_WORD_CHARS,
    MAX_CACHE_SALT_CHARS,
    MAX_NUM_BAD_WORDS,
    MAX_NUM_STOP_STRINGS,
    MAX_STOP_STRING_CHARS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from tandem.router.errors import InvalidRequest, ModelNotFound
from tandem.router.json_fields import (
    get_bool,
    get_float,
    get_int,
    get_int_list,
    get_object,
    get_str,
    get_str_list,
    invalid,
    show,
)
from tandem.router.openai.chat_messages import chat_message
from tandem.router.openai.errors import ContextLengthExceeded
from tandem.router.openai.guided import guided_from_body
from tandem.router.openai.sampling_fields import DEFAULT_MAX_N, SamplingExtras, parse_extras
from tandem.router.openai.tools import ToolPlan, parse_tools
from tandem.router.policy import RequestSlo, SloConfig
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.structured_outputs import field_ruling_out_grammar_tokens
from tandem.router.tokenization import PromptTokenizer

# Most alternatives a client may ask for per position (vLLM's default `max_logprobs`).
MAX_LOGPROBS = MAX_TOP_LOGPROBS
# Seeds travel as uint64; a negative one (int64, as vLLM and OpenAI's clients take) as
# its two's complement, so -1 is 2**64 - 1 (torch's manual_seed maps it alike).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# OpenAI's default for /v1/completions when `max_tokens` is absent.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Most prompts one /v1/completions request may batch (each runs as a request of its own).
MAX_PROMPTS_PER_REQUEST = 256

# Field → values that mean "feature not used"; any other value is refused, never
# ignored: these are vLLM request fields that change the output, which a client moving
# from vLLM would otherwise get silently without. Fields outside every list (`user`,
# `metadata`, ...) do not change the output and are ignored.
# (Penalties, logit_bias, n, best_of, echo, suffix: sampling_fields.py.)
_COMMON_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "guided_whitespace_pattern": (None,),
    "prompt_embeds": (None,),
    "vllm_xargs": (None, {}),
    "priority": (None, 0),  # vLLM too refuses it unless its scheduler runs by priority
}
_COMPLETION_UNSUPPORTED = {**_COMMON_UNSUPPORTED}
_CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "echo": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None, {}),
    "add_special_tokens": (None, False),  # the chat template places them
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "chat_template": (None,),
}
# Keyword arguments apply_chat_template sets itself, never from `chat_template_kwargs`.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
    }
)


@dataclass
class GenerationRequest:
    """One validated completion or chat request, ready for `RequestFlow.generate`."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    # stream_options.include_usage: end the stream with a usage chunk (empty `choices`).
    include_usage: bool
    # Report the chosen token's logprob for each generated token (and, with
    # params.top_logprobs, the most likely tokens at its position).
    logprobs: bool
    # The request's SLO (Tandem extension fields `slo_class`, `ttft_slo_s`, `itl_slo_s`).
    slo: RequestSlo
    # Penalties, logit_bias (already in `params`), n, echo.
    extras: SamplingExtras
    # Completions with `echo`: the prompt's text, sent before the completion's.
    echo_text: str | None = None
    # Completions with `echo` and `max_tokens` 0 (vLLM's echo without generation; how
    # lm-evaluation-harness scores a text's loglikelihood): the prompt alone, its token
    # generated (params.max_tokens is 1) and left out of the response.
    echo_only: bool = False
    # stream_options.continuous_usage_stats (vLLM's), with include_usage: every chunk
    # carries the usage so far.
    continuous_usage: bool = False
    # vLLM's return_token_ids: the response carries token ids beside the text.
    return_token_ids: bool = False
    # Chat `tools` / `tool_choice` (None: no tools).
    tools: ToolPlan | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob and rank, and this many of the
    # most likely tokens at its position (None: not asked).
    prompt_logprobs: int | None = None
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>", not text.
    tokens_as_ids: bool = False


@dataclass
class _Prompt:
    """One prompt of a completions request: its ids, the name errors give it, and its
    text when the client sent text (what `echo` repeats)."""

    ids: list[int]
    field: str
    text: str | None = None


class RequestParser:
    """Validates request bodies against the served model (name, vocabulary, context)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        model_name: str,
        slo: SloConfig,
        max_n: int = DEFAULT_MAX_N,
        defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.slo = slo
        self.max_n = max_n
        # Sampling values of requests that leave them out (the model's, or OpenAI's).
        self.defaults = defaults

    def completion(self, body: dict[str, Any]) -> list[GenerationRequest]:
        """One request per prompt (`prompt` may hold a batch of them), in order; every
        prompt is checked before any is returned."""
        self._check_common(body, _COMPLETION_UNSUPPORTED)
        if body.get("top_logprobs") is not None:  # chat's field: ignored, it would ask nothing
            raise invalid(
                "top_logprobs",
                "is a chat completions field; /v1/completions takes 'logprobs', an integer: "
                "how many alternatives per token",
            )
        extras = parse_extras(body, self.tokenizer.vocab_size, self.max_n, completion=True)
        logprobs = get_int(body, "logprobs", min_value=0, max_value=MAX_LOGPROBS)
        prompt_logprobs = _prompt_logprobs(body)
        # echo with logprobs: the echoed prompt tokens' logprobs and alternatives.
        echo_top = logprobs if extras.echo else None
        echo_only = extras.echo and _asks_no_tokens(body)
        if echo_only:
            # (Checked against the 0 asked, not the 1 generated and left out.)
            get_int(body, "min_tokens", min_value=0, max_value=0)
            body = {**body, "max_tokens": 1}
        generations = []
        for prompt in self._prompts(body):
            ids = self._truncated(body, prompt.ids)
            generation = self._generation(
                body,
                ids,
                prompt_field=prompt.field,
                default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
                logprobs=logprobs is not None,
                num_top_logprobs=logprobs or 0,
                extras=extras,
            )
            if extras.echo:
                # The prompt as the client wrote it (a whole text prompt), or its tokens'
                # text (token ids, or truncated).
                whole_text = prompt.text if len(ids) == len(prompt.ids) else None
                generation.echo_text = whole_text or self.tokenizer.decode(
                    ids, skip_special_tokens=False
                )
            generation.echo_only = echo_only
            generation = _scoring_prompt(generation, echo_top, prompt_logprobs)
            generations.append(_constrained(generation, body, tools=None))
        return generations

    def chat(self, body: dict[str, Any]) -> GenerationRequest:
        self._check_common(body, _CHAT_UNSUPPORTED)
        extras = parse_extras(body, self.tokenizer.vocab_size, self.max_n, completion=False)
        tools = parse_tools(body)
        prompt_ids = self._truncated(body, self._chat_ids(body, tools))
        logprobs = bool(get_bool(body, "logprobs"))
        top_logprobs = get_int(body, "top_logprobs", min_value=0, max_value=MAX_LOGPROBS)
        if top_logprobs and not logprobs:
            raise invalid("top_logprobs", "requires 'logprobs': true")
        generation = self._generation(
            body,
            prompt_ids,
            prompt_field="messages",
            default_max_tokens=None,
            logprobs=logprobs,
            num_top_logprobs=top_logprobs or 0,
            extras=extras,
        )
        generation = _scoring_prompt(generation, None, _prompt_logprobs(body))
        return _constrained(generation, body, tools=tools)

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        """Token ids of `prompt` or `messages` (no context-length check: this is for counting)."""
        self.check_model(body)
        has_prompt, has_messages = "prompt" in body, "messages" in body
        if has_prompt == has_messages:
            raise invalid("prompt", "send exactly one of 'prompt' and 'messages'")
        if not has_prompt:
            return self._chat_ids(body, parse_tools(body))
        prompts = self._prompts(body)
        if len(prompts) > 1:
            raise invalid("prompt", f"holds {len(prompts)} prompts; tokenize one at a time")
        return prompts[0].ids

    def detokenize(self, body: dict[str, Any]) -> str:
        """The text of `tokens` (vLLM's /detokenize: special tokens kept)."""
        self.check_model(body)
        if "tokens" not in body:
            raise invalid("tokens", "is required")
        ids = get_int_list(body, "tokens")
        self._check_token_ids("tokens", ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_model(self, body: dict[str, Any]) -> None:
        model = get_str(body, "model")
        if model is not None and model != self.model_name:
            raise ModelNotFound(
                f"the model {show(model)} does not exist; this server serves "
                f"{show(self.model_name)}",
                param="model",
            )

    def _check_common(self, body: dict[str, Any], unsupported: dict[str, tuple[Any, ...]]) -> None:
        self.check_model(body)
        for name, neutral in unsupported.items():
            value = body.get(name)
            if not any(_same(value, v) for v in neutral):
                raise invalid(name, f"is not supported by this server (got {show(value)})")

    def _prompts(self, body: dict[str, Any]) -> list[_Prompt]:
        """`prompt`: a text, a list of token ids, or a batch (a list) of those."""
        prompt = body.get("prompt")
        if prompt is None:
            raise invalid("prompt", "is required")
        # vLLM's add_special_tokens: text prompts get the tokenizer's BOS (default) or not.
        special = get_bool(body, "add_special_tokens")
        add_special = True if special is None else special
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS_PER_REQUEST:
                raise invalid(
                    "prompt",
                    f"holds {len(prompt)} prompts; at most {MAX_PROMPTS_PER_REQUEST} per request",
                )
            return [self._prompt(p, f"prompt[{i}]", add_special) for i, p in enumerate(prompt)]
        return [self._prompt(prompt, "prompt", add_special)]

    def _prompt(self, prompt: Any, where: str, add_special_tokens: bool) -> _Prompt:
        """One prompt; errors name it by `where` ("prompt", or "prompt[i]" in a batch)."""
        if isinstance(prompt, str):
            # An empty text is a prompt of the tokenizer's BOS alone (OpenAI's and vLLM's
            # reading: generation from the start of a document).
            ids = self.tokenizer.encode(prompt, add_special_tokens)
            if not ids:
                raise invalid(where, f"encodes to no tokens: {show(prompt)}")
            return _Prompt(ids, where, prompt)
        if not isinstance(prompt, list):
            raise invalid(where, f"must be a string or a list of token ids, got {show(prompt)}")
        if not prompt:
            raise invalid(where, "must not be empty")
        self._check_token_ids(where, prompt)
        return _Prompt(list(prompt), where)

    def _truncated(self, body: dict[str, Any], ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the model's
        context length; the prompt still needs room for the output)."""
        keep = get_int(body, "truncate_prompt_tokens", min_value=-1)
        if keep is None:
            return ids
        limit = self.tokenizer.max_model_len
        if keep == 0:
            raise invalid("truncate_prompt_tokens", "must be -1 (the context length) or >= 1")
        if keep > limit:
            raise invalid(
                "truncate_prompt_tokens",
                f"is {keep}, more than this model's maximum context length ({limit} tokens)",
            )
        return ids[-(limit if keep == -1 else keep) :]

    def _check_token_ids(self, name: str, ids: list[Any]) -> None:
        vocab_size = self.tokenizer.vocab_size
        for i, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise invalid(
                    name, f"must hold integer token ids, got {show(token_id)} at index {i}"
                )
            if not 0 <= token_id < vocab_size:
                raise invalid(
                    name,
                    f"holds token id {token_id} at index {i}, "
                    f"outside the vocabulary [0, {vocab_size})",
                )

    def _chat_ids(self, body: dict[str, Any], tools: ToolPlan | None = None) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise invalid("messages", "is required")
        if not isinstance(messages, list):
            raise invalid("messages", f"must be a list of message objects, got {show(messages)}")
        if not messages:
            raise invalid("messages", "must not be empty")
        chat = [chat_message(i, message) for i, message in enumerate(messages)]
        template_kwargs = get_object(body, "chat_template_kwargs") or {}
        if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys()):
            raise invalid("chat_template_kwargs", f"may not set {', '.join(reserved)}")
        # vLLM's: the assistant prompt after the chat (default), or the model goes on
        # with the chat's last message, an assistant's.
        add_generation_prompt = get_bool(body, "add_generation_prompt")
        continue_final = bool(get_bool(body, "continue_final_message"))
        if continue_final and add_generation_prompt:
            raise invalid(
                "continue_final_message", "cannot be true with 'add_generation_prompt': true"
            )
        if continue_final and chat[-1]["role"] != "assistant":
            raise invalid(
                "continue_final_message",
                f"needs an assistant message last, got {show(chat[-1]['role'])}",
            )
        try:
            ids = self.tokenizer.encode_chat(
                chat,
                tools.template_tools() if tools else None,
                template_kwargs,
                add_generation_prompt=not continue_final and add_generation_prompt is not False,
                continue_final_message=continue_final,
            )
        except (ValueError, TemplateError) as exc:
            raise invalid("messages", f"cannot be encoded with the chat template: {exc}") from exc
        except RecursionError as exc:
            # The template's renderer recurses once per level of a tool's parameters
            # schema or a template variable: hundreds of levels exceed Python's limit.
            raise invalid(
                "tools" if tools else "messages",
                "nest too deeply for the chat template to render",
            ) from exc
        if not ids:
            raise invalid("messages", "encode to no tokens")
        return ids

    def _generation(
        self,
        body: dict[str, Any],
        prompt_ids: list[int],
        prompt_field: str,
        default_max_tokens: int | None,
        logprobs: bool,
        num_top_logprobs: int,
        extras: SamplingExtras,
    ) -> GenerationRequest:
        stream = bool(get_bool(body, "stream"))
        stream_options = get_object(body, "stream_options")
        include_usage = continuous_usage = False
        if stream_options is not None:
            if not stream:
                raise invalid("stream_options", "is only allowed when 'stream' is true")
            include_usage = _stream_option(stream_options, "include_usage")
            continuous_usage = _stream_option(stream_options, "continuous_usage_stats")
        max_tokens = self._max_tokens(body, len(prompt_ids), prompt_field, default_max_tokens)
        params = self._sampling_params(body, max_tokens, logprobs, num_top_logprobs, extras)
        return GenerationRequest(
            prompt_ids=prompt_ids,
            params=params,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=include_usage and continuous_usage,
            return_token_ids=bool(get_bool(body, "return_token_ids")),
            tokens_as_ids=bool(get_bool(body, "return_tokens_as_token_ids")),
            logprobs=logprobs,
            extras=extras,
            slo=self.slo.resolve(
                get_str(body, "slo_class"),
                ttft_s=get_float(body, "ttft_slo_s"),
                itl_s=get_float(body, "itl_slo_s"),
            ),
        )

    def _max_tokens(
        self,
        body: dict[str, Any],
        num_prompt_tokens: int,
        prompt_field: str,
        default: int | None,
    ) -> int:
        limit = self.tokenizer.max_model_len
        given = {
            name: value
            for name in ("max_tokens", "max_completion_tokens")
            if (value := get_int(body, name, min_value=1)) is not None
        }
        if len(set(given.values())) > 1:
            raise invalid(
                "max_completion_tokens",
                f"is {given['max_completion_tokens']} but 'max_tokens' is "
                f"{given['max_tokens']}; send one of them",
            )
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"the prompt ('{prompt_field}') has {num_prompt_tokens} tokens; this model's "
                f"maximum context length is {limit} tokens, including at least one "
                "generated token",
                param=prompt_field,
            )
        room = limit - num_prompt_tokens
        if not given:
            return room if default is None else min(default, room)
        name, max_tokens = next(iter(given.items()))
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {limit} tokens; the request asks "
                f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                f"'{name}' = {max_tokens}); '{name}' may be at most {room} for this prompt",
                param=name,
            )
        return max_tokens

    def _sampling_params(
        self,
        body: dict[str, Any],
        max_tokens: int,
        logprobs: bool,
        num_top_logprobs: int,
        extras: SamplingExtras,
    ) -> SamplingParams:
        temperature = get_float(body, "temperature")
        if temperature is not None and temperature < 0:
            raise invalid("temperature", f"must be >= 0, got {show(body['temperature'])}")
        top_p = get_float(body, "top_p")
        if top_p is not None and not 0 < top_p <= 1:
            raise invalid("top_p", f"must be in (0, 1], got {show(body['top_p'])}")
        min_p = get_float(body, "min_p")
        if min_p is not None and not 0 <= min_p <= 1:
            raise invalid("min_p", f"must be in [0, 1], got {show(body['min_p'])}")
        top_k = get_int(body, "top_k")
        if top_k is not None and top_k < -1:
            raise invalid("top_k", f"must be -1 or 0 (off) or >= 1, got {top_k}")
        stop_token_ids = get_int_list(body, "stop_token_ids")
        self._check_token_ids("stop_token_ids", stop_token_ids)
        allowed_token_ids = get_int_list(body, "allowed_token_ids")
        self._check_token_ids("allowed_token_ids", allowed_token_ids)
        bad_words = get_str_list(body, "bad_words", MAX_NUM_BAD_WORDS, MAX_BAD_WORD_CHARS)
        try:
            bad_words_token_ids = self.tokenizer.bad_words_token_ids(bad_words)
        except ValueError as exc:
            raise invalid("bad_words", str(exc)) from exc
        min_tokens = get_int(body, "min_tokens", min_value=0, max_value=max_tokens)
        skip_special_tokens = get_bool(body, "skip_special_tokens")
        seed = get_int(body, "seed", min_value=MIN_SEED, max_value=MAX_SEED)
        if seed is not None:
            seed %= 2**64
        stop = get_str_list(body, "stop", MAX_NUM_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        ignore_eos = bool(get_bool(body, "ignore_eos"))
        include_stop = bool(get_bool(body, "include_stop_str_in_output"))
        cache_salt = get_str(body, "cache_salt")
        if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise invalid(
                "cache_salt",
                f"must hold 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}",
            )
        defaults = self.defaults
        # Every field is checked above; this only catches combinations the engine refuses.
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.temperature if temperature is None else temperature,
                top_k=defaults.top_k if top_k is None else top_k,
                top_p=defaults.top_p if top_p is None else top_p,
                min_p=defaults.min_p if min_p is None else min_p,
                seed=seed,
                stop=stop,
                include_stop_str_in_output=include_stop,
                stop_token_ids=stop_token_ids,
                allowed_token_ids=allowed_token_ids,
                bad_words_token_ids=bad_words_token_ids,
                ignore_eos=ignore_eos,
                min_tokens=min_tokens or 0,
                logprobs=logprobs,
                top_logprobs=num_top_logprobs,
                skip_special_tokens=True if skip_special_tokens is None else skip_special_tokens,
                cache_salt=cache_salt,
                **extras.params_kwargs(defaults.repetition_penalty),
            )
        except ValueError as exc:  # its message names the fields
            raise InvalidRequest(str(exc)) from exc


def _asks_no_tokens(body: dict[str, Any]) -> bool:
    value = body.get("max_tokens")
    return value == 0 and not isinstance(value, bool)


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt position, whole responses only
    (vLLM refuses it with `stream` too)."""
    value = get_int(body, "prompt_logprobs", min_value=0, max_value=MAX_LOGPROBS)
    if value is not None and get_bool(body, "stream"):
        raise invalid("prompt_logprobs", "is not available when 'stream' is true")
    return value


def _scoring_prompt(
    generation: GenerationRequest, echo_top: int | None, prompt_logprobs: int | None
) -> GenerationRequest:
    """The request with its prompt scored when asked: for `echo` with logprobs
    (`echo_top` alternatives) and for vLLM's prompt_logprobs (ranks and that many)."""
    asked = [k for k in (echo_top, prompt_logprobs) if k is not None]
    if not asked:
        return generation
    params = dataclasses.replace(
        generation.params, prompt_logprobs=True, prompt_top_logprobs=max(asked)
    )
    return dataclasses.replace(generation, params=params, prompt_logprobs=prompt_logprobs)


def _constrained(
    generation: GenerationRequest, body: dict[str, Any], tools: ToolPlan | None
) -> GenerationRequest:
    """The request with its structured-output grammar (response_format / guided_* / a
    forced tool call) and tool plan attached."""
    given = guided_from_body(body)
    forced = tools.guided() if tools is not None else None
    if given is not None and forced is not None:
        raise invalid(given[0], "cannot be combined with a forced 'tool_choice'")
    structured = forced if forced is not None else (given[1] if given else None)
    if structured is not None:
        params = dataclasses.replace(generation.params, structured=structured)
        if (conflict := field_ruling_out_grammar_tokens(params)) is not None:
            raise invalid(
                conflict, "cannot be combined with structured outputs or a forced tool call"
            )
        generation = dataclasses.replace(generation, params=params)
    if tools is not None:
        generation = dataclasses.replace(generation, tools=tools)
    return generation


def _stream_option(options: dict[str, Any], name: str) -> bool:
    value = options.get(name) or False
    if not isinstance(value, bool):
        raise invalid("stream_options", f"field '{name}' must be true or false, got {show(value)}")
    return value


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality where `true` is not 1 and `0.0` is 0."""
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return value == neutral
