"""The processes bench_tls.py measures, and its test CA: the real `ghostgpu collector` plaintext or mTLS
(with /metrics, and HTTPS there from a --web-config-file), and a bare NodeStream echo server with the
same transport credentials, storing nothing and asking nobody who they are. Also its part 3, the
/metrics scrapes (plain HTTP against HTTPS, keep-alive and a new connection each time).

Run as `bench/tls_procs.py serve-echo ARM PKI_DIR` by bench_tls.py; not on its own.
"""

from __future__ import annotations

import http.client
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_ingest import _node_totals
from bench.common import ROOT

PY = sys.executable
ARMS = ("plaintext", "mtls")
# The mTLS collectors' policy: the bench's nodes stream, the local root (NodeStatus over the unix
# socket) reads. The recheck arm rewrites it while tracers stream, so each reload re-checks them all.
POLICY = """rules:
  - role: admin
    subjects: ["uid:0"]
  - role: tracer
    subjects: ["node:*"]
"""
RECONNECT_NODE = "bench-reconnect"
CONSUMERS = 20  # per node in the scraped collectors, as the ingest clients' snapshots


# ---- test CA and collectors ----------------------------------------------------------------------


def make_pki(directory: Path, tracers: int) -> Path:
    """A CA, the collector's pair, a node pair per tracer (and the reconnecting one), a web config."""
    from tests.helpers.certs import Pki

    pki = Pki(directory)
    pki.write("collector", pki.collector())
    for node in [*(f"bench-node-{i:03d}" for i in range(tracers)), RECONNECT_NODE]:
        pki.write(f"node-{node}", pki.node(node))
    (directory / "policy.yaml").write_text(POLICY)
    (directory / "web.yml").write_text("tls_server_config:\n  cert_file: collector.crt\n"
                                       "  key_file: collector.key\n")
    return directory


def node_tls(pki: str | None, node: str) -> Any:
    from ghostgpu.common.transport.tls import TlsFiles

    if not pki:
        return None
    return TlsFiles(f"{pki}/node-{node}.crt", f"{pki}/node-{node}.key", f"{pki}/ca.crt")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    addr: str  # 127.0.0.1:PORT
    unix: str  # unix:///...: NodeStatus as the local root
    metrics_url: str | None
    tmp: str

    def audit_peers(self, node: str) -> list[str]:
        lines = Path(self.tmp, "collector.audit.jsonl").read_text().splitlines()
        recs = [json.loads(x) for x in lines if x.strip()]
        return [r["detail"].get("peer", "") for r in recs
                if r["action"] == "tracer.connect" and r["detail"].get("node") == node]


def web_config_supported() -> bool:
    help_text = subprocess.run([PY, "-m", "ghostgpu.cli", "collector", "--help"], cwd=ROOT,
                               capture_output=True, text=True).stdout
    return "--web-config-file" in help_text


@contextmanager
def collector(arm: str, pki: Path, metrics: bool = False, web_config: bool = False,
              policy: Path | None = None) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-tls-") as tmp:
        cmd = [PY, "-m", "ghostgpu.cli", "collector", "--listen", f"127.0.0.1:0,unix://{tmp}/c.sock",
               "--db", f"{tmp}/collector.db"]
        if arm == "mtls":
            cmd += ["--tls-cert", f"{pki}/collector.crt", "--tls-key", f"{pki}/collector.key",
                    "--tls-ca", f"{pki}/ca.crt"]
        if policy is not None:
            cmd += ["--policy", str(policy)]
        if metrics:
            cmd += ["--metrics-listen", "127.0.0.1:0"]
            if web_config:
                cmd += ["--web-config-file", f"{pki}/web.yml"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            yield _started(proc, arm, tmp)
        finally:
            proc.terminate()
            proc.wait(30)


@contextmanager
def echo(arm: str, pki: Path) -> Iterator[Server]:
    """The bare echo server (serve_echo) as a process."""
    proc = subprocess.Popen([PY, str(Path(__file__).resolve()), "serve-echo", arm, str(pki)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield _started(proc, f"{arm} echo", "")
    finally:
        proc.terminate()
        proc.wait(30)


def serve_echo(arm: str, pki: str) -> None:
    """NodeStream answering Hello with a Welcome and acking batches (bench_ingest's echo), storing nothing
    and asking nobody who they are: the transport's own handshake, plaintext or with the collector's mTLS
    credentials (ghostgpu/common/transport/tls_reload.py)."""
    import asyncio

    import grpc

    from bench.bench_ingest import METHOD_SERVICE, _echo_reply
    from ghostgpu.common.transport.tls import TlsFiles
    from ghostgpu.common.transport.tls_reload import server_credentials
    from ghostgpu.common.wire.protocol import channel_options

    async def connect(requests: Any, context: Any) -> None:
        async for raw in requests:
            if (reply := _echo_reply(raw)) is not None:
                await context.write(reply)

    async def main() -> None:
        server = grpc.aio.server(options=channel_options())
        handler = grpc.stream_stream_rpc_method_handler(connect)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(METHOD_SERVICE,
                                                                              {"Connect": handler}),))
        if arm == "mtls":
            files = TlsFiles(f"{pki}/collector.crt", f"{pki}/collector.key", f"{pki}/ca.crt")
            port = server.add_secure_port("127.0.0.1:0", server_credentials(files, lambda _a, _d: None))
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _started(proc: subprocess.Popen[str], arm: str, tmp: str) -> Server:
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "listening on" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            parts = line.split("listening on", 1)[1].split(";")
            addrs = [a.strip() for a in parts[0].split(",")]
            metrics = next((p.strip().split(" ", 1)[1] for p in parts if p.strip().startswith("metrics ")),
                           None)
            return Server(proc, next(a for a in addrs if not a.startswith("unix:")),
                          next((a for a in addrs if a.startswith("unix:")), ""), metrics, tmp)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"bench: the {arm} collector did not start: {proc.stderr.read()}")


def tcp_sockets() -> int:
    """TCP sockets on the host, TIME_WAIT included: the rows the plaintext collector reads per new
    loopback peer to learn its uid (collector/peers.py loopback_uid)."""
    rows = 0
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                rows += sum(1 for _ in f) - 1
        except OSError:
            continue
    return rows


def quantiles_ms(samples_s: list[float]) -> dict[str, float]:
    xs = sorted(samples_s)

    def q(p: float) -> float:  # nearest rank
        return round(xs[min(len(xs) - 1, max(0, round(p * len(xs) + 0.5) - 1))] * 1000, 2)

    return {"p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(xs[-1] * 1000, 2),
            "mean_ms": round(statistics.fmean(xs) * 1000, 2), "n": len(xs)}



# ---- 3. scrape -----------------------------------------------------------------------------------


def populate(servers: dict[str, Server], pki: Path, nodes: int) -> list[Any]:
    """`nodes` sim tracers per collector, each with a snapshot of CONSUMERS consumers, kept connected."""
    from tests.helpers.sim_tracer import SimTracer, make_consumer

    sims = []
    for arm, srv in servers.items():
        for i in range(nodes):
            node = f"bench-node-{i:03d}"
            sim = SimTracer(srv.addr, node, capabilities=(), tls=node_tls(str(pki) if arm == "mtls" else None,
                                                                         node))
            sim.connect(timeout_s=30)
            sim.send_snapshot([make_consumer(node, 10_000 + j, gpu=j % 8, container_id=f"{j:02x}" * 32)
                               for j in range(CONSUMERS)], seq=0)
            sims.append(sim)
    return sims


def _scraper(url: str, ca: str) -> Callable[[http.client.HTTPConnection | None], tuple[float, int, Any]]:
    scheme, _, rest = url.partition("://")
    hostport = rest.split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    context = ssl.create_default_context(cafile=ca) if scheme == "https" else None

    def scrape(conn: http.client.HTTPConnection | None) -> tuple[float, int, Any]:
        """One GET /metrics (a new connection when conn is None): seconds, body bytes, the connection."""
        t0 = time.perf_counter()
        if conn is None:
            conn = (http.client.HTTPSConnection(host, int(port), context=context) if context
                    else http.client.HTTPConnection(host, int(port)))
        conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        resp = conn.getresponse()
        body = resp.read()
        took = time.perf_counter() - t0
        if resp.status != 200:
            raise SystemExit(f"bench: GET {url}: HTTP {resp.status}: {body[:200]!r}")
        return took, len(body), conn

    return scrape


def measure_scrapes(urls: dict[str, str], ca: str, scrapes: int, warmup: int) -> dict[str, Any]:
    scrapers = {arm: _scraper(url, ca) for arm, url in urls.items()}
    out: dict[str, Any] = {"scrapes": scrapes, "warmup": warmup, "urls": urls}
    for mode in ("keep_alive", "new_connection"):
        samples: dict[str, list[float]] = {arm: [] for arm in urls}
        conns: dict[str, Any] = {arm: None for arm in urls}
        size: dict[str, int] = {}
        for i in range(warmup + scrapes):
            for arm in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
                took, size[arm], conn = scrapers[arm](conns[arm])
                if mode == "keep_alive":
                    conns[arm] = conn
                else:
                    conn.close()
                if i >= warmup:
                    samples[arm].append(took)
        for c in conns.values():
            if c is not None:
                c.close()
        out[mode] = {arm: {**quantiles_ms(samples[arm]), "body_bytes": size[arm]} for arm in urls}
        if "tls" in urls:
            for q in ("p50_ms", "p99_ms"):
                out[mode][f"ratio_{q.removesuffix('_ms')}_tls_vs_plaintext"] = round(
                    out[mode]["tls"][q] / out[mode]["plaintext"][q], 2)
    return out


def wait_populated(srv: Server, nodes: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _node_totals(srv.unix)["nodes"] < nodes:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {nodes} nodes not connected to {srv.addr} within {timeout_s} s")
        time.sleep(0.05)


def https_url(url: str | None, ca: str) -> tuple[str | None, str]:
    """The TLS collector's /metrics as https://, and why not when it does not speak TLS there."""
    if not url:
        return None, "the collector printed no metrics address"
    tls_url = "https://" + url.split("://", 1)[1]
    try:
        _scraper(tls_url, ca)(None)[2].close()
    except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
        return None, f"{tls_url} did not answer over TLS ({e}): --web-config-file not applied to /metrics yet"
    return tls_url, ""

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve-echo":
        raise SystemExit(__doc__)
    serve_echo(sys.argv[2], sys.argv[3])
