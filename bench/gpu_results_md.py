"""Turn bench/gpu_all.sh's outputs into a dated section of bench/RESULTS-gpu.md.

Reads, from --dir: machine.txt, gpu_train.json, gpu_checkpoint.json, pytest.txt (each optional:
a missing one is said to be missing). Writes the section to --out, and with --insert FILE puts it
at the top of FILE, after its title paragraph, keeping the older runs' sections below.

Usage: python bench/gpu_results_md.py --dir DIR [--out FILE] [--insert bench/RESULTS-gpu.md]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TRAIN_RATIO_TARGET = 0.98
MFU_TARGET = 0.39
STALL_TARGET = 1.1


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def machine(d: Path) -> tuple[list[str], str]:
    text = (d / "machine.txt").read_text() if (d / "machine.txt").is_file() else ""
    info = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    date = info.get("date", "undated")[:10]
    parts = [line.split() for line in text.splitlines() if re.fullmatch(r"\S+ -?\d+ \d+", line)]
    lines = [f"- machine: GPU {info.get('gpu', '?')}, {info.get('cpus', '?')} CPUs, {info.get('mem_gib', '?')} GiB "
             f"RAM; Python {info.get('python', '?')}, torch {info.get('torch', '?')}; commit "
             f"`{info.get('commit', '?')}`",
             "- parts (exit code, seconds): "
             + (", ".join(f"{n} {rc} ({s} s)" for n, rc, s in parts) or "none recorded")]
    return lines, date


def train_section(r: dict | None) -> list[str]:
    if r is None:
        return ["### Training throughput (`bench/gpu_train.py`)", "", "No result (gpu_train.json missing).", ""]
    m = r["machine"]
    out = ["### Training throughput (`bench/gpu_train.py`)", "",
           f"One {m['device']} (dense bf16 peak {m['peak_bf16_tflops']} TFLOP/s), torch {m['torch']}, sequence "
           f"{r['seq_len']}, bf16-mixed, one micro-batch per step; fsdpkit's trainer against a minimal FSDP2 loop "
           f"(torchtitan's shape) in {r['rounds']} alternating rounds of {r['steps_per_round']} steps each after "
           f"{r['warmup_steps']} warm-up steps; median tokens/s (min-max over rounds). MFU counts torchtitan's "
           "6N + 12LHQT FLOPs per token (see the script's docstring). torchtitan's 33-39% are for Llama 3.1 8B on "
           "8 H100s; this is a 1B model on one GPU." + (" **CPU smoke run: the figures mean nothing.**"
                                                           if r.get("cpu_smoke") else ""), "",
           "| model | compile | AC | micro-batch | baseline tok/s | fsdpkit tok/s | fsdpkit / baseline (≥ 0.98) "
           "| MFU baseline | MFU fsdpkit | peak GiB baseline / fsdpkit | first-step loss fsdpkit / baseline |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, mfus = [], []
    for c in r["configs"]:
        head = (f"| {c['model']} | {'yes' if c['compile'] else 'no'} "
                f"| {'yes' if c['activation_checkpointing'] else 'no'} ")
        if "sides" not in c:
            why = c.get("error") or c.get("skipped") or f"out of memory at {c.get('oom_at')}"
            out.append(head + f"| - | {why.replace('|', '/')[:300]} | | | | | | |")
            continue
        b, f = c["sides"]["baseline"], c["sides"]["fsdpkit"]
        tok = lambda x: (f"{x['median_tokens_per_s']:,.0f} "  # noqa: E731
                         f"({x['min_tokens_per_s']:,.0f}-{x['max_tokens_per_s']:,.0f})")

        def mfu(x):
            if x["median_mfu"] is None:
                return "n/a"
            return f"{x['median_mfu'] * 100:.1f}% ({min(x['mfu']) * 100:.1f}-{max(x['mfu']) * 100:.1f})"

        gib = lambda x: "n/a" if x["peak_mem_gib"] is None else f"{x['peak_mem_gib']:.1f}"  # noqa: E731
        rr = c["round_ratios"]
        ratios.append(c["ratio"])
        if c["compile"] and f["median_mfu"] is not None:
            mfus.append(f["median_mfu"])
        chk = c["first_step_check"]
        out.append(head + f"| {c['micro_batch']}{' (OOM at ' + str(c['oom_at']) + ')' if c.get('oom_at') else ''} "
                   f"| {tok(b)} | {tok(f)} | {c['ratio']:.3f} ({min(rr):.3f}-{max(rr):.3f}) | {mfu(b)} | {mfu(f)} "
                   f"| {gib(b)} / {gib(f)} | {chk['fsdpkit_loss']:.4f} / {chk['baseline_loss']:.4f} |")
    done = [c for c in r["configs"] if "sides" in c]
    out += ["", f"- fsdpkit ≥ {TRAIN_RATIO_TARGET}× the minimal loop in every configuration: "
            + met(all(x >= TRAIN_RATIO_TARGET for x in ratios) if ratios else None)
            + (f" (worst {min(ratios):.3f}; {len(done)} of {len(r['configs'])} configurations ran)" if ratios else ""),
            f"- MFU ≥ {MFU_TARGET:.0%} with compile (fsdpkit's side): "
            + met(all(x >= MFU_TARGET for x in mfus) if mfus else None)
            + (f" (lowest {min(mfus) * 100:.1f}%)" if mfus else ""), ""]
    return out


def checkpoint_section(r: dict | None) -> list[str]:
    if r is None:
        return ["### Async checkpoint (`bench/gpu_checkpoint.py`)", "", "No result (gpu_checkpoint.json missing).", ""]
    out = ["### Async checkpoint (`bench/gpu_checkpoint.py`)", "",
           f"State {r['bytes'] / 1e9:.2f} GB (params + AdamW state, fp32) on {r['device']}, torch {r['torch']}; "
           f"median of {r['runs']} after one warm-up (min-max beside it). Fair baseline: torchtitan's fast mode "
           "(PROCESS, a persistent pinned shared-memory DefaultStager with async staging and non-blocking copies, "
           "plan caching where this torch has it, a gloo group; a new stager per save where this torch's cannot "
           "stage twice: see the notes); its stall counts until staging is done."
           + (" **CPU smoke run: the figures mean nothing.**" if r.get("cpu_smoke") else ""), "",
           "| figure | median | min-max | against | median | ratio |", "|---|---|---|---|---|---|"]
    for row in r.get("rows", []):
        a, b = r[row["key"]], r[row["against_key"]]
        out.append(f"| {row['figure']} | {a['median']:.4f} s | {a['min']:.4f}-{a['max']:.4f} | {row['against']} "
                   f"| {b['median']:.4f} s | {row['ratio']:.2f} |")
    ratio = {(row["key"], row["against_key"]): row["ratio"] for row in r.get("rows", [])}
    fair = ratio.get(("fsdpkit_async_stall_s", "dcp_fast_stall_until_staged_s"))
    d2h = ratio.get(("fsdpkit_async_stall_s", "d2h_pinned_s"))
    out += ["", f"- fsdpkit's stall ≤ {STALL_TARGET}× the fair baseline's: "
            + met(None if fair is None else fair <= STALL_TARGET) + (f" ({fair:.2f})" if fair is not None else ""),
            f"- fsdpkit's stall ≤ {STALL_TARGET}× the device-to-host copy: "
            + met(None if d2h is None else d2h <= STALL_TARGET) + (f" ({d2h:.2f})" if d2h is not None else "")]
    out += [f"- {note}" for note in r.get("notes", [])]
    return [*out, ""]


def tests_section(d: Path) -> list[str]:
    path = d / "pytest.txt"
    out = ["### CUDA tests (`pytest tests/cuda -ra`)", ""]
    if not path.is_file():
        return [*out, "No result (pytest.txt missing).", ""]
    lines = path.read_text(errors="replace").splitlines()
    final = [x for x in lines if re.match(r"^=+ .*(passed|failed|error|skipped).* in [\d.]+s", x)]
    # `path::test PASSED [ 12%]` (one process) or `[gw0] [ 12%] PASSED path::test` (pytest-xdist)
    outcome = r"(PASSED|FAILED|ERROR|SKIPPED)"
    results = [x for x in lines if re.search(rf"::\S+ {outcome}|\] {outcome} \S+::", x)]
    summary = [x for x in lines if re.match(r"^(FAILED|ERROR|SKIPPED) ", x)]
    durations = [x for x in lines if re.match(r"^[\d.]+s (call|setup|teardown) ", x)]
    out.append(f"Outcome: `{final[-1].strip('= ')}`" if final else
               f"No final summary (cut by the time limit?): {len(results)} test(s) finished.")
    tidy = lambda x: re.sub(r"^\[gw\d+\]\s+\[\s*\d+%\]\s+|\s+\[\s*\d+%\]$", "", x).strip()  # noqa: E731
    out += ["", "```", *map(tidy, results), *summary, "```", ""]
    if durations:
        out += ["Durations (pytest `--durations`):", "", "```", *durations, "```", ""]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--insert", type=Path, default=None, help="RESULTS-gpu.md to put the section in, at the top")
    args = p.parse_args()
    head, date = machine(args.dir)
    section = [f"## Run of {date} (`bench/gpu_all.sh`, generated by `bench/gpu_results_md.py`)", "", *head, "",
               *train_section(load(args.dir / "gpu_train.json")),
               *checkpoint_section(load(args.dir / "gpu_checkpoint.json")), *tests_section(args.dir)]
    text = "\n".join(section)
    if args.out:
        args.out.write_text(text)
    if args.insert:
        old = args.insert.read_text()
        first = old.find("\n## ")  # the title paragraph stays first, the older sections follow
        args.insert.write_text(old[:first + 1] + text + "\n" + old[first + 1:] if first >= 0 else old + "\n" + text)
    if not args.out and not args.insert:
        print(text)


if __name__ == "__main__":
    main()
