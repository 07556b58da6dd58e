"""The engine's side of structured outputs: compile, wait, attach, advance, finish.

A constrained request does not enter the scheduler until its grammar is compiled: it
waits here (compilation runs on the cache's threads, never on the engine thread), up to
`compile_timeout_s`, then joins the scheduler with a fresh matcher that has replayed the
tokens the grammar already accepted elsewhere (a migrated request's streamed output;
on a decode worker, also the first token the prefill worker sampled). After each step
the sampled tokens advance the matchers; a matcher that reaches the grammar's end
finishes its request with `stop`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.outputs import CannotStart
from tandem.engine.request import Request
from tandem.engine.scheduler import SampledToken, ScheduledChunk
from tandem.engine.structured.matcher import GrammarRejected, RequestGrammar

if TYPE_CHECKING:
    from tandem.engine.structured.compiler import GrammarCache

logger = logging.getLogger(__name__)

# How long a request may wait for its grammar to compile before it is aborted.
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# How long an engine step with nothing else to run waits for a compilation.
_IDLE_WAIT_S = 0.005


@dataclass
class _Waiting:
    request: Request
    future: concurrent.futures.Future
    deadline: float
    replay: list[int]
    on_ready: Callable[[Request], None]


class StructuredRuntime:
    """Grammar state of one engine's requests (used only on the engine thread)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        clock: Callable[[], float],
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._clock = clock
        self.compile_timeout_s = compile_timeout_s
        self._cache: GrammarCache | None = None
        self._waiting: dict[str, _Waiting] = {}

    @property
    def cache(self) -> GrammarCache:
        """The grammar cache, made on first use (most engines never need one)."""
        if self._cache is None:
            from tandem.engine.structured.compiler import GrammarCache

            self._cache = GrammarCache(self._tokenizer, self._vocab_size, self._stop_token_ids)
        return self._cache

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def start(
        self, request: Request, replay: list[int], on_ready: Callable[[Request], None]
    ) -> None:
        """Give `request` its matcher (after replaying `replay`) and call `on_ready`, now
        if the grammar is cached, else once it is compiled (see `poll`). Raises ValueError
        when the grammar is known to be bad or rejects the replay."""
        guided = request.params.structured
        if guided is None:
            raise ValueError(f"request {request.req_id} has no structured-output spec")
        future = self.cache.get(guided)
        replay = [*guided.accepted_token_ids, *replay]
        if future.done():
            request.grammar = _matcher(future, replay)
            on_ready(request)
            return
        deadline = self._clock() + self.compile_timeout_s
        self._waiting[request.req_id] = _Waiting(request, future, deadline, replay, on_ready)

    def poll(self) -> list[tuple[Request, CannotStart]]:
        """Start the requests whose grammar is ready; returns those that cannot start
        (bad grammar, rejected replay, compile timeout) with the reason."""
        failed = []
        now = self._clock()
        for req_id, waiting in list(self._waiting.items()):
            if not waiting.future.done():
                if now >= waiting.deadline:
                    del self._waiting[req_id]
                    reason = f"grammar not compiled within {self.compile_timeout_s:.1f} s"
                    failed.append((waiting.request, CannotStart(reason, timed_out=True)))
                continue
            del self._waiting[req_id]
            try:
                waiting.request.grammar = _matcher(waiting.future, waiting.replay)
            except ValueError as exc:
                failed.append((waiting.request, CannotStart(str(exc), timed_out=False)))
                continue
            waiting.on_ready(waiting.request)
        return failed

    def wait(self) -> None:
        """Block briefly until a pending compilation finishes (the engine has nothing
        else to run)."""
        futures = [w.future for w in self._waiting.values()]
        if futures:
            concurrent.futures.wait(
                futures, timeout=_IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def discard(self, req_id: str) -> bool:
        """Forget a request still waiting for its grammar (aborted)."""
        return self._waiting.pop(req_id, None) is not None

    def advance(
        self, chunks: Iterable[ScheduledChunk], sampled: dict[str, SampledToken]
    ) -> set[str]:
        """Advance the matchers of this step's constrained requests by their new token;
        returns the ids of requests whose token the grammar refused (they must end: their
        output left the grammar)."""
        refused = set()
        for chunk in chunks:
            request = chunk.request
            token = sampled.get(request.req_id)
            if request.grammar is None or token is None:
                continue
            try:
                request.grammar.accept(token.token_id)
            except GrammarRejected as exc:
                logger.error("request %s left its grammar: %s", request.req_id, exc)
                refused.add(request.req_id)
        return refused

    def close(self) -> None:
        """Stop the compile threads; a later grammar starts a new cache."""
        self._waiting.clear()
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def _matcher(future: concurrent.futures.Future, replay: list[int]) -> RequestGrammar:
    """A matcher of the compiled grammar in `future` (done) after `replay`."""
    try:
        compiled = future.result(timeout=0)
    except ValueError:
        raise
    except Exception as exc:  # the library's own failure, as the caller's ValueError
        raise ValueError(f"grammar compilation failed: {exc}") from exc
    return RequestGrammar(compiled, replay)
