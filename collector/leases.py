"""Node leases: which collector replica applies a node's stream, proved by a fencing token.

    leases = Leases(store, owner="collector-0", ttl_s=10.0)
    taken = await asyncio.wrap_future(leases.take("gpu-node-7"))   # at the stream's Hello
    store.submit(ops, done, fence=leases.fence("gpu-node-7"))      # every write of that node
    lost = await asyncio.wrap_future(leases.renew())                # every ttl/3 (Collector._serve)

One row per node in `node_leases` (node, owner, token, expires_unix_ns, taken_unix_ns). A Hello takes
the lease whoever held it: the row's token goes up by one, in a transaction that also reads the node's
stream positions and open findings, so the new owner goes on from what the old one committed and
nothing after. Each write of the node carries (node, token); the store checks it in the write's own
transaction, under a share lock on the lease row (collector/store.py, `_fenced_out`), and refuses it
once the token moved: a replica that lost a node, even one cut off from the database that comes back
with writes queued, can never write it again.

The owner renews its rows every ttl/3. A renewal that finds another token tells the loop the node moved
(its stream is ended, ABORTED). A replica that cannot renew for a whole ttl (the database out of reach,
a network partition) ends its streams itself (UNAVAILABLE), so their tracers reconnect to a replica that
can reach the database; its late writes would be refused anyway. A new stream takes the lease at once,
whatever its expiry: failing over after a replica dies costs no wait for the lease to run out.

SQLite has the same table: one collector takes its nodes' leases like a replica, and the contract tests
(tests/integration/test_store_contract.py) run the same on both engines.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ghostgpu.collector.store import FindingRow, Position, Store

_TAKE = ("INSERT INTO node_leases (node, owner, token, expires_unix_ns, taken_unix_ns) "
         "VALUES (?, ?, 1, ?, ?) ON CONFLICT (node) DO UPDATE SET owner = excluded.owner, "
         "token = node_leases.token + 1, expires_unix_ns = excluded.expires_unix_ns, "
         "taken_unix_ns = excluded.taken_unix_ns RETURNING token")


@dataclass
class TakenLease:
    """What taking a node's lease read in the same transaction."""

    node: str
    token: int
    previous_owner: str  # "" for a node no replica held before
    positions: list[Position] = field(default_factory=list)
    open_findings: list[FindingRow] = field(default_factory=list)


class Leases:
    """This replica's leases. Methods run on the event loop; the SQL on the store's writer thread."""

    def __init__(self, store: Store, owner: str, ttl_s: float) -> None:
        self.store = store
        self.owner = owner
        self.ttl_s = ttl_s
        self.held: dict[str, int] = {}  # node -> the token this replica holds it with
        self.renewed_mono = time.monotonic()  # the last renewal that reached the database
        self.steals_total = 0  # leases this replica took from another replica

    def fence(self, node: str) -> tuple[str, int] | None:
        token = self.held.get(node)
        return (node, token) if token is not None else None

    def owned_nodes(self) -> list[str]:
        return sorted(self.held)

    def take(self, node: str) -> Future[TakenLease]:
        """Take `node`'s lease (token + 1); the future's TakenLease holds the node's positions and open
        findings as committed. The caller records it with `adopt` once the stream is still wanted."""
        owner, ttl_ns = self.owner, int(self.ttl_s * 1e9)

        def run(conn: Any) -> TakenLease:
            prev = conn.execute("SELECT owner FROM node_leases WHERE node = ?", (node,)).fetchone()
            now = time.time_ns()
            token = conn.execute(_TAKE, (node, owner, now + ttl_ns, now)).fetchone()[0]
            positions = [Position(*r) for r in conn.execute("SELECT * FROM positions WHERE node = ?",
                                                            (node,))]
            findings = [FindingRow(*r) for r in conn.execute(
                "SELECT * FROM findings WHERE node = ? AND resolved_unix_ns = 0 ORDER BY id", (node,))]
            return TakenLease(node, int(token), prev[0] if prev else "", positions, findings)

        return self.store.read_write(run)

    def adopt(self, taken: TakenLease) -> None:
        self.held[taken.node] = taken.token
        if taken.previous_owner and taken.previous_owner != self.owner:
            self.steals_total += 1

    def drop(self, node: str, token: int | None = None) -> None:
        """Forget a node this replica no longer applies (its stream moved, or this replica ends it).
        With `token`, only while that is still the token held (a newer stream may have taken it again)."""
        if token is None or self.held.get(node) == token:
            self.held.pop(node, None)

    def renew(self) -> Future[list[str]]:
        """Extend every held lease by ttl; the future's list names the nodes whose token moved (another
        replica took them). It fails while the database is out of reach (see `overdue`)."""
        held = dict(self.held)
        owner, ttl_ns = self.owner, int(self.ttl_s * 1e9)

        def run(conn: Any) -> list[str]:
            if not held:
                return []
            nodes = sorted(held)
            marks = ", ".join("?" * len(nodes))
            expires = time.time_ns() + ttl_ns
            conn.execute(f"UPDATE node_leases SET expires_unix_ns = ? WHERE owner = ? AND node IN ({marks})",
                         (expires, owner, *nodes))
            current = dict(conn.execute(f"SELECT node, token FROM node_leases WHERE node IN ({marks})",
                                        nodes).fetchall())
            return [n for n in nodes if current.get(n) != held[n]]

        fut = self.store.read_write(run)
        fut.add_done_callback(self._renewed)
        return fut

    def _renewed(self, fut: Future[list[str]]) -> None:
        if fut.exception() is None:
            self.renewed_mono = time.monotonic()

    def overdue(self, now_mono: float | None = None) -> bool:
        """True once no renewal reached the database for a whole ttl: this replica's leases may have
        expired, and another replica may take its nodes at any moment."""
        return ((now_mono if now_mono is not None else time.monotonic()) - self.renewed_mono) > self.ttl_s
