"""The markdown report of bench/checkpoint.py and its verdicts against the targets."""

from __future__ import annotations

from typing import Any

MiB = 2**20
FSDPKIT_SYNC = "fsdpkit save_checkpoint"
DCP_SYNC = "dcp.save"
TORCH_SYNC = "torch.save (rank 0, full)"
FSDPKIT_ASYNC = "fsdpkit AsyncSaver"
FSDPKIT_LOAD = "fsdpkit load_checkpoint"
FSDPKIT_LOAD_VERIFY = "fsdpkit load_checkpoint, verify=True"
DCP_LOAD = "dcp.load + set_state_dict"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _target(rows: list[dict[str, Any]], name: str, size: str, value: float | None, goal: str, ok: bool | None,
            shown: str) -> None:
    rows.append({"target": name, "size": size, "value": value, "goal": goal,
                 "met": None if value is None else bool(ok), "shown": shown})


def _b1(size: str, main: dict[str, Any], disk: float, targets: list, lines: list, notes: list) -> None:
    b1 = main["B1"]
    total = sum(main["state_bytes_per_rank"])
    med = b1["median_s"]
    for name, t in med.items():
        gbps = total / t / 1e9
        runs = ", ".join(f"{x:.2f}" for x in b1["seconds"][name])
        lines.append(f"| {size} | {name} | {t:.2f} | {gbps:.2f} | {gbps / disk:.2f} | "
                     f"{t / med[FSDPKIT_SYNC]:.2f} | {runs} |")
    timings = b1["fsdpkit_manifest_timings"]
    if timings:
        hash_s = sorted(t["hash_s"] for t in timings)[len(timings) // 2]
        write_s = sorted(t["write_s"] for t in timings)[len(timings) // 2]
        notes.append(f"{size} GiB: fsdpkit's own timings (its manifest, rank 0, medians): tensor checksums "
                     f"{hash_s:.2f} s, then DCP write + file-list gather {write_s:.2f} s")
    gbps = total / med[FSDPKIT_SYNC] / 1e9
    _target(targets, "B1 fsdpkit sync durable GB/s / disk write+fsync GB/s", size, gbps / disk, ">= 0.8",
            gbps / disk >= 0.8, f"{gbps:.2f} / {disk:.2f} = {gbps / disk:.2f}")
    r = med[FSDPKIT_SYNC] / med[DCP_SYNC]
    _target(targets, "B1 fsdpkit sync time / dcp.save time", size, r, "<= 1.10", r <= 1.10,
            f"{med[FSDPKIT_SYNC]:.2f} s / {med[DCP_SYNC]:.2f} s = {r:.2f}")
    r = med[TORCH_SYNC] / med[FSDPKIT_SYNC]
    _target(targets, "B1 torch.save recipe time / fsdpkit sync time", size, r, "> 1 (fsdpkit faster)", r > 1,
            f"{med[TORCH_SYNC]:.2f} s / {med[FSDPKIT_SYNC]:.2f} s = {r:.2f}")


def _b2(size: str, main: dict[str, Any], memcpy: float, targets: list, lines: list) -> None:
    b2 = main["B2"]
    per_rank = max(main["state_bytes_per_rank"])
    copy_s = per_rank / (memcpy * 1e9)
    sync_s = b2["sync_save_s"]
    for name, s in b2["summary"].items():
        stall = s["stall_median_s"]
        first = s["first_stall_s"]
        lines.append(f"| {size} | {name} | {_f(first and first * 1e3, '.0f')} | {stall * 1e3:.0f} | "
                     f"{stall / copy_s:.2f} | {sync_s / stall:.1f} | {_f(s['durable_median_s'])} | "
                     f"{_f(s['first_durable_s'])} | {_f(s['step_slowdown'])} ({s['in_flight_steps']} steps) |")
    s = b2["summary"][FSDPKIT_ASYNC]
    x = s["stall_median_s"] / copy_s
    _target(targets, "B2 fsdpkit async stall / memcpy time of per-rank state", size, x, "<= 1.3", x <= 1.3,
            f"{s['stall_median_s'] * 1e3:.0f} ms / {copy_s * 1e3:.0f} ms = {x:.2f} "
            f"(first save {s['first_stall_s'] * 1e3:.0f} ms)")
    x = sync_s / s["stall_median_s"]
    _target(targets, "B2 fsdpkit sync save time / async stall", size, x, ">= 20", x >= 20,
            f"{sync_s:.2f} s / {s['stall_median_s'] * 1e3:.0f} ms = {x:.1f}")


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
    foot = worst[FSDPKIT_SYNC]
    limit = 1.1 * s_mib + 256
    _target(targets, "B3 fsdpkit sync: peak RSS - RSS before the model (MiB)", size, foot,
            f"<= 1.1 S + 256 = {limit:.0f}", foot <= limit, f"{foot:.0f} MiB = {foot / s_mib:.2f} S")
    foot = max(v for k, v in worst.items() if k.startswith(FSDPKIT_ASYNC))
    _target(targets, "B3 fsdpkit async (worst of first/reused): peak RSS - RSS before the model (MiB)", size, foot,
            f"<= 2.1 S = {2.1 * s_mib:.0f}", foot <= 2.1 * s_mib, f"{foot:.0f} MiB = {foot / s_mib:.2f} S")


def _loads(size: str, per: dict[str, Any], targets: list, lines: list) -> None:
    same = per.get("main", {}).get("B4")
    rows = [("2", same)] + [(str(n), per.get(f"load_{n}", {}).get("B5")) for n in (1, 3)]
    for ranks, b in rows:
        if b is None:
            continue
        m = b["median_s"]
        rel = f"{m[FSDPKIT_LOAD] / same['median_s'][FSDPKIT_LOAD]:.2f}" if same else "n/a"
        rel_v = (f"{m[FSDPKIT_LOAD_VERIFY] / same['median_s'][FSDPKIT_LOAD_VERIFY]:.2f}" if same else "n/a")
        lines.append(f"| {size} | {ranks} | {m[FSDPKIT_LOAD]:.2f} | {m[FSDPKIT_LOAD_VERIFY]:.2f} "
                     f"(verify {_f(b['verify_part_median_s'])}) | {m[DCP_LOAD]:.2f} | {rel} | {rel_v} |")
        if same and ranks != "2":
            x = m[FSDPKIT_LOAD] / same["median_s"][FSDPKIT_LOAD]
            _target(targets, f"B5 load on {ranks} rank(s) / load on 2 ranks (fsdpkit, no verify)", size, x,
                    "<= 1.2", x <= 1.2, f"{m[FSDPKIT_LOAD]:.2f} s / {same['median_s'][FSDPKIT_LOAD]:.2f} s = {x:.2f}")


def _b6(g: dict[str, Any], targets: list, lines: list) -> None:
    b6 = g["B6"]
    size = f"{g['size_gib']:g}"
    for mode in ("no checkpoint", "fsdpkit sync", FSDPKIT_ASYNC, "dcp.async_save"):
        r = b6[mode]
        over = "-" if mode == "no checkpoint" else f"{r['overhead_pct']:+.1f}%"
        lines.append(f"| {mode} | {', '.join(f'{x:.2f}' for x in r['loop_s'])} | {r['loop_mean_s']:.2f} | {over} | "
                     f"{r['saves_per_run']} | {r['stall_mean_s'] * 1e3:.0f} | {r['drain_mean_s']:.2f} |")
    for mode in ("fsdpkit sync", FSDPKIT_ASYNC):
        over = b6[mode]["overhead_pct"]
        _target(targets, f"B6 goodput overhead, {mode} (%)", size, over, "<= 3", over <= 3, f"{over:+.1f}%")


def _code_line(res: dict[str, Any]) -> str:
    before, after = res["code_before"], res["code_after"]
    line = (f"fsdpkit checkpoint code: {before['head']}{' + uncommitted changes' if before['uncommitted'] else ''} "
            f"(digest {before['digest']})")
    if before != after:
        return line + f"; **CHANGED during the run** (now {after['head']}, digest {after['digest']}): phases mix versions"
    return line + "; unchanged during the run"


def render(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    c, m = res["ceilings"], res["machine"]
    disk, memcpy = c["write_fsync_gbps"], c["memcpy_gbps"]
    targets: list[dict[str, Any]] = []
    b1, b1_notes, b2, b3, loads, b6 = [], [], [], [], [], []
    sizes_desc = []
    for size, per in res["sizes"].items():
        main = per.get("main", {})
        if main:
            sizes_desc.append(f"{size} GiB = {main['n_layers']} x Linear({main['width']}, {main['width']}), "
                              f"{max(main['state_bytes_per_rank']) / MiB:.0f} MiB/rank")
        if "B1" in main:
            _b1(size, main, disk, targets, b1, b1_notes)
        if "B2" in main:
            _b2(size, main, memcpy, targets, b2)
        if "B3" in main:
            _b3(size, main, targets, b3)
        _loads(size, per, targets, loads)
    if "goodput" in res:
        _b6(res["goodput"], targets, b6)
    lb, la = m["loadavg_before"], m["loadavg_after"]
    out = [
        "## fsdpkit checkpoint benchmark",
        f"{m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}; 2 gloo ranks x 1 thread; "
        f"load average (1/5/15 min) {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f} before, {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} "
        f"after; took {res['elapsed_s'] / 60:.1f} min",
        "sizes: " + "; ".join(sizes_desc) + f"; medians of {res['config']['runs']} runs",
        _code_line(res),
        "",
        "### Ceilings (measured in this run)",
        "| ceiling | value | how |",
        "|---|---|---|",
        f"| disk write + fsync, 1 stream | **{disk:.2f} GB/s** (runs "
        + ", ".join(f"{x:.2f}" for x in c["write_fsync_runs_gbps"])
        + f") | a new {c['file_bytes'] / 2**30:g} GiB file in 16 MiB os.write chunks, then fsync; median of 3 |",
        f"| disk write + fsync, 2 streams | {c['write_fsync_2streams_gbps']:.2f} GB/s | two threads, half each |",
        f"| cold-ish read | {c['read_cold_fadvise_gbps']:.2f} GB/s | posix_fadvise(DONTNEED), then 16 MiB reads "
        "(a VM host may still cache) |",
        f"| O_DIRECT read | {_f(c['read_o_direct_gbps'])} GB/s | 16 MiB aligned reads |",
        f"| warm read | {c['read_warm_gbps']:.2f} GB/s | page cache |",
        f"| memcpy | **{memcpy:.2f} GB/s** | torch copy_ into an existing tensor, 1 thread, "
        f"{c['memcpy_bytes'] / MiB:.0f} MiB |",
        f"| memcpy into a fresh allocation | {c['memcpy_fresh_alloc_gbps']:.2f} GB/s | torch.empty + copy_ "
        "(page faults) |",
        f"| memcpy, two at once (each) | {c['memcpy_2threads_each_gbps']:.2f} GB/s | two threads copying "
        "concurrently, as two ranks staging at once |",
        "",
        "### Targets",
        "| target | size GiB | measured | goal | met |",
        "|---|---|---|---|---|",
        *(f"| {t['target']} | {t['size']} | {t['shown']} | {t['goal']} | "
          f"{'n/a' if t['met'] is None else 'met' if t['met'] else '**NOT met**'} |" for t in targets),
    ]
    if b1:
        out += ["", "### B1 sync save (wall time until committed; GB/s = all ranks' state bytes / time)",
                "| size GiB | method | median s | durable GB/s | x disk write | time / fsdpkit | runs (s) |",
                "|---|---|---|---|---|---|---|", *b1, *b1_notes]
    if b2:
        fs = [(s, p["main"]["B2"]) for s, p in res["sizes"].items() if "B2" in p.get("main", {})]
        out += ["", "### B2 async save (stall = time until the call returned, max over ranks)",
                "| size GiB | method | first stall ms | stall ms | x memcpy time | fsdpkit sync / stall | "
                "durable s | first durable s | step slowdown in flight |",
                "|---|---|---|---|---|---|---|---|---|", *b2,
                "memcpy time of the per-rank state (S / memcpy GB/s): "
                + ", ".join(f"{s} GiB {max(p['main']['state_bytes_per_rank']) / (memcpy * 1e9) * 1e3:.0f} ms single, "
                            f"{max(p['main']['state_bytes_per_rank']) / (c['memcpy_2threads_each_gbps'] * 1e9) * 1e3:.0f} ms "
                            "with two copies at once" for s, p in res["sizes"].items() if "main" in p),
                *(f"{s} GiB: fixed-cost step {b['fixed_step_s'] * 1e3:.0f} ms, {b['steps_per_save']} steps run per "
                  f"save, fsdpkit's get_state_dict capture {b['fsdpkit_capture_median_s'] * 1e3:.1f} ms, "
                  f"fsdpkit sync save {b['sync_save_s']:.2f} s" for s, b in fs)]
    if b3:
        out += ["", "### B3 peak RSS per rank (max over ranks and runs; footprint = peak - RSS before the model "
                "was built; S = per-rank state)",
                "| size GiB | method | peak MiB | increase over pre-save MiB | footprint MiB | footprint / S | "
                "kept after MiB |",
                "|---|---|---|---|---|---|---|", *b3]
    if loads:
        out += ["", "### B4/B5 load (cold-ish: pages evicted with posix_fadvise before each load; saved on 2 ranks)",
                "| size GiB | ranks | fsdpkit s | fsdpkit + verify s | dcp.load s | fsdpkit / 2 ranks | "
                "verify / 2 ranks |",
                "|---|---|---|---|---|---|---|", *loads]
    if b6:
        g = res["goodput"]
        out += ["", f"### B6 goodput ({g['size_gib']:g} GiB state, {res['config']['b6_steps']} fixed-cost steps of "
                f"{g['B6']['fixed_step_s'] * 1e3:.0f} ms, a save every {res['config']['b6_every']}, "
                f"{g['B6']['rounds']} run(s) per mode in alternating order)",
                "| mode | loop s (runs) | mean | overhead vs no checkpoint | saves per run | mean stall per save ms | "
                "drain s |",
                "|---|---|---|---|---|---|---|", *b6,
                "the loop ends when the last save call returned; drain = from then until that save is durable"]
    if res["errors"]:
        out += ["", "### Errors", *(f"- {e}" for e in res["errors"])]
    return "\n".join(out), targets
