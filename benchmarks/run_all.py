"""Every benchmark in one run: ``make bench`` (quick sizes) and ``make bench-full`` (the report).

Each benchmark measures its own baselines in the same run and prints its figures as ratios
against them (these machines are noisy: compare ratios, not absolute rates, between runs). This
runner starts them one after the other, each in its own process, shows their output as it comes,
and ends with a summary (which ran, how long, which failed).

    .venv/bin/python benchmarks/run_all.py [--only messages,store,...] [--dry-run]
    .venv/bin/python benchmarks/run_all.py --full [--report docs/performance.md]

``--full`` runs the default (large) sizes and writes a report (``--report PATH`` writes one
after a quick run too): the machine, every benchmark's
command and output, and PNG plots next to it (single-message throughput against the same
run's baselines, latency percentiles, throughput against message size and batch size, peak RSS
against the backlog). The README keeps the
headline table and links the report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent


@dataclass
class Bench:
    """One benchmark script and its arguments at each size."""

    name: str
    script: str
    quick: list[str]
    full: list[str] = field(default_factory=list)
    json_flag: str | None = None  # the script writes its results as JSON with this flag
    what: str = ""


BENCHES = [
    Bench("messages", "bench_messages.py", ["--quick", "--no-journal"], ["--no-journal"],
          "--json", "one message per call: send, threads, processes, producer, receive, "
          "latency; addresses with a file per commit (journal=False)"),
    Bench("messages-journal", "bench_messages.py",
          ["--quick", "--journal", "--scenarios",
           "bare,sqlite,send,threads-shared,threads-own,procs,receive,pagefiles,interleaved"],
          ["--journal", "--scenarios",
           "bare,sqlite,persistqueue,send,threads-shared,threads-own,procs,receive,latency,"
           "pagefiles,interleaved"],
          what="the same on addresses with the local journal (the default on local disks)"),
    Bench("producer", "bench_producer.py", ["--messages", "50000", "--repeat", "1"], [],
          what="the batching producer, rows per second"),
    Bench("store", "bench_store.py", ["--messages", "100000", "--commits", "2000"], [],
          what="batched sends and the commit path against the disk"),
    Bench("selector", "bench_selector.py",
          ["--rows", "1000000", "--chunk-rows", "250000", "--repeat", "1",
           "--receive-messages", "200000"], [],
          what="selector evaluation and page skipping"),
    Bench("journal-skip", "bench_journal_skip.py", ["--rows", "200000"], [],
          what="bytes a selective consumer reads of a journal backlog (issue 36), against "
          "page files and a full read"),
    Bench("sink", "bench_sink.py", ["--rows", "400000", "--repeat", "1"], [], "--json",
          what="Spark sink against Spark's own parquet writer"),
    Bench("source", "bench_source.py", ["--rows", "400000", "--repeat", "1"], [],
          what="Spark source against a parquet scan"),
    Bench("small-pages", "bench_small_pages.py", ["--messages", "20000"], [],
          what="many small commits: page files left and the drain rate against one batch"),
    Bench("compact", "bench_compact.py", ["--quick"], ["--full"], "--json",
          "compaction (issue 28): page files left, drain rate after compacting against one "
          "batch, compaction's speed against one read and its peak RSS as the backlog grows"),
    Bench("spark-compact", "bench_spark_compact.py", ["--batches", "100", "--repeat", "1"], [],
          "--json", "a Spark stream of 1,000 micro-batches of 10 rows: pages left before and "
          "after compaction, the source's drain of that backlog before and after"),
    Bench("sizes", "bench_sizes.py", ["--quick"], [], "--json",
          "throughput against message size and batch size, against append+fdatasync"),
    Bench("stat-sync", "bench_stat_sync.py", ["--writes", "1000", "--rounds", "2"], [],
          what="what a stat (and other calls) before a write costs the fdatasync after it"),
    Bench("retention", "bench_retention.py", ["--total", "256MiB", "--rounds", "3"],
          ["--total", "1GiB", "--rounds", "3"], "--json",
          "retentionBytes (issue 41): stats bytes after every cleanup against the bound plus "
          "two pages, sends against an address without retention (alternating A/B)"),
    Bench("expiry", "bench_expiry.py", ["--messages", "100000", "--rounds", "5"],
          ["--messages", "1000000", "--rounds", "7"], "--json",
          "receive(1) + deferred ack with expiryDelayMs set and nothing expired, against no "
          "expiry (issue 41 target 3, alternating A/B)"),
    Bench("scheduled", "bench_scheduled.py",
          ["--messages", "50000", "--scheduled", "100000", "--rounds", "3",
           "--latency-messages", "100"], ["--rounds", "7"], "--json",
          "scheduled delivery (issue 42 target 1): receive(1) + deferred ack with 100,000 "
          "messages scheduled over the next hour against none (alternating A/B), and how soon "
          "after its time a waiting consumer gets a scheduled message"),
    Bench("metrics", "bench_metrics.py", ["--scrapes", "10"], ["--scrapes", "30"], "--json",
          "Prometheus scrapes (issue 41): 100 addresses x 10 consumers, steady-state scrape "
          "time and its ratio with a 10x larger backlog (alternating A/B)"),
    Bench("memory", "bench_memory.py", ["--small", "100000", "--large", "1000000"], [],
          "--json", "peak RSS as the backlog grows 10x"),
    Bench("delivery", "bench_delivery.py", ["--quick"], [],
          what="receive(1) + ack with 1% nacked against main's code (A/B), nack delays, "
               "opening a consumer with a full window; shared consumers against a sqlite3 "
               "work queue and persist-queue, 4 processes against 1, against an exclusive "
               "consumer (issue 40)"),
    Bench("scaling", "bench_scaling.py", ["--pages", "300", "--tasks", "1,10",
                                          "--consumers", "1,10"], [],
          what="S3 requests (LIST, GET, PUT, HEAD, DELETE) per Spark sink task and commit, "
               "plan, read task, source commit, cleanup and compaction as tasks, pages and "
               "consumers grow, counted at the S3 test server (docs/scaling.md; its table is "
               "the default size, ~15 minutes)"),
]


@dataclass
class Outcome:
    bench: Bench
    command: list[str]
    seconds: float
    status: int
    output: str
    data: object = None


def run(bench: Bench, full: bool, workdir: Path) -> Outcome:
    command = [sys.executable, str(HERE / bench.script), *(bench.full if full else bench.quick)]
    json_path = workdir / f"{bench.name}.json"
    if bench.json_flag:
        command += [bench.json_flag, str(json_path)]
    print(f"\n=== {bench.name}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=PROJECT, env=env)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    status = proc.wait()
    data = None
    if bench.json_flag and json_path.exists():
        data = json.loads(json_path.read_text())
    return Outcome(bench, command, time.monotonic() - started, status, "".join(lines), data)


def machine() -> str:
    load = os.getloadavg()
    return (f"{platform.node() or 'host'}: {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, load average "
            f"{load[0]:.2f} at the start")


# -- the report -------------------------------------------------------------------------------
def plot_messages(rows: list[dict], out: Path) -> list[str]:
    """Throughput of every single-message scenario next to the baselines, and latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rated = [r for r in rows if r.get("rate") and r.get("kind") != "latency"]  # paced
    if not rated:
        return []
    made = []
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rated) + 1.5))
    colors = {"bare": "tab:gray", "sqlite": "tab:blue", "persistqueue": "tab:cyan"}
    labels = [f"{r['name']} [{r['writers']}]" for r in rated]
    ax.barh(labels, [r["rate"] for r in rated],
            color=[colors.get(r["family"], "tab:orange") for r in rated])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("messages per second (log scale); gray: bare write+fdatasync, blue: sqlite3")
    ax.set_title("one message per call, durable, same run")
    fig.tight_layout()
    fig.savefig(out / "messages-throughput.png", dpi=90)
    plt.close(fig)
    made.append("messages-throughput.png")
    timed = [r for r in rows if r.get("latency_ms")]
    if timed:
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(timed) + 1.5))
        names = [f"{r['name']} [{r['writers']}]" for r in timed]
        for key, color in (("p50", "tab:green"), ("p99", "tab:red")):
            ax.scatter([r["latency_ms"][key] for r in timed], names, label=key, color=color)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("latency of one call, ms (log scale)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "messages-latency.png", dpi=90)
        plt.close(fig)
        made.append("messages-latency.png")
    return made


def plot_sizes(data: dict, out: Path) -> list[str]:
    """Send and receive throughput against message size and against batch size, next to the
    bare append+fdatasync of the same bytes: one figure per sweep, MB/s and messages/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    sweeps = (("sizes", "message_bytes", "message size in bytes", "message size",
               f"{data.get('size_batch', '?')} messages per send", "sizes-throughput.png"),
              ("batches", "batch", "messages per send", "batch size",
               f"messages of {data.get('batch_message_bytes', '?')} bytes",
               "batches-throughput.png"))
    for key, x, xlabel, what, fixed, name in sweeps:
        rows = sorted(data.get(key) or [], key=lambda r: r[x])
        if not rows:
            continue
        xs = [r[x] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, unit, ylabel in ((axes[0], "mb_s", "payload MB/s"),
                                 (axes[1], "msgs_s", "messages per second")):
            for series, label, style in (("send", "send (durable)", "o-"),
                                         ("receive", "receive + ack", "s-"),
                                         ("bare", "append+fdatasync, same bytes", "--")):
                ax.plot(xs, [r[f"{series}_{unit}"] for r in rows], style, label=label,
                        color="tab:gray" if series == "bare" else None)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel + " (log scale)")
            ax.set_ylabel(ylabel + " (log scale)")
            ax.grid(True, which="major", alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"throughput by {what} ({fixed}), durable, same run")
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append(name)
    return made


def plot_memory(data: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backlogs = sorted(data.get("backlogs", {}).items(), key=lambda kv: int(kv[0]))
    if not backlogs:
        return []
    xs = [int(n) for n, _ in backlogs]
    fig, ax = plt.subplots(figsize=(7, 4))
    series = {
        "client receive+ack": [r.get("client") for _, r in backlogs],
        "Spark driver (python + JVM)": [(r.get("spark") or {}).get("driver_total")
                                        for _, r in backlogs],
        "largest Spark python worker": [max((r.get("spark") or {}).get("python_workers") or [0])
                                        or None for _, r in backlogs],
    }
    for label, ys in series.items():
        if all(y for y in ys):
            ax.plot(xs, [y / 1e6 for y in ys], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("backlog (messages)")
    ax.set_ylabel("peak RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title("memory does not grow with the backlog")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "memory-rss.png", dpi=90)
    plt.close(fig)
    return ["memory-rss.png"]


#: Sections of the report that other commands write (``make soak`` runs 30 minutes, ``make
#: crash-matrix`` up to 60, neither part of ``make bench-full``; the send profile and issue
#: 43's before / after figures are measured by hand, see their sections): a new report
#: carries them over unchanged.
KEPT_SECTIONS = ("## soak:", "## crash-matrix:", "## send-profile:", "## issue 43:")


def kept_sections(path: Path) -> list[str]:
    """The :data:`KEPT_SECTIONS` of the report at ``path``, each up to the next ``## ``."""
    if not path.exists():
        return []
    kept = []
    for part in ("\n" + path.read_text()).split("\n## ")[1:]:
        if ("## " + part).startswith(KEPT_SECTIONS):
            kept.append("## " + part.rstrip("\n") + "\n")
    return kept


def write_report(outcomes: list[Outcome], path: Path, header: str) -> None:
    figures = path.parent / "performance"
    figures.mkdir(parents=True, exist_ok=True)
    parts = [
        "# Performance report\n",
        "Written by `.venv/bin/python benchmarks/run_all.py --full` (`make bench-full`): every "
        "benchmark (at its default size with `--full`; the commands below say which), each "
        "printing its figures as ratios against baselines measured in the same run. Absolute "
        "rates move with the machine's load; compare ratios.\n",
        f"Finished {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {header}.\n",
    ]
    for o in outcomes:
        parts.append(f"## {o.bench.name}: {o.bench.what}\n")
        shown = o.command[2:-2] if o.bench.json_flag else o.command[2:]  # not the temp file
        command = " ".join(["benchmarks/" + o.bench.script, *shown])
        parts.append(f"`.venv/bin/python {command}` ({o.seconds:.0f} s"
                     f"{'' if o.status == 0 else f', FAILED with status {o.status}'})\n")
        images: list[str] = []
        if o.bench.name == "messages" and isinstance(o.data, list):
            images = plot_messages(o.data, figures)
        elif o.bench.name == "sizes" and isinstance(o.data, dict):
            images = plot_sizes(o.data, figures)
        elif o.bench.name == "memory" and isinstance(o.data, dict):
            images = plot_memory(o.data, figures)
        parts.extend(f"![{name}](performance/{name})\n" for name in images)
        parts.append("```\n" + o.output.rstrip() + "\n```\n")
    parts.extend(kept_sections(path))
    path.write_text("\n".join(parts))
    print(f"\nwrote {path} and its figures in {figures}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="default sizes, and write the report")
    ap.add_argument("--only", default=None,
                    help=f"comma list of: {', '.join(b.name for b in BENCHES)}")
    ap.add_argument("--report", default=None, help="write the report here (--full: "
                    "docs/performance.md)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    chosen = BENCHES
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {b.name for b in BENCHES})
        if unknown:
            ap.error(f"unknown benchmark(s) {unknown}; choose from "
                     f"{', '.join(b.name for b in BENCHES)}")
        chosen = [b for b in BENCHES if b.name in names]
    if args.dry_run:
        for b in chosen:
            print(" ".join(["benchmarks/" + b.script, *(b.full if args.full else b.quick)]))
        return 0
    header = machine()
    print(header)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-") as workdir:
        for b in chosen:
            outcomes.append(run(b, args.full, Path(workdir)))
    print("\n=== summary")
    for o in outcomes:
        print(f"  {o.bench.name:<10} {'ok' if o.status == 0 else f'FAILED ({o.status})':<12} "
              f"{o.seconds:6.0f} s  {o.bench.what}")
    report = args.report or (str(PROJECT / "docs" / "performance.md") if args.full else None)
    if report:
        write_report(outcomes, Path(report), header)
    return 0 if all(o.status == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
