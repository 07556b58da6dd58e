"""Builds the router's `GoodputPolicy` from config and keeps its worker view fresh.

`PolicyRuntime` owns a background task that polls every worker's `Stats` (and
health) every `stats_interval_s`, feeding snapshots to the policy and marking
unreachable workers unavailable so no new request is placed on them. The first poll
also tells the router the workers' KV block size and max model length.

Membership changes arrive through `add_worker` / `remove_worker` / `set_placeable`
(the router's `update_membership`). A worker takes new requests while it is both
placeable (membership says SERVING) and reachable (its last poll answered, and no
request saw it fail since).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from tandem.engine.config import ModelConfig
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.config import RouterConfig
from tandem.router.membership import RestartHold
from tandem.router.policy import (
    AdmissionConfig,
    DecodeLatencyModel,
    GoodputPolicy,
    PrefillLatencyModel,
    SelectorConfig,
    SloClass,
    SloConfig,
    WorkerState,
    WorkerStats,
)
from tandem.router.policy.slo import Slo, default_classes
from tandem.router.warmup_profile import probe_batch_sizes, probe_decode, profile_prefill
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.worker.config import WorkerRole
from tandem.worker.convert import WORKER_ROLE_FROM_PROTO

logger = logging.getLogger(__name__)


def slo_config(config: RouterConfig) -> SloConfig:
    """The SLO classes, with the interactive targets overridden from config."""
    classes = default_classes()
    interactive = classes["interactive"]
    classes["interactive"] = SloClass(
        interactive.name,
        Slo(
            ttft_s=config.ttft_slo_s if config.ttft_slo_s is not None else interactive.slo.ttft_s,
            itl_s=config.itl_slo_s if config.itl_slo_s is not None else interactive.slo.itl_s,
        ),
        interactive.priority,
    )
    return SloConfig(default_class=config.slo_class, classes=classes)


@dataclass(frozen=True)
class WorkerLimits:
    """Engine facts every worker reports in `Stats` and all must agree on."""

    # Tokens per KV block (the router's prefix index hashes blocks of this size).
    block_size: int
    # Longest prompt + output a request may ask for.
    max_model_len: int
    # The workers' weights/KV dtype ("" when they do not say); shown on /v1/models.
    dtype: str = ""


def worker_limits(stats: dict[str, pb.StatsResponse], roles: dict[str, WorkerRole]) -> WorkerLimits:
    """The limits the workers report; ValueError naming the workers when they disagree
    (or one reports none, or the wrong role), since the router cannot serve such a mix."""
    for worker_id, reply in stats.items():
        reported = WORKER_ROLE_FROM_PROTO.get(reply.role)
        if reported is not roles[worker_id]:
            raise ValueError(
                f"worker {worker_id} reports role {reported}, the router expects "
                f"{roles[worker_id].value}"
            )
    values = {}
    for name in ("block_size", "max_model_len"):
        seen = {worker_id: getattr(reply, name) for worker_id, reply in stats.items()}
        missing = sorted(w for w, v in seen.items() if v == 0)
        if missing:
            raise ValueError(f"workers {', '.join(missing)} report no {name} (too old?)")
        if len(set(seen.values())) != 1:
            listed = ", ".join(f"{w}={v}" for w, v in sorted(seen.items()))
            raise ValueError(f"workers disagree on {name} ({listed}); serve one value")
        values[name] = next(iter(seen.values()))
    dtypes = {worker_id: reply.dtype for worker_id, reply in stats.items() if reply.dtype}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{w}={v}" for w, v in sorted(dtypes.items()))
        raise ValueError(f"workers disagree on dtype ({listed}); serve one value")
    return WorkerLimits(**values, dtype=next(iter(dtypes.values()), ""))


class PolicyRuntime:
    """The policy plus the Stats poller that feeds it."""

    def __init__(self, config: RouterConfig, pool: WorkerPool) -> None:
        self.config = config
        self.pool = pool
        self.slo = slo_config(config)
        self.policy: GoodputPolicy | None = None
        # Learned from the workers in `start`.
        self._limits: WorkerLimits | None = None
        self._poller: asyncio.Task | None = None
        # Workers the membership owner does not want new requests on (draining, ...).
        self._unplaceable: set[str] = set()
        # Workers whose last poll or call failed; cleared by the next answered poll.
        self._unreachable: set[str] = set()

    async def is_ready(self) -> bool:
        """True while a request can be served: a decode-capable worker that takes new
        requests (serving, not draining) answers its health check. A prefill worker is
        not needed (with none up, a decode worker prefills the prompt itself), nor every
        worker: one dead or frozen among others is placed nothing meanwhile, and the
        pool controller replaces it. (Readiness that needed every worker took every
        router of a Kubernetes Service out of it at once, for one worker.)"""
        placeable = [w for w in self.pool.decode if w.worker_id not in self._unplaceable]
        return await self.pool.any_serving(placeable, self.config.probe_timeout_s)

    @property
    def limits(self) -> WorkerLimits:
        """The limits every worker reported; RuntimeError before `start` learned them."""
        if self._limits is None:
            raise RuntimeError("PolicyRuntime.limits: start() has not read the workers' Stats")
        return self._limits

    async def start(self) -> GoodputPolicy:
        """Read every worker's pool size and limits, build the policy, start polling.
        Raises ValueError when the workers disagree on block size or model length."""
        stats = await self.pool.stats(self.config.probe_timeout_s)
        now = time.monotonic()
        self._limits = limits = worker_limits(
            stats, {w.worker_id: w.role for w in self.pool.workers}
        )

        def state(worker) -> WorkerState:
            s = WorkerState(
                worker.worker_id,
                worker.role,
                block_size=limits.block_size,
                num_blocks=max(1, stats[worker.worker_id].num_blocks),
            )
            s.update_stats(WorkerStats.from_proto(stats[worker.worker_id]), now)
            return s

        prefill_states = [state(w) for w in self.pool.prefill]
        decode_states = [state(w) for w in self.pool.decode]
        if self.config.warmup_profile:
            await self._profile(prefill_states, decode_states, stats, limits)
        self.policy = GoodputPolicy(
            prefill_states,
            decode_states,
            selector_config=SelectorConfig(
                enable_local_prefill=self.config.max_local_prefill_tokens > 0,
                max_local_prefill_tokens=self.config.max_local_prefill_tokens,
            ),
            admission_config=AdmissionConfig(policy=self.config.admission_policy),
        )
        self._poller = asyncio.get_running_loop().create_task(self._poll(self.policy))
        return self.policy

    async def _profile(
        self,
        prefill_states: list[WorkerState],
        decode_states: list[WorkerState],
        stats: dict[str, pb.StatsResponse],
        limits: WorkerLimits,
    ) -> None:
        """Seed every worker's latency models from a few timed probe requests of at most
        `limits.max_model_len` tokens."""
        model = ModelConfig.from_model_dir(self.config.model_dir)
        timeout, max_len = self.config.prefill_timeout_s, limits.max_model_len
        by_id = {w.worker_id: w for w in self.pool.workers}
        for state in prefill_states:
            state.prefill_model = await profile_prefill(
                self.pool, by_id[state.worker_id], model.vocab_size, max_len, timeout
            )
        for state in decode_states:
            reply = stats[state.worker_id]
            batches = probe_batch_sizes(
                reply.max_num_seqs, reply.num_blocks, limits.block_size, max_len
            )
            prefill_obs, decode_obs = await probe_decode(
                self.pool, by_id[state.worker_id], model.vocab_size, max_len, timeout, batches
            )
            state.prefill_model = PrefillLatencyModel.from_profile(prefill_obs)
            state.decode_model = DecodeLatencyModel.from_profile(decode_obs)
            fixed_s, per_seq_s, _ = state.decode_model.coefficients
            logger.info("%s: a decode step costs %.1f ms + %.2f ms per sequence (probed at "
                        "batch 1%s)", state.worker_id, fixed_s * 1e3, per_seq_s * 1e3,
                        "".join(f", {b}" for b in batches))  # fmt: skip
        logger.info("seeded latency models of %d workers from a start-up profile",
                    len(prefill_states) + len(decode_states))  # fmt: skip

    async def add_worker(self, worker: WorkerEndpoint) -> None:
        """Put a worker that joined the pool (already in `self.pool`) under the policy.

        Its Stats must agree with the pools' limits (ValueError otherwise; gRPC errors
        pass through). Its latency models start as a copy of a same-role peer's, so its
        first placements are predicted like its peers' until it has its own samples.
        """
        policy, limits = self.policy, self.limits
        if policy is None or limits is None:
            raise RuntimeError("the policy runtime has not started")
        taken_at = time.monotonic()
        reply = await self.pool.worker_stats(worker, self.config.probe_timeout_s)
        joined = worker_limits({worker.worker_id: reply}, {worker.worker_id: worker.role})
        if joined != limits:
            raise ValueError(
                f"worker {worker.worker_id} reports {joined}, the pools serve {limits}"
            )
        state = WorkerState(
            worker.worker_id,
            worker.role,
            block_size=limits.block_size,
            num_blocks=max(1, reply.num_blocks),
        )
        state.update_stats(WorkerStats.from_proto(reply), taken_at)
        peer = next((w for w in policy.workers.values() if w.role is worker.role), None)
        if peer is not None:
            state.prefill_model = copy.deepcopy(peer.prefill_model)
            state.decode_model = copy.deepcopy(peer.decode_model)
        policy.add_worker(state)
        self._unreachable.discard(worker.worker_id)
        self._apply(worker.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        if self.policy is not None:
            self.policy.remove_worker(worker_id)
        self._unplaceable.discard(worker_id)
        self._unreachable.discard(worker_id)

    def follow_restart_holds(self, holds: Mapping[str, RestartHold]) -> None:
        """The membership's restart holds: while no decode-capable worker serves, a 503
        asks the client to come back once the next one may start (its Retry-After)."""
        if self.policy is None:
            return
        decode_capable = (WorkerRole.DECODE.value, WorkerRole.COLOCATED.value)
        self.policy.selector.decode_start_held_until_unix_s = max(
            (hold.until_unix_s for role, hold in holds.items() if role in decode_capable),
            default=0.0,
        )

    def set_placeable(self, worker_id: str, placeable: bool) -> None:
        """Membership says whether the worker takes new requests (SERVING) or not."""
        if placeable:
            self._unplaceable.discard(worker_id)
        else:
            self._unplaceable.add(worker_id)
        self._apply(worker_id)

    def mark_unreachable(self, worker_id: str) -> None:
        """A call to the worker failed: place nothing there until a poll answers again."""
        self._unreachable.add(worker_id)
        self._apply(worker_id)

    def _apply(self, worker_id: str) -> None:
        if self.policy is not None:
            available = worker_id not in self._unplaceable and worker_id not in self._unreachable
            self.policy.set_available(worker_id, available)

    async def _poll(self, policy: GoodputPolicy) -> None:
        """Every `stats_interval_s`, poll each worker whose last poll has returned: one
        slow to answer (frozen, overloaded: up to the probe timeout) holds up no other
        worker's stats, nor its return from unreachable."""
        in_flight: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(self.config.stats_interval_s)
                for worker in self.pool.workers:  # a copy: membership may change meanwhile
                    if worker.worker_id in in_flight:
                        continue
                    task = asyncio.create_task(self._poll_one(policy, worker))
                    in_flight[worker.worker_id] = task
                    task.add_done_callback(functools.partial(_forget, in_flight, worker.worker_id))
        finally:
            polls = list(in_flight.values())
            for task in polls:
                task.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    async def _poll_one(self, policy: GoodputPolicy, worker: WorkerEndpoint) -> None:
        taken_at = time.monotonic()
        try:
            reply = await self.pool.worker_stats(worker, self.config.probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if worker.worker_id not in self._unreachable:
                # One the membership took off placement (draining) stops answering as it
                # leaves: routine in every scale-down, not a warning to alert on.
                leaving = worker.worker_id in self._unplaceable
                (logger.info if leaving else logger.warning)(
                    "worker %s unreachable (%s); not placing on it", worker.worker_id,
                    exc.code().name,
                )  # fmt: skip
            self.mark_unreachable(worker.worker_id)
            return
        except KeyError:
            return  # removed from the pool while we waited
        self._unreachable.discard(worker.worker_id)
        self._apply(worker.worker_id)
        policy.update_stats(worker.worker_id, WorkerStats.from_proto(reply), taken_at)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None


def _forget(
    in_flight: dict[str, asyncio.Task[None]], worker_id: str, _: asyncio.Task[None]
) -> None:
    in_flight.pop(worker_id, None)
