"""gRPC `tandem.admin.v1.Admin` on the router's public port (see `router.admin`; the
API key, when set, is checked for every public service by `router.api_key`)."""

from __future__ import annotations

import time

from tandem.proto.tandem.admin.v1 import admin_pb2 as admin_pb
from tandem.proto.tandem.admin.v1 import admin_pb2_grpc
from tandem.router.admin import PoolsAdmin, parse_targets
from tandem.router.errors import RouterError, abort_with
from tandem.router.membership import Membership, holds_not_passed

SERVICE_NAME = admin_pb.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, admin: PoolsAdmin) -> None:
        self.admin = admin

    async def GetPools(self, request: admin_pb.GetPoolsRequest, context) -> admin_pb.PoolsResponse:
        try:
            return self._response(await self.admin.get_pools())
        except RouterError as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises

    async def ScalePools(
        self, request: admin_pb.ScalePoolsRequest, context
    ) -> admin_pb.PoolsResponse:
        try:
            body = {
                role: getattr(request, role)
                for role in ("prefill", "decode")
                if request.HasField(role)
            }
            targets = parse_targets(body)
            return self._response(await self.admin.scale(targets))
        except RouterError as exc:
            await abort_with(context, exc)
            raise

    async def DrainWorker(
        self, request: admin_pb.DrainWorkerRequest, context
    ) -> admin_pb.PoolsResponse:
        try:
            return self._response(await self.admin.drain(request.worker_id))
        except RouterError as exc:
            await abort_with(context, exc)
            raise

    def _response(self, membership: Membership) -> admin_pb.PoolsResponse:
        reply = admin_pb.PoolsResponse(version=membership.version, owner=membership.owner)
        for worker in membership.workers:
            fields = self.admin.worker_json(worker)
            reply.workers.append(admin_pb.Worker(**fields))
        if membership.targets is not None:
            reply.targets.CopyFrom(
                admin_pb.PoolTargets(
                    prefill=membership.targets.prefill, decode=membership.targets.decode
                )
            )
        for role, hold in holds_not_passed(membership.restart_holds, time.time()).items():
            reply.restart_holds[role].CopyFrom(
                admin_pb.RestartHold(failures=hold.failures, until_unix_s=hold.until_unix_s)
            )
        return reply
