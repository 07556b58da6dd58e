"""Response JSON for `/v1/completions` and `/v1/chat/completions`, shaped like OpenAI's.

One builder per request turns the `GenerationChunk`s of `RequestFlow` into stream chunks
(`text_completion` / `chat.completion.chunk`) or, collected, into one whole response. A
completions batch has one builder: choice i belongs to prompt i // n.

Logprobs: each generated token's logprob and, when asked, the most likely tokens at its
position (the engine's `TopLogprobs`). Completions' `top_logprobs` maps token text to
logprob for those alternatives plus the chosen token (as vLLM: up to k + 1 entries);
chat's lists the k alternatives. An echoed prompt's positions carry theirs too (the
first position, which nothing predicts, `null`). vLLM's `prompt_logprobs` (whole
responses only) lists, per prompt position, the prompt token and the k most likely by
token id, each with its logprob, rank and text.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.outputs import PromptLogprobs
from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.router.generation_chunk import GenerationChunk, Usage, public_finish_reason
from tandem.router.tokenization import PromptTokenizer

# What OpenAI reports for a token whose logprob is -inf (JSON has no infinities).
_MIN_LOGPROB = -9999.0

# A token's alternatives: None where none were computed (an echoed prompt's tokens, or
# top_logprobs not asked for).
Alternatives = TopLogprobs | None


def add_stop_reason(choice: dict[str, Any], ended: GenerationChunk | Collected) -> None:
    """vLLM's `stop_reason` beside a choice's finish_reason: the stop token id or stop
    string that ended it, null for EOS and every other reason."""
    if ended.finish_reason is not None:
        choice["stop_reason"] = ended.stop_reason


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


@dataclass
class Collected:
    """A whole generation gathered from its chunks (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: int | str | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.prompt_logprobs = chunk.prompt_logprobs or self.prompt_logprobs
        if chunk.finish_reason is not None:
            self.stop_reason = chunk.stop_reason
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_logprobs += chunk.top_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage


class LogprobsFormatter:
    """Per-request logprobs JSON; remembers the text offset across stream chunks."""

    def __init__(self, tokenizer: PromptTokenizer, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        # vLLM's return_tokens_as_token_ids: tokens are named "token_id:<id>".
        self.tokens_as_ids = tokens_as_ids
        self._text_offset = 0

    def _token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._decoded(token_id)

    def _decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: Sequence[float | None], tops: Sequence[Alternatives]
    ) -> dict[str, Any]:
        """None for a token without a logprob (the first token of an echoed prompt)."""
        tokens = [self._token_text(t) for t in token_ids]
        values = [None if lp is None else _finite(lp) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        top_json: list[dict[str, float] | None] = []
        for token, value, top in zip(tokens, values, tops, strict=True):
            if value is None:
                top_json.append(None)
                continue
            alternatives = {} if top is None else self._alternatives(top)
            alternatives.setdefault(token, value)  # the chosen token is always there (vLLM)
            top_json.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": top_json,
            "text_offset": offsets,
        }

    def chat(
        self, token_ids: list[int], logprobs: list[float], tops: Sequence[Alternatives]
    ) -> dict[str, Any]:
        content = []
        for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True):
            alternatives = [] if top is None else [
                self._chat_entry(t, lp) for t, lp in zip(top.token_ids, top.logprobs, strict=True)
            ]  # fmt: skip
            content.append({**self._chat_entry(token_id, logprob), "top_logprobs": alternatives})
        return {"content": content}

    def vllm_prompt(
        self, prompt_ids: list[int], scores: PromptLogprobs | None, k: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt position (the first, which nothing
        predicts, None) the prompt token then the k most likely, keyed by token id."""
        positions: list[dict[str, dict[str, Any]] | None] = [None]
        if scores is None:  # a one-token prompt has no position to score
            return positions + [None] * (len(prompt_ids) - 1)
        tops = scores.top or [TopLogprobs([], [])] * len(scores.logprobs)
        for token_id, logprob, rank, top in zip(
            prompt_ids[1:], scores.logprobs, scores.ranks, tops, strict=True
        ):
            entries = {str(token_id): self._vllm_entry(token_id, logprob, rank)}
            for alt_rank, (alt_id, alt_logprob) in enumerate(
                zip(top.token_ids[:k], top.logprobs[:k], strict=True), start=1
            ):
                entries.setdefault(str(alt_id), self._vllm_entry(alt_id, alt_logprob, alt_rank))
            positions.append(entries)
        return positions

    def _vllm_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        token = self._decoded(token_id)  # text even with tokens_as_ids (as vLLM)
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    def _alternatives(self, top: TopLogprobs) -> dict[str, float]:
        """Token text -> logprob, most likely first (a text two ids share keeps the first)."""
        alternatives: dict[str, float] = {}
        for token_id, logprob in zip(top.token_ids, top.logprobs, strict=True):
            alternatives.setdefault(self._token_text(token_id), _finite(logprob))
        return alternatives


@dataclass(frozen=True)
class ResponseOptions:
    """What a request asked of its response's shape (set from its parsed prompts)."""

    # Each prompt's ids (a completions batch has several); choice i is prompt i // n's.
    prompt_ids: list[list[int]]
    # Choices per prompt.
    n: int = 1
    # stream_options.include_usage: a usage chunk ends the stream.
    include_usage: bool = False
    # stream_options.continuous_usage_stats (vLLM's, with include_usage): every stream
    # chunk carries its choice's usage so far (its prompt's tokens, its own so far).
    continuous_usage: bool = False
    # vLLM's return_token_ids: choices carry their tokens' ids (`token_ids`, a stream
    # chunk its new ones) and their prompt's (`prompt_token_ids`: completions on each
    # choice's first chunk and whole choice, chat on the first chunk and the response).
    return_token_ids: bool = False
    # Completions `echo`: each prompt's text, which leads its choices' text.
    echo_texts: list[str] | None = None
    # Each token's logprob and, per token, this many alternatives (an echoed prompt's
    # tokens too).
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's prompt_logprobs (whole responses only): each prompt position's logprob,
    # rank and this many alternatives; None = not asked.
    prompt_logprobs: int | None = None


class ResponseBuilder:
    """Common part of the completion and chat builders: ids, envelope, usage chunk."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""
    # With return_token_ids: prompt ids on each choice (completions), else on the response.
    prompt_ids_on_choice = True

    def __init__(
        self,
        req_id: str,
        model: str,
        created: int,
        formatter: LogprobsFormatter,
        options: ResponseOptions,
    ) -> None:
        self.id = req_id
        self.model = model
        self.created = created
        self.formatter = formatter
        self.options = options
        self.n = options.n
        # Each choice's logprobs keep their own text offsets.
        self._formatters: dict[int, LogprobsFormatter] = {}
        # Streamed tokens per choice (continuous usage), and the choices whose prompt
        # ids were sent (return_token_ids).
        self._choice_tokens: Counter[int] = Counter()
        self._ids_sent: set[int] = set()

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any], index: int = 0) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [{"index": index, **choice}])
        if self.options.include_usage:
            body["usage"] = self._choice_usage(index)
        return body

    def count_tokens(self, chunk: GenerationChunk) -> None:
        """Counts a streamed chunk's tokens for its choice's usage so far."""
        self._choice_tokens[chunk.index] += len(chunk.token_ids)

    def _choice_usage(self, index: int) -> dict[str, int] | None:
        """Choice `index`'s usage so far with continuous usage stats (no prompt details,
        as vLLM), else None (a usage chunk ends the stream)."""
        if not self.options.continuous_usage:
            return None
        prompt = len(self._prompt_of(index))
        completion = self._choice_tokens[index]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token (chat: the assistant role)."""
        return []

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """The stream chunk for `chunk`; None when it carries nothing to show yet."""
        if self._shows_nothing(chunk):
            return None
        choice = self._choice_delta(chunk)
        add_stop_reason(choice, chunk)
        self._add_token_ids(choice, chunk.token_ids, chunk.index)
        return self._chunk(choice, chunk.index)

    def _shows_nothing(self, chunk: GenerationChunk) -> bool:
        """Whether `chunk` has no text, no finish, and no tokens the client asked to see
        (logprobs, token ids: a token ending inside a UTF-8 character has no text yet)."""
        return not chunk.text and chunk.finish_reason is None and not self._shows_tokens(chunk)

    def _shows_tokens(self, chunk: GenerationChunk) -> bool:
        """Whether `chunk` has tokens the client asked to see (logprobs or ids)."""
        return bool(self.options.logprobs or self.options.return_token_ids) and bool(
            chunk.token_ids
        )

    def _prompt_of(self, index: int) -> list[int]:
        """The ids of choice `index`'s prompt."""
        return self.options.prompt_ids[index // self.n]

    def _add_token_ids(self, choice: dict[str, Any], token_ids: list[int], index: int) -> None:
        """With return_token_ids: the choice's new token ids, and a completion choice's
        prompt ids the first time (a whole response's choice: always)."""
        if not self.options.return_token_ids:
            return
        choice["token_ids"] = list(token_ids)
        if self.prompt_ids_on_choice and index not in self._ids_sent:
            choice["prompt_token_ids"] = self._prompt_of(index)
        self._ids_sent.add(index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage_json(usage)
        return body

    def response(self, choices: list[Collected], usage: Usage | None) -> dict[str, Any]:
        """The whole response; `choices` in index order, `usage` the request's."""
        wholes = []
        for i, collected in enumerate(choices):
            whole = {"index": i, **self._choice_whole(collected, i)}
            add_stop_reason(whole, collected)
            self._add_token_ids(whole, collected.token_ids, i)
            wholes.append(whole)
        body = self._envelope(self.object_name, wholes)
        if self.options.return_token_ids and not self.prompt_ids_on_choice:
            body["prompt_token_ids"] = self.options.prompt_ids[0]
        if usage is not None:
            body["usage"] = usage_json(usage)
        return body

    def _logprobs_json(
        self,
        formatter: LogprobsFormatter,
        token_ids: list[int],
        logprobs: Sequence[float | None],
        tops: Sequence[Alternatives],
    ) -> Any:
        raise NotImplementedError

    def _choice_delta(self, chunk: GenerationChunk) -> dict[str, Any]:
        raise NotImplementedError

    def _choice_whole(self, collected: Collected, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs_of(
        self,
        token_ids: list[int],
        logprobs: Sequence[float | None],
        tops: Sequence[Alternatives],
        index: int,
    ) -> Any:
        """`tops`: one per token, or none (not asked for)."""
        if not self.options.logprobs:
            return None
        formatter = self._formatters.get(index)
        if formatter is None:
            formatter = self._formatters[index] = copy.copy(self.formatter)
        alternatives: list[Alternatives] = list(tops) or [None] * len(token_ids)
        return self._logprobs_json(formatter, token_ids, logprobs, alternatives)


class CompletionResponses(ResponseBuilder):
    """Completions of one prompt or a batch: choice i belongs to prompt i // n."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        req_id: str,
        model: str,
        created: int,
        formatter: LogprobsFormatter,
        options: ResponseOptions,
    ) -> None:
        super().__init__(req_id, model, created, formatter, options)
        # Completions `echo`: each prompt's text, which leads its choices' text.
        self.echo_texts = options.echo_texts
        # Each prompt's own logprobs once they come (echo with logprobs, prompt_logprobs).
        self._prompt_scores: list[PromptLogprobs | None] = [None] * len(options.prompt_ids)
        # With echo + logprobs, the choices whose first chunk already carried the prompt.
        self._echoed_indexes: set[int] = set()

    def _echo_text_of(self, index: int) -> str | None:
        return None if self.echo_texts is None else self.echo_texts[index // self.n]

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.echo_texts is None or self.options.logprobs:
            return []  # with logprobs, the prompt leads each choice's first chunk
        return [
            self._chunk({"text": text, "logprobs": None, "finish_reason": None}, index)
            for p, text in enumerate(self.echo_texts)
            for index in range(p * self.n, (p + 1) * self.n)
        ]

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        self._note_prompt_logprobs(chunk.index, chunk.prompt_logprobs)
        return super().chunk(chunk)

    def _note_prompt_logprobs(self, index: int, scores: PromptLogprobs | None) -> None:
        if scores is not None:
            self._prompt_scores[index // self.n] = scores

    def _echoed(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        index: int,
        first: bool,
    ) -> tuple[str, Any]:
        """Text and logprobs JSON, the echoed prompt in front when `first`."""
        echo_text = self._echo_text_of(index) if first else None
        if echo_text is not None and self.options.logprobs:
            prompt_values, prompt_tops = self._echoed_positions(index)
            output_tops: list[Alternatives] = [*tops] if tops else [None] * len(token_ids)
            logprobs_json = self._logprobs_of(
                [*self._prompt_of(index), *token_ids],
                [*prompt_values, *logprobs],
                [*prompt_tops, *output_tops],
                index,
            )
            return echo_text + text, logprobs_json
        if echo_text is not None:
            text = echo_text + text
        return text, self._logprobs_of(token_ids, logprobs, tops, index)

    def _echoed_positions(self, index: int) -> tuple[list[float | None], list[Alternatives]]:
        """Choice `index`'s echoed prompt tokens' logprobs and alternatives (None at the
        first position, which nothing predicts, and everywhere before the scores came)."""
        length = len(self._prompt_of(index))
        values: list[float | None] = [None] * length
        tops: list[Alternatives] = [None] * length
        scores = self._prompt_scores[index // self.n]
        if scores is not None:
            values[1:] = scores.logprobs
            k = self.options.top_logprobs  # the prompt may be scored with more alternatives
            if k:
                tops[1:] = [TopLogprobs(t.token_ids[:k], t.logprobs[:k]) for t in scores.top]
        return values, tops

    def _logprobs_json(
        self,
        formatter: LogprobsFormatter,
        token_ids: list[int],
        logprobs: Sequence[float | None],
        tops: Sequence[Alternatives],
    ) -> Any:
        return formatter.completion(token_ids, logprobs, tops)

    def _choice_delta(self, chunk: GenerationChunk) -> dict[str, Any]:
        first = self.options.logprobs and chunk.index not in self._echoed_indexes
        self._echoed_indexes.add(chunk.index)
        text, logprobs = self._echoed(
            chunk.text, chunk.token_ids, chunk.logprobs, chunk.top_logprobs, chunk.index, first
        )
        return {
            "text": text,
            "logprobs": logprobs,
            "finish_reason": public_finish_reason(chunk.finish_reason),
        }

    def response(self, choices: list[Collected], usage: Usage | None) -> dict[str, Any]:
        for index, collected in enumerate(choices):
            self._note_prompt_logprobs(index, collected.prompt_logprobs)
        return super().response(choices, usage)

    def _choice_whole(self, collected: Collected, index: int) -> dict[str, Any]:
        text, logprobs = self._echoed(
            collected.text,
            collected.token_ids,
            collected.logprobs,
            collected.top_logprobs,
            index,
            first=True,
        )
        whole = {
            "text": text,
            "logprobs": logprobs,
            "finish_reason": public_finish_reason(collected.finish_reason),
        }
        if self.options.prompt_logprobs is not None:
            scores = self._prompt_scores[index // self.n]
            whole["prompt_logprobs"] = self.formatter.vllm_prompt(
                self._prompt_of(index), scores, self.options.prompt_logprobs
            )
        return whole


class ChatResponses(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    prompt_ids_on_choice = False

    def _logprobs_json(
        self,
        formatter: LogprobsFormatter,
        token_ids: list[int],
        logprobs: Sequence[float | None],
        tops: Sequence[Alternatives],
    ) -> Any:
        # Chat never echoes the prompt, so every generated token has its logprob.
        return formatter.chat(token_ids, [lp for lp in logprobs if lp is not None], tops)

    def opening_chunks(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        choice = {"delta": delta, "logprobs": None, "finish_reason": None}
        chunks = [self._chunk(choice, i) for i in range(self.n)]
        if self.options.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.options.prompt_ids[0]
        return chunks

    def _choice_delta(self, chunk: GenerationChunk) -> dict[str, Any]:
        return {
            "delta": {"content": chunk.text} if chunk.text else {},
            "logprobs": self._logprobs_of(
                chunk.token_ids, chunk.logprobs, chunk.top_logprobs, chunk.index
            ),
            "finish_reason": public_finish_reason(chunk.finish_reason),
        }

    def response(self, choices: list[Collected], usage: Usage | None) -> dict[str, Any]:
        body = super().response(choices, usage)
        if self.options.prompt_logprobs is not None:
            # The prompt's, on the response (vLLM); its first sequence carried them.
            scores = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
            body["prompt_logprobs"] = self.formatter.vllm_prompt(
                self.options.prompt_ids[0], scores, self.options.prompt_logprobs
            )
        return body

    def _choice_whole(self, collected: Collected, index: int) -> dict[str, Any]:
        return {
            "message": {"role": "assistant", "content": collected.text},
            "logprobs": self._logprobs_of(
                collected.token_ids, collected.logprobs, collected.top_logprobs, index
            ),
            "finish_reason": public_finish_reason(collected.finish_reason),
        }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB
