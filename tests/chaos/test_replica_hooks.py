"""ReplicaFault against a mock transport: the HTTP it sends and how it reads the answers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from chaos.faults.base import FaultError, FaultSpec, RevertFailed, RevertToken
from chaos.faults.replica import ReplicaFault

from .fakes import FakeTarget

URL = "http://127.0.0.1:8101/admin/faults"


class FakeHooks:
    """A replica's /admin/faults in memory."""

    def __init__(self) -> None:
        self.faults: dict[str, dict[str, object]] = {}
        self.requests: list[str] = []
        self.auth: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        self.auth.append(request.headers.get("authorization"))
        if request.method == "PUT":
            fid = f"f{len(self.faults) + 1}"
            self.faults[fid] = {"id": fid, **json.loads(request.content), "started_at": 1000.0}
            return httpx.Response(201, json=self.faults[fid])
        if request.method == "GET":
            return httpx.Response(200, json={"faults": list(self.faults.values())})
        fid = request.url.path.rsplit("/", 1)[-1]
        if self.faults.pop(fid, None) is None:
            return httpx.Response(404, json={"error": {"message": "no such fault"}})
        return httpx.Response(200, json={})


def fault(hooks: FakeHooks, kind: str = "token_latency") -> ReplicaFault:
    return ReplicaFault(kind, transport=httpx.MockTransport(hooks), wall_clock=lambda: 1000.0,
                        admin_tokens=lambda rid: "from-lookup")


def test_inject_puts_the_fault_and_revert_deletes_it_by_id() -> None:
    hooks = FakeHooks()
    f = fault(hooks)
    spec = FaultSpec("token_latency", {"seconds": 0.5}, duration_s=30)

    async def scenario() -> RevertToken:
        token = await f.inject(spec, FakeTarget("r0", admin_url=URL, admin_token="secret"))
        await f.revert(token)
        await f.revert(token)  # already gone: 404 is success
        return token

    token = asyncio.run(scenario())
    assert token.data["fault_id"] == "f1" and "secret" not in json.dumps(token.to_json())
    assert hooks.requests == ["PUT /admin/faults", "DELETE /admin/faults/f1", "DELETE /admin/faults/f1"]
    assert set(hooks.auth) == {"Bearer secret"}
    assert hooks.faults == {}


def test_record_registered_before_inject_reverts_the_matching_fault() -> None:
    hooks = FakeHooks()
    spec = FaultSpec("kv_pressure", {"fraction": 0.5}, duration_s=30)
    f2 = fault(hooks, "kv_pressure")
    target = FakeTarget("r0", admin_url=URL)

    async def scenario() -> None:
        pre = f2.prepare(spec, target)
        await f2.inject(spec, target)  # the ledger never learnt the id
        hooks.faults["other"] = {"id": "other", "kind": "kv_pressure", "fraction": 0.9, "duration_s": 30,
                                 "started_at": 1000.0}
        await ReplicaFault("kv_pressure", transport=httpx.MockTransport(hooks),
                           admin_tokens=lambda rid: "t").revert(pre)

    asyncio.run(scenario())
    assert list(hooks.faults) == ["other"]  # only the fault with the same kind and parameters went


def test_revert_of_a_replica_that_is_gone_is_success() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    f = ReplicaFault("hang", transport=httpx.MockTransport(refuse), admin_tokens=lambda rid: "t")
    token = RevertToken("hang", "r0", "delete", {"admin_url": URL, "fault_id": "f3"})
    asyncio.run(f.revert(token))


def test_revert_without_an_admin_token_fails_permanently() -> None:
    f = ReplicaFault("hang", transport=httpx.MockTransport(FakeHooks()))
    token = RevertToken("hang", "r0", "delete", {"admin_url": URL, "fault_id": "f3"})
    with pytest.raises(RevertFailed, match="no admin token") as info:
        asyncio.run(f.revert(token))
    assert not info.value.retryable


def test_server_error_on_revert_is_retryable() -> None:
    f = ReplicaFault("hang", transport=httpx.MockTransport(lambda r: httpx.Response(503)),
                     admin_tokens=lambda rid: "t")
    token = RevertToken("hang", "r0", "delete", {"admin_url": URL, "fault_id": "f3"})
    with pytest.raises(RevertFailed, match="answered 503") as info:
        asyncio.run(f.revert(token))
    assert info.value.retryable


def test_admin_url_off_loopback_is_refused() -> None:
    f = fault(FakeHooks())
    spec = FaultSpec("token_latency", {"seconds": 0.5})
    with pytest.raises(FaultError, match="loopback"):
        f.prepare(spec, FakeTarget("r0", admin_url="http://10.0.0.5:8101/admin/faults"))
