"""B9's markdown: the real-rank and simulated tables (fsdpkit beside plain DCP), the growth fits
(log-log slope of coordinator time against ranks) and issue 36's item-2 targets, met or not."""

from __future__ import annotations

import math
from typing import Any

SAVE_RATIO = 0.5  # fsdpkit's per-save coordinator time after the first <= this x uncached dcp.save's
LOAD_RATIO = 1.2  # fsdpkit's resume metadata handling <= this x dcp.load's
MAX_EXPONENT = 1.0  # growing no faster than linearly in ranks

MAPPING = (
    "How the simulation maps to a real cluster: rank 0's own work is run for real on what N ranks would "
    "send it (their local plans, write results, file lists and digests, built from rank 0's real DCP plan "
    "and checked against DCP's plans of real FSDP2 shards by tests/unit/test_coordinator_bench.py); the "
    "gathers are modelled as rank 0 unpickling N payloads and the scatters as pickling N. It leaves out the "
    "network latency and bandwidth of the gathers (bytes are reported instead), storage latency (`.metadata` "
    "and `manifest.json` go to local disk; the data files are not written), the other ranks' planning (on a "
    "cluster it runs in parallel and only rank 0's share is on its path), and stragglers.")


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(time) against log(ranks): 1 linear, 2 quadratic."""
    pts = [(math.log(n), math.log(t)) for n, t in points if t > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def _row(world: int, r: dict[str, Any], *, key: str = "coord_s", gathered: str) -> list[str]:
    out = []
    for method in ("fsdpkit", "dcp"):
        m = r[method]
        out += [f"{m['save_first'][key]:.3f}", f"{m['save'][key]:.3f}", f"{m['resume'][key]:.3f}"]
    return out


def real_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| ranks | fsdpkit save, first (s) | fsdpkit save (s) | fsdpkit save CPU (s) | fsdpkit resume (s) | "
             "DCP save, first (s) | DCP save (s) | DCP save CPU (s) | DCP resume (s) | gathered at rank 0, save "
             "fsdpkit / DCP (KiB) | `.metadata` (KiB) | `manifest.json` (KiB) | rank-0 peak RSS fsdpkit / DCP (MiB) |",
             "|" + "---|" * 13]
    for r in runs:
        f, d = r["fsdpkit"], r["dcp"]
        lines.append(
            f"| {r['world']} | {f['save_first']['coord_s']:.3f} | {f['save']['coord_s']:.3f} | "
            f"{f['save']['coord_cpu_s']:.3f} | "
            f"{f['resume']['coord_s'] - f['resume'].get('verify_s', 0):.3f} | {d['save_first']['coord_s']:.3f} | "
            f"{d['save']['coord_s']:.3f} | {d['save']['coord_cpu_s']:.3f} | {d['resume']['coord_s']:.3f} | "
            f"{_kib(f['save_bytes']['gathered_total'])} / {_kib(d['save_bytes']['gathered_total'])} | "
            f"{_kib(d['metadata_bytes'])} | {_kib(f['manifest_bytes'])} | "
            f"{f['save']['peak_rss_mb']:.0f} / {d['save']['peak_rss_mb']:.0f} |")
    return lines


def sim_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| simulated ranks | fsdpkit save, first (s) | fsdpkit save (s) | fsdpkit save CPU (s) | fsdpkit resume "
             "metadata (s) | DCP save (s) | DCP save CPU (s) | DCP resume metadata (s) | gathered at rank 0, save "
             "fsdpkit / DCP (KiB) | `.metadata` (KiB) | `manifest.json` (KiB) | peak RSS save fsdpkit / DCP (MiB) |",
             "|" + "---|" * 12]
    for r in runs:
        f, d = r["fsdpkit"], r["dcp"]
        gathered = {m: sum(v for k, v in r[m]["save"]["bytes"].items() if k.startswith("gather"))
                    for m in ("fsdpkit", "dcp")}
        lines.append(
            f"| {r['world']:,} | {f['save_first']['wall_s']:.3f} | {f['save']['wall_s']:.3f} | "
            f"{f['save']['cpu_s']:.3f} | "
            f"{f['resume']['wall_s']:.3f} | {d['save']['wall_s']:.3f} | {d['save']['cpu_s']:.3f} | "
            f"{d['resume']['wall_s']:.3f} | {_kib(gathered['fsdpkit'])} / {_kib(gathered['dcp'])} | "
            f"{_kib(d['metadata_bytes'])} | {_kib(f['manifest_bytes'])} | "
            f"{f['save']['peak_rss_mb']:.0f} / {d['save']['peak_rss_mb']:.0f} |")
    return lines


def phases(runs: list[dict[str, Any]]) -> list[str]:
    if not runs:
        return []
    r = runs[-1]
    out = [f"Where rank 0's time goes at {r['world']:,} simulated ranks (seconds, median save / resume):", ""]
    for method in ("fsdpkit", "dcp"):
        for what in ("save", "resume"):
            ph = r[method][what]["phases_s"]
            out.append(f"- {method} {what}: " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    return out + [""]


def targets(sim: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    if not sim:
        return ["targets: no simulated run"], {}
    top = sim[-1]
    f, d = top["fsdpkit"], top["dcp"]
    save_ratio = f["save"]["wall_s"] / d["save"]["wall_s"]
    load_ratio = f["resume"]["wall_s"] / d["resume"]["wall_s"]
    exponent = slope([(r["world"], r["fsdpkit"]["save"]["wall_s"]) for r in sim])
    ok_save, ok_load = save_ratio <= SAVE_RATIO, load_ratio <= LOAD_RATIO
    ok_exp = exponent is not None and exponent <= MAX_EXPONENT + 0.1
    mark = {True: "met", False: "**NOT met**"}
    stopped = "" if top["world"] == 4096 else " (the issue names 4,096; this run stopped here)"
    at = f"{top['world']:,} simulated ranks" + stopped
    lines = [
        f"- per-save coordinator time after the first, fsdpkit / uncached dcp.save at {at}: {save_ratio:.2f}x "
        f"(target <= {SAVE_RATIO}x): {mark[ok_save]}",
        f"- its growth with ranks (log-log slope over the simulated sizes): "
        f"{'n/a' if exponent is None else f'{exponent:.2f}'} (target <= 1, linear): {mark[ok_exp]}",
        f"- resume metadata handling, fsdpkit / dcp.load at {at}: {load_ratio:.2f}x (target <= {LOAD_RATIO}x): "
        f"{mark[ok_load]}",
    ]
    return lines, {"save_ratio": save_ratio, "save_exponent": exponent, "load_ratio": load_ratio,
                   "save_met": ok_save, "exponent_met": ok_exp, "load_met": ok_load}


def fits(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> list[str]:
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    out = ["Fits (log-log slope of time against ranks; 1 = linear, 2 = quadratic):", ""]
    for label, runs, key in (("real ranks", real, "coord_s"), ("simulated ranks", sim, "wall_s")):
        for method in ("fsdpkit", "dcp"):
            s = slope([(r["world"], r[method]["save"][key]) for r in runs])
            lo = slope([(r["world"], r[method]["resume"][key]) for r in runs])
            out.append(f"- {label}, {method}: save {fmt(s)}, resume {fmt(lo)}")
    return out + [""]


def render(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    real, sim = data.get("real", []), data.get("sim", [])
    target_lines, verdict = targets(sim)
    md = ["### B9: the coordinator's cost, 2-16 real ranks and simulated ranks", "",
          f"State: {data['state']}. Machine: {data['machine_note']}", "",
          "Real gloo ranks on this host, rank 0's time outside write_data/read_data (wall; medians of "
          f"{data['repeats']} after the first save; fsdpkit's resume excludes its post-load checksum pass):", ""]
    md += real_table(real) + [""] if real else ["(no real-rank run)", ""]
    md += ["Simulated ranks, rank 0's coordinator work in one process (no data written or read):", ""]
    md += sim_table(sim) + [""] if sim else ["(no simulated run)", ""]
    md += phases(sim) + fits(real, sim) + ["Targets of issue 36, item 2:", ""] + target_lines + ["", MAPPING, ""]
    if data.get("failures"):
        md += ["Did not run: " + "; ".join(data["failures"]), ""]
    return "\n".join(md), verdict
