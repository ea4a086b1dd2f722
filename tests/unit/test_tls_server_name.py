"""--tls-server-name: a client checks the collector's certificate against a name other than the host it
dials, as `kubectl ghostgpu` does through a port-forward (127.0.0.1, a certificate for
ghostgpu-collector.NAMESPACE.svc). A real collector serves mTLS with a certificate naming only that
Service name; the real `ghostgpu ps` reaches it on 127.0.0.1 with the flag, and without it is told
in one line why not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from ghostgpu.common.transport.collector_target import parse_collector
from ghostgpu.common.transport.dial import collector_channel_options
from ghostgpu.common.transport.tls import TlsError, TlsFiles
from tests.helpers.certs import Pki

SERVICE_NAME = "ghostgpu-collector.ghostgpu.svc"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def collector(tmp_path: Path, pki: Pki) -> Iterator[Collector]:
    """mTLS on 127.0.0.1 with a certificate for the Service name only; user alice may read."""
    tls = pki.write("collector", pki.collector([SERVICE_NAME]))
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - role: viewer\n    subjects: [user:alice]\n")
    config = CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db"), tls_cert=tls.cert,
                             tls_key=tls.key, tls_ca=tls.ca, policy_path=str(policy))
    c = Collector(config).start()
    try:
        yield c
    finally:
        c.stop(grace_s=0.5)


def ps(collector: Collector, alice: TlsFiles, *extra: str) -> list[str]:
    return ["ps", "--collector", collector.address, "-o", "json", "--tls-ca", str(alice.ca),
            "--tls-cert", str(alice.cert), "--tls-key", str(alice.key), *extra]


def test_the_name_given_is_the_one_checked(collector: Collector, pki: Pki,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    alice = pki.write("alice", pki.user("alice"))
    assert main(ps(collector, alice, "--tls-server-name", SERVICE_NAME)) == 0
    assert json.loads(capsys.readouterr().out) == []  # answered: an empty cluster

    assert main(ps(collector, alice)) == 1
    err = capsys.readouterr().err
    assert f"its certificate does not name '{collector.address.rpartition(':')[0]}'" in err, err

    assert main(ps(collector, alice, "--tls-server-name", "ghostgpu-collector.other.svc")) == 1
    err = capsys.readouterr().err
    assert ("its certificate does not name 'ghostgpu-collector.other.svc' (--tls-server-name); pass a name "
            "the certificate lists") in err, err


@pytest.mark.parametrize("name", ["bad name", "-x.svc", "a..b", "x" * 254, ""])
def test_a_name_that_is_no_dns_name_is_one_line(name: str) -> None:
    with pytest.raises(TlsError, match=r"--tls-server-name .*: not a DNS name; give the name the"):
        TlsFiles.resolve(ca="/ca.crt", server_name=name, env={})


@pytest.mark.parametrize(("address", "secure", "name", "want"), [
    ("127.0.0.1:40001", True, SERVICE_NAME, SERVICE_NAME),
    ("127.0.0.1:40001", True, None, None),  # the host dialled, gRPC's own
    ("127.0.0.1:40001", False, SERVICE_NAME, None),  # plaintext: no certificate to check
    ("a.example:7450,b.example:7450", True, None, "a.example"),  # a list: its first host
    ("a.example:7450,b.example:7450", True, SERVICE_NAME, SERVICE_NAME),
])
def test_channel_option(address: str, secure: bool, name: str | None, want: str | None) -> None:
    options = dict(collector_channel_options(parse_collector(address), secure=secure, server_name=name))
    assert options.get("grpc.ssl_target_name_override") == want
