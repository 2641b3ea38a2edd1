"""The markdown report of bench/checkpoint.py and its verdicts against the targets."""

from __future__ import annotations

from typing import Any

MiB = 2**20
OUR_SYNC = "fsdpkit save_checkpoint"
DCP_SYNC = "dcp.save"
TORCH_SYNC = "torch.save (rank 0, full)"
RAW_WRITE = "raw write + fsync of each rank's bytes (ceiling)"  # B1's in-run disk ceilings: this one,
RAW_WRITE_WB = "raw write + fsync, write-back started every"  # and (prefixes) this one and the O_DIRECT one;
RAW_WRITE_DIRECT = "raw write + fsync, O_DIRECT"  # the fastest counts
RAW_READ = "raw read of each rank's share of the bytes (ceiling)"  # B4/B5's, likewise
OUR_ASYNC = "fsdpkit AsyncSaver"
OUR_ASYNC_BG = "fsdpkit AsyncSaver, background staging"
OUR_LOAD = "fsdpkit load_checkpoint"
OUR_LOAD_VERIFY = "fsdpkit load_checkpoint, verify=True"
DCP_LOAD = "dcp.load + set_state_dict"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _range(xs: list[float], fmt: str = ".2f") -> str:
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
                 "met": None if value is None else bool(ok), "shown": shown})


def _b1(size: str, main: dict[str, Any], c: dict[str, Any], targets: list, lines: list, notes: list) -> None:
    b1 = main["B1"]
    total = sum(main["state_bytes_per_rank"])
    n = len(main["state_bytes_per_rank"])
    disk, one = write_ceiling(c, n), write_ceiling(c, 1)
    med = b1["median_s"]
    for name, t in med.items():
        gbps = total / t / 1e9
        lines.append(f"| {size} | {name} | {t:.2f} | {_range(b1['seconds'][name])} | {gbps:.2f} | "
                     f"{gbps / disk:.2f} ({gbps / one:.2f}) | {t / med[DCP_SYNC]:.2f} | {t / med[OUR_SYNC]:.2f} |")
    timings = [t for t in b1["fsdpkit_manifest_timings"] if "hash_cpu_s" in t]
    if timings:
        m = {k: _median([t[k] for t in timings]) for k in timings[0]}
        notes.append(f"{size} GiB: fsdpkit's own timings (rank 0's manifest, medians): DCP write + file-list gather "
                     f"{m['write_s']:.2f} s ({m['write_cpu_s']:.2f} s CPU); tensor checksums on a worker thread meanwhile "
                     f"{m['hash_s']:.2f} s ({m['hash_cpu_s']:.2f} s CPU), waited for after the write "
                     f"{m['hash_wait_s'] * 1e3:.0f} ms, summed over ranks {m['hash_reduce_s'] * 1e3:.0f} ms; "
                     f"whole save in the manifest {m['total_s']:.2f} s")
    gbps = total / med[OUR_SYNC] / 1e9
    others = f"the ceilings measured before the benchmarks: {n} streams {disk:.2f}: {gbps / disk:.2f}, 1 stream {one:.2f}: {gbps / one:.2f}"
    raws = {name: total / t / 1e9 for name, t in med.items()
            if name == RAW_WRITE or name.startswith((RAW_WRITE_WB, RAW_WRITE_DIRECT))}
    if raws:  # the ceilings timed in the same rotation as the saves: same ranks, bytes and moment; the fastest counts
        best = max(raws, key=raws.__getitem__)
        raw = raws[best]
        label = lambda k: "plain" if k == RAW_WRITE else "O_DIRECT" if k.startswith(RAW_WRITE_DIRECT) else "write-back as it goes"  # noqa: E731
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


def _memcpy_gbps(c: dict[str, Any], *, together: bool = False) -> float:
    """The memcpy ceiling measured before the benchmarks: the faster of torch's copy_ and the
    non-temporal copy (results from before it was measured have copy_ only); per copy, two at once
    with `together`."""
    key = "memcpy{}_2threads_each_gbps" if together else "memcpy{}_gbps"
    found = [g for way in ("", "_stream") if (g := c.get(key.format(way)))]
    if found:
        return max(found)
    if together:  # results from before two copies at once were measured
        return _memcpy_gbps(c)
    raise KeyError(f"no memcpy ceiling in the results ({key.format('')} missing): rerun the benchmark")


def _streamed(b2: dict[str, Any]) -> str:
    if "state_memcpy_stream_s" not in b2:
        return ""
    return (f", {b2['state_memcpy_stream_median_s'] * 1e3:.0f} ms "
            f"({_range([x * 1e3 for x in b2['state_memcpy_stream_s']], '.0f')}) with non-temporal stores")


def _b2(size: str, main: dict[str, Any], c: dict[str, Any], targets: list, lines: list) -> None:
    """The yardstick of a stall is the memcpy time of the per-rank state at the parallelism of the
    save: every rank copying its own state at once, timed in the same rotation as the saves (this
    VM's memory bandwidth drifts by half between minutes). The memcpy ceilings measured before
    the benchmarks are quoted beside it."""
    b2 = main["B2"]
    per_rank = max(main["state_bytes_per_rank"])
    ranks = len(main["state_bytes_per_rank"])
    before_s = per_rank / (_memcpy_gbps(c, together=ranks == 2) * 1e9)
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
        which = "fsdpkit async" + (" (background staging: call + next optimizer step's wait)" if kind != OUR_ASYNC else "")
        x = s["stall_median_s"] / copy_s
        _target(targets, f"B2 {which} stall / memcpy time of per-rank state", size, x, "<= 1.3", x <= 1.3,
                f"{s['stall_median_s'] * 1e3:.0f} ms / {copy_s * 1e3:.0f} ms ({how}) = {x:.2f} "
                f"(first save {s['first_stall_s'] * 1e3:.0f} ms)")
        x = sync_s / s["stall_median_s"]
        bound = "" if kind != OUR_ASYNC else (f" (a stall that copies the state takes about its memcpy time: "
                                                   f"sync / memcpy is {sync_s / copy_s:.1f} here)")
        _target(targets, f"B2 fsdpkit sync save time / {which} stall", size, x, ">= 20", x >= 20,
                f"{sync_s:.2f} s / {s['stall_median_s'] * 1e3:.0f} ms = {x:.1f}{bound}")


def _b3(size: str, main: dict[str, Any], targets: list, lines: list) -> None:
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


def _loads(size: str, per: dict[str, Any], targets: list, lines: list) -> None:
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
                        f"{here:.2f}× / {there:.2f}× = {here / there:.2f} (raw reads {m[RAW_READ]:.2f} s on {ranks} rank(s), "
                        f"{same['median_s'][RAW_READ]:.2f} s on 2)")


def _b6(g: dict[str, Any], label: str, targets: list, lines: list) -> None:
    b6 = g["B6"]
    size = f"{g['size_gib']:g}"
    for mode in ("no checkpoint", "fsdpkit sync", OUR_ASYNC, OUR_ASYNC_BG, "dcp.async_save"):
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
        gil = "-" if late is None else (f"{late:.2f}" + ("" if mode == "no checkpoint" else
                                                         f" ({late - b6['no checkpoint']['heartbeat_late_median_s']:+.2f})"))
        lines.append(f"| {label} | {mode} | {r['loop_median_s']:.2f} | {_range(r['loop_s'])} | {over} | "
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


def _b7(size: str, runs: list[dict[str, Any]], targets: list, lines: list) -> None:
    """Whole resume: launches (process start -> first step) and the checkpoint part in-process."""
    from checkpoint_resume import FSDPKIT, PLAIN, RESUME_METHODS, TWO_READS, balanced_order  # noqa: I001 - a sibling module of this script

    res = [r["resume"] for r in runs]
    for m in (FSDPKIT, TWO_READS, PLAIN):
        part = [x for r in res for x in r["seconds"].get(m, [])]
        firsts = [r for r in res if r["first_method"] == m]
        whole = [r["start_to_first_step_s"] for r in firsts]
        part_first = [r["checkpoint_s"] for r in firsts]
        built = [r["start_to_built_s"] for r in firsts]
        step = [r["first_step_s"] for r in firsts]
        if not part:
            continue
        if not whole:
            lines.append(f"| {size} | {m} | - | - | - | - | - | {_median(part):.2f} | {_range(part)} |")
            continue
        lines.append(f"| {size} | {m} | {_median(whole):.2f} | {_range(whole)} | {_median(built):.2f} | "
                     f"{_median(part_first):.2f} | {_median(step):.2f} | {_median(part):.2f} | {_range(part)} |")
    part_f = _median([x for r in res for x in r["seconds"][FSDPKIT]])
    part_p = _median([x for r in res for x in r["seconds"][PLAIN]])
    x = part_f / part_p
    _target(targets, "B7 whole resume, checkpoint part: fsdpkit (resolve + load verifying files as read + "
            "tensor checks) / dcp.load + set_state_dict", size, x, "<= 1.2", x <= 1.2,
            f"{part_f:.2f} s / {part_p:.2f} s = {x:.2f} (files verified before loading, two reads: "
            f"{_median([x for r in res for x in r['seconds'].get(TWO_READS, [])] or [float('nan')]) / part_p:.2f})")
    after = _by_predecessor(res, RESUME_METHODS, balanced_order)
    if after:
        short = {FSDPKIT: "fsdpkit", TWO_READS: "two reads", PLAIN: "dcp.load"}
        lines.append(f"in-process checkpoint part at {size} GiB by the load just before it in the process (medians, n): " + "; ".join(
            f"{short[m]} after " + ", ".join(f"{short[p]} {_median(after[m, p]):.2f} s ({len(after[m, p])})"
                                             for p in RESUME_METHODS if (m, p) in after)
            for m in RESUME_METHODS))
    parts = [r["fsdpkit_parts_median_s"] for r in res if r.get("fsdpkit_parts_median_s")]
    if parts:
        lines.append(f"fsdpkit's parts at {size} GiB (medians over launches): " + ", ".join(
            f"{k} {_median([p[k] for p in parts]):.2f} s" for k in parts[0]))


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


def _b8(sc: dict[str, Any], c: dict[str, Any], targets: list, lines: list) -> None:
    from checkpoint_resume import FSDPKIT, PLAIN  # noqa: I001 - a sibling module of this script

    pts: dict[str, list[tuple[float, float]]] = {"save": [], "resume": []}
    base: dict[str, list[tuple[float, float]]] = {"save": [], "resume": []}  # dcp.save, dcp.load of the same rows
    for key, row in sc["rows"].items():
        if "skipped" in row:
            lines.append(f"| {key} | skipped: {row['skipped']} |||||||||")
            continue
        save, resume = row["save"], row["resume"]
        if save is None or resume is None:
            lines.append(f"| {key} | failed: {'; '.join(row['errors'])} |||||||||")
            continue
        total = sum(save["state_bytes_per_rank"])
        sv = save["scale"]
        rs = resume["resume"]
        fs, ds = sv["median_s"]["fsdpkit save_checkpoint"], sv["median_s"]["dcp.save"]
        fr, pr = rs["median_s"][FSDPKIT], rs["median_s"][PLAIN]
        n = row["ranks"]
        lines.append(f"| {key} | {total / 2**30:.2f} | {fs:.2f} ({fs / ds:.2f}× dcp.save) | {total / fs / 1e9:.2f} "
                     f"({total / fs / 1e9 / write_ceiling(c, n):.2f}× disk) | "
                     f"{sv['peak_rss_bytes']['fsdpkit save_checkpoint'] / MiB:.0f} | {fr:.2f} ({fr / pr:.2f}× dcp.load) | "
                     f"{total / fr / 1e9:.2f} ({total / fr / 1e9 / read_ceiling(c, n):.2f}× cold read) | "
                     f"{rs['peak_rss_bytes'][FSDPKIT] / MiB:.0f} | {rs['start_to_first_step_s']:.2f} |")
        if n == 2:
            pts["save"].append((total / 2**30, fs))
            pts["resume"].append((total / 2**30, fr))
            base["save"].append((total / 2**30, ds))
            base["resume"].append((total / 2**30, pr))
    for what, xy in pts.items():
        if len(xy) < 3:
            continue
        a, b, r2 = _fit([x for x, _ in xy], [y for _, y in xy])
        ba, bb, br2 = _fit([x for x, _ in base[what]], [y for _, y in base[what]])
        lines.append(f"{what} on 2 ranks: time = {a:+.3f} s + {b:.3f} s/GiB × size (r² {r2:.3f}); the baseline of the same "
                     f"rows ({BASELINE_NAMES[what]}): {ba:+.3f} s + {bb:.3f} s/GiB (r² {br2:.3f}): a bend both show is the disk's")
        span = f"{min(x for x, _ in xy):.2g}–{max(x for x, _ in xy):.2g}"
        _target(targets, f"B8 {what} time on 2 ranks vs size: constant of the linear fit (s)", span, a,
                "< 0.1 s, linear (r² >= 0.98)", a < 0.1 and r2 >= 0.98, f"{a:+.3f} s + {b:.3f} s/GiB, r² {r2:.3f}")


def _code_line(res: dict[str, Any]) -> str:
    before, after = res["code_before"], res["code_after"]
    line = (f"fsdpkit checkpoint code: {before['head']}{' + uncommitted changes' if before['uncommitted'] else ''} "
            f"(digest {before['digest']})")
    if before != after:
        return line + f"; **CHANGED during the run** (now {after['head']}, digest {after['digest']}): phases mix versions"
    return line + "; unchanged during the run"


def _ways(w: dict[str, Any]) -> str:
    """How a write ceiling was taken: the fastest of plain writes, writes that start their
    write-back as they go and O_DIRECT writes (older results: fewer ways)."""
    ways = w.get("ways_gbps")
    if not ways or len(ways) < 2:
        return ""
    names = {"plain": "plain", "writeback": f"write-back started every {w['writeback_bytes'] >> 20} MiB",
             "O_DIRECT": "O_DIRECT"}
    return " (the fastest median of: " + ", ".join(f"{names.get(k, k)} {v:.2f}" for k, v in ways.items()) + ")"


def _pieces(c: dict[str, Any]) -> str:
    """How the write ceiling wrote (results before page_cache: 16 MiB calls)."""
    piece = c.get("write_piece_bytes")
    return f"16 MiB blocks in {piece >> 10} KiB os.write calls" if piece else "16 MiB os.write calls"


def _restarted(c: dict[str, Any]) -> str:
    return ", a new descriptor every 16 MiB" if c.get("read_restart_bytes") else ""


def _ceiling_rows(c: dict[str, Any]) -> list[str]:
    reps = c["reps"]
    rows = [f"| disk write + fsync, {n} stream(s) at once | **{w['gbps']:.2f} GB/s** | {_range(w['runs_gbps'])} | "
            f"{n} new file(s) of {w['bytes'] / int(n) / 2**30:.2g} GiB, one thread each, {_pieces(c)}, then fsync"
            f"{_ways(w)}; the ceiling of {n} rank(s) saving |"
            for n, w in sorted(c["write_fsync"].items(), key=lambda x: int(x[0]))]
    for k, r in c["read_cold"].items():
        if r is None:
            continue
        how = ("O_DIRECT, 16 MiB aligned reads" if k.startswith("o_direct") else "page cache (warm)" if k.startswith("warm")
               else f"posix_fadvise(DONTNEED), then 16 MiB reads{_restarted(c)} (a VM host may still cache)")
        kind = "O_DIRECT" if k.startswith("o_direct") else "warm" if k.startswith("warm") else "cold-ish"
        rows.append(f"| read, {r['streams']} stream(s) at once, {kind} | "
                    f"{r['gbps']:.2f} GB/s | {_range(r['runs_gbps'])} | {how} |")
    rows += [f"| memcpy | **{c['memcpy_gbps']:.2f} GB/s** | median of {reps} | torch copy_ into an existing tensor, "
             f"1 thread, {c['memcpy_bytes'] / MiB:.0f} MiB |",
             f"| memcpy into a fresh allocation | {c['memcpy_fresh_alloc_gbps']:.2f} GB/s | median of {reps} | "
             "torch.empty + copy_ (page faults) |",
             f"| memcpy, two at once (each) | {c['memcpy_2threads_each_gbps']:.2f} GB/s | median of {reps} | two threads "
             "copying concurrently, as two ranks staging at once |"]
    if "memcpy_stream_gbps" in c:
        rows += [f"| memcpy, non-temporal stores | **{c['memcpy_stream_gbps']:.2f} GB/s** | median of {reps} | "
                 "fsdpkit's streaming copy (its staging copies), the same tensors |",
                 f"| memcpy, non-temporal stores, two at once (each) | {c['memcpy_stream_2threads_each_gbps']:.2f} GB/s | "
                 f"median of {reps} | as above, two threads |"]
    return rows


def render(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    c, m = res["ceilings"], res["machine"]
    memcpy = _memcpy_gbps(c)
    cfg = res["config"]
    targets: list[dict[str, Any]] = []
    b1, b1_notes, b2, b3, loads, b6, b7 = [], [], [], [], [], [], []
    sizes_desc = []
    for size, per in res["sizes"].items():
        main = per.get("main", {})
        if main:
            sizes_desc.append(f"{size} GiB = {main['n_layers']} x Linear({main['width']}, {main['width']}), "
                              f"{max(main['state_bytes_per_rank']) / MiB:.0f} MiB/rank")
        if "B1" in main:
            _b1(size, main, c, targets, b1, b1_notes)
        if "B2" in main:
            _b2(size, main, c, targets, b2)
        if "B3" in main:
            _b3(size, main, targets, b3)
        _loads(size, per, targets, loads)
        if per.get("whole_resume"):
            _b7(size, per["whole_resume"], targets, b7)
    for key, label in (("goodput", "2 ranks (no core free)"), ("goodput_free_core", "1 rank (a core free)")):
        if key in res:
            _b6(res[key], label, targets, b6)
    b8: list[str] = []
    if "scaling" in res:
        _b8(res["scaling"], c, targets, b8)
    lb, la = m["loadavg_before"], m["loadavg_after"]
    out = [
        "## fsdpkit checkpoint benchmark",
        f"{m['cpu_count']} CPUs ({m.get('cpu_model', '?')}), {m.get('mem_total_bytes', 0) / 2**30:.0f} GiB RAM, "
        f"torch {m['torch']}, python {m['python']}; gloo ranks x 1 thread; checkpoints on "
        f"`{m.get('checkpoint_filesystem', m['checkpoint_parent'])}`; load average (1/5/15 min) "
        f"{lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f} before, {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} after; "
        f"started {res.get('started_utc', '?')}, took {res['elapsed_s'] / 60:.1f} min",
        "sizes: " + "; ".join(sizes_desc) + f"; timed figures are medians of {cfg['runs']} runs (min–max (n) beside "
        f"them), peak memory the worst of {cfg['b3_runs']} runs, ceilings medians of {c['reps']}",
        _code_line(res),
        *(["", "**A `--quick` smoke run (tiny sizes, 1-2 runs): it checks that every phase works; do not quote "
            "its figures.**"] if cfg.get("quick") else []),
        "",
        "### Ceilings (measured in this run)",
        "| ceiling | median | runs: min–max (n) | how |",
        "|---|---|---|---|",
        *_ceiling_rows(c),
        "",
        "### Targets",
        "| target | size GiB | measured | goal | met |",
        "|---|---|---|---|---|",
        *(f"| {t['target']} | {t['size']} | {t['shown']} | {t['goal']} | "
          f"{'n/a' if t['met'] is None else 'met' if t['met'] else '**NOT met**'} |" for t in targets),
    ]
    if b1:
        out += ["", "### B1 sync save (wall time until committed, 2 ranks; GB/s = all ranks' state bytes / time; the methods "
                "rotate, raw writes of the same bytes among them as the disk's ceiling at this moment: plain, starting the write-back as they go, and O_DIRECT, the ways fsdpkit's writer writes)",
                "| size GiB | method | median s | min–max (n) | durable GB/s | × disk, 2 streams (1 stream) | "
                "time / dcp.save | time / fsdpkit |",
                "|---|---|---|---|---|---|---|---|", *b1, *b1_notes]
    if b2:
        fs = [(s, p["main"]["B2"]) for s, p in res["sizes"].items() if "B2" in p.get("main", {})]
        out += ["", "### B2 async save (stall = time until the call returned, max over ranks; medians)",
                "| size GiB | method | first stall ms | stall ms | x memcpy time (every rank at once, same rotation) | fsdpkit sync / stall | "
                "durable s | first durable s | step slowdown in flight |",
                "|---|---|---|---|---|---|---|---|---|", *b2,
                *(f"{s} GiB: memcpy of the per-rank state, every rank at once, in the same rotation as the saves: "
                  f"{b['state_memcpy_median_s'] * 1e3:.0f} ms ({_range([x * 1e3 for x in b['state_memcpy_s']], '.0f')}) "
                  f"with copy_{_streamed(b)}; "
                  f"from the memcpy ceilings measured before the benchmarks (S / GB/s): "
                  f"{max(p['main']['state_bytes_per_rank']) / (memcpy * 1e9) * 1e3:.0f} ms single, "
                  f"{max(p['main']['state_bytes_per_rank']) / (_memcpy_gbps(c, together=True) * 1e9) * 1e3:.0f} ms "
                  "with two copies at once" for s, p in res["sizes"].items()
                  if "main" in p and "state_memcpy_s" in (b := p["main"].get("B2", {}))),
                *(f"{s} GiB: fixed-cost step {b['fixed_step_s'] * 1e3:.0f} ms, {b['steps_per_save']} steps run per "
                  f"save, fsdpkit's get_state_dict capture {b['fsdpkit_capture_median_s'] * 1e3:.1f} ms, "
                  f"fsdpkit sync save {b['sync_save_s']:.2f} s" for s, b in fs)]
    if b3:
        out += ["", f"### B3 peak RSS per rank (worst over ranks and {cfg['b3_runs']} runs; footprint = peak - RSS "
                "before the model was built; S = per-rank state)",
                "| size GiB | method | peak MiB | increase over pre-save MiB | footprint MiB | footprint / S | "
                "kept after MiB |",
                "|---|---|---|---|---|---|---|", *b3]
    if loads:
        out += ["", "### B4/B5 load_checkpoint alone (cold-ish: pages evicted before each load; saved on 2 ranks; "
                f"medians of {cfg['runs']})",
                "| size GiB | ranks | fsdpkit s | fsdpkit + verify s | dcp.load s | raw read of the same bytes s "
                "(fsdpkit / it) | fsdpkit / 2 ranks | verify / 2 ranks |",
                "|---|---|---|---|---|---|---|---|", *loads]
    if b7:
        out += ["", f"### B7 whole resume ({cfg['resume_launches']} fresh torchrun launches per method, alternating, "
                "pages evicted before each; 2 ranks)",
                "From the launch of torchrun to the end of the first training step after the resume (a real "
                "forward/backward/AdamW step). The checkpoint part: fsdpkit = resolve (newest committed) + "
                "load_checkpoint(verify=True, verify_files=True) (every file's checksum from the load's own read, "
                "then per-tensor checksums); plain = dcp.load + set_state_dict. 'in-process' = the "
                f"checkpoint part repeated {-(-cfg.get('resume_runs', 1) // 3) * 3} time(s) per method in each launch after "
                "the first step (cold pages; each method following each about equally often: in one process fsdpkit's "
                "load right after a dcp.load ran up to 2x slower than after its own), pooled.",
                "| size GiB | method | launch → first step s (median) | min–max (n) | launch → model built s | "
                "checkpoint part, first in the process s | first step s | checkpoint part in-process s | min–max (n) |",
                "|---|---|---|---|---|---|---|---|---|", *b7]
    if b8:
        out += ["", f"### B8 scaling (medians of {res['scaling']['runs']} runs per row; resume = the checkpoint part "
                "as in B7, in one launch per row; launch → first step from that launch)",
                "| state × ranks | GiB | fsdpkit save s | save GB/s | save peak RSS MiB/rank | fsdpkit resume s | "
                "resume GB/s | resume peak RSS MiB/rank | launch → first step s |",
                "|---|---|---|---|---|---|---|---|---|", *b8]
    if b6:
        g = res.get("goodput") or res.get("goodput_free_core")
        out += ["", f"### B6 goodput ({g['size_gib']:g} GiB state, {cfg['b6_steps']} fixed-cost steps of "
                f"{g['B6']['fixed_step_s'] * 1e3:.0f} ms, a save every {cfg['b6_every']}; medians of "
                f"{g['B6']['rounds']} runs per mode, modes in alternating order)",
                "| ranks | mode | loop s | min–max (n) | overhead vs no checkpoint | saves per run | median stall ms | "
                "drain s | extra process CPU per rank (/ loop) | GIL/core wait s (vs none) | "
                "fsdpkit per save: wall / CPU (medians) |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *b6,
                "each async method is made once per phase and warmed by one untimed save (a training run makes its saver once; the staging buffer's one-time allocation is B2's first stall); the loop ends when the last save call returned; drain = from then until that save is durable; "
                "extra CPU = the process CPU time (all threads) minus that of the runs without checkpoints: the "
                "work the saves add, which competes with training when no core is free; GIL/core wait = how late "
                "a Python thread of rank 0 that sleeps 5 ms at a time woke up, summed over the run (the time a "
                "Python thread waits for the GIL, or for a core when none is free), and in brackets its "
                "increase over the runs without checkpoints; prepare + agree = rank 0 readies the directory "
                "and every rank learns the outcome (a broadcast) before writing"]
    if res["errors"]:
        out += ["", "### Errors", *(f"- {e}" for e in res["errors"])]
    return "\n".join(out), targets
