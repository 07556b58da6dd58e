"""`RequestTrace`: what one request did, as the load generator saw it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class RequestTrace:
    """One request; times are `time.perf_counter()` seconds (or relative to a run start)."""

    req_id: str
    tag: str
    prompt_len: int  # the server's count (usage) when it reports one, else the spec's
    max_tokens: int
    send_s: float  # when the request left the client
    end_s: float  # when it ended: last byte, error, or cancellation
    # Arrival time of each output token; a message carrying k tokens adds k equal times.
    # A server that merges tokens into one SSE chunk without saying how many shows here
    # as fewer arrivals than `num_output_tokens` (see `clients.HttpClient`).
    token_times_s: list[float] = field(default_factory=list)
    # Output tokens generated: the server's own count (usage) when it reports one, else
    # the number of arrivals.
    num_output_tokens: int = 0
    finish_reason: str = ""  # "stop", "length" or "abort" as the server said; "" if it said none
    # "" on success; else what failed: a gRPC status name, "HTTP 429: ...", "timeout", ...
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # output ids where seen (gRPC)
    # Open loop: when the schedule wanted it sent (send_s − scheduled_s is client lag).
    scheduled_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error

    def shifted(self, origin_s: float) -> RequestTrace:
        """The same trace with every time relative to `origin_s`."""
        return replace(
            self,
            send_s=self.send_s - origin_s,
            end_s=self.end_s - origin_s,
            token_times_s=[t - origin_s for t in self.token_times_s],
            scheduled_s=None if self.scheduled_s is None else self.scheduled_s - origin_s,
        )
