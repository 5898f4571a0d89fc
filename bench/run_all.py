"""Every throughput benchmark in one run, side by side: ``make bench``.

    .venv/bin/python bench/run_all.py [--quick] [--only pipeline,transport,...] [--out bench/results.json]

Runs each benchmark as its own process (clean thread settings and memory),
prints one table of ratios and writes every number to ``bench/results.json``
(each benchmark's own log and JSON go to ``runs/bench/``):

1. pipeline efficiency: end-to-end drafter tokens/s of a real job (target +
   1 drafter + sidecar processes over gloo) / the slower of target-alone and
   drafter-alone on the same batch shapes (``bench/pipeline_bench.py``);
2. transport: ``shm`` (the zero-copy batch pool) / memcpy of the same bytes, and ``PairGroup``
   (gloo) / raw ``init_process_group("gloo")`` send/recv, for one batch
   (``bench/transport_bench.py``);
3. target capture (hooks, stop after the last captured layer) / plain
   forward with ``output_hidden_states=True`` (``bench/capture_bench.py``);
4. fused LM-head loss vs the plain one: peak memory and time at SmolLM2's
   vocabulary (``bench/fused_loss_bench.py``);
5. scaling: drafter tokens/s with 1, 2 and 4 drafters on one target (from 1.);
6. metrics on / off training throughput (``bench/metrics_overhead.py``).

Each benchmark alternates the things it compares and reports medians. On a
shared machine the numbers move with the load: the load average is recorded
next to each benchmark. Exit status 1 if a benchmark failed (not for a goal
missed: the table says that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, run_script, write_json

BENCH = ROOT / "bench"
NAMES = ("transport", "capture", "pipeline", "fused_loss", "metrics")


def commands(quick: bool) -> dict[str, tuple[list[str], float, int | None]]:
    """name -> (script and arguments, timeout in seconds, OMP threads)."""
    if quick:  # a smoke run of the whole suite in a couple of minutes
        return {
            "transport": ([str(BENCH / "transport_bench.py"), "--rounds", "2", "--iters", "6"], 300, 1),
            "capture": ([str(BENCH / "capture_bench.py"), "--rounds", "1", "--model", "tiny"], 300, 1),
            "pipeline": ([str(BENCH / "pipeline_bench.py"), "--drafters", "1,2", "--windows", "2", "--window-s", "4",
                          "--scaling-window-s", "5", "--alone-batches", "2", "--target-layers", "8",
                          "--target-hidden", "64"], 600, 1),
            "fused_loss": ([str(BENCH / "fused_loss_bench.py"), "--threads", "1", "--repeats", "1", "--n", "240"], 300, 1),
            "metrics": ([str(BENCH / "metrics_overhead.py"), "--steps", "3", "--rounds", "1"], 300, 1),
        }
    return {
        "transport": ([str(BENCH / "transport_bench.py")], 300, 1),
        "capture": ([str(BENCH / "capture_bench.py")], 400, 1),
        "pipeline": ([str(BENCH / "pipeline_bench.py")], 900, 1),
        "fused_loss": ([str(BENCH / "fused_loss_bench.py"), "--threads", "1", "--repeats", "2"], 600, 1),
        "metrics": ([str(BENCH / "metrics_overhead.py"), "--steps", "10", "--rounds", "12"], 600, 1),
    }


# ---------------------------------------------------------------------------
# Table rows: (row, what, measured, baseline, ratio, goal, met)


def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _tok(x: float) -> str:
    return f"{x:,.0f} tok/s"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "NO")


def rows(results: dict[str, Any], errors: dict[str, str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []

    def failed(row: str, what: str, name: str) -> None:
        out.append((row, what, f"failed: {errors[name].splitlines()[0][:60]}", "", "", "", "n/a"))

    p = results.get("pipeline")
    if p and "pipeline_efficiency" in p:
        eff = p["pipeline_efficiency"]
        slower = min(p["target_alone_tokens_per_s"], p["drafter_alone_tokens_per_s"])
        out.append(("1", f"pipeline efficiency (slower alone: {p['bottleneck']})", _tok(p["end_to_end_tokens_per_s"]),
                    _tok(slower), _f(eff), ">= 0.9", _met(eff >= 0.9)))
        out.append(("", "  target alone / drafter alone, one at a time", _tok(p["target_alone_tokens_per_s"]),
                    _tok(p["drafter_alone_tokens_per_s"]), "", "", ""))
        both_t, both_d = p["concurrent_target_alone_tokens_per_s"], p["concurrent_drafter_alone_tokens_per_s"]
        out.append(("", "  target / drafter alone, both at once (2 processes)", _tok(both_t), _tok(both_d),
                    _f(p["pipeline_efficiency_vs_concurrent_alone"]), "(explains)", ""))
        job = p["jobs"]["1"]
        cores = job["cpu_cores_used"].get("target" if p["bottleneck"] == "target" else "d0", float("nan"))
        out.append(("", f"  cores the {p['bottleneck']} got: in the job / alone", _f(cores), _f(p["alone_cpu_cores_used"]),
                    _f(p["pipeline_efficiency_cpu_adjusted"]), "(explains)", ""))
    elif "pipeline" in errors:
        failed("1", "pipeline efficiency", "pipeline")

    t = results.get("transport")
    if t:
        gb = t["GBps"]
        if t.get("shm_vs_memcpy") is None:
            out.append(("2a", "shm / memcpy", "n/a (shm transport missing)", f"{gb['memcpy_ring']:.1f} GB/s", "n/a",
                        ">= 0.8", "n/a"))
        else:
            read = "read in place" if t.get("consume", "sum") == "sum" else "copied out"
            out.append(("2a", f"shm (zero-copy pool, {read}) / memcpy ({t['nbytes'] / 1e6:.1f} MB, ring-sized set)",
                        f"{gb['shm']:.1f} GB/s", f"{gb['memcpy_ring']:.1f} GB/s", _f(t["shm_vs_memcpy"]), ">= 0.8",
                        _met(t["shm_vs_memcpy"] >= 0.8)))
            out.append(("", "  shm / memcpy, one cache-resident buffer", f"{gb['shm']:.1f} GB/s",
                        f"{gb['memcpy']:.1f} GB/s", _f(t["shm_vs_memcpy_hot"]), "", ""))
            out.append(("", "  shm / gloo PairGroup (same batch)", f"{gb['shm']:.1f} GB/s", f"{gb['gloo_pair']:.2f} GB/s",
                        _f(gb["shm"] / gb["gloo_pair"]), "", ""))
            if "shm_copy" in gb:
                out.append(("", "  a copying ring (producer copies into the slot) / memcpy", f"{gb['shm_copy']:.1f} GB/s",
                            f"{gb['memcpy_ring']:.1f} GB/s", _f(t["shm_copy_vs_memcpy"]), "(replaced)", ""))
                out.append(("", "  a copying ring / both processes copying at once", f"{gb['shm_copy']:.1f} GB/s",
                            f"{gb['memcpy_pair']:.1f} GB/s", _f(t["shm_copy_vs_memcpy_pair"]), "(explains)", ""))
            b = t["shm_breakdown_ms"]
            for kind in ("shm", "shm_copy"):
                if f"{kind}/producer_write_ms" in b:
                    out.append(("", f"  {kind} ms/batch: write, wait slot | wait, read",
                                f"{b[f'{kind}/producer_write_ms']:.2f}, {b[f'{kind}/producer_ack_wait_ms']:.2f} | "
                                f"{b[f'{kind}/consumer_wait_ms']:.2f}, {b[f'{kind}/consumer_read_ms']:.2f}",
                                f"memcpy {t['memcpy_ring_ms']:.2f}", "", "", ""))
        out.append(("2b", "gloo PairGroup / raw gloo send+recv (transfers interleaved)", f"{gb['gloo_pair']:.2f} GB/s",
                    f"{gb['gloo_raw']:.2f} GB/s", _f(t["gloo_pair_vs_raw"]), ">= 0.9", _met(t["gloo_pair_vs_raw"] >= 0.9)))
        if "gloo_pair_vs_raw_blocks" in t:
            out.append(("", "  the same in blocks of one method, then the other (noisier)", "", "",
                        _f(t["gloo_pair_vs_raw_blocks"]), "", ""))
    elif "transport" in errors:
        failed("2", "transport", "transport")

    c = results.get("capture")
    if c:
        out.append(("3", f"capture / plain forward ({c['model'][:20]}, {c['batch']}x{c['seq_len']})",
                    _tok(c["capture_tokens_per_s"]), _tok(c["plain_tokens_per_s"]), _f(c["capture_vs_plain"]), "> 1.0",
                    _met(c["capture_vs_plain"] > 1.0)))
    elif "capture" in errors:
        failed("3", "capture", "capture")

    f = results.get("fused_loss")
    if f:
        plain = f["methods"]["plain"]
        for name, m in f["methods"].items():
            if name == "plain":
                continue
            mem, tim = m["mem_ratio_vs_plain"], m["time_ratio_vs_plain"]
            out.append(("4", f"fused loss ({name}) / plain: peak memory (V={f['vocab']}, N={f['n']})",
                        f"{m['peak_bytes'] / 2**20:.0f} MiB", f"{plain['peak_bytes'] / 2**20:.0f} MiB", _f(mem, 3),
                        "< 1", _met(mem < 1.0)))
            out.append(("", f"  fused loss ({name}) / plain: time of fwd+bwd", f"{m['median_s'] * 1e3:.0f} ms",
                        f"{plain['median_s'] * 1e3:.0f} ms", _f(tim), "<= 1", _met(tim <= 1.0)))
    elif "fused_loss" in errors:
        failed("4", "fused loss", "fused_loss")

    if p and p.get("jobs"):
        base = p["jobs"].get("1", {}).get("total_tokens_per_s")
        for n, job in sorted(p["jobs"].items(), key=lambda kv: int(kv[0])):
            per = ", ".join(f"{d['tokens_per_s']:,.0f}" for d in job["drafters"].values())
            out.append(("5" if n == min(p["jobs"], key=int) else "", f"scaling: {n} drafter(s), total (per drafter: {per})",
                        _tok(job["total_tokens_per_s"]), _tok(base) if base else "", _f(job["total_tokens_per_s"] / base)
                        if base else "", "report", ""))
    elif "pipeline" in errors:
        failed("5", "scaling", "pipeline")

    m = results.get("metrics")
    if m:
        ratio = m["throughput_ratio_metrics_on_vs_off"]
        out.append(("6", "metrics on / off training throughput", f"{m['step_ms_metrics_on']:.0f} ms/step",
                    f"{m['step_ms_metrics_off']:.0f} ms/step", _f(ratio), ">= 0.99", _met(ratio >= 0.99)))
        if "metrics_path_ms_per_step" in m:
            out.append(("", "  step / (step + the metrics path timed alone)", f"{m['metrics_path_ms_per_step']:.3f} ms/step",
                        f"{m['step_ms_metrics_off']:.0f} ms/step", f"{m['isolated_ratio']:.4f}", "(explains)", ""))
        out.append(("", "  host syncs per step in the hot path", f"{m['host_syncs_per_step']:.0f}", "", "", "0",
                    _met(m["host_syncs_per_step"] == 0)))
    elif "metrics" in errors:
        failed("6", "metrics overhead", "metrics")
    return out


def format_table(table: list[tuple[str, ...]]) -> str:
    header = ("row", "measurement", "measured", "baseline", "ratio", "goal", "met")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), line, *(fmt(r) for r in table)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(NAMES), help=f"comma list of {', '.join(NAMES)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short windows: checks the suite runs")
    parser.add_argument("--out", default=str(BENCH / "results.json"))
    parser.add_argument("--log-dir", default=str(ROOT / "runs" / "bench"),
                        help="each benchmark's log and JSON (default runs/bench/, ignored by git)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(NAMES)}")
    out = Path(args.out)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    runs: dict[str, Any] = {}
    specs = commands(args.quick)
    for name in names:
        script, timeout_s, threads = specs[name]
        print(f"[bench] {name}: {' '.join(Path(a).name if a.endswith('.py') else a for a in script)} "
              f"(log {log_dir / (name + '.log')})", flush=True)
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        try:
            results[name] = run_script(script, log_dir / f"{name}.json", timeout_s=timeout_s,
                                       log=log_dir / f"{name}.log", threads=threads)
        except (RuntimeError, json.JSONDecodeError) as exc:
            errors[name] = str(exc)
            print(f"[bench] {name} FAILED: {exc}", file=sys.stderr, flush=True)
        runs[name] = {"seconds": time.monotonic() - t0, "loadavg_1min_before": load_before,
                      "loadavg_1min_after": os.getloadavg()[0]}
        print(f"[bench] {name}: {runs[name]['seconds']:.0f}s, 1-min load average {load_before:.1f} -> "
              f"{runs[name]['loadavg_1min_after']:.1f}", flush=True)

    import torch

    table = rows(results, errors)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__}
    print(f"\n=== dflash-stream benchmarks ({time.monotonic() - started:.0f}s; {machine['cpus']} CPUs, "
          f"torch {machine['torch']}) ===")
    print(format_table(table))
    write_json(out, {
        "machine": machine, "quick": args.quick, "seconds": time.monotonic() - started, "runs": runs,
        "table": [dict(zip(("row", "measurement", "measured", "baseline", "ratio", "goal", "met"), r)) for r in table],
        "results": results, "errors": errors,
    })
    print(f"results: {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
