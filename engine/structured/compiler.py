"""Compiles guided-decoding specs for one tokenizer, off the engine thread, with a cache.

Compiling a grammar against the vocabulary takes milliseconds to seconds (large schemas);
the engine thread must not wait for it. `GrammarCache.get` returns a future at once: the
first request with a spec starts the compilation on a small thread pool, later requests
with the same (kind, spec) share the future, and the result stays cached (LRU, bounded).
A failed compilation is cached too (as its exception) so a bad spec is not retried.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from tandem.engine.structured.grammar_builder import build_grammar
from tandem.engine.structured.spec import GuidedDecoding, GuidedKind

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine (each is small: token masks per grammar state).
DEFAULT_MAX_CACHED_GRAMMARS = 256
# Threads compiling grammars (xgrammar itself may use more inside one compilation).
DEFAULT_NUM_COMPILE_THREADS = 1


class GrammarCache:
    """Compiled grammars of one tokenizer, keyed by `GuidedDecoding.cache_key`."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_cached: int = DEFAULT_MAX_CACHED_GRAMMARS,
        num_threads: int = DEFAULT_NUM_COMPILE_THREADS,
    ) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=num_threads, cache_enabled=False
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="grammar-compile"
        )
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[GuidedKind, str], concurrent.futures.Future] = (
            OrderedDict()
        )
        self.num_compiled = 0
        self.num_hits = 0

    def get(self, guided: GuidedDecoding) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        """The compiled grammar of `guided` (a future; done at once on a cache hit)."""
        key = guided.cache_key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                self.num_hits += 1
                return future
            future = self._pool.submit(self._compile, guided)
            self._futures[key] = future
            while len(self._futures) > self._max_cached:
                self._futures.popitem(last=False)
            return future

    def _compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        grammar = build_grammar(guided)
        compiled = self._compiler.compile_grammar(grammar)
        with self._lock:
            self.num_compiled += 1
        logger.debug("compiled a %s grammar (%d spec chars)", guided.kind.value, len(guided.spec))
        return compiled

    def close(self) -> None:
        """Stop the compile threads (pending compilations are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
