"""The sections of bench/checkpoint.py's report, one function per phase: its table rows, notes,
and verdicts against the targets (appended to the lists it is given). bench/checkpoint_report.py
puts them on the page.
"""

from __future__ import annotations

from typing import Any

from checkpoint_common import (
    B6_MODES,
    DCP_LOAD,
    DCP_SYNC,
    FSDPKIT,
    OUR_ASYNC,
    OUR_ASYNC_BG,
    OUR_LOAD,
    OUR_LOAD_VERIFY,
    OUR_SYNC,
    PASS_FIRST,
    PLAIN,
    RAW_READ,
    RAW_WRITE,
    RAW_WRITE_DIRECT,
    RAW_WRITE_WB,
    RESUME_METHODS,
    TORCH_SYNC,
    balanced_order,
)

MiB = 2**20


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def min_max(xs: list[float], fmt: str = ".2f") -> str:
    """min-max (n) of a list of runs."""
    return f"{format(min(xs), fmt)}–{format(max(xs), fmt)} ({len(xs)})" if xs else "n/a"


def write_ceiling(c: dict[str, Any], streams: int) -> float:
    """The write+fsync GB/s of `streams` files written at once (the nearest measured count below)."""
    w = c["write_fsync"]
    return w[str(max(int(k) for k in w if int(k) <= streams))]["gbps"]


def read_ceiling(c: dict[str, Any], streams: int) -> float:
    r = {k: v for k, v in c["read_cold"].items() if k.isdigit()}
    return r[str(max(int(k) for k in r if int(k) <= streams))]["gbps"]


def _target(rows: list[dict[str, Any]], name: str, size: str, value: float | None, goal: str, ok: bool | None,
            shown: str) -> None:
    rows.append({"target": name, "size": size, "value": value, "goal": goal,
                 "met": None if value is None or ok is None else bool(ok), "shown": shown})


def b1_rows(size: str, main: dict[str, Any], c: dict[str, Any], targets: list, lines: list, notes: list) -> None:
    b1 = main["B1"]
    total = sum(main["state_bytes_per_rank"])
    n = len(main["state_bytes_per_rank"])
    disk, one = write_ceiling(c, n), write_ceiling(c, 1)
    med = b1["median_s"]
    for name, t in med.items():
        gbps = total / t / 1e9
        lines.append(f"| {size} | {name} | {t:.2f} | {min_max(b1['seconds'][name])} | {gbps:.2f} | "
                     f"{gbps / disk:.2f} ({gbps / one:.2f}) | {t / med[DCP_SYNC]:.2f} | {t / med[OUR_SYNC]:.2f} |")
    timings = [t for t in b1["fsdpkit_manifest_timings"] if "hash_cpu_s" in t]
    if timings:
        m = {k: _median([t[k] for t in timings]) for k in timings[0]}
        notes.append(f"{size} GiB: fsdpkit's own timings (rank 0's manifest, medians): DCP write + file-list gather "
                     f"{m['write_s']:.2f} s ({m['write_cpu_s']:.2f} s CPU); tensor checksums on a worker thread "
                     f"meanwhile {m['hash_s']:.2f} s ({m['hash_cpu_s']:.2f} s CPU), waited for after the write "
                     f"{m['hash_wait_s'] * 1e3:.0f} ms, summed over ranks {m['hash_reduce_s'] * 1e3:.0f} ms; "
                     f"whole save in the manifest {m['total_s']:.2f} s")
    gbps = total / med[OUR_SYNC] / 1e9
    others = (f"the ceilings measured before the benchmarks: {n} streams {disk:.2f}: {gbps / disk:.2f}, "
              f"1 stream {one:.2f}: {gbps / one:.2f}")
    raws = {name: total / t / 1e9 for name, t in med.items()
            if name == RAW_WRITE or name.startswith((RAW_WRITE_WB, RAW_WRITE_DIRECT))}
    if raws:  # the ceilings timed in the same rotation as the saves: same ranks, bytes and moment; the fastest counts
        best = max(raws, key=raws.__getitem__)
        raw = raws[best]
        label = lambda k: ("plain" if k == RAW_WRITE  # noqa: E731
                           else "O_DIRECT" if k.startswith(RAW_WRITE_DIRECT) else "write-back as it goes")
        each = ", ".join(f"{label(k)} {v:.2f}" for k, v in raws.items())
        _target(targets, f"B1 fsdpkit sync durable GB/s / raw write+fsync GB/s of the same bytes ({n} ranks at once, "
                "timed in the same rotation; the fastest way)", size, gbps / raw, ">= 0.8", gbps / raw >= 0.8,
                f"{gbps:.2f} / {raw:.2f} = {gbps / raw:.2f} (raw writes: {each}; {others})")
    else:
        _target(targets, f"B1 fsdpkit sync durable GB/s / disk write+fsync GB/s ({n} streams at once, as {n} ranks)",
                size, gbps / disk, ">= 0.8", gbps / disk >= 0.8, f"{gbps:.2f} / {disk:.2f} = {gbps / disk:.2f} "
                f"(1-stream ceiling {one:.2f}: {gbps / one:.2f})")
    r = med[OUR_SYNC] / med[DCP_SYNC]
    _target(targets, "B1 fsdpkit sync time / dcp.save time", size, r, "<= 1.05", r <= 1.05,
            f"{med[OUR_SYNC]:.2f} s / {med[DCP_SYNC]:.2f} s = {r:.2f}")
    r = med[TORCH_SYNC] / med[OUR_SYNC]
    _target(targets, "B1 torch.save recipe time / fsdpkit sync time", size, r, "> 1 (fsdpkit faster)", r > 1,
            f"{med[TORCH_SYNC]:.2f} s / {med[OUR_SYNC]:.2f} s = {r:.2f}")


def memcpy_ceiling_gbps(c: dict[str, Any], *, together: bool = False) -> float:
    """The memcpy ceiling measured before the benchmarks: the faster of torch's copy_ and the
    non-temporal copy (results from before it was measured have copy_ only); per copy, two at once
    with `together`."""
    key = "memcpy{}_2threads_each_gbps" if together else "memcpy{}_gbps"
    found = [g for way in ("", "_stream") if (g := c.get(key.format(way)))]
    if found:
        return max(found)
    if together:  # results from before two copies at once were measured
        return memcpy_ceiling_gbps(c)
    raise KeyError(f"no memcpy ceiling in the results ({key.format('')} missing): rerun the benchmark")


def streamed_memcpy(b2: dict[str, Any]) -> str:
    if "state_memcpy_stream_s" not in b2:
        return ""
    return (f", {b2['state_memcpy_stream_median_s'] * 1e3:.0f} ms "
            f"({min_max([x * 1e3 for x in b2['state_memcpy_stream_s']], '.0f')}) with non-temporal stores")


def b2_rows(size: str, main: dict[str, Any], c: dict[str, Any], targets: list, lines: list) -> None:
    """The yardstick of a stall is the memcpy time of the per-rank state at the parallelism of the
    save: every rank copying its own state at once, timed in the same rotation as the saves (this
    VM's memory bandwidth drifts by half between minutes). The memcpy ceilings measured before
    the benchmarks are quoted beside it."""
    b2 = main["B2"]
    per_rank = max(main["state_bytes_per_rank"])
    ranks = len(main["state_bytes_per_rank"])
    before_s = per_rank / (memcpy_ceiling_gbps(c, together=ranks == 2) * 1e9)
    in_rotation = [x for k in ("state_memcpy_median_s", "state_memcpy_stream_median_s") if (x := b2.get(k))]
    copy_s = min(in_rotation, default=before_s)  # results written before the yardstick ran in the rotation
    how = (f"{ranks} rank(s) copying their state at once in the same rotation, the faster of copy_ and "
           f"non-temporal stores; before the benchmarks: {before_s * 1e3:.0f} ms" if in_rotation
           else f"{before_s * 1e3:.0f} ms from the memcpy ceiling measured before the benchmarks")
    sync_s = b2["sync_save_s"]
    for name, s in b2["summary"].items():
        stall = s["stall_median_s"]
        first = s["first_stall_s"]
        lines.append(f"| {size} | {name} | {_f(first and first * 1e3, '.0f')} | {stall * 1e3:.0f} | "
                     f"{stall / copy_s:.2f} | {sync_s / stall:.1f} | {_f(s['durable_median_s'])} | "
                     f"{_f(s['first_durable_s'])} | {_f(s['step_slowdown'])} ({s['in_flight_steps']} steps) |")
    for kind in (OUR_ASYNC, OUR_ASYNC_BG):
        if kind not in b2["summary"]:
            continue
        s = b2["summary"][kind]
        background = " (background staging: call + next optimizer step's wait)"
        which = "fsdpkit async" + (background if kind != OUR_ASYNC else "")
        x = s["stall_median_s"] / copy_s
        _target(targets, f"B2 {which} stall / memcpy time of per-rank state", size, x, "<= 1.3", x <= 1.3,
                f"{s['stall_median_s'] * 1e3:.0f} ms / {copy_s * 1e3:.0f} ms ({how}) = {x:.2f} "
                f"(first save {s['first_stall_s'] * 1e3:.0f} ms)")
        x = sync_s / s["stall_median_s"]
        bound = "" if kind != OUR_ASYNC else (f" (a stall that copies the state takes about its memcpy time: "
                                                   f"sync / memcpy is {sync_s / copy_s:.1f} here)")
        _target(targets, f"B2 fsdpkit sync save time / {which} stall", size, x, ">= 20", x >= 20,
                f"{sync_s:.2f} s / {s['stall_median_s'] * 1e3:.0f} ms = {x:.1f}{bound}")


def b3_rows(size: str, main: dict[str, Any], targets: list, lines: list) -> None:
    per_rank = max(main["state_bytes_per_rank"])
    worst: dict[str, float] = {}
    for name, runs in main["B3"]["methods"].items():
        peak = max(r["peak_mib"] for r in runs)
        inc = max(r["increase_mib"] for r in runs)
        foot = max(r["footprint_mib"] for r in runs)
        kept = max(r["retained_after_mib"] for r in runs)
        lines.append(f"| {size} | {name} | {peak:.0f} | {inc:.0f} | {foot:.0f} | {foot * MiB / per_rank:.2f} | "
                     f"{kept:.0f} |")
        worst[name] = foot
    s_mib = per_rank / MiB
    foot = worst[OUR_SYNC]
    limit = 1.1 * s_mib + 256
    _target(targets, "B3 fsdpkit sync: peak RSS - RSS before the model (MiB)", size, foot,
            f"<= 1.1 S + 256 = {limit:.0f}", foot <= limit, f"{foot:.0f} MiB = {foot / s_mib:.2f} S")
    foot = max(v for k, v in worst.items() if k.startswith(OUR_ASYNC))
    # what training holds with no saver at all: RSS before a dcp.save, per rank (the model, optimizer
    # state and FSDP2's own buffers), the baseline of what a save adds
    held = [r["before"] for r in main["B3"]["methods"][DCP_SYNC][0]["per_rank"]]
    held_s = max(h - r["base"] for h, r in zip(held, main["B3"]["methods"][DCP_SYNC][0]["per_rank"], strict=True)) / MiB
    _target(targets, "B3 fsdpkit async (worst of first/reused): peak RSS - RSS before the model (MiB)", size, foot,
            f"<= 2.1 S = {2.1 * s_mib:.0f}", foot <= 2.1 * s_mib,
            f"{foot:.0f} MiB = {foot / s_mib:.2f} S (training alone holds {held_s:.0f} MiB = {held_s / s_mib:.2f} S)")
    added = max(r["peak"] - h for name, runs in main["B3"]["methods"].items() if name.startswith(OUR_ASYNC)
                for run in runs for r, h in zip(run["per_rank"], held, strict=True)) / MiB
    _target(targets, "B3 fsdpkit async (worst of first/reused): what saving adds, peak RSS - RSS of training "
            "alone (MiB)", size, added, f"<= 1.1 S = {1.1 * s_mib:.0f}", added <= 1.1 * s_mib,
            f"{added:.0f} MiB = {added / s_mib:.2f} S (its staging buffer is 1 S)")


def load_rows(size: str, per: dict[str, Any], targets: list, lines: list) -> None:
    same = per.get("main", {}).get("B4")
    rows = [("2", same)] + [(str(n), per.get(f"load_{n}", {}).get("B5")) for n in (1, 3)]
    for ranks, b in rows:
        if b is None:
            continue
        m = b["median_s"]
        rel = f"{m[OUR_LOAD] / same['median_s'][OUR_LOAD]:.2f}" if same else "n/a"
        rel_v = (f"{m[OUR_LOAD_VERIFY] / same['median_s'][OUR_LOAD_VERIFY]:.2f}" if same else "n/a")
        raw = f"{m[RAW_READ]:.2f} ({m[OUR_LOAD] / m[RAW_READ]:.2f}×)" if RAW_READ in m else "-"
        lines.append(f"| {size} | {ranks} | {m[OUR_LOAD]:.2f} | {m[OUR_LOAD_VERIFY]:.2f} "
                     f"(verify {_f(b['verify_part_median_s'])}) | {m[DCP_LOAD]:.2f} | {raw} | {rel} | {rel_v} |")
        if same and ranks != "2":
            x = m[OUR_LOAD] / same["median_s"][OUR_LOAD]
            plain = m[DCP_LOAD] / same["median_s"][DCP_LOAD]
            _target(targets, f"B5 load on {ranks} rank(s) / load on 2 ranks (fsdpkit, no verify)", size, x,
                    "<= 1.2", x <= 1.2, f"{m[OUR_LOAD]:.2f} s / {same['median_s'][OUR_LOAD]:.2f} s = {x:.2f} "
                    f"(dcp.load the same: {plain:.2f})")
            if RAW_READ in m and RAW_READ in same["median_s"]:  # each load against the disk at its own moment
                here, there = m[OUR_LOAD] / m[RAW_READ], same["median_s"][OUR_LOAD] / same["median_s"][RAW_READ]
                _target(targets, f"B5 load on {ranks} rank(s) / load on 2 ranks, each over the raw read of the same "
                        "bytes in its own rotation", size, here / there, "<= 1.2", here / there <= 1.2,
                        f"{here:.2f}× / {there:.2f}× = {here / there:.2f} (raw reads {m[RAW_READ]:.2f} s on {ranks} "
                        f"rank(s), {same['median_s'][RAW_READ]:.2f} s on 2)")


def b6_rows(g: dict[str, Any], label: str, targets: list, lines: list) -> None:
    b6 = g["B6"]
    size = f"{g['size_gib']:g}"
    for mode in B6_MODES:
        if mode not in b6:  # results from before background staging existed
            continue
        r = b6[mode]
        over = "-" if mode == "no checkpoint" else f"{r['overhead_pct']:+.1f}%"
        extra = "-" if mode == "no checkpoint" else f"{r['extra_cpu_s']:+.2f} s = {r['extra_cpu_over_loop_pct']:+.1f}%"
        ph = r.get("fsdpkit_phase_median_s", {})
        hashed = (f"hash {ph['hash_s']:.2f} s / {ph['hash_cpu_s']:.2f} CPU" if "hash_s" in ph else
                  f"staging copy + hash in one pass {ph['staging_and_hash_s']:.2f} s / "
                  f"{ph['staging_and_hash_cpu_s']:.2f} CPU" if "staging_and_hash_s" in ph else "hash n/a")
        bg = (f"write {ph['write_s']:.2f} s / {ph['write_cpu_s']:.2f} CPU; {hashed}"
              + (f"; prepare + agree {ph['prepare_s'] * 1e3:.0f} ms"
                                               if "prepare_s" in ph else "")
              + (f"; background thread CPU {ph['background_cpu_s']:.2f} s" if "background_cpu_s" in ph else "")
              if "write_cpu_s" in ph else "-")
        late = r.get("heartbeat_late_median_s")
        gil = "-" if late is None else f"{late:.2f}"
        if late is not None and mode != "no checkpoint":
            gil += f" ({late - b6['no checkpoint']['heartbeat_late_median_s']:+.2f})"
        lines.append(f"| {label} | {mode} | {r['loop_median_s']:.2f} | {min_max(r['loop_s'])} | {over} | "
                     f"{r['saves_per_run']} | {r['stall_median_s'] * 1e3:.0f} | {r['drain_median_s']:.2f} | "
                     f"{extra} | {gil} | {bg} |")
    dcp = b6["dcp.async_save"]["overhead_pct"]
    for mode in (OUR_ASYNC, OUR_ASYNC_BG):
        if mode not in b6:
            continue
        over, name = b6[mode]["overhead_pct"], mode.removeprefix("fsdpkit AsyncSaver").removeprefix(", ")
        which = f"fsdpkit async{f' ({name})' if name else ''}"
        if b6["world_size"] == 1:
            _target(targets, f"B6 {which} overhead with a core free for the background (1 rank on 2 cores) (%)",
                    size, over, "<= 2", over <= 2, f"{over:+.1f}% (stall {b6[mode]['stall_median_s'] * 1e3:.0f} ms "
                    "per save, median)")
        else:
            allowed = b6[mode]["extra_cpu_over_loop_pct"]
            _target(targets, f"B6 {which} overhead, no core free ({b6['world_size']} ranks) (%)", size, over,
                    f"<= its extra CPU / loop = {allowed:.1f}%", over <= allowed,
                    f"{over:+.1f}% (extra CPU {b6[mode]['extra_cpu_s']:.2f} s per rank)")
        _target(targets, f"B6 {which} overhead < dcp.async_save's ({b6['world_size']} rank(s))", size, over,
                f"< {dcp:+.1f}%", over < dcp, f"{over:+.1f}% vs {dcp:+.1f}%")
    if b6["world_size"] > 1:
        sync = b6["fsdpkit sync"]
        blocked = sync["stall_median_s"] * sync["saves_per_run"] / b6["no checkpoint"]["loop_median_s"] * 100
        _target(targets, "B6 goodput overhead, fsdpkit sync (%)", size, sync["overhead_pct"], "<= 3",
                sync["overhead_pct"] <= 3, f"{sync['overhead_pct']:+.1f}% (the saves themselves block the loop "
                f"{blocked:.1f}% of its time)")


SHORT = {FSDPKIT: "fsdpkit", PASS_FIRST: "fsdpkit, pass first", PLAIN: "dcp.load"}


def b7_rows(size: str, runs: list[dict[str, Any]], targets: list, lines: list) -> None:
    """Whole resume: launches (process start -> first step) and the checkpoint part in-process."""
    res = [r["resume"] for r in runs]
    methods = [m for m in RESUME_METHODS if any(m in r["seconds"] for r in res)]
    for m in methods:
        part = [x for r in res for x in r["seconds"].get(m, [])]
        firsts = [r for r in res if r["first_method"] == m]
        whole = [r["start_to_first_step_s"] for r in firsts]
        part_first = [r["checkpoint_s"] for r in firsts]
        built = [r["start_to_built_s"] for r in firsts]
        step = [r["first_step_s"] for r in firsts]
        if not part:
            continue
        read = _read_ratio(res, m)
        if not whole:
            lines.append(f"| {size} | {m} | - | - | - | - | - | {_median(part):.2f} | {min_max(part)} | "
                         f"{_median(part) / _median(_pooled(res, PLAIN)):.2f} | {read} |")
            continue
        lines.append(f"| {size} | {m} | {_median(whole):.2f} | {min_max(whole)} | {_median(built):.2f} | "
                     f"{_median(part_first):.2f} | {_median(step):.2f} | {_median(part):.2f} | {min_max(part)} | "
                     f"{_median(part) / _median(_pooled(res, PLAIN)):.2f} | {read} |")
    part_p = _median(_pooled(res, PLAIN))
    for m, goal in ((FSDPKIT, 1.1), (PASS_FIRST, None)):
        if m not in methods:
            continue
        part_f = _median(_pooled(res, m))
        x = part_f / part_p
        what = ("each file read once + tensor checks" if m == FSDPKIT
                else "a checksum pass over every file first, as before issue 56")
        _target(targets, f"B7 whole resume, checkpoint part: {SHORT[m]} (resolve + {what}) / dcp.load + "
                "set_state_dict", size, x, "n/a (the old path, for comparison)" if goal is None else f"<= {goal}",
                None if goal is None else x <= goal, f"{part_f:.2f} s / {part_p:.2f} s = {x:.2f}")
    after = _by_predecessor(res, tuple(methods), balanced_order)
    if after:
        lines.append(f"in-process checkpoint part at {size} GiB by the load just before it in the process (medians, "
                     "n): " + "; ".join(
            f"{SHORT[m]} after " + ", ".join(f"{SHORT[p]} {_median(after[m, p]):.2f} s ({len(after[m, p])})"
                                             for p in methods if (m, p) in after)
            for m in methods))
    for m in (FSDPKIT, PASS_FIRST):
        parts = [r["fsdpkit_parts_median_s"][m] for r in res if m in r.get("fsdpkit_parts_median_s", {})]
        if parts:
            lines.append(f"{SHORT[m]}'s parts at {size} GiB (medians over launches): " + ", ".join(
                f"{k} {_median([p[k] for p in parts]):.2f} s" for k in parts[0]))


def _pooled(res: list[dict[str, Any]], m: str) -> list[float]:
    return [x for r in res for x in r["seconds"].get(m, [])]


def _read_ratio(res: list[dict[str, Any]], m: str) -> str:
    """Bytes read per resume over the checkpoint's size (median, min–max), every rank's reads."""
    ratios = [n / r["checkpoint_bytes"] for r in res if r.get("checkpoint_bytes") for n in r["bytes_read"].get(m, [])]
    return f"{_median(ratios):.3f} ({min_max(ratios, '.3f')})" if ratios else "n/a"


def _by_predecessor(res: list[dict[str, Any]], methods: tuple[str, ...], order) -> dict[tuple[str, str], list[float]]:
    """In-process loads keyed by (method, the method of the load just before it): each launch ran
    `order(methods, n, start=...)` after its first load (the order is fixed, so it is rebuilt here).
    Empty if a launch's counts do not fit that order."""
    after: dict[tuple[str, str], list[float]] = {}
    for r in res:
        n = len(r["seconds"].get(methods[0], []))
        sequence = order(methods, n, start=methods.index(r["first_method"]))
        if any(sequence.count(m) != len(r["seconds"].get(m, [])) for m in methods):
            return {}
        seen = dict.fromkeys(methods, 0)
        before = r["first_method"]
        for m in sequence:
            after.setdefault((m, before), []).append(r["seconds"][m][seen[m]])
            seen[m] += 1
            before = m
    return after


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, r^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True)) / ss if ss else 1.0
    return a, b, r2


BASELINE_NAMES = {"save": "dcp.save", "resume": "dcp.load + set_state_dict"}


def b8_rows(sc: dict[str, Any], c: dict[str, Any], targets: list, lines: list) -> None:
    pts: dict[str, list[tuple[float, float]]] = {"save": [], "resume": []}
    base: dict[str, list[tuple[float, float]]] = {"save": [], "resume": []}  # dcp.save, dcp.load of the same rows
    runs: dict[str, list[tuple[float, list[float]]]] = {m: [] for m in RESUME_METHODS}  # per method: (GiB, each run)
    for key, row in sc["rows"].items():
        if "skipped" in row:
            lines.append(f"| {key} | skipped: {row['skipped']} ||||||||||")
            continue
        save, resume = row["save"], row["resume"]
        if save is None or resume is None:
            lines.append(f"| {key} | failed: {'; '.join(row['errors'])} ||||||||||")
            continue
        total = sum(save["state_bytes_per_rank"])
        sv = save["scale"]
        rs = resume["resume"]
        fs, ds = sv["median_s"]["fsdpkit save_checkpoint"], sv["median_s"]["dcp.save"]
        fr, pr = rs["median_s"][FSDPKIT], rs["median_s"][PLAIN]
        fp = rs["median_s"].get(PASS_FIRST)
        n = row["ranks"]
        lines.append(f"| {key} | {total / 2**30:.2f} | {fs:.2f} ({fs / ds:.2f}× dcp.save) | {total / fs / 1e9:.2f} "
                     f"({total / fs / 1e9 / write_ceiling(c, n):.2f}× disk) | "
                     f"{sv['peak_rss_bytes']['fsdpkit save_checkpoint'] / MiB:.0f} | {fr:.2f} ({fr / pr:.2f}× "
                     f"dcp.load) | {_f(fp)} ({_f(fp and fp / pr)}× dcp.load) | {pr:.2f} | "
                     f"{total / fr / 1e9:.2f} ({total / fr / 1e9 / read_ceiling(c, n):.2f}× cold read) | "
                     f"{rs['peak_rss_bytes'][FSDPKIT] / MiB:.0f} | {rs['start_to_first_step_s']:.2f} |")
        if n == 2:
            pts["save"].append((total / 2**30, fs))
            pts["resume"].append((total / 2**30, fr))
            base["save"].append((total / 2**30, ds))
            base["resume"].append((total / 2**30, pr))
            for m in RESUME_METHODS:
                if rs["seconds"].get(m):
                    runs[m].append((total / 2**30, rs["seconds"][m]))
    for what, xy in pts.items():
        if len(xy) < 3:
            continue
        a, b, r2 = _fit([x for x, _ in xy], [y for _, y in xy])
        ba, bb, br2 = _fit([x for x, _ in base[what]], [y for _, y in base[what]])
        lines.append(f"{what} on 2 ranks: time = {a:+.3f} s + {b:.3f} s/GiB × size (r² {r2:.3f}); "
                     "the baseline of the "
                     f"same rows ({BASELINE_NAMES[what]}): {ba:+.3f} s + {bb:.3f} s/GiB (r² {br2:.3f}): a bend both "
                     "show is the disk's")
        span = f"{min(x for x, _ in xy):.2g}–{max(x for x, _ in xy):.2g}"
        _target(targets, f"B8 {what} time on 2 ranks vs size: constant of the linear fit (s)", span, a,
                "< 0.1 s, linear (r² >= 0.98)", a < 0.1 and r2 >= 0.98, f"{a:+.3f} s + {b:.3f} s/GiB, r² {r2:.3f}")
    _b8_slopes(runs, lines, targets)


def _b8_slopes(runs: dict[str, list[tuple[float, list[float]]]], lines: list, targets: list) -> None:
    """Per-GiB slopes of the resume on 2 ranks, of every method, each over dcp.load's: from the
    medians of the rows, and from each run index alone (run i of every row, every method: loads
    made in the same stretch of the rotation), whose spread is the ratio's."""
    if len(runs[PLAIN]) < 3:
        return
    n = min(len(ys) for m in runs for _, ys in runs[m])
    slope = {m: _fit([x for x, _ in runs[m]], [_median(ys) for _, ys in runs[m]])[1] for m in runs if runs[m]}
    per_run = {m: [_fit([x for x, _ in runs[m]], [ys[i] for _, ys in runs[m]])[1] for i in range(n)]
               for m in runs if runs[m]}
    for m in (FSDPKIT, PASS_FIRST):
        if m not in slope:
            continue
        ratios = [f / p for f, p in zip(per_run[m], per_run[PLAIN], strict=True)]
        lines.append(f"resume on 2 ranks, {SHORT[m]}: {slope[m]:.3f} s/GiB against dcp.load's {slope[PLAIN]:.3f} "
                     f"s/GiB = {slope[m] / slope[PLAIN]:.3f}× (fits of the rows' medians); run by run: "
                     f"{_median(ratios):.3f}× ({min_max(ratios, '.3f')})")
        goal = 1.05 if m == FSDPKIT else None
        x = slope[m] / slope[PLAIN]
        _target(targets, f"B8 resume per-GiB slope on 2 ranks: {SHORT[m]} / dcp.load + set_state_dict",
                f"{min(x for x, _ in runs[m]):.2g}–{max(x for x, _ in runs[m]):.2g}", x,
                "n/a (the old path, for comparison)" if goal is None else f"<= {goal}",
                None if goal is None else x <= goal,
                f"{slope[m]:.3f} / {slope[PLAIN]:.3f} s/GiB = {x:.3f} (run by run {min_max(ratios, '.3f')})")
