"""Chat responses of a request with tools: `tool_calls` in messages and stream deltas.

Streaming follows OpenAI: a call's first delta carries `index`, `id`, `type` and the
function `name`; later deltas carry pieces of `arguments`; the last chunk says
`finish_reason: "tool_calls"` (`"stop"` for a named function, as OpenAI). A named
choice streams its arguments as they are generated, and so does `required`: each call
of its JSON list starts once its name is complete (`call_scanner`), and its arguments
follow as they grow; before the first name the reply is held, and one that ends
before it (cut short by max_tokens) is sent as content, as the whole response has it.
`auto` output in the Hermes format streams the same way through a `HermesCallStream`
(content around the `<tool_call>` blocks as soon as it cannot begin one); one that opens
with `{` or `[` (Llama 3 JSON, or content that merely starts so) is held and read whole
at its end, when its calls are sent whole or it is released as content.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.router.chunk_stream import public_finish_reason
from tandem.router.openai.call_scanner import CallListScanner, CallPiece
from tandem.router.openai.hermes_stream import HermesCallStream
from tandem.router.openai.responses import (
    ChatResponses,
    Collected,
    LogprobsFormatter,
    ResponseOptions,
    add_stop_reason,
)
from tandem.router.openai.tool_parsers import (
    ToolCall,
    parse_output,
)
from tandem.router.openai.tools import ToolChoice, ToolPlan
from tandem.router.request_flow import GenerationChunk


def _finish(reason: FinishReason | None, plan: ToolPlan) -> str | None:
    """A choice with tool calls that ended by itself: `tool_calls` for `auto` and
    `required`, `stop` for a named function (OpenAI's, and vLLM's, rule)."""
    if reason is FinishReason.STOP and plan.choice is not ToolChoice.NAMED:
        return "tool_calls"
    return public_finish_reason(reason)


def _call_entry(piece: CallPiece) -> dict[str, Any]:
    """A `tool_calls` delta entry: a call's first one with its id and name (OpenAI's
    shape), later ones with arguments only."""
    if piece.name is not None:
        return ToolCall(piece.name, piece.arguments).json(piece.index)
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


class ToolChatResponses(ChatResponses):
    """`ChatResponses` for a request whose output may be (or must be) tool calls."""

    def __init__(
        self,
        plan: ToolPlan,
        req_id: str,
        model: str,
        created: int,
        formatter: LogprobsFormatter,
        options: ResponseOptions,
    ) -> None:
        super().__init__(req_id, model, created, formatter, options)
        self.plan = plan
        # Streaming state per choice index: output held back (text and the tokens no
        # delta carried yet), a named call's id (fixed by its first delta), a `required`
        # reply's list as read so far and whether a call of it was sent, an `auto`
        # reply's Hermes stream or whether it is a Llama 3 JSON reply.
        self._held: dict[int, Collected] = {}
        self._named_calls: dict[int, ToolCall] = {}
        self._call_lists: dict[int, CallListScanner] = {}
        self._calls_begun: set[int] = set()
        self._hermes: dict[int, HermesCallStream] = {}
        self._json_replies: set[int] = set()

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        if self.plan.choice is ToolChoice.NONE:
            return super().chunk(chunk)
        if self.plan.choice is ToolChoice.NAMED:
            return self._named_delta(chunk)
        if self.plan.choice is ToolChoice.REQUIRED:
            return self._required_delta(chunk)
        return self._auto_delta(chunk)

    def _auto_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """`auto`: a reply that opens with `{` or `[` (Llama 3 JSON) is held and read
        whole at its end; any other streams through a `HermesCallStream`."""
        index = chunk.index
        held = self._held.setdefault(index, Collected())
        held.add(chunk)
        stream = self._hermes.get(index)
        text = chunk.text
        if stream is None and index not in self._json_replies:
            head = held.text.lstrip()
            if head.startswith(("{", "[")):
                self._json_replies.add(index)
            elif not head and chunk.finish_reason is None:
                return None  # only whitespace yet
            else:
                stream = self._hermes[index] = HermesCallStream(self.plan.names, self.plan.parallel)
                text = held.text
        if stream is None:
            return self._json_reply_delta(chunk) if chunk.finish_reason else None
        content, pieces = stream.feed(text)
        if chunk.finish_reason is not None:
            content += stream.finish()
        if not content and not pieces and chunk.finish_reason is None:
            return None  # held: its tokens go with the next delta
        delta: dict[str, Any] = {"content": content} if content else {}
        if pieces:
            delta["tool_calls"] = [_call_entry(piece) for piece in pieces]
        del self._held[index]
        body = {
            "delta": delta,
            "logprobs": self._logprobs_of(held.token_ids, held.logprobs, held.top_logprobs, index),
            "finish_reason": _finish(chunk.finish_reason, self.plan)
            if stream.num_calls
            else public_finish_reason(chunk.finish_reason),
        }
        add_stop_reason(body, chunk)
        self._add_token_ids(body, held.token_ids, index)
        return self._chunk(body, index)

    def _json_reply_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """The end of a held Llama 3 JSON reply: its calls whole, or it as content."""
        held = self._held[chunk.index]
        parsed = parse_output(self.plan, held.text)
        if not parsed.calls:
            return super().chunk(self._released(chunk.index))
        del self._held[chunk.index]
        delta: dict[str, Any] = {"tool_calls": [c.json(i) for i, c in enumerate(parsed.calls)]}
        if parsed.content:
            delta["content"] = parsed.content
        return self._delta(delta, held.token_ids, held.logprobs, held.top_logprobs, chunk)

    def _named_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        if self._shows_nothing(chunk):
            return None
        delta: dict[str, Any] = {}
        if chunk.text:
            if chunk.index not in self._named_calls:
                assert self.plan.named is not None
                call = self._named_calls[chunk.index] = ToolCall(self.plan.named.name, chunk.text)
                entry = call.json(0)
            else:
                entry = {"index": 0, "function": {"arguments": chunk.text}}
            delta["tool_calls"] = [entry]
        return self._delta(delta, chunk.token_ids, chunk.logprobs, chunk.top_logprobs, chunk)

    def _required_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        index = chunk.index
        scanner = self._call_lists.setdefault(index, CallListScanner())
        entries = [_call_entry(piece) for piece in scanner.feed(chunk.text)]
        if index in self._calls_begun:
            # The list's own punctuation is not content: a chunk of only that is skipped.
            if not entries and chunk.finish_reason is None and not self._shows_tokens(chunk):
                return None
            delta = {"tool_calls": entries} if entries else {}
            return self._delta(delta, chunk.token_ids, chunk.logprobs, chunk.top_logprobs, chunk)
        held = self._held.setdefault(index, Collected())
        held.add(chunk)
        if not entries:  # no call named yet: held, or content if the reply ends here
            return super().chunk(self._released(index)) if chunk.finish_reason else None
        self._calls_begun.add(index)
        del self._held[index]
        delta = {"tool_calls": entries}
        return self._delta(delta, held.token_ids, held.logprobs, held.top_logprobs, chunk)

    def _delta(
        self,
        delta: dict[str, Any],
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        chunk: GenerationChunk,
    ) -> dict[str, Any]:
        """A chunk of tool-call deltas (finishing with `tool_calls` on a stop)."""
        body = {
            "delta": delta,
            "logprobs": self._logprobs_of(token_ids, logprobs, tops, chunk.index),
            "finish_reason": _finish(chunk.finish_reason, self.plan),
        }
        add_stop_reason(body, chunk)
        self._add_token_ids(body, token_ids, chunk.index)
        return self._chunk(body, chunk.index)

    def _released(self, index: int) -> GenerationChunk:
        held = self._held.pop(index)
        return GenerationChunk(
            held.token_ids,
            held.text,
            held.logprobs,
            held.finish_reason,
            held.usage,
            index,
            top_logprobs=held.top_logprobs,
            stop_reason=held.stop_reason,
        )

    def _choice_whole(self, collected: Collected, index: int) -> dict[str, Any]:
        parsed = parse_output(self.plan, collected.text)
        if not parsed.calls:
            return super()._choice_whole(collected, index)
        return {
            "message": {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [c.json() for c in parsed.calls],
            },
            "logprobs": self._logprobs_of(
                collected.token_ids, collected.logprobs, collected.top_logprobs, index
            ),
            "finish_reason": _finish(collected.finish_reason, self.plan),
        }
