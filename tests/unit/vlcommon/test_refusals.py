"""The registry of refusals (``vlcommon.refusals``): the docs table is the registry's, every
reason the serving packages send is named through it, and every member is used.

Fast: reads sources and the docs page, builds errors in process; no service is started.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from qwenvl.common.v1 import generation_pb2

from vlcommon import refusals
from vlcommon.errors import ServiceError, error_info, to_status
from vlcommon.refusals import Refusal
from vlcommon.relay import DEPENDENCY_FAILURES, from_rpc_error

ROOT = Path(__file__).resolve().parents[3]
SERVING = (
    "gateway",
    "encoder_service",
    "cache_service",
    "decoder_service",
    "vlcommon",
    "splitvl",
    "splitvl_tools",
)
#: Builders that take a reason: its position among the arguments.
HELPERS = {"invalid_argument": 0, "resource_exhausted": 0, "unavailable": 0}
REGISTRY = ROOT / "vlcommon" / "refusals.py"
RELAY = ROOT / "vlcommon" / "relay.py"
ERRORS = ROOT / "vlcommon" / "errors.py"


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for package in SERVING:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


SOURCES = list(_sources())


def _name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _reason_arg(call: ast.Call, position: int) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == "reason"), None)


def test_the_docs_table_is_the_registrys() -> None:
    page = ROOT / "docs" / "api.md"
    text = page.read_text(encoding="utf-8")
    errors = text[text.index("\n## Errors\n") :]
    assert refusals.DOCS_START in errors.split("\n## ", 2)[1], "the table left ## Errors"
    assert refusals.with_docs_table(text) == text, (
        "docs/api.md's refusals table differs from vlcommon/refusals.py: run "
        "`python -m vlcommon.refusals --write-docs docs/api.md`"
    )
    for r in Refusal:
        assert f"| `{r.value}` |" in text


def test_no_reason_is_a_bare_string() -> None:
    """A reason goes through the registry: never a string (or f-string) given to
    ServiceError or the errors helpers, no helper left in the serving packages, and no
    string equal to a reason anywhere (comparisons, tables) outside the registry (but a
    gRPC status name, such as a retry policy's ``CANCELLED``)."""
    names = set(Refusal.__members__) - {code.name for code in grpc.StatusCode}
    found = []
    for path, tree in SOURCES:
        where = path.relative_to(ROOT)
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _name(node)
                if name in HELPERS and path != ERRORS:
                    found.append(f"{where}:{node.lineno}: {name}() (use Refusal.X.error)")
                if name == "ServiceError" and path not in (ERRORS, REGISTRY, RELAY):
                    reason = _reason_arg(node, 1)
                    if not (isinstance(reason, ast.Attribute) and reason.attr == "reason"):
                        # Only a relay builds one by hand: it keeps a dependency's reason.
                        found.append(f"{where}:{node.lineno}: ServiceError(...) not a relay")
            if (
                isinstance(node, ast.Constant)
                and node.value in names
                and path != REGISTRY
                and not isinstance(parents.get(node), ast.JoinedStr)
            ):
                found.append(f"{where}:{node.lineno}: the string {node.value!r}")
    assert not found, "\n".join(found)


def test_every_member_is_used() -> None:
    """Each reason is raised (or answered) somewhere: ``Refusal.X`` outside its definition."""
    used: set[str] = set()
    for _, tree in SOURCES:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Refusal"
            ):
                used.add(node.attr)
    assert sorted(set(Refusal.__members__) - used) == []
    assert sorted(used - set(Refusal.__members__) - {"error"}) == []


def test_members_are_their_reasons_with_one_status() -> None:
    for r in Refusal:
        assert r == r.value == r.name and r.meaning and "\n" not in r.meaning
        if r.status is None:  # an error of the OpenAI front's HTTP layer only
            assert r.http_status in (404, 405, 408, 415)
            with pytest.raises(TypeError):
                r.error("x")
        else:
            assert r.http_status is None
            err = r.error("m", field="f")
            assert (err.code, err.reason, err.metadata) == (r.status, r.name, {"field": "f"})
    statuses = {r.name: r.status for r in Refusal}
    assert statuses["TOP_P_OUT_OF_RANGE"] == grpc.StatusCode.INVALID_ARGUMENT
    assert statuses["URL_FETCH_FAILED"] == grpc.StatusCode.UNAVAILABLE
    assert statuses["IMAGE_URLS_DISABLED"] == grpc.StatusCode.FAILED_PRECONDITION


def test_a_registry_error_is_byte_identical_on_the_wire() -> None:
    """A member is a str: the status it packs equals the one a plain string gave."""
    by_registry = Refusal.URL_FETCHES_BUSY.error(
        "busy", field="images", limit=8, retry_after_ms=250, host="h"
    )
    by_hand = ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "URL_FETCHES_BUSY",
        "busy",
        {"field": "images", "limit": "8", "host": "h"},
        retry_after_ms=250,
    )
    assert to_status(by_registry).code == to_status(by_hand).code
    assert to_status(by_registry).details == to_status(by_hand).details
    assert to_status(by_registry).trailing_metadata == to_status(by_hand).trailing_metadata


@pytest.mark.parametrize(
    ("code", "reason", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, "DECODER_UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
        (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "DECODER_DEADLINE_EXCEEDED",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ),
        (grpc.StatusCode.INTERNAL, "DECODER_UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
        # A proxy or mesh's authorization in front of the dependency: kept as it is (a
        # configuration error, not one to retry), not read as the dependency down.
        (
            grpc.StatusCode.PERMISSION_DENIED,
            "DECODER_PERMISSION_DENIED",
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (
            grpc.StatusCode.UNAUTHENTICATED,
            "DECODER_UNAUTHENTICATED",
            grpc.StatusCode.UNAUTHENTICATED,
        ),
        # Not a status gRPC or a proxy makes up by itself, and no splitvl service sends it
        # bare: the dependency failing.
        (grpc.StatusCode.ABORTED, "DECODER_UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_a_dependency_status_without_errorinfo_gets_a_registry_reason(
    code: grpc.StatusCode, reason: str, status: grpc.StatusCode
) -> None:
    err = from_rpc_error(
        AioRpcError(code, Metadata(), Metadata(), details="x"), dependency="decoder"
    )
    assert (err.reason, err.code) == (reason, status)
    assert Refusal(err.reason).status == err.code
    assert set(DEPENDENCY_FAILURES) == {"encoder", "decoder"}


def test_one_owner_per_shared_rule() -> None:
    """The encoder and the cache share one transport rule, the gateway and the cache one
    policy rule; top_p is ``optional`` and its range is vlcommon.sampling's."""
    from vlcommon.handoff import check_transport
    from vlcommon.request_rules import check_cache_policy
    from vlcommon.sampling import check_sampling_ranges

    with pytest.raises(ServiceError) as caught:
        check_transport(9)
    assert (caught.value.reason, caught.value.message) == (
        "TRANSPORT_UNSUPPORTED",
        "transport 9 is not a Transport value",
    )
    with pytest.raises(ServiceError) as caught:
        check_cache_policy(7, "policy")
    assert caught.value.message == "policy 7 is not a CachePolicy value"
    assert check_sampling_ranges(generation_pb2.SamplingParams()) == 1.0
    with pytest.raises(ServiceError) as caught:
        check_sampling_ranges(generation_pb2.SamplingParams(top_p=0.0))
    assert caught.value.reason == "TOP_P_OUT_OF_RANGE"
    assert caught.value.message == "sampling.top_p is 0.0; allowed (0, 1]"


def test_the_wire_reason_of_a_served_error_is_the_plain_string() -> None:
    """What a client reads back (grpcio-status) is the registry's string."""
    status = to_status(Refusal.IMAGE_DECODE_FAILED.error("bad", field="images[0]"))
    err = AioRpcError(
        status.code, Metadata(), Metadata(*status.trailing_metadata), details=status.details
    )
    info = error_info(err)
    assert info is not None and info.reason == "IMAGE_DECODE_FAILED"
    assert type(info.reason) is str


def test_a_dependency_status_with_unreadable_details_gets_a_registry_reason() -> None:
    """A proxy's corrupt grpc-status-details-bin (or an ErrorInfo without a reason) reads
    as no ErrorInfo: the registry's reason, never a DecodeError turned INTERNAL."""
    from google.rpc import error_details_pb2, status_pb2

    empty = status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="x")
    empty.details.add().Pack(error_details_pb2.ErrorInfo(reason=""))
    for details in (b"\xff\xff\xff", empty.SerializeToString()):
        trailing = Metadata(("grpc-status-details-bin", details))
        err = from_rpc_error(
            AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), trailing, details="x"),
            dependency="encoder",
        )
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "ENCODER_UNAVAILABLE")
