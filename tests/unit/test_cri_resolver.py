"""CriResolver against a fake CRI runtime served over real gRPC on a unix socket (no root).

The resolver's transport is the real `direct_transport`; the fake (tests/helpers/cri_fake.py)
counts every call, so single flight and caching are asserted as call counts.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ghostgpu.collector.cri import CriCallError, CriResolver, CriTransport, direct_transport

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until

NODE = "node-a"
POD_UID = "0f3e2b1a-5c6d-4e7f-8a9b-0c1d2e3f4a5b"


def new_id() -> str:
    return secrets.token_hex(32)


class Changes:
    """on_change calls, thread-safe. With `answers_of` set to a resolver, each call also records the
    container state that resolver answers at that moment: what the change was to (a count taken
    after get() shows an answer can still be short of that answer's own on_change, which fires
    after the answer is stored)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str]] = []
        self.answers_of: CriResolver | None = None
        self.states: list[tuple[str, str]] = []  # (container ID, its container_state at the call)

    def __call__(self, node: str, cid: str) -> None:
        state = self.answers_of.get(node, cid).container_state if self.answers_of is not None else ""
        with self.lock:
            self.seen.append((node, cid))
            self.states.append((cid, state))

    def states_of(self, cid: str) -> list[str]:
        with self.lock:
            return [s for c, s in self.states if c == cid]

    def count(self, cid: str) -> int:
        with self.lock:
            return sum(1 for _, c in self.seen if c == cid)


@pytest.fixture
def fake() -> Iterator[FakeCri]:
    with FakeCri() as f:
        f.add_sandbox("sb1", "trainer-0", "ml", POD_UID)
        yield f


@pytest.fixture
def changes() -> Changes:
    return Changes()


@pytest.fixture
def make(fake: FakeCri, changes: Changes) -> Iterator[Callable[..., CriResolver]]:
    """Build resolvers over a direct transport to the fake; all closed at the end."""
    made: list[CriResolver] = []
    transport = direct_transport(fake.endpoint)

    def build(**kw: object) -> CriResolver:
        kw.setdefault("ttl_s", 30.0)
        kw.setdefault("retry_initial_s", 0.05)
        kw.setdefault("retry_max_s", 0.2)
        r = CriResolver(lambda node: transport, changes, **kw)  # type: ignore[arg-type]
        made.append(r)
        return r

    yield build
    for r in made:
        r.close()
    transport.channel.close()  # type: ignore[attr-defined]


def resolved(r: CriResolver, cid: str, node: str = NODE, what: str = "resolved") -> K8sInfo:
    """The answer once the lookup is complete (names may be published early, before the sandbox check)."""
    def done() -> bool:
        return r.get(node, cid).resolution == what and (what != "resolved" or r.stats().pending == 0)

    wait_until(done, f"{cid[:12]} {what}")
    return r.get(node, cid)


def test_burst_of_lookups_makes_one_set_of_calls(fake: FakeCri, make, changes: Changes) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make()
    fake.gate.clear()  # hold the first call so every get() below lands while it is in flight
    start = threading.Barrier(100)

    def one(_: int) -> K8sInfo:
        start.wait()
        return r.get(NODE, cid)

    with ThreadPoolExecutor(100) as pool:
        answers = list(pool.map(one, range(100)))
    assert {a.resolution for a in answers} == {"unresolved"}
    assert {a.error for a in answers} == {"CRI lookup pending"}
    fake.gate.set()
    # The names come as soon as ListContainers answers; the sandbox check completes the lookup.
    wait_until(lambda: r.get(NODE, cid).sandbox_state == "SANDBOX_READY", "the sandbox check")
    info = r.get(NODE, cid)
    assert info.resolution == "resolved" and info.pod == "trainer-0"
    assert fake.calls["Version"] == 1
    assert fake.calls["ListContainers"] == 1
    assert fake.calls["PodSandboxStatus"] == 1
    assert fake.calls["ContainerStatus"] == 0  # running: no reason to ask for one
    assert changes.count(cid) == 2  # the early names, then the sandbox's state
    s = r.stats()
    assert s.cache_misses_total == 1 and s.fetches_total == 1 and s.calls_total == 3 and s.failures_total == 0
    assert 0 < s.last_call_latency_s <= s.call_seconds_total <= s.fetch_seconds_total
    assert s.fetch_seconds_total == s.last_fetch_latency_s


def test_k8s_info_fields(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker", image="docker.io/nvidia/cuda:12.4")
    info = resolved(make(), cid)
    assert info == K8sInfo(
        resolution="resolved", namespace="ml", pod="trainer-0", pod_uid=POD_UID, container="worker",
        image="docker.io/nvidia/cuda:12.4", container_state="CONTAINER_RUNNING",
        sandbox_state="SANDBOX_READY", runtime="fakecri 1.0.0")
    assert info.orphan_reason is None


def test_fresh_answers_come_from_the_cache_until_the_ttl(fake: FakeCri, make, changes: Changes) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make(ttl_s=0.3)
    resolved(r, cid)
    calls = fake.total_calls()
    for _ in range(50):
        assert r.get(NODE, cid).pod == "trainer-0"
    assert fake.total_calls() == calls
    assert r.stats().cache_hits_total >= 50
    fake.sandboxes["sb1"].name = "trainer-1"  # what CRI says changes; the cache still says the old
    wait_until(lambda: r.get(NODE, cid).pod == "trainer-1", "the refresh after the TTL")
    assert fake.calls["ListContainers"] == 2 and fake.calls["Version"] == 1
    assert changes.count(cid) == 3  # early names and the sandbox check, then the refresh (not early)


def test_unknown_container_is_not_found_and_cached_negatively(fake: FakeCri, make) -> None:
    cid = new_id()
    r = make(negative_ttl_s=0.3)
    info = resolved(r, cid, what="not_found")
    assert info.container_state == "NOT_FOUND"
    assert info.orphan_reason == "CRI (fakecri 1.0.0) does not know this container: its record is gone"
    assert fake.calls["ListContainers"] == 1 and fake.calls["ContainerStatus"] == 1  # confirmed
    for _ in range(20):
        assert r.get(NODE, cid).resolution == "not_found"
    assert fake.calls["ListContainers"] == 1
    fake.add_container(cid, "sb1", "late")  # created after the first lookup: seen after 0.3 s
    assert resolved(r, cid).container == "late"


def test_exited_container_carries_reason_and_exit_code(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker", state=cri.CONTAINER_EXITED, reason="Error", exit_code=137)
    info = resolved(make(), cid)
    assert (info.container_state, info.container_reason, info.exit_code) == ("CONTAINER_EXITED", "Error", 137)
    assert fake.calls["ContainerStatus"] == 1
    assert info.orphan_reason == ("CRI (fakecri 1.0.0) reports container worker exited "
                                  "(reason Error, exit code 137)")


def test_unknown_state_container_is_an_orphan(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker", state=cri.CONTAINER_UNKNOWN)
    info = resolved(make(), cid)
    assert info.orphan_reason == "CRI (fakecri 1.0.0) reports container worker unknown"


def test_sandbox_gone_names_come_from_labels(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    del fake.sandboxes["sb1"]
    info = resolved(make(), cid)
    assert (info.namespace, info.pod, info.pod_uid, info.container) == ("ml", "trainer-0", POD_UID, "worker")
    assert info.sandbox_state == "NOT_FOUND"
    assert info.orphan_reason == "CRI (fakecri 1.0.0) reports pod ml/trainer-0 sandbox gone"


def test_sandbox_not_ready(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_sandbox("sb2", "job-7", "batch", "u-7", state=cri.SANDBOX_NOTREADY)
    fake.add_container(cid, "sb2", "main")
    info = resolved(make(), cid)
    assert info.sandbox_state == "SANDBOX_NOTREADY"
    assert info.orphan_reason == "CRI (fakecri 1.0.0) reports pod batch/job-7 sandbox not ready (stopped)"


def test_sandbox_metadata_wins_over_labels_and_metadata_name_is_the_last_resort(fake: FakeCri, make) -> None:
    labelled, bare = new_id(), new_id()
    fake.add_sandbox("sb3", "real-pod", "real-ns", "real-uid", labels={})
    fake.add_container(labelled, "sb3", "meta-name", labels={
        "io.kubernetes.pod.name": "label-pod", "io.kubernetes.pod.namespace": "label-ns",
        "io.kubernetes.container.name": "label-container"})
    fake.add_container(bare, "gone-sandbox", "meta-name", labels={})
    r = make()
    a = resolved(r, labelled)
    names = (a.namespace, a.pod, a.pod_uid, a.container)
    assert names == ("real-ns", "real-pod", "real-uid", "label-container")
    b = resolved(r, bare)
    assert (b.namespace, b.pod, b.pod_uid, b.container) == ("", "", "", "meta-name")


def test_unreachable_then_resolved_when_cri_returns(fake: FakeCri, make, changes: Changes) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    fake.stop()
    r = make()
    assert r.get(NODE, cid).resolution == "unresolved"
    wait_until(lambda: "CRI unreachable for node node-a: UNAVAILABLE" in r.get(NODE, cid).error,
               "the transport error in the answer")
    assert r.get(NODE, cid).resolution == "unresolved"
    wait_until(lambda: r.node_failures(NODE) >= 2, "retries while CRI is away")
    before = changes.count(cid)
    fake.start()
    info = resolved(r, cid)
    assert info.pod == "trainer-0" and info.error == ""
    assert changes.count(cid) > before
    assert r.stats().failures_by_node[NODE] >= 2


def test_failed_refresh_keeps_the_names_and_says_why(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make(ttl_s=0.2)
    resolved(r, cid)
    fake.fail["ListContainers"] = grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: r.get(NODE, cid).resolution == "unresolved", "the failed refresh")
    info = r.get(NODE, cid)
    assert info.pod == "trainer-0" and "DEADLINE_EXCEEDED" in info.error
    del fake.fail["ListContainers"]
    assert resolved(r, cid).error == ""


def test_short_prefix_and_kubelet_form_resolve_as_cri_does(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make()
    assert resolved(r, cid[:12]).container == "worker"
    assert resolved(r, "containerd://" + cid.upper()).container == "worker"


def test_container_only_status_knows_is_resolved(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker", listed=False)
    info = resolved(make(), cid)
    assert (info.container, info.pod, info.sandbox_state) == ("worker", "trainer-0", "")


def test_version_is_asked_once_per_node(fake: FakeCri, make) -> None:
    ids = [new_id() for _ in range(10)]
    for cid in ids:
        fake.add_container(cid, "sb1", "c")
    r = make()
    for node in ("n1", "n2"):
        for cid in ids:
            r.get(node, cid)
    for node in ("n1", "n2"):
        for cid in ids:
            resolved(r, cid, node=node)
    assert fake.calls["Version"] == 2
    assert r.runtime("n1") == "fakecri 1.0.0"


def test_each_node_has_its_own_runtime(changes: Changes) -> None:
    cid = new_id()
    with FakeCri(runtime_name="containerd") as a, FakeCri(runtime_name="cri-o") as b:
        a.add_sandbox("s", "pod-a", "ns", "ua")
        a.add_container(cid, "s", "x")
        b.add_sandbox("s", "pod-b", "ns", "ub")
        b.add_container(cid, "s", "x")
        transports = {"a": direct_transport(a.endpoint), "b": direct_transport(b.endpoint)}
        with CriResolver(transports.get, changes, ttl_s=30.0) as r:
            assert resolved(r, cid, node="a").pod == "pod-a"
            assert resolved(r, cid, node="b").pod == "pod-b"
            assert r.get("b", cid).runtime == "cri-o 1.0.0"


def test_no_transport_for_the_node(changes: Changes) -> None:
    with CriResolver(lambda node: None, changes, ttl_s=30.0, retry_initial_s=0.05) as r:
        cid = new_id()
        wait_until(lambda: "no CRI path to node lost" in r.get("lost", cid).error, "the no-path error")
        assert r.get("lost", cid).resolution == "unresolved"


def test_no_container_id_is_no_lookup(fake: FakeCri, make) -> None:
    r = make()
    assert r.get(NODE, "").resolution == "none"
    assert fake.total_calls() == 0


def test_cache_size_is_bounded(fake: FakeCri, make) -> None:
    r = make(max_entries=5)
    for _ in range(20):
        r.get(NODE, new_id())
    assert r.stats().cached == 5
    wait_until(lambda: r.stats().pending == 0, "the remaining lookups")


def test_a_forgotten_container_is_looked_up_afresh(fake: FakeCri, make) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make()
    resolved(r, cid)
    r.forget(NODE, "containerd://" + cid)  # the kubelet's form names the same container
    assert r.stats().cached == 0
    assert r.get(NODE, cid).error == "CRI lookup pending"
    assert resolved(r, cid).pod == "trainer-0"
    assert fake.calls["ListContainers"] == 2


def test_an_answer_for_a_container_forgotten_meanwhile_is_dropped(fake: FakeCri, make,
                                                                  changes: Changes) -> None:
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make()
    fake.gate.clear()  # the lookup's first call waits here
    r.get(NODE, cid)
    wait_until(lambda: fake.total_calls() == 1, "the lookup to be in flight")
    r.forget(NODE, cid)
    fake.gate.set()
    wait_until(lambda: r.stats().fetches_total == 1, "the lookup to end")
    assert r.stats().cached == 0 and changes.count(cid) == 0  # neither kept nor announced


def test_direct_transport_only_passes_read_only_methods(fake: FakeCri) -> None:
    call: CriTransport = direct_transport(fake.endpoint)
    with pytest.raises(CriCallError) as e:
        call("RemoveContainer", cri.RemoveContainerRequest(container_id="x").SerializeToString(), 1.0)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert fake.total_calls() == 0
    raw = call("Version", cri.VersionRequest().SerializeToString(), 1.0)
    assert cri.VersionResponse.FromString(raw).runtime_name == "fakecri"


def test_direct_transport_survives_a_runtime_restart(fake: FakeCri) -> None:
    call = direct_transport(fake.endpoint)
    req = cri.VersionRequest().SerializeToString()
    call("Version", req, 1.0)
    fake.stop()
    with pytest.raises(CriCallError) as e:
        call("Version", req, 1.0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert fake.endpoint.removeprefix("unix://") in e.value.message
    fake.start()

    def answers() -> bool:
        try:
            return bool(call("Version", req, 1.0))
        except CriCallError:
            return False

    wait_until(answers, "the same transport to answer after the restart", timeout_s=5.0)


def test_bad_endpoint_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unix:///absolute/path"):
        direct_transport("localhost:1234")


def test_a_kept_container_is_fetched_again_by_itself_and_its_stop_is_heard(
        fake: FakeCri, make, changes: Changes) -> None:
    """keep(): nobody asks again, yet the answer is refreshed every ttl, so a container that stops
    under a holder that outlives it reaches on_change (the cluster table turns the holder orphaned);
    forget() ends the keeping."""
    cid = new_id()
    fake.add_container(cid, "sb1", "worker")
    r = make(ttl_s=0.2)
    changes.answers_of = r
    r.keep(NODE, cid)
    wait_until(lambda: "CONTAINER_RUNNING" in changes.states_of(cid), "the kept container resolved")
    with fake.lock:
        fake.containers[cid].state = cri.CONTAINER_EXITED
    wait_until(lambda: "CONTAINER_EXITED" in changes.states_of(cid),
               "the kept container's stop heard with nobody asking")
    assert r.get(NODE, cid).container_state == "CONTAINER_EXITED"
    r.forget(NODE, cid)
    assert r.stats().cached == 0  # forgotten: no longer kept, nor fetched

