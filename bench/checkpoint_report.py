"""The markdown report of bench/checkpoint.py and its verdicts against the targets: the page
(machine, ceilings, targets, then one section per phase); each section's rows and verdicts come
from bench/checkpoint_tables.py.
"""

from __future__ import annotations

from typing import Any

from checkpoint_tables import (
    b1_rows,
    b2_rows,
    b3_rows,
    b6_rows,
    b7_rows,
    b8_rows,
    load_rows,
    memcpy_ceiling_gbps,
    min_max,
    streamed_memcpy,
)

MiB = 2**20


def _code_line(res: dict[str, Any]) -> str:
    before, after = res["code_before"], res["code_after"]
    line = (f"fsdpkit checkpoint code: {before['head']}{' + uncommitted changes' if before['uncommitted'] else ''} "
            f"(digest {before['digest']})")
    if before != after:
        return line + (f"; **CHANGED during the run** (now {after['head']}, digest {after['digest']}): "
                       "phases mix versions")
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
    rows = [f"| disk write + fsync, {n} stream(s) at once | **{w['gbps']:.2f} GB/s** | {min_max(w['runs_gbps'])} | "
            f"{n} new file(s) of {w['bytes'] / int(n) / 2**30:.2g} GiB, one thread each, {_pieces(c)}, then fsync"
            f"{_ways(w)}; the ceiling of {n} rank(s) saving |"
            for n, w in sorted(c["write_fsync"].items(), key=lambda x: int(x[0]))]
    for k, r in c["read_cold"].items():
        if r is None:
            continue
        how = ("O_DIRECT, 16 MiB aligned reads" if k.startswith("o_direct")
               else "page cache (warm)" if k.startswith("warm")
               else f"posix_fadvise(DONTNEED), then 16 MiB reads{_restarted(c)} (a VM host may still cache)")
        kind = "O_DIRECT" if k.startswith("o_direct") else "warm" if k.startswith("warm") else "cold-ish"
        rows.append(f"| read, {r['streams']} stream(s) at once, {kind} | "
                    f"{r['gbps']:.2f} GB/s | {min_max(r['runs_gbps'])} | {how} |")
    rows += [f"| memcpy | **{c['memcpy_gbps']:.2f} GB/s** | median of {reps} | torch copy_ into an existing tensor, "
             f"1 thread, {c['memcpy_bytes'] / MiB:.0f} MiB |",
             f"| memcpy into a fresh allocation | {c['memcpy_fresh_alloc_gbps']:.2f} GB/s | median of {reps} | "
             "torch.empty + copy_ (page faults) |",
             f"| memcpy, two at once (each) | {c['memcpy_2threads_each_gbps']:.2f} GB/s | median of {reps} | two "
             "threads copying concurrently, as two ranks staging at once |"]
    if "memcpy_stream_gbps" in c:
        rows += [f"| memcpy, non-temporal stores | **{c['memcpy_stream_gbps']:.2f} GB/s** | median of {reps} | "
                 "fsdpkit's streaming copy (its staging copies), the same tensors |",
                 f"| memcpy, non-temporal stores, two at once (each) | {c['memcpy_stream_2threads_each_gbps']:.2f} "
                 f"GB/s | median of {reps} | as above, two threads |"]
    return rows


def render(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    c, m = res["ceilings"], res["machine"]
    memcpy = memcpy_ceiling_gbps(c)
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
            b1_rows(size, main, c, targets, b1, b1_notes)
        if "B2" in main:
            b2_rows(size, main, c, targets, b2)
        if "B3" in main:
            b3_rows(size, main, targets, b3)
        load_rows(size, per, targets, loads)
        if per.get("whole_resume"):
            b7_rows(size, per["whole_resume"], targets, b7)
    for key, label in (("goodput", "2 ranks (no core free)"), ("goodput_free_core", "1 rank (a core free)")):
        if key in res:
            b6_rows(res[key], label, targets, b6)
    b8: list[str] = []
    if "scaling" in res:
        b8_rows(res["scaling"], c, targets, b8)
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
        out += ["", "### B1 sync save (wall time until committed, 2 ranks; GB/s = all ranks' state bytes / time; the "
                    "methods "
                "rotate, raw writes of the same bytes among them as the disk's ceiling at this moment: plain, starting "
                "the write-back as they go, and O_DIRECT, the ways fsdpkit's writer writes)",
                "| size GiB | method | median s | min–max (n) | durable GB/s | × disk, 2 streams (1 stream) | "
                "time / dcp.save | time / fsdpkit |",
                "|---|---|---|---|---|---|---|---|", *b1, *b1_notes]
    if b2:
        fs = [(s, p["main"]["B2"]) for s, p in res["sizes"].items() if "B2" in p.get("main", {})]
        out += ["", "### B2 async save (stall = time until the call returned, max over ranks; medians)",
                "| size GiB | method | first stall ms | stall ms | x memcpy time (every rank at once, same rotation) | "
                "fsdpkit sync / stall | durable s | first durable s | step slowdown in flight |",
                "|---|---|---|---|---|---|---|---|---|", *b2,
                *(f"{s} GiB: memcpy of the per-rank state, every rank at once, in the same rotation as the saves: "
                  f"{b['state_memcpy_median_s'] * 1e3:.0f} ms "
                  f"({min_max([x * 1e3 for x in b['state_memcpy_s']], '.0f')}) with copy_{streamed_memcpy(b)}; "
                  f"from the memcpy ceilings measured before the benchmarks (S / GB/s): "
                  f"{max(p['main']['state_bytes_per_rank']) / (memcpy * 1e9) * 1e3:.0f} ms single, "
                  f"{max(p['main']['state_bytes_per_rank']) / (memcpy_ceiling_gbps(c, together=True) * 1e9) * 1e3:.0f} "
                  "ms with two copies at once" for s, p in res["sizes"].items()
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
                "load_checkpoint(verify=True, verify_files=True) (the load reads each file once and checks "
                "`.metadata` and every item as it reads them, then per-tensor checksums); fsdpkit, pass first = "
                "resolve + a pass that checks every file's checksum + the load through DCP's reader + per-tensor "
                "checksums (the default before issue 56); plain = dcp.load + set_state_dict. 'in-process' = the "
                f"checkpoint part repeated {-(-cfg.get('resume_runs', 1) // 3) * 3} time(s) per method in each launch "
                "after the first step (cold pages; each method following each equally often: in one process "
                "fsdpkit's load right after a dcp.load ran up to 2x slower than after its own), pooled. Read = "
                "bytes the ranks asked the kernel for during the checkpoint part (/proc/self/io rchar, page cache "
                "or disk) over the checkpoint's size.",
                "| size GiB | method | launch → first step s (median) | min–max (n) | launch → model built s | "
                "checkpoint part, first in the process s | first step s | "
                "checkpoint part in-process s | min–max (n) | / dcp.load | read / size (min–max) |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *b7]
    if b8:
        out += ["", f"### B8 scaling (medians of {res['scaling']['runs']} runs per row; resume = the checkpoint part "
                "as in B7, in one launch per row; launch → first step from that launch)",
                "| state × ranks | GiB | fsdpkit save s | save GB/s | save peak RSS MiB/rank | fsdpkit resume s | "
                "fsdpkit resume, pass first s | dcp.load s | resume GB/s | resume peak RSS MiB/rank | "
                "launch → first step s |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *b8]
    if b6:
        g = res.get("goodput") or res.get("goodput_free_core")
        out += ["", f"### B6 goodput ({g['size_gib']:g} GiB state, {cfg['b6_steps']} fixed-cost steps of "
                f"{g['B6']['fixed_step_s'] * 1e3:.0f} ms, a save every {cfg['b6_every']}; medians of "
                f"{g['B6']['rounds']} runs per mode, modes in alternating order)",
                "| ranks | mode | loop s | min–max (n) | overhead vs no checkpoint | "
                "saves per run | median stall ms | "
                "drain s | extra process CPU per rank (/ loop) | GIL/core wait s (vs none) | "
                "fsdpkit per save: wall / CPU (medians) |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *b6,
                "each async method is made once per phase and warmed by one untimed save (a training run makes its "
                "saver once; the staging buffer's one-time allocation is B2's first stall); the loop ends when the "
                "last save call returned; drain = from then until that save is durable; extra CPU = the process CPU "
                "time (all threads) minus that of the runs without checkpoints: the work the saves add, which competes "
                "with training when no core is free; GIL/core wait = how late a Python thread of rank 0 that sleeps 5 "
                "ms at a time woke up, summed over the run (the time a Python thread waits for the GIL, or for a core "
                "when none is free), and in brackets its increase over the runs without checkpoints; prepare + agree = "
                "rank 0 readies the directory and every rank learns the outcome (a broadcast) before writing"]
    if res["errors"]:
        out += ["", "### Errors", *(f"- {e}" for e in res["errors"])]
    return "\n".join(out), targets
