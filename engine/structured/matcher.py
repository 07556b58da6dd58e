"""One request's position in its grammar: which tokens may come next, and when it ends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarRejected(ValueError):
    """A token the grammar does not allow at this point (e.g. a bad replay)."""


class RequestGrammar:
    """An xgrammar matcher for one sequence; advanced with every token it emits."""

    def __init__(self, compiled: xgr.CompiledGrammar, replay: Iterable[int] = ()) -> None:
        import xgrammar  # loaded by the compiler already; kept out of engine start-up

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.num_accepted = 0
        for token_id in replay:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; GrammarRejected when the grammar forbids it."""
        if not self._matcher.accept_token(token_id):
            raise GrammarRejected(
                f"token {token_id} is not allowed by the grammar after "
                f"{self.num_accepted} accepted tokens"
            )
        self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
