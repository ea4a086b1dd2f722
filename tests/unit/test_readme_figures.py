"""Every figure in the README's benchmark table comes from a committed bench/results/*.json.

ROWS maps each row of the table (by the start of its first cell) to the figures it holds. A figure
is a text the row must contain, rendered from a stored result with the README's rounding (`fig`),
or, for the few numbers that are not measurements, from the code's own constant (`const`) or with a
stated reason (`fixed`). For each row the test fails when

- the row has no entry in ROWS (a new row: add its figures, naming the results file they come from);
- a figure's text is not in the row (the README and the stored result disagree);
- the row holds a number that no figure accounts for (a figure with no stored source).

PROSE does the same for the sentences outside the table that quote measured figures, in the README,
docs/METRICS.md and docs/REMEDIATION.md ("Cost").
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer import stream

from ghostgpu.common.wire import protocol

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Where PROSE's sentences are: the README, and the reference moved out of it that quotes a figure.
PROSE_FILES = (README, ROOT / "docs" / "METRICS.md", ROOT / "docs" / "REMEDIATION.md")
RESULTS = ROOT / "bench" / "results"
# A number as the README writes one: 1,014,695 / 0.323 / 2.9 (not the 50 of "p50", nor the 0 of "nvidia0").
NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?")

Getter = str | Callable[[dict[str, Any]], Any]


@cache
def result(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    assert path.is_file(), f"bench/results/{name}.json is not in the repository"
    return json.loads(path.read_text())


def dig(data: Any, path: str) -> Any:
    """'runs.0.events_per_s' -> data['runs'][0]['events_per_s']."""
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


@dataclass(frozen=True)
class Figure:
    render: Callable[[], str]  # the text the README must hold
    source: str  # where it comes from, for the failure message


def fig(template: str, name: str, *getters: Getter) -> Figure:
    """template.format(*values), each value a dotted path into bench/results/NAME.json or a function of it."""
    def render() -> str:
        data = result(name)
        return template.format(*(dig(data, g) if isinstance(g, str) else g(data) for g in getters))

    paths = ", ".join(g if isinstance(g, str) else "computed" for g in getters)
    return Figure(render, f"bench/results/{name}.json ({paths})")


def const(template: str, *values: Any, where: str) -> Figure:
    """A setting of the code under test (not a measurement), read from the code."""
    return Figure(lambda: template.format(*values), where)


def fixed(text: str, why: str) -> Figure:
    """A number that is neither measured nor in the code (a tool's version): the reason is required."""
    assert why.strip(), f"{text!r}: say why it has no stored source"
    return Figure(lambda: text, f"fixed: {why}")


def sig2(x: float) -> str:
    """Two significant figures, as the README writes a rough ratio (326 -> 330)."""
    return f"{round(x, 1 - math.floor(math.log10(abs(x)))):,.0f}"


def run(target: str, batch: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: next(r for r in d["runs"] if r["target"] == target and r["batch_events"] == batch)


def per_batch(target: str, key: str) -> list[Callable[[dict[str, Any]], Any]]:
    """`key` of the target's runs at 2,000, 200 and 50 events a batch, in the README's order."""
    return [lambda d, b=b: run(target, b)(d)[key] for b in (2000, 200, 50)]


def paced(target: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: next(r for r in d["runs"] if r["target"] == target)


def ingest_goal(d: dict[str, Any]) -> str:
    """'met at 200 and 2,000; missed at 50' from the collector's runs and the goal."""
    runs = sorted((r for r in d["runs"] if r["target"] == "collector"), key=lambda r: r["batch_events"])
    met = [f"{r['batch_events']:,}" for r in runs if r["events_per_s"] >= d["goal_events_per_s"]]
    missed = [f"{r['batch_events']:,}" for r in runs if r["events_per_s"] < d["goal_events_per_s"]]
    return f"met at {' and '.join(met)}; missed at {' and '.join(missed)}"


def replica_run(target: str, batch: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: next(r for r in d["ingest"] if r["target"] == target and r["batch_events"] == batch)


def replica_pair(target: str, key: str, fmt: str = "{:,}") -> Callable[[dict[str, Any]], str]:
    """`key` of bench_replicas' ingest runs of `target` at 2,000 and 200 events, as 'A / B'."""
    return lambda d: " / ".join(fmt.format(replica_run(target, b)(d)[key]) for b in (2000, 200))


def replicas_goal(d: dict[str, Any]) -> str:
    goal = d["goal_ratio_vs_bare"]
    met = [f"{b:,}" for b in (2000, 200) if replica_run("pg-3", b)(d)["ratio_vs_bare_client"] >= goal]
    missed = [f"{b:,}" for b in (2000, 200) if f"{b:,}" not in met]
    return (f"met at {' and '.join(met)}" if met else "") + ("; " if met and missed else "") + (
        f"missed at {' and '.join(missed)}" if missed else "")


def driver(method: str, batch: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: next(r for r in d["results"] if r["method"] == method and r["batch_rows"] == batch)


def driver_best(name: str, batch: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: max((r for r in d["results"] if r["driver"] == name and r["batch_rows"] == batch),
                         key=lambda r: r["rows_per_s_median"])


SCRAPE_GOAL_CASES = ("warm", "cold", "warm_gzip", "cold_gzip")  # bench_metrics_scrape.py goal_cases


def scrape_goal(d: dict[str, Any]) -> str:
    cases = d["cases"]
    p50 = "met" if d["goal_met_p50"] else "missed"
    if d["goal_met_p99"]:
        return f"p50 {p50}; p99 met"
    worst = max(SCRAPE_GOAL_CASES, key=lambda c: cases[c]["p99_ms"])
    return f"p50 {p50}; p99 missed by the {worst.replace('_', ' ')} case"


def loop_hold_range(d: dict[str, Any]) -> str:
    held = [d["cases"][c]["loop_hold"]["p50_ms"] for c in SCRAPE_GOAL_CASES]
    return f"{min(held):.0f}-{max(held):.0f}"


def full_gc_range(d: dict[str, Any]) -> str:
    """The shortest and longest full collection that landed in any scrape of the run."""
    pauses = [ms for case in d["cases"].values() for ms in case.get("full_gc_during_scrapes_ms", [])]
    assert pauses, "no full collection landed in a scrape: nothing to quote"
    return f"{min(pauses):.0f}-{max(pauses):.0f}"


def alert_push(d: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return [phase[key] for phase in d["phases"].values()]


def met_or_missed(goals: list[tuple[str, bool]]) -> str:
    """'both missed', 'both met', or 'fuser met, lsof missed'."""
    if all(ok for _, ok in goals) or not any(ok for _, ok in goals):
        return f"both {'met' if goals[0][1] else 'missed'}"
    return ", ".join(f"{name} {'met' if ok else 'missed'}" for name, ok in goals)


def machines() -> str:
    """'2-core VM, Linux 6.18' when every stored result says so (scan.json calls it `host`)."""
    seen = set()
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        m = data.get("machine") or data.get("host")
        assert m, f"{path.name} does not record its machine"
        seen.add((m["cpus"], ".".join(m["kernel"].split(".")[:2])))
    return "; ".join(f"{cpus}-core VM, Linux {kernel}" for cpus, kernel in sorted(seen))


def poller_key(d: dict[str, Any]) -> str:
    """bench_shortlived.py stores the reference poller under poller_<interval>s (poller_1s)."""
    return next(k for k in d if re.fullmatch(r"poller_\d+s", k))


def busy(path: str) -> Callable[[dict[str, Any]], Any]:
    """A figure of bench_agent.py's busy-node window (steady_busy_node)."""
    def get(d: dict[str, Any]) -> Any:
        window = d["steady_busy_node"]
        assert window is not None, "bench_agent.py ran with --node-procs 0: no busy-node window stored"
        return dig(window, path)
    return get


def churn_growth_mb(d: dict[str, Any]) -> float:
    return d["churn"]["growth_after_checkpoint_mb"]


def clients_kept_up(d: dict[str, Any]) -> str:
    """The paced goal: the clients offered the rate on schedule and every event was acknowledged once."""
    r = paced("collector")(d)
    return "met: the clients kept up" if r["clients_kept_up"] and r["exactly_once"] else "NOT met"


def load_under(limit: float, *names: str) -> Callable[[dict[str, Any]], str]:
    """`limit` when every named result started under that 1-minute load average (else the highest)."""
    def render(_: dict[str, Any]) -> str:
        worst = max(result(n)["loadavg_1m_at_start"] for n in names)
        return f"{limit:g}" if worst < limit else f"{worst:g} (not under {limit:g})"
    return render


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def trace_taken(d: dict[str, Any]) -> float:
    """bench_trace.py part 1: the share of the in-session spin calls whose record the session thread took."""
    p = d["per_call"]
    taken = sum(p["session_records_delivered"])
    return taken / max(taken + sum(p["session_dropped_ringbuf"]) + sum(p["session_dropped_limit"]), 1)


def trace_outside(op: str, key: str) -> Callable[[dict[str, Any]], Any]:
    """bench_trace.py part 2, CPU time: `key` of the op's figures (dotted)."""
    return lambda d: dig(d["outside"]["cpu_ns"][op], key)


def trace_outside_goal(op: str) -> Callable[[dict[str, Any]], str]:
    return lambda d: met(d["outside"]["cpu_ns"][op]["ratio_session_vs_bpf"]
                         <= d["outside"]["goal_ratio_session_vs_bpf_max"])



def attribution_goal(d: dict[str, Any]) -> str:
    """bench_trace.py part 5: every opener seen, open -> its --jsonl line p99 under the goal."""
    s = d["via_collector"]["session"]
    return met(s["open_to_jsonl_ms"]["p99"] < s["goal_p99_ms"] and s["openers_seen"] == s["openers"])


def tls_batches(template: str, leaf: str) -> Figure:
    """A bench_tls.py figure given for both batch sizes: template.format(2,000's, 200's)."""
    return fig(template, "tls", f"ingest.batch_2000.{leaf}", f"ingest.batch_200.{leaf}")


def met_by_batch(flag: str) -> Callable[[dict[str, Any]], str]:
    """bench_tls.py part 1: 'met at 200 and 2,000', or which batch sizes missed the goal `flag` says."""
    def say(d: dict[str, Any]) -> str:
        runs = sorted(d["ingest"].values(), key=lambda s: s["batch_events"])
        met_at = [f"{s['batch_events']:,}" for s in runs if s[flag]]
        missed_at = [f"{s['batch_events']:,}" for s in runs if not s[flag]]
        return "; ".join([f"met at {' and '.join(met_at)}"] * bool(met_at)
                         + [f"missed at {' and '.join(missed_at)}"] * bool(missed_at))
    return say


tls_goal = met_by_batch("goal_met")  # mTLS ingest >= 0.8x plaintext
recheck_goal = met_by_batch("recheck_goal_met")  # the re-check at each reload <= 2% of mTLS ingest


# The tracer's batching policy, quoted where the README explains the ingest figures.
TRACER_BATCHING = [
    const("else {:g} ms or {:,} events", stream.FLUSH_S * 1000, protocol.MAX_BATCH_EVENTS,
          where="tracer/stream.py FLUSH_S, ghostgpu/common/wire/protocol.py MAX_BATCH_EVENTS"),
    const("at most {} batches unacknowledged", stream.WINDOW_BATCHES,
          where="tracer/stream.py WINDOW_BATCHES"),
]

# Row key (the start of the row's first cell) -> its figures. Keep them in the table's order.
ROWS: dict[str, list[Figure]] = {
    "added cost per non-GPU `ioctl`": [
        fig("best of {}", "syscall_cost", lambda d: len(d["rounds"]["ioctl"])),
        fig("+{:.0f} ns", "syscall_cost", "added_ns_ghostgpu.ioctl"),
        fig("+{:.0f} ns", "syscall_cost", "added_ns_empty.ioctl"),
        fig("{:.2f}x (median of rounds {:.2f}x)", "syscall_cost", "ratio_ghostgpu_vs_empty.ioctl",
            "ratio_ghostgpu_vs_empty_median_of_rounds.ioctl"),
        fig("<= {}x ({})", "syscall_cost", "goal_ratio_ioctl", lambda d: "met" if max(
            d["ratio_ghostgpu_vs_empty"]["ioctl"], d["ratio_ghostgpu_vs_empty_median_of_rounds"]["ioctl"])
            <= d["goal_ratio_ioctl"] else "missed"),
    ],
    "added cost per `openat`+`close`": [
        fig("+{:.0f} ns", "syscall_cost", "added_ns_ghostgpu.open"),
        fig("+{:.0f} ns", "syscall_cost", "added_ns_empty.open"),
        fig("(`bench/opensnoop_peer.bpf.c`: the whole filename read at every open) +{:,.0f} ns",
            "syscall_cost", "added_ns_opensnoop.open"),
        fig("{:.2f}x empty, {:.2f}x opensnoop", "syscall_cost", "ratio_ghostgpu_vs_empty.open",
            "ratio_ghostgpu_vs_opensnoop.open"),
        fig("<= {}x, < {:g}x opensnoop ({})", "syscall_cost", "goal_ratio", "goal_vs_opensnoop_below",
            lambda d: "met" if d["ratio_ghostgpu_vs_empty"]["open"] <= d["goal_ratio"]
            and d["ratio_ghostgpu_vs_opensnoop"]["open"] < d["goal_vs_opensnoop_below"] else "missed"),
    ],
    "a holder's non-allocating GPU `ioctl`": [
        fig("previous main's programs ({})", "syscall_cost", "base_rev"),
        fig("+{:.0f} ns", "syscall_cost", "added_ns_ghostgpu.gpu"),
        fig("{}'s programs +{:.0f} ns", "syscall_cost", "base_rev", "added_ns_ghostgpu_base.gpu"),
        fig("a non-GPU `ioctl` +{:.0f} ns", "syscall_cost", "added_ns_vs_base.ioctl"),
        fig("| +{:.0f} ns |", "syscall_cost", "added_ns_vs_base.gpu"),
        fig("<= +{} ns ({}", "syscall_cost", "goal_gpu_added_ns_vs_base", lambda d: "met"
            if d["added_ns_vs_base"]["gpu"] <= d["goal_gpu_added_ns_vs_base"] else "missed"),
        fixed("about 70 ns", "an empty program on sys_exit_ioctl alone, measured by hand with "
              "bench_syscall_cost's loop (the empty set's added ioctl cost before and after the exit "
              "joined it)"),
    ],
    "GPU memory per process from the driver's calls": [
        fig("{}, {} and {} GiB allocated, {} GiB freed and a {} GiB allocation refused", "gpu_real",
            "requested.alloc_gib.0", "requested.alloc_gib.1", "requested.alloc_gib.2", "requested.free_gib.0",
            "requested.refused_gib.0"),
        fig("{:,} bytes on GPU 0", "gpu_real", "per_gpu.0.decoded_bytes"),
        fig("saw the same {} memory calls", "gpu_real", "kernel_side.kernel_memcalls"),
        fig("state: {:,} bytes", "gpu_real", "per_gpu.0.reference_bytes"),
        fig("{:.1f}% off", "gpu_real", "per_gpu.0.diff_pct"),
        fixed("within 5%", "the goal bench/gpu_real_check.sh states in its JSON's `goal`"),
    ],
    "full `/proc` scan": [
        fig("{:,} procs x {} fds", "scan", "procs", "fds_per_proc"),
        fig("best of {}", "scan", "runs"),
        fig("{:.3f} s", "scan", "best_s.ours"),
        fig("`fuser -v` {:.3f} s, `lsof` {:.3f} s", "scan", "best_s.fuser", "best_s.lsof"),
        fig("{:.2f}x fuser, {:.2f}x lsof", "scan", "ours_vs_fuser", "ours_vs_lsof"),
        fig("{}x, {}x ({})", "scan", "goal_vs_fuser", "goal_vs_lsof", lambda d: met_or_missed(
            [(tool, d[f"ours_vs_{tool}"] <= d[f"goal_vs_{tool}"]) for tool in ("fuser", "lsof")])),
    ],
    "1,000 short-lived consumers": [
        fig("{:,} short-lived consumers ({}-{} ms) in {} fake containers", "shortlived",
            "consumers", "sleep_ms.0", "sleep_ms.1", "containers"),
        fig("{:.0%} caught", "shortlived", lambda d: min(d["tracer"]["open_rate"], d["tracer"]["exit_rate"])),
        fig("{} s `/proc` poller: {:.1%}", "shortlived", lambda d: poller_key(d).removeprefix("poller_")[:-1],
            lambda d: d[poller_key(d)]["rate"]),
        fig("| {:.0%} |", "shortlived", "goal_catch_rate"),
    ],
    "tracer spawn to first BPF event": [
        fig("{:.2f} s (best of {})", "agent", "first_event.spawn_to_first_open_s.best",
            lambda d: len(d["first_event"]["trials"])),
        fixed("about 2.8 s", "bcc's BPF() constructor (the compile) under cProfile, measured by hand "
              "on the same machine the same hour"),
        fixed("3.31 s", "bench_agent.py --trials 3 --node-procs 0 at 63cb2c5 from a worktree, the same hour "
              "(bench/README.md quotes it too)"),
        fig("< {:g} s ({}", "agent", "goals.first_open_under_s", lambda d: "met"
            if d["first_event"]["spawn_to_first_open_s"]["best"] < d["goals"]["first_open_under_s"]
            else "missed"),
    ],
    "RSS after": [
        fig("RSS after {:g} s", "agent", "steady.rss_after_s"),
        fig("{:.1f} MB", "agent", "steady.memory_mb.tracer.VmRSS"),
        fig("minimal bcc program {:.1f} MB", "agent", "steady.memory_mb.minimal_bcc.VmRSS"),
        fig("{:.2f}x", "agent", "rss_ratio_tracer_vs_minimal_bcc"),
        fig("<= {:g} MB", "agent", "goals.rss_at_most_mb"),
    ],
    "CPU at idle over": [
        fig("CPU at idle over {:.0f} s", "agent", "steady.idle_window_s"),
        fig("{:.2f}% of a core", "agent", "steady.idle_cpu_pct_of_one_core.tracer"),
        fig("minimal bcc program {:.2f}%", "agent", "steady.idle_cpu_pct_of_one_core.minimal_bcc"),
        fig("< {:g}%", "agent", "goals.idle_cpu_under_pct"),
    ],
    "CPU at idle, node with": [
        fig("node with {:,} more processes x {} fds", "agent", busy("node_filler.procs"),
            busy("node_filler.fds_each")),
        fig("{:.2f}% of a core over {:.0f} s", "agent", busy("idle_cpu_pct_of_one_core.tracer"),
            busy("idle_window_s")),
        fig("rescans every {:g} s", "agent", busy("scan_interval_s")),
        fig("{:.2f}% with the full reconcile ({:.3f} s of CPU) every {:g} s", "agent",
            busy("idle_cpu_pct_amortized"), busy("full_reconcile_cpu_s"), busy("full_scan_interval_s")),
        fig("minimal bcc program {:.2f}%", "agent", busy("idle_cpu_pct_of_one_core.minimal_bcc")),
        fig("< {:g}% ({}", "agent", "goals.idle_cpu_under_pct",
            lambda d: "met" if d["goals"]["idle_cpu_busy_node_under_goal"] else "missed"),
    ],
    "detection latency": [
        fig("{} trials", "detect_latency", "trials"),
        fig("p50 {:.1f} ms, p99 {:.1f} ms", "detect_latency", "open_to_resolved.p50_ms",
            "open_to_resolved.p99_ms"),
        fig("scrape interval {:g} s", "detect_latency", "dcgm_exporter_scrape_interval_s"),
        fig("1/{:.0f}", "detect_latency",
            lambda d: d["dcgm_exporter_scrape_interval_s"] * 1000 / d["open_to_resolved"]["p50_ms"]),
        fig("p50 < {:g} ms, p99 < {:g} ms", "detect_latency", "goal.p50_ms", "goal.p99_ms"),
    ],
    "the same, `ps`-style ListConsumers": [
        fig("polled every {:g} ms", "detect_latency_poll", "poll_ms"),
        fig("p50 {:.1f} ms, p99 {:.1f} ms", "detect_latency_poll", "open_to_resolved.p50_ms",
            "open_to_resolved.p99_ms"),
        fig("{:g} s scrape", "detect_latency_poll", "dcgm_exporter_scrape_interval_s"),
        fig("1/{:.0f}", "detect_latency_poll",
            lambda d: d["dcgm_exporter_scrape_interval_s"] * 1000 / d["open_to_resolved"]["p50_ms"]),
    ],
    "collector ingest,": [
        fig("{} simulated tracers", "ingest", "tracers"),
        fig("batches of {:,} / {:,} / {:,} events", "ingest", "runs.0.batch_events", "runs.3.batch_events",
            "runs.6.batch_events"),
        fig("{:,} / {:,} / {:,} events/s", "ingest", *per_batch("collector", "events_per_s")),
        fig("stores nothing: {:,} / {:,} / {:,}", "ingest", *per_batch("echo-aio", "events_per_s")),
        fig("{:.2f} / {:.2f} / {:.2f}", "ingest", *per_batch("collector", "ratio_vs_echo_aio")),
        fig("≥ {:,} events/s ({})", "ingest", "goal_events_per_s", ingest_goal),
    ],
    "the same 50 tracers offering": [
        fig("the same {} tracers offering {:,.0f} events/s for {:g} s", "ingest_paced", "tracers",
            "offered_events_per_s", "duration_s"),
        *TRACER_BATCHING,
        fig("--paced {:.0f}", "ingest_paced", "offered_events_per_s"),
        fig("{:,} events/s acknowledged, all {:,} stored once", "ingest_paced",
            lambda d: paced("collector")(d)["acked_events_per_s"],
            lambda d: paced("collector")(d)["node_status"]["ingested"]),
        fig("batches mean {:.0f} events (p99 {})", "ingest_paced",
            lambda d: paced("collector")(d)["batch_events"]["mean"],
            lambda d: paced("collector")(d)["batch_events"]["p99"]),
        fig("ack latency p50 {:.0f} ms, p99 {:.0f} ms", "ingest_paced",
            lambda d: paced("collector")(d)["ack_latency_ms"]["p50"],
            lambda d: paced("collector")(d)["ack_latency_ms"]["p99"]),
        fig("echo: {:,} acknowledged, batches mean {:.0f}, ack p50 {:.0f} ms", "ingest_paced",
            lambda d: paced("echo-aio")(d)["acked_events_per_s"],
            lambda d: paced("echo-aio")(d)["batch_events"]["mean"],
            lambda d: paced("echo-aio")(d)["ack_latency_ms"]["p50"]),
        fig("≥ {:,} events/s", "ingest", "goal_events_per_s"),
        fig("({}, offering {:,} events/s, and every event was acknowledged)", "ingest_paced", clients_kept_up,
            lambda d: paced("collector")(d)["offered_events_per_s"]),
    ],
    "collector memory, 1,000 simulated nodes": [
        fig("{:,} simulated nodes × {} consumers", "collector_memory", "nodes", "consumers_per_node"),  # noqa: RUF001
        fig("{:.1f} MB RSS ({:.0f} KiB per node), {} threads", "collector_memory", "collector.rss_mb",
            "collector.per_node_kib", "collector.threads"),
        fig("holding the streams: {:.1f} MB", "collector_memory", "reference_echo_aio.rss_mb"),
        fig("thread-pool echo: {:.1f} MB, {:,} threads", "collector_memory", "reference_echo_sync.rss_mb",
            "reference_echo_sync.threads"),
        fig("{:.1f}x aio echo", "collector_memory", "collector_over_echo_rss"),
    ],
    "collector memory under process churn": [
        fig("{:,} short-lived consumers", "collector_churn", "consumers"),
        fig("RSS {:.1f} MB after the first {:,}, {:.1f} MB at {:,} (+{:.1f} MB", "collector_churn",
            "churn.rss_at_checkpoint_mb", "checkpoint", "churn.rss_at_end_mb", "consumers", churn_growth_mb),
        fig("another run to {:,}: +{:.1f} MB", "collector_churn_60000", "consumers", churn_growth_mb),
        fig("before CRI answers were dropped: {:.1f} → {:.1f} MB (+{:.1f} MB", "collector_churn_before_drop",
            "churn.rss_at_checkpoint_mb", "churn.rss_at_end_mb", churn_growth_mb),
        fig("the same events for {} long-lived consumers: {:.1f} → {:.1f} MB (+{:.1f} MB", "collector_churn",
            "per_batch", "reference_long_lived.rss_at_checkpoint_mb", "reference_long_lived.rss_at_end_mb",
            "reference_long_lived.growth_after_checkpoint_mb"),
        fig("| {:.2f}x |", "collector_churn", "churn_over_reference_rss"),
        fig("flat within {:g} MB from {:,} to {:,} ({})", "collector_churn", "goal_growth_mb", "checkpoint",
            "consumers", lambda d: "met" if d["goal_met"] else "missed"),
    ],
    "soak: `ghostgpu up --demo`": [
        fig("for {:g} min with {:g} churn consumers/s", "soak", "minutes", "churn_per_s"),
        fig("--soak-min {:g}", "soak", "minutes"),
        fig("RSS every {:g} s", "soak", "sample_s"),
        fig("after a {:g} s warm-up", "soak", "warmup_s"),
        fig("`up` {:.2f} ± {:.2f} MB/h ({:.1f} → {:.1f} MB)", "soak", "rss_slope_mb_per_h.up",
            "rss_slope_stderr_mb_per_h.up", lambda d: d["rss_bytes_first_fitted"]["up"] / 1e6,
            lambda d: d["rss_bytes_last"]["up"] / 1e6),
        fig("its tracer {:.2f} ± {:.2f} MB/h ({:.1f} → {:.1f} MB)", "soak", "rss_slope_mb_per_h.tracer",
            "rss_slope_stderr_mb_per_h.tracer", lambda d: d["rss_bytes_first_fitted"]["tracer"] / 1e6,
            lambda d: d["rss_bytes_last"]["tracer"] / 1e6),
        fig("one tracer PID throughout{}", "soak",
            lambda d: "" if len(d["tracer_pids_seen"]) == 1 else " (NO)"),
        fixed("< 1 MB/h each", "the goal for the soak's RSS slope"),
        fig("missed by {:.2f} MB/h", "soak", lambda d: d["rss_slope_mb_per_h"]["up"] - 1),
    ],
    "`StreamSink.emit`": [
        fig("{:.2f} µs CPU per event", "stream_emit",
            lambda d: d["ns_per_emit"]["stream_connected_cpu"] / 1000),
        fig("`JsonlSink` {:.1f} µs", "stream_emit", lambda d: d["ns_per_emit"]["jsonl_cpu"] / 1000),
        fig("{:.2f}x", "stream_emit",
            lambda d: d["ns_per_emit"]["stream_connected_cpu"] / d["ns_per_emit"]["jsonl_cpu"]),
    ],
    "`/metrics` scrape": [
        fig("{:,} nodes × {} consumers ({:,} series, {:.1f} MB; {:.0f} KB gzipped)",  # noqa: RUF001
            "metrics_scrape", "nodes", "consumers_per_node", "samples", lambda d: d["page_bytes"] / 1e6,
            lambda d: d["cases"]["cold_gzip"]["wire_bytes"] / 1e3),
        fig("{} per case", "metrics_scrape", "scrapes_per_case"),
        fig("warm p50 {:.0f} ms (gzip {:.0f} ms), p99 {:.0f} ms ({:.0f} ms)", "metrics_scrape",
            "cases.warm.p50_ms", "cases.warm_gzip.p50_ms", "cases.warm.p99_ms", "cases.warm_gzip.p99_ms"),
        fig("scrape p50 {:.0f} ms (gzip {:.0f} ms), p99 {:.0f} ms ({:.0f} ms)", "metrics_scrape",
            "cases.cold.p50_ms", "cases.cold_gzip.p50_ms", "cases.cold.p99_ms", "cases.cold_gzip.p99_ms"),
        fig("event loop held {} ms a scrape", "metrics_scrape", loop_hold_range),
        fig("same series {:.0f} ms", "metrics_scrape", "cases.naive_generate_latest.p50_ms"),
        fig("same size {:.1f} ms (gzip {:.1f} ms)", "metrics_scrape", "cases.static.p50_ms",
            "cases.static_gzip.p50_ms"),
        fig("cold {:.2f}x `generate_latest`; {:.1f}x the gzipped static body", "metrics_scrape",
            lambda d: d["cases"]["cold"]["p50_ms"] / d["cases"]["naive_generate_latest"]["p50_ms"],
            "ratios.cold_gzip_over_static_gzip_p50"),
        fig("< {:g} ms a scrape ({})", "metrics_scrape", "goal_ms", scrape_goal),
    ],
    "a planted hidden consumer": [
        fixed("Alertmanager 0.25", "the Debian package the bench runs (tests/helpers/promstack.py)"),
        fig("p50 {:.0f} ms, max {:.0f} ms over {} trials", "alert_latency", lambda d: d["push_p50_s"] * 1000,
            lambda d: max(p["max_s"] for p in alert_push(d, "push")) * 1000,
            lambda d: sum(p["n"] for p in alert_push(d, "push"))),
        fig("resolved p50 {:.0f} ms", "alert_latency",
            lambda d: d["phases"]["1s"]["push_resolve"]["p50_s"] * 1000),
        fixed("Prometheus 2.42", "the Debian package the bench runs (tests/helpers/promstack.py)"),
        fixed("(`for:` 0 s)", "the bench's rules: the shipped ones with `for:` at 0 s (promstack.py)"),
        fig("every 1 s: p50 {:.2f} s", "alert_latency", "phases.1s.scrape.p50_s"),
        fig("every 15 s: p50 {:.1f} s ({:.1f}-{:.1f} s, {} trials)", "alert_latency",
            *(f"phases.15s.scrape.{k}" for k in ("p50_s", "min_s", "max_s", "n"))),
        fig("push = 1/{:.0f} of the 1 s scrape path, 1/{} of a {:g} s interval", "alert_latency",
            "scrape_1s_over_push_p50", lambda d: sig2(d["reference_scrape_interval_s"] / d["push_p50_s"]),
            "reference_scrape_interval_s"),
        fig("push < {:g} s ({})", "alert_latency", "goal_push_p50_s",
            lambda d: "met" if d["push_p50_s"] < d["goal_push_p50_s"] else "missed"),
    ],
    "process churn": [
        fig("{:,} consumers that open", "churn", "consumers"),
        fig("hold it ~{} ms", "churn", "hold_ms"),
        fig("half in {} fake containers", "churn", "containers"),
        fig("all {:,} open and exit records", "churn",
            lambda d: d["consumers"] if d["tracer"]["open_records"] == d["tracer"]["exit_records"]
            == d["consumers"] else -1),
        fig("exit-record lag p50 {:.1f} ms, p99 {:.1f} ms", "churn", "tracer.exit_lag_ms.p50",
            "tracer.exit_lag_ms.p99"),
        fig("{} false findings; {:.0f} agent errors", "churn", "tracer.false_findings",
            "tracer.agent_errors_total"),
        fig("tracer CPU {:.3f} ms per consumer", "churn", "tracer.cpu_ms_per_consumer"),
        fig("after the first {:,} → at the end", "churn", "rss_after_first_consumers"),
        fig("tracer {:.1f} → {:.1f} MB", "churn", lambda d: d["tracer"]["rss_bytes_after_first"] / 1e6,
            lambda d: d["tracer"]["rss_bytes_end"] / 1e6),
        fig("collector {:.1f} → {:.1f} MB", "churn", lambda d: d["collector"]["rss_bytes_after_first"] / 1e6,
            lambda d: d["collector"]["rss_bytes_end"] / 1e6),
        fixed("every 1 s", "the reference poller's interval (bench/churn_poller.py)"),
        fig("saw {:,} of {:,}", "churn", "poller_1s.caught", "consumers"),
        fig("{:.1f}x the poller's catch", "churn", "ratio_tracer_exits_vs_poller"),
        fixed("p99 < 100 ms, 0 false findings", "the goals for exit lag and findings (bench_churn.py "
              "checks them)"),
        fixed("RSS flat within 5 MB", "the goal for RSS growth (bench_churn.py checks it)"),
        fig("flat within 5 MB ({})", "churn", lambda d: "met" if all(d["goals"].values()) else "missed"),
        fixed("as fd 3", "the fd tests/helpers/churn.c opens the device as"),
    ],
    "trace session: added cost per traced GPU `ioctl`": [
        fig("median of {} rounds", "trace", lambda d: len(d["per_call"]["rounds"])),
        fig("at full spin {:.0%} of the records taken", "trace", trace_taken),
        fig("+{:.0f} ns (BPF loaded, no session: +{:.0f} ns)", "trace", "per_call.added_ns_median.session",
            "per_call.added_ns_median.bpf"),
        fig("`strace -f -e trace=ioctl` +{:,.0f} ns", "trace", "per_call.added_ns_median.strace"),
        fig("| {:.3f}x |", "trace", "per_call.ratio_added_session_vs_strace"),
        fig("<= {:g}x ({})", "trace", "per_call.goal_ratio_max", lambda d: met(
            d["per_call"]["ratio_added_session_vs_strace"] <= d["per_call"]["goal_ratio_max"])),
    ],
    "trace session running on another process: non-GPU `ioctl`": [
        fig("median of {} rounds", "trace", lambda d: len(d["outside"]["rounds"])),
        fig("{:,.0f} ns ({:+.0f} ns)", "trace", trace_outside("ioctl", "ns_per_op_median.session"),
            trace_outside("ioctl", "added_ns_session_vs_bpf")),
        fig("no session: {:,.0f} ns", "trace", trace_outside("ioctl", "ns_per_op_median.bpf")),
        fig("| {:.2f}x |", "trace", trace_outside("ioctl", "ratio_session_vs_bpf")),
        fig("unchanged, within {:.0f}% ({}:", "trace",
            lambda d: 100 * (d["outside"]["goal_ratio_session_vs_bpf_max"] - 1), trace_outside_goal("ioctl")),
    ],
    "trace session running on another process: `openat`+`close`": [
        fig("{:,.0f} ns ({:+.0f} ns)", "trace", trace_outside("open", "ns_per_op_median.session"),
            trace_outside("open", "added_ns_session_vs_bpf")),
        fig("| {:,.0f} ns |", "trace", trace_outside("open", "ns_per_op_median.bpf")),
        fig("| {:.2f}x |", "trace", trace_outside("open", "ratio_session_vs_bpf")),
        fig("unchanged, within {:.0f}% ({})", "trace",
            lambda d: 100 * (d["outside"]["goal_ratio_session_vs_bpf_max"] - 1), trace_outside_goal("open")),
    ],
    "trace session start": [
        fig("{} starts", "trace", "start.starts"),
        fig("p50 {:.1f} ms, p99 {:.1f} ms", "trace", lambda d: 1000 * d["start"]["first_record_s"]["p50"],
            lambda d: 1000 * d["start"]["first_record_s"]["p99"]),
        fig("p50 < {:g} s ({})", "trace", "start.goal_p50_s",
            lambda d: met(d["start"]["first_record_s"]["p50"] < d["start"]["goal_p50_s"])),
    ],
    "trace session on a workload issuing": [
        fig("issuing {:,} GPU ioctls/s for {:g} s", "trace", "via_collector.session.rate_target",
            "options.duration_s"),
        fig("{:,.0f} records/s delivered ({:.0%} of the calls)", "trace",
            "via_collector.session.records_per_s", "via_collector.session.records_vs_calls"),
        fig("dropped: {:,} by the ring buffer, {:,} at the limit, {:,} in transport, {:,} in the store",
            "trace",
            "via_collector.session.dropped_ringbuf_total", "via_collector.session.dropped_limit_total",
            "via_collector.session.dropped_transport_total", "via_collector.session.dropped_store_total"),
        fig("collector {:.1f}%, tracer {:.1f}%, CLI {:.1f}%", "trace",
            "via_collector.session.cpu_pct_of_one_core_window.collector",
            "via_collector.session.cpu_pct_of_one_core_window.tracer",
            "via_collector.session.cpu_pct_of_one_core_window.cli"),
        fig("outside any session: collector {:.1f}%, tracer {:.1f}%", "trace",
            "via_collector.reference_no_session.cpu_pct_of_one_core_window.collector",
            "via_collector.reference_no_session.cpu_pct_of_one_core_window.tracer"),
        fig("in-process with no stream: {:,.0f} records/s", "trace", "throughput.session.records_per_s"),
    ],
    "attribution meanwhile": [
        fig("{} fresh processes", "trace", "via_collector.session.openers"),
        fig("read every {:g} ms", "trace", lambda d: 1000 * d["via_collector"]["session"]["jsonl_poll_s"]),
        fig("| p50 {:.1f} ms, p99 {:.1f} ms |", "trace", "via_collector.session.open_to_jsonl_ms.p50",
            "via_collector.session.open_to_jsonl_ms.p99"),
        fig("outside any session: p50 {:.1f} ms, p99 {:.1f} ms", "trace",
            "via_collector.reference_no_session.open_to_jsonl_ms.p50",
            "via_collector.reference_no_session.open_to_jsonl_ms.p99"),
        fig("p99 < {:g} ms ({})", "trace", "via_collector.session.goal_p99_ms", attribution_goal),
    ],
    "collector ingest over mTLS": [
        fig("the same {} simulated tracers", "tls", "tracers"),
        fig("median of {} rounds", "tls", "rounds"),
        tls_batches("batches of {:,} / {:,} events", "batch_events"),
        tls_batches("| {:,} / {:,} events/s", "mtls.events_per_s_median"),
        tls_batches("collector CPU per event {:.2f}x / {:.2f}x plaintext's",
                    "cpu_per_event_ratio_mtls_vs_plaintext"),
        tls_batches("plaintext on loopback: {:,} / {:,}", "plaintext.events_per_s_median"),
        tls_batches("| {:.2f} / {:.2f} |", "ratio_mtls_vs_plaintext"),
        fig("≥ {:g}x plaintext ({})", "tls", "goal_ratio_mtls_vs_plaintext", tls_goal),
    ],
    "open streams re-checked at each policy reload": [
        fig("rewritten every {:g} s", "tls", "policy_rewrite_every_s"),
        tls_batches("batches of {:,} / {:,})", "batch_events"),
        fig("each of the {} tracers' streams", "tls", "reload_recheck.streams_open"),
        fig("| one reload {:.0f} µs + the re-check of {} streams {:.0f} µs", "tls",
            "reload_recheck.reload_cpu_us", "reload_recheck.streams_open", "reload_recheck.recheck_cpu_us"),
        tls_batches("once a second: {:.2%} / {:.2%} of the collector's CPU", "recheck_cost"),
        tls_batches("{:,} / {:,} events/s while reloading", "mtls-recheck.events_per_s_median"),
        tls_batches("without reloads: {:,} / {:,} events/s", "mtls.events_per_s_median"),
        tls_batches("| {:.2f} / {:.2f} |", "ratio_recheck_arm_vs_mtls"),
        fig("≤ 2% of mTLS ingest ({})", "tls", recheck_goal),
    ],
    "reconnecting tracer over mTLS": [
        fig("{} reconnects", "tls", "handshake.reconnects"),
        fig("| p50 {:.1f} ms, p99 {:.1f} ms |", "tls", "handshake.collector.mtls.p50_ms",
            "handshake.collector.mtls.p99_ms"),
        fig("plaintext: p50 {:.1f} ms, p99 {:.1f} ms", "tls", "handshake.collector.plaintext.p50_ms",
            "handshake.collector.plaintext.p99_ms"),
        fig("{:,} → {:,} sockets", "tls", "handshake.tcp_sockets_on_host.before",
            "handshake.tcp_sockets_on_host.after"),
        fig("echo: plaintext p50 {:.1f} ms, mTLS p50 {:.1f} ms", "tls", "handshake.echo.plaintext.p50_ms",
            "handshake.echo.mtls.p50_ms"),
        fig("{:.2f}x plaintext", "tls", "handshake.collector.ratio_p50_mtls_vs_plaintext"),
        fig("the TLS handshake alone +{:.1f} ms", "tls", "handshake.echo.added_p50_ms"),
    ],
    "`/metrics` over TLS": [
        fig("holding {} nodes × {} consumers", "tls", "scrape.nodes", "scrape.consumers_per_node"),  # noqa: RUF001
        fig("{} per arm", "tls", "scrape.scrapes"),
        fig("keep-alive p50 {:.2f} ms, p99 {:.2f} ms; a new connection each scrape p50 {:.2f} ms, "
            "p99 {:.2f} ms", "tls", "scrape.keep_alive.tls.p50_ms", "scrape.keep_alive.tls.p99_ms",
            "scrape.new_connection.tls.p50_ms", "scrape.new_connection.tls.p99_ms"),
        fig("keep-alive p50 {:.2f} ms, p99 {:.2f} ms; new connection p50 {:.2f} ms, p99 {:.2f} ms", "tls",
            "scrape.keep_alive.plaintext.p50_ms", "scrape.keep_alive.plaintext.p99_ms",
            "scrape.new_connection.plaintext.p50_ms", "scrape.new_connection.plaintext.p99_ms"),
        fig("keep-alive {:.2f}x, new connection {:.2f}x", "tls",
            *(f"scrape.{mode}.ratio_p50_tls_vs_plaintext" for mode in ("keep_alive", "new_connection"))),
    ],
    "collector replicas over PostgreSQL 15": [
        fixed("PostgreSQL 15", "Debian 12's postgresql, which tests/helpers/postgres.py starts"),
        fig("{} simulated tracers", "replicas", "tracers"),
        fig("batches of {} events", "replicas",
            lambda d: " / ".join(f"{r['batch_events']:,}" for r in d["ingest"] if r["target"] == "pg-3")),
        fixed("| 3 replicas:", "bench_replicas.py's pg-3 target: three replicas (code)"),
        fixed("| 3 replicas 4", "bench_replicas.py's pg-3 target: three replicas (code)"),
        fig("3 replicas: {} events/s; 1 replica: {}; one collector on SQLite: {} |", "replicas",
            replica_pair("pg-3", "events_per_s"), replica_pair("pg-1", "events_per_s"),
            replica_pair("sqlite-1", "events_per_s")),
        fig("a row per event: {} events/s", "replicas", replica_pair("bare-client", "events_per_s")),
        fig("(a row per batch): {} |", "replicas", replica_pair("bare-client-store-shape", "events_per_s")),
        fig("3 replicas {}x the bare client, {}x its row shape", "replicas",
            replica_pair("pg-3", "ratio_vs_bare_client", "{:.2f}"),
            replica_pair("pg-3", "ratio_vs_bare_store_shape", "{:.2f}")),
        fig("≥ {}x the bare client ({})", "replicas", "goal_ratio_vs_bare", replicas_goal),
    ],
    "replica failover": [
        fig("{} kills", "replicas", "failover.kills"),
        fixed("6 tracers over 3 replicas", "bench_replicas.py failover(): six tracers, three replicas"),
        fig("p50 {:.0f} ms, p99 {:.0f} ms ({} moves)", "replicas", lambda d: d["failover"]["p50_s"] * 1000,
            lambda d: d["failover"]["p99_s"] * 1000, "failover.moved_nodes"),
        fig("every event stored once | - | - | p99 ≤ {:g} s ({})", "replicas", "failover.goal_p99_s",
            lambda d: "met" if d["failover"]["exactly_once"] and d["failover"]["p99_s"] <= d["failover"][
                "goal_p99_s"] else "missed"),
    ],
    "a finding committed on one replica": [
        fig("{} notifications a run", "watch_latency", "workload.notifications"),
        fig("p50 {:.1f} ms, p99 {:.1f} ms; while the watching replica ingests {:,} events/s: p50 {:.1f} ms, "
            "p99 {:.1f} ms", "watch_latency", "runs.0.stats_ms.commit_to_watcher.p50",
            "runs.0.stats_ms.commit_to_watcher.p99", "runs.2.load_on_b.events_per_s_sent",
            "runs.2.stats_ms.commit_to_watcher.p50", "runs.2.stats_ms.commit_to_watcher.p99"),
        fig("p99 < {:g} ms ({})", "watch_latency", "budget_commit_to_watcher_p99_ms",
            lambda d: "met" if d["met"] else "missed"),
    ],
    "collector memory with replicas": [
        fig("{:,} simulated nodes", "replicas", "memory.nodes"),
        fig("{} KiB per node per replica", "replicas",
            lambda d: max(d["memory"]["kib_per_node_per_replica"])),
        fixed("× 20 consumers", "bench_ingest.py's client processes send a 20-consumer snapshot (code)"),  # noqa: RUF001
        fixed("over 3 replicas", "bench_replicas.py starts three replicas (code)"),
        fig("all {:,} nodes: {:.0f} KiB per node", "collector_memory", "nodes", "collector.per_node_kib"),
        fig("| {:.2f}x |", "replicas", lambda d: max(d["memory"]["kib_per_node_per_replica"])
            / result("collector_memory")["collector"]["per_node_kib"]),
    ],
    "the store's PostgreSQL driver": [
        fig("median of {} rounds", "pg_driver", "workload.rounds"),
        fig("inserts of {:,} / {:,} events", "pg_driver", "workload.batch_rows.0", "workload.batch_rows.1"),
        fig("psycopg 3's best method: {:,} / {:,} rows/s", "pg_driver",
            lambda d: driver_best("psycopg", 2000)(d)["rows_per_s_median"],
            lambda d: driver_best("psycopg", 200)(d)["rows_per_s_median"]),
        fig("asyncpg's best: {:,} / {:,}", "pg_driver",
            lambda d: driver_best("asyncpg", 2000)(d)["rows_per_s_median"],
            lambda d: driver_best("asyncpg", 200)(d)["rows_per_s_median"]),
        fig("no driver: {:,} / {:,} |", "pg_driver",
            lambda d: driver("server-side (ceiling)", 2000)(d)["rows_per_s_median"],
            lambda d: driver("server-side (ceiling)", 200)(d)["rows_per_s_median"]),
        fig("psycopg {:.2f} / {:.2f} of the server's ceiling", "pg_driver",
            lambda d: driver_best("psycopg", 2000)(d)["vs_ceiling"],
            lambda d: driver_best("psycopg", 200)(d)["vs_ceiling"]),
    ],
    "guarded kill of an orphaned GPU holder": [
        fig("{:,} `sleep` holders", "remediate", "kill.kills"),
        fig("| p50 {:.2f} ms, p99 {:.2f} ms;", "remediate", "kill.arms.act.p50_ms", "kill.arms.act.p99_ms"),
        fig("(dry run) p50 {:.2f} ms", "remediate", "kill.arms.recheck.p50_ms"),
        fig("ContainerStatus p50 {:.2f} ms, the identity read {:.2f} ms, the hold scan {:.2f} ms",
            "remediate", "kill.arms.cri.p50_ms", "kill.arms.look.p50_ms", "kill.arms.held.p50_ms"),
        fig("on the device p50 {:.2f} ms, p99 {:.2f} ms", "remediate",
            "kill.arms.fuser.p50_ms", "kill.arms.fuser.p99_ms"),
        fig("{} processes here", "remediate", "kill.procs_on_host"),
        fig("`waitpid` p50 {:.2f} ms, p99 {:.2f} ms", "remediate",
            "kill.arms.kill.p50_ms", "kill.arms.kill.p99_ms"),
        fig("{:.2f}x fuser; {:.2f}x the bare kill", "remediate",
            "kill.act_vs_fuser_p50", "kill.act_vs_kill_p50"),
    ],
    "remediation engine's tick on the collector's loop": [
        fig("{:,} open findings on {} nodes, {} of them orphaned", "remediate",
            "tick.open_findings", "tick.nodes", "tick.orphaned"),
        fig("{} ticks per mode", "remediate", "tick.ticks"),
        fig("| p50 {:.2f} ms, p99 {:.2f} ms; loop CPU p50 {:.2f} ms ({:.2f}% of the loop", "remediate",
            "tick.dry_run.wall.p50_ms", "tick.dry_run.wall.p99_ms", "tick.dry_run.loop_cpu.p50_ms",
            "tick.dry_run_loop_cpu_pct_of_tick_s"),
        fig("the first round ({} incidents decided, re-checked and proposed, each step audited) {:.1f} ms, "
            "{:.1f} ms of loop CPU", "remediate", "tick.first_dry_run_round.incidents_proposed",
            "tick.first_dry_run_round.wall_ms", "tick.first_dry_run_round.loop_cpu_ms"),
        fig("mode off (the default): p50 {:.2f} ms, p99 {:.2f} ms; loop CPU p50 {:.2f} ms", "remediate",
            "tick.off.wall.p50_ms", "tick.off.wall.p99_ms", "tick.off.loop_cpu.p50_ms"),
        fig("| {:.2f}x off |", "remediate", "tick.dry_run_vs_off_wall_p50"),
    ],
    "`kubectl ghostgpu ps -o json`": [
        fig("holding {:,} GPU holders of {} nodes", "kubectl_plugin", "holders", "nodes"),
        fig("{} trials", "kubectl_plugin", "trials"),
        fig("| p50 {:.1f} ms (min {:.1f} ms) |", "kubectl_plugin", "kubectl ghostgpu ps.p50_ms",
            "kubectl ghostgpu ps.min_ms"),
        fig("`ghostgpu ps` p50 {:.1f} ms (min {:.1f} ms)", "kubectl_plugin", "ghostgpu ps.p50_ms",
            "ghostgpu ps.min_ms"),
        fig("(`kubectl version --client`) p50 {:.1f} ms", "kubectl_plugin",
            "kubectl version --client.p50_ms"),
        fig("| {:.2f}x (+{:.1f} ms) |", "kubectl_plugin", "ratio_p50", "added_p50_ms"),
    ],
}

# Sentences outside the table that quote measured figures: (first words, last words) -> figures.
PROSE: dict[tuple[str, str], list[Figure]] = {
    ("Measured by `bench/bench_remediate.py`", "every step audited, took"): [
        fig("took p50 {:.2f} ms, p99 {:.2f} ms over {} holders", "remediate",
            "kill.arms.act.p50_ms", "kill.arms.act.p99_ms", "kill.kills"),
        fig("p50 {:.2f} ms for a bare", "remediate", "kill.arms.kill.p50_ms"),
        fig("p50 {:.2f} ms for `fuser -k -TERM`", "remediate", "kill.arms.fuser.p50_ms"),
        fig("(p50 {:.2f} ms timed alone)", "remediate", "kill.arms.cri.p50_ms"),
        fig("tick over {:,} open findings ({} orphaned)", "remediate", "tick.open_findings", "tick.orphaned"),
        fig("p50 {:.2f} ms in dry-run against {:.2f} ms with remediation off", "remediate",
            "tick.dry_run.loop_cpu.p50_ms", "tick.off.loop_cpu.p50_ms"),
        fig("{:.2f}% of the loop", "remediate", "tick.dry_run_loop_cpu_pct_of_tick_s"),
        fig("round, {} incidents", "remediate", "tick.first_dry_run_round.incidents_proposed"),
    ],
    ("every step audited, took", "ms."): [
        fig("took {:.1f} ms.", "remediate", "tick.first_dry_run_round.wall_ms"),
    ],
    ("Latest figures (", "; raw numbers in"): [
        Figure(lambda: f"({machines()};", "machine (or host) of every bench/results/*.json"),
    ],
    ("A 1,000-node x 20-consumer cluster is about", "gzipped)"): [
        fig("A {:,}-node x {}-consumer cluster is about {} series ({:.0f} MB, {} KB gzipped)",
            "metrics_scrape", "nodes", "consumers_per_node", lambda d: sig2(d["samples"]),
            lambda d: d["page_bytes"] / 1e6,
            lambda d: sig2(d["cases"]["cold_gzip"]["wire_bytes"] / 1e3)),
    ],
    ("`emit()` only assigns a sequence number", "µs)"): [
        fig("(about {:.1f} µs)", "stream_emit", lambda d: d["ns_per_emit"]["stream_connected_cpu"] / 1000),
    ],
    ("one `grpc.aio` event loop holds the streams (", "not 1,000)"): [
        fig("({:,} tracers cost {} threads, not {:,})", "collector_memory", "nodes", "collector.threads",
            "nodes"),
    ],
    ("already-rendered lines from the event loop in one call", "for 1,000 nodes)"): [
        fig("(about {} ms of loop time for {:,} nodes)", "metrics_scrape", loop_hold_range, "nodes"),
    ],
    ("over the per-node series takes about", " s. The Alertmanager"): [
        fig("takes about {:.1f} s", "metrics_scrape",
            lambda d: d["cases"]["naive_generate_latest"]["p50_ms"] / 1000),
    ],
    ("full garbage collections stop the loop for", "at 1,000 nodes."): [
        fig("stop the loop for {} ms", "metrics_scrape", full_gc_range),
        fig("instead of {} ms at {:,} nodes", "metrics_scrape_no_heap_policy", full_gc_range, "nodes"),
    ],
    ("the first `run --demo --once` took", "MB."): [
        fig("took {:.0f} s, the second {:.0f} s, and the finished root is {:,} MB", "first_run",
            "first.wall_s", "second.wall_s", "root_size_mb"),
    ],
    ("a real tracer sends a lone event at once", "batches unacknowledged"): [
        const("gathers up to {:g} ms or {:,} events", stream.FLUSH_S * 1000, protocol.MAX_BATCH_EVENTS,
              where="tracer/stream.py FLUSH_S, ghostgpu/common/wire/protocol.py MAX_BATCH_EVENTS"),
        const("at most {} batches unacknowledged", stream.WINDOW_BATCHES,
              where="tracer/stream.py WINDOW_BATCHES"),
    ],
    ("In the paced run above the collector kept up", "-event batches."): [
        fig("the collector {}", "ingest_paced",
            lambda d: "kept up" if paced("collector")(d)["clients_kept_up"] else "fell behind"),
        fig("without it (`--paced-window {}`)", "ingest_paced_no_window", "window_batches"),
        fig("acknowledged {:,} events/s, in {:.0f}-event batches", "ingest_paced_no_window",
            lambda d: paced("collector")(d)["acked_events_per_s"],
            lambda d: paced("collector")(d)["batch_events"]["mean"]),
    ],
    ("At 50-event batches even the bare echo server", "here."): [
        fig("At {}-event batches even the bare echo server reaches only {:,} events/s", "ingest",
            lambda d: run("echo-aio", 50)(d)["batch_events"],
            lambda d: run("echo-aio", 50)(d)["events_per_s"]),
    ],
    ("the detection-latency runs started under", "(`loadavg_1m_at_start`)"): [
        fig("started under {}", "detect_latency", load_under(0.7, "detect_latency", "detect_latency_poll")),
    ],
}


def benchmark_table() -> list[list[str]]:
    """The rows (cells, stripped) of the first table under '## Benchmarks', header and rule left out."""
    lines = README.read_text().splitlines()
    start = lines.index("## Benchmarks")
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break  # the end of the first table
    assert len(rows) > 2, "no benchmark table under '## Benchmarks' in README.md"
    header, rule, *body = rows
    assert header[:2] == ["benchmark", "ghostgpu"] and set("".join(rule)) <= set("-: "), header
    return body


def row_key(first_cell: str) -> str | None:
    keys = [k for k in ROWS if first_cell.startswith(k)]
    assert len(keys) <= 1, f"row {first_cell[:60]!r} matches several ROWS keys: {keys}"
    return keys[0] if keys else None


def check(text: str, figures: list[Figure], what: str) -> None:
    covered = [False] * len(text)
    problems = []
    for f in figures:
        expected = f.render()
        spans = [m.span() for m in re.finditer(re.escape(expected), text)]
        if not spans:
            problems.append(f"{expected!r} (from {f.source}) is not in the README")
        for a, b in spans:
            covered[a:b] = [True] * (b - a)
    for m in NUMBER.finditer(text):
        if not all(covered[m.start():m.end()]):
            context = text[max(0, m.start() - 30):m.end() + 10]
            problems.append(f"{m.group()!r} (…{context}…) has no stored source: "
                            "add a figure for it to tests/unit/test_readme_figures.py")
    assert not problems, f"{what}:\n  " + "\n  ".join(problems)


def table_ids() -> list[str]:
    return [row[0][:48] for row in benchmark_table()]


@pytest.mark.parametrize("row", benchmark_table(), ids=table_ids())
def test_every_table_figure_comes_from_a_stored_result(row: list[str]) -> None:
    key = row_key(row[0])
    assert key is not None, (f"README benchmark row {row[0][:80]!r} has no entry in ROWS "
                             "(tests/unit/test_readme_figures.py): map each of its figures to the "
                             "bench/results JSON it comes from")
    check(" | ".join(["", *row, ""]).strip(), ROWS[key], f"README benchmark row {key!r}")


def test_every_rows_entry_names_a_row_of_the_table() -> None:
    keys = {row_key(row[0]) for row in benchmark_table()}
    assert set(ROWS) <= keys, f"ROWS entries with no README row: {sorted(set(ROWS) - keys)}"


@pytest.mark.parametrize("span", list(PROSE), ids=[first for first, _ in PROSE])
def test_figures_quoted_in_the_text_come_from_stored_results(span: tuple[str, str]) -> None:
    first, last = span
    saying = [(path, text) for path in PROSE_FILES if first in (text := " ".join(path.read_text().split()))]
    names = " or ".join(path.relative_to(ROOT).as_posix() for path in PROSE_FILES)
    assert saying, f"{names} no longer says {first!r}: update PROSE"
    path, text = saying[0]
    where = path.relative_to(ROOT).as_posix()
    start = text.find(first)
    end = text.find(last, start)
    assert end >= 0, f"{where}: {last!r} does not follow {first!r}: update PROSE"
    check(text[start:end + len(last)], PROSE[span], f"{where} text {first!r}")


def test_the_number_pattern() -> None:
    found = NUMBER.findall("p50 12.0 ms on /dev/nvidia0, 1,014,695 / 1/1250, +0.2 MB, 8.0-19.7 s, at 2,000,")
    assert found == ["12.0", "1,014,695", "1", "1250", "0.2", "8.0", "19.7", "2,000"]
