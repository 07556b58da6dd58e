"""Chat responses of a request with tools: `tool_calls` in messages and stream deltas.

Streaming follows OpenAI: a call's first delta carries `index`, `id`, `type` and the
function `name`; later deltas carry pieces of `arguments`; the last chunk says
`finish_reason: "tool_calls"` (`"stop"` for a named function, as OpenAI). A named
choice streams its arguments as they are generated, and so does `required`: each call
of its JSON list starts once its name is complete (`call_scanner`), and its arguments
follow as they grow; before the first name the reply is held, and one that ends
before it (cut short by max_tokens) is sent as content, as the whole response has it.
`auto` output streams the same way (`auto_call_streams`): in the Hermes format, content
around the `<tool_call>` blocks goes out as soon as it cannot begin one; a reply that
opens with `{` or `[` is read as Llama 3 JSON, its calls streamed, and sent as content
when it ends if it named no declared tool.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.router.generation_chunk import GenerationChunk, public_finish_reason
from tandem.router.openai.auto_call_streams import HermesCallStream, JsonCallStream
from tandem.router.openai.call_scanner import CallListScanner, CallPiece
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
        # reply's stream.
        self._held: dict[int, Collected] = {}
        self._named_calls: dict[int, ToolCall] = {}
        self._call_lists: dict[int, CallListScanner] = {}
        self._calls_begun: set[int] = set()
        self._auto_streams: dict[int, HermesCallStream | JsonCallStream] = {}

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        if self.plan.choice is ToolChoice.NONE:
            return super().chunk(chunk)
        if self.plan.choice is ToolChoice.NAMED:
            return self._named_delta(chunk)
        if self.plan.choice is ToolChoice.REQUIRED:
            return self._required_delta(chunk)
        return self._auto_delta(chunk)

    def _auto_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        """`auto`: a reply that opens with `{` or `[` streams as Llama 3 JSON, any other
        as Hermes (`auto_call_streams`); what they hold back waits, with its tokens."""
        index = chunk.index
        held = self._held.setdefault(index, Collected())
        held.add(chunk)
        stream = self._auto_streams.get(index)
        text = chunk.text
        if stream is None:
            head = held.text.lstrip()
            if not head and chunk.finish_reason is None:
                return None  # only whitespace yet
            kind = JsonCallStream if head.startswith(("{", "[")) else HermesCallStream
            stream = self._auto_streams[index] = kind(self.plan.names, self.plan.parallel)
            text = held.text
        content, pieces = stream.feed(text)
        if chunk.finish_reason is not None:
            held_content, last_pieces = stream.finish()
            content += held_content
            pieces += last_pieces
        elif not content and not pieces:
            return None
        delta: dict[str, Any] = {"content": content} if content else {}
        if pieces:
            delta["tool_calls"] = [_call_entry(piece) for piece in pieces]
        del self._held[index]
        return self._delta(
            delta, held.token_ids, held.logprobs, held.top_logprobs, chunk,
            made_calls=stream.num_calls > 0,
        )  # fmt: skip

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
        made_calls: bool = True,
    ) -> dict[str, Any]:
        """A chunk of tool-call deltas (finishing with `tool_calls` on a stop, where the
        reply `made_calls`) and content."""
        reason = chunk.finish_reason
        body = {
            "delta": delta,
            "logprobs": self._logprobs_of(token_ids, logprobs, tops, chunk.index),
            "finish_reason": _finish(reason, self.plan)
            if made_calls
            else public_finish_reason(reason),
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
