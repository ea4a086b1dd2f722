"""Remediation's words, shared by the collector that decides, the tracer that acts and the commands
that show it (docs/REMEDIATION.md).

An incident is one action for one finding ("f<finding id>/<action>"), stored before anything is done
for it, so that no replica acts on it twice. Its state moves from `proposed` (decided, in dry-run,
or waiting for the node's tracer) to one of the ends: `done`, `failed`, `unkillable`, or `skipped` (a
guard or a re-check said no, or the dry run ended there). Every move is a step in the audit chain.
"""

from __future__ import annotations

from dataclasses import dataclass

# The modes: off (the default: nothing is considered), dry-run (everything but the act), on.
MODE_OFF, MODE_DRY_RUN, MODE_ON = "off", "dry-run", "on"
MODES = (MODE_OFF, MODE_DRY_RUN, MODE_ON)
MODE_MANUAL = "manual"  # an incident `ghostgpu remediate --finding` started, whatever the mode

# An incident's states, in the order it can reach them.
PROPOSED, SKIPPED, DONE, FAILED, UNKILLABLE = "proposed", "skipped", "done", "failed", "unkillable"
STATES = (PROPOSED, SKIPPED, DONE, FAILED, UNKILLABLE)
ENDED = frozenset({SKIPPED, DONE, FAILED, UNKILLABLE})

# The actions (the config's remediation.actions keys name them: kill_orphans, isolate_node, ticket).
KILL_ORPHAN, ISOLATE_NODE, TICKET = "kill_orphan", "isolate_node", "ticket"
ACTIONS = (KILL_ORPHAN, ISOLATE_NODE, TICKET)

# What isolates a node (action 2): a critical Xid, an unkillable holder, memory no process owns.
TRIGGER_XID, TRIGGER_UNKILLABLE, TRIGGER_UNACCOUNTED_MEMORY = "xid", "unkillable", "unaccounted-memory"
ISOLATION_TRIGGERS = (TRIGGER_XID, TRIGGER_UNKILLABLE, TRIGGER_UNACCOUNTED_MEMORY)

# The steps each incident leaves in the audit chain (action "remediation.<step>").
DECIDED, RECHECKED, ACTED, OUTCOME = "decided", "re-checked", "acted", "outcome"
STEPS = (DECIDED, RECHECKED, ACTED, OUTCOME)

# An act's time bounds on the node (tracer/remediate.py), which the collector's waits are built from
# (collector/remediation.py's RemediationTiming) and the config's grace is checked against: the grace
# is cut to MAX_GRACE_S; SIGKILL's exit is waited for KILL_WAIT_S; each of its CRI_CALLS CRI calls
# (Version, ContainerStatus) takes CRI_TIMEOUT_S at most.
MAX_GRACE_S = 60.0
KILL_WAIT_S = 5.0
CRI_TIMEOUT_S = 5.0
CRI_CALLS = 2

# The tracer's Hello offers this while its node takes part (tracer --remediation on, the default).
CAPABILITY = "remediation"
# A node's label that keeps ghostgpu's hands off it: ghostgpu.io/remediation=off.
OPT_OUT_LABEL = "ghostgpu.io/remediation"
# The taint isolation puts on a node (its value names the trigger), NoSchedule.
TAINT_KEY = "ghostgpu.io/gpu-unhealthy"


def incident_key(finding_id: int, action: str) -> str:
    """The incident's key: one per finding and action, stored before any act."""
    return f"f{finding_id}/{action}"


@dataclass(frozen=True)
class RemediationState:
    """Where one finding's remediation stands: `findings -o json`'s `remediation`."""

    state: str  # one of STATES
    action: str  # one of ACTIONS
    at_unix_ns: int  # when it reached this state
    reason: str  # what was (or would be) done, or why not
    mode: str = ""  # dry-run | on | manual: the mode it was decided in
    incident: str = ""  # incident_key(finding, action)
    audit_seq: int = 0  # the audit record of this state; 0 before one is written
