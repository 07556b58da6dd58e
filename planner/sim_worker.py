"""One simulated worker: the engine's token-budget scheduler, stepped on a latency law.

It mirrors `tandem.engine.scheduler` (see that module) at the level the planner needs:
every step runs the running decodes first (one token each), then the next chunk of
each prompt being prefilled, then admits waiting prompts in order while the step's
`max_num_batched_tokens` budget, `max_num_seqs` and free KV blocks allow. A step lasts
`LatencyLaws.step_s` of what it ran. Roles change what happens after the first token:

- prefill: the request stops (`PREFILLED`) and its blocks stay held until the decode
  side pulls the KV (or its lease expires);
- decode: imported requests join the batch with their KV present; prompts are
  prefilled here only when the router placed them locally;
- colocated: both, under one budget.

Simplifications (said once, here): a request reserves its worst-case blocks (prompt +
output) when admitted, so nothing is ever preempted; output lengths are known; the
prefix cache is exact (no eviction) within one simulation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.planner.profile_format import EngineLimits
from tandem.planner.profile_model import LatencyLaws
from tandem.worker.config import WorkerRole


@dataclass
class SimSeq:
    """One request on one worker."""

    req_id: str
    prompt_tokens: int
    output_tokens: int
    # Prompt tokens served by this worker's prefix cache.
    cached_tokens: int = 0
    # Prompt tokens computed or cached so far.
    computed_tokens: int = 0
    # Output tokens produced so far (the first one comes from the prefill).
    generated_tokens: int = 0
    # Blocks reserved on this worker.
    num_blocks: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed_tokens < self.prompt_tokens


@dataclass
class StepResult:
    """What one finished step produced."""

    # Requests whose prompt finished in this step (their first token is out).
    first_tokens: list[SimSeq]
    # Requests that produced their last token.
    finished: list[SimSeq]


class SimWorker:
    def __init__(
        self, worker_id: str, role: WorkerRole, laws: LatencyLaws, limits: EngineLimits
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.laws = laws
        self.limits = limits
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        # Prefilled requests whose KV waits to be pulled (prefill role).
        self.held: dict[str, SimSeq] = {}
        self.num_free_blocks = limits.num_blocks
        self.busy_until_s: float | None = None
        self._step: list[tuple[SimSeq, int]] = []
        self.busy_s = 0.0
        # Imports with blocks reserved whose KV is still on the wire.
        self.num_importing = 0

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch or about to join it (bounded by max_num_seqs)."""
        return len(self.running) + self.num_importing

    # ----- inputs ----------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    def add_prompt(self, seq: SimSeq) -> None:
        """A prompt to prefill here (prefill, colocated, or a decode worker's local prefill)."""
        seq.computed_tokens = seq.cached_tokens
        self.waiting.append(seq)

    def try_import(self, seq: SimSeq) -> bool:
        """Reserve blocks for a prefilled request's KV (pull-based admission); False: full."""
        need = self.blocks_for(seq.prompt_tokens + seq.output_tokens)
        if need > self.num_free_blocks or self.num_seqs >= self.limits.max_num_seqs:
            return False
        self.num_free_blocks -= need
        seq.num_blocks = need
        self.num_importing += 1
        return True

    def join_batch(self, seq: SimSeq) -> None:
        """The imported KV arrived: decode from the next step on."""
        seq.computed_tokens = seq.prompt_tokens
        seq.generated_tokens = max(1, seq.generated_tokens)
        self.num_importing -= 1
        self.running.append(seq)

    def release(self, req_id: str) -> None:
        """The decode side pulled (or the lease expired): free the held blocks."""
        seq = self.held.pop(req_id, None)
        if seq is not None:
            self.num_free_blocks += seq.num_blocks

    # ----- stepping ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.busy_until_s is not None

    @property
    def num_queued_tokens(self) -> int:
        return sum(s.prompt_tokens - s.computed_tokens for s in (*self.waiting, *self.running))

    def start_step(self, now_s: float) -> float | None:
        """Schedule and start one step; returns its end time, or None when idle."""
        budget = self.limits.max_num_batched_tokens
        step: list[tuple[SimSeq, int]] = []
        batch, context = 0, 0
        chunks: list[tuple[int, int]] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                new = min(seq.prompt_tokens - seq.computed_tokens, budget)
                chunks.append((new, seq.computed_tokens))
            else:
                new = 1
                batch += 1
                context += seq.prompt_tokens + seq.generated_tokens
            step.append((seq, new))
            budget -= new
        while self.waiting and budget > 0 and self.num_seqs < self.limits.max_num_seqs:
            seq = self.waiting[0]
            need = self._blocks_needed(seq)
            if need > self.num_free_blocks:
                break  # head-of-line: as the engine, later prompts wait too
            self.waiting.popleft()
            self.num_free_blocks -= need
            seq.num_blocks = need
            self.running.append(seq)
            new = min(seq.prompt_tokens - seq.computed_tokens, budget)
            chunks.append((new, seq.computed_tokens))
            step.append((seq, new))
            budget -= new
        if not step:
            return None
        duration = self.laws.step_s(chunks, batch, context)
        self._step = step
        self.busy_s += duration
        self.busy_until_s = now_s + duration
        return self.busy_until_s

    def _blocks_needed(self, seq: SimSeq) -> int:
        if self.role is WorkerRole.PREFILL:
            return self.blocks_for(seq.prompt_tokens)
        return self.blocks_for(seq.prompt_tokens + seq.output_tokens)

    def finish_step(self) -> StepResult:
        """Apply the step that just ended."""
        result = StepResult([], [])
        for seq, new in self._step:
            if seq.prefilling:
                seq.computed_tokens += new
                if seq.prefilling:
                    continue
                seq.generated_tokens = 1
                result.first_tokens.append(seq)
            else:
                seq.generated_tokens += 1
            if self.role is WorkerRole.PREFILL:
                self.running.remove(seq)
                self.held[seq.req_id] = seq
            elif seq.generated_tokens >= seq.output_tokens:
                self.running.remove(seq)
                self.num_free_blocks += seq.num_blocks
                result.finished.append(seq)
        self._step = []
        self.busy_until_s = None
        return result
