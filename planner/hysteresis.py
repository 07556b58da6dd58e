"""When the live planner in `auto` may resize the pools, and to what (pure, no I/O).

A change happens only when all hold:
- the pools are at their targets (no worker starting or draining: one change at a time);
- at least `min_change_interval_s` since the last change, the planner's own or anyone
  else's (an operator's `tandem scale`, seen as a split other than the one the gate
  last saw or moved to);
- the last `confirmations` plans, all made from the current split, recommended the same
  split, different from now
  (a plan recommends another split only when its predicted goodput beats the current
  split's by more than the planner's `min_gain`: `compute_plan` in live_plan.py).
Then the pools move **one worker** toward it (one role -1, the other +1, or one more
or fewer when the budget differs from the pools' size; never below one per role); the
pool controller drains a removed worker before stopping it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Split = tuple[int, int]  # (prefill, decode)


@dataclass
class ResizeGate:
    min_change_interval_s: float
    confirmations: int
    last_change_s: float = float("-inf")
    _recent: list[Split] = field(default_factory=list)
    # The split the gate last saw, or last moved the pools to.
    _split: Split | None = None

    def decide(
        self,
        now_s: float,
        current: Split,
        recommended: Split,
        at_target: bool,
    ) -> tuple[Split | None, str]:
        """The next targets (or None) and why."""
        if self._split is not None and current != self._split:
            # Resized by someone else: that is a change too, and the plans made from the
            # old split confirm nothing (the first plan after an operator's scale undid it).
            self.last_change_s, self._recent = now_s, []
        self._split = current
        self._recent = [*self._recent, recommended][-self.confirmations :]
        if recommended == current:
            return None, "already at the recommended split"
        if not at_target:
            return None, "waiting for the last change to finish"
        if now_s - self.last_change_s < self.min_change_interval_s:
            return None, "too soon after the last change"
        if len(self._recent) < self.confirmations or len(set(self._recent)) > 1:
            return None, f"waiting for {self.confirmations} plans in a row to agree"
        target = one_step(current, recommended)
        if min(target) < 1:
            return None, "would leave a role without workers"
        return target, f"moving one worker toward {recommended[0]}P+{recommended[1]}D"

    def changed(self, now_s: float, target: Split) -> None:
        """The pools were resized to `target` as `decide` said (a refused resize is no
        change: the next plan may try again at once)."""
        self.last_change_s = now_s
        self._recent = []
        self._split = target


def one_step(current: Split, recommended: Split) -> Split:
    """One worker toward `recommended`: move one between the roles, or add or remove one
    when the budget differs from the pools' size."""
    (prefill, decode), (want_p, want_d) = current, recommended
    grow_p, grow_d = want_p - prefill, want_d - decode
    if grow_p > 0 and grow_d < 0:
        return prefill + 1, decode - 1
    if grow_p < 0 and grow_d > 0:
        return prefill - 1, decode + 1
    if grow_p > 0 or grow_d > 0:
        return (prefill + 1, decode) if grow_p > 0 else (prefill, decode + 1)
    return (prefill - 1, decode) if grow_p < 0 else (prefill, decode - 1)
