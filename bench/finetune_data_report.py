"""The markdown of bench/finetune_data.py's figures (bench/RESULTS-data.md), each target of issue 52
met or not, beside its baseline and ceiling from the same run."""

from __future__ import annotations

import subprocess
from pathlib import Path

from results_md import machine

PAD_TARGET, CONCAT_TARGET = 0.05, 0.9
GAIN_TARGETS = {"2048": 2.7, "4096": 4.5}
PEAK_TARGET_MIB = 1536


def _met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def _tps(s: dict) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}, n={s['n']})"


def _throughput(data: dict) -> list[str]:
    lines = []
    for seq, got in data.items():
        st, tps = got["stats"], got["tokens_per_s"]
        ln = st["lengths"]
        lines += [f"### seq {seq}", "",
                  f"Corpus: {ln['documents']:,} conversations, tokens median {ln['median']:.0f}, mean "
                  f"{ln['mean']:.0f}, p99 {ln['p99']:,.0f}; {ln['over_window']} longer than the window (truncated: "
                  "data.overlong=truncate).", "",
                  "| data.packing | samples | padding of the input positions | trained tokens/s, median (min-max) |",
                  "|---|---|---|---|"]
        for mode, label in (("false", "false (one conversation per sample)"),
                            ("true", "true (packed, kept apart: attention one document at a time)"),
                            ("true-masked", "true, with transformers' block-diagonal mask (attn_implementation=sdpa)"),
                            ("concat", "concat (run together)")):
            row = st[mode.removesuffix("-masked")]
            lines.append(f"| {label} | {row['samples']:,} | {100 * row['padding']:.1f}% | {_tps(tps[mode])} |")
        gain = tps["true"]["median"] / tps["false"]["median"]
        vs_concat = tps["true"]["median"] / tps["concat"]["median"]
        pad = st["true"]["padding"]
        lines += ["", f"- packed padding {100 * pad:.1f}% (target <= {100 * PAD_TARGET:.0f}%): "
                      f"{_met(pad <= PAD_TARGET)}",
                  f"- packed / concat trained tokens/s: {vs_concat:.3f}x (target >= {CONCAT_TARGET}x): "
                  f"{_met(vs_concat >= CONCAT_TARGET)}",
                  f"- packed / one per sample: {gain:.2f}x (target >= {GAIN_TARGETS[seq]}x: "
                  f"{_met(gain >= GAIN_TARGETS[seq])}); ceiling at the fill reached {st['ceiling_at_fill']:.2f}x, "
                  f"at a 95% fill {st['ceiling_95']:.2f}x (the ratio of the two modes' sample counts)",
                  f"- attention one document at a time / the block-diagonal mask: "
                  f"{tps['true']['median'] / tps['true-masked']['median']:.2f}x (the A/B of per-document attention; "
                  f"ranges {'apart' if tps['true']['min'] > tps['true-masked']['max'] else 'overlapping'})",
                  f"- first-step loss per mode (the same model and seed): "
                  f"{', '.join(f'{m} {v:.4f}' for m, v in got['first_loss'].items())}", ""]
    return lines


def _loss(data: dict) -> list[str]:
    lines = ["### The loss alone: 2,048 tokens, hidden 256, one process", "",
             "| vocab | full logits: peak MiB | chunked: peak MiB | full: s per step | chunked: s per step |",
             "|---|---|---|---|---|"]
    for vocab in ("32768", "131072", "262144"):
        full, chunked = data.get(f"{vocab}/full", {}), data.get(f"{vocab}/chunked", {})
        if "error" in full or "error" in chunked:
            lines.append(f"| {vocab} | {full.get('error', '')[:80]} | {chunked.get('error', '')[:80]} | | |")
            continue

        def sec(s: dict) -> str:
            return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"

        lines.append(f"| {int(vocab):,} | {full['peak_mib']:,.0f} | {chunked['peak_mib']:,.0f} | "
                     f"{sec(full['seconds'])} | {sec(chunked['seconds'])} |")
    return lines + ["", "Peak: the RSS the step adds over the model's and gradients' own buffers (VmHWM after a reset, "
                        "minus VmRSS before).", ""]


def _trainer(data: dict) -> list[str]:
    c4, ab = data["chunked_micro4"], data["ab"]
    peak = c4.get("peak_mib")
    lines = ["### The trainer at vocab 131,072, seq 2,048, 2 ranks (fsdpkit's Llama, 17M parameters)", "",
             f"- micro-batch 4, chunked loss: largest phase of the \"peak memory per phase\" line, max over ranks: "
             f"**{peak:,.0f} MiB** (target <= {PEAK_TARGET_MIB} MiB; 13.0 GB with the full logits when the issue was "
             f"filed): {_met(peak is not None and peak <= PEAK_TARGET_MIB)}",
             f"  - the line: `{c4.get('peak_line')}`"]
    tps = ab["tokens_per_s"]
    ok = tps["chunked"]["median"] >= tps["full"]["min"]
    lines += [f"- micro-batch {ab['micro_batch']}, taking turns: trained tokens/s chunked {_tps(tps['chunked'])}, "
              f"full logits {_tps(tps['full'])}; ratio {tps['chunked']['median'] / tps['full']['median']:.3f}x "
              f"(target: not below the full logits beyond the spread): {_met(ok)}; first-step loss chunked "
              f"{ab['first_loss']['chunked']:.6f}, full {ab['first_loss']['full']:.6f}", ""]
    return lines


def render(data: dict) -> str:
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    lines = ["# Fine-tuning data and the loss (bench/finetune_data.py)", "",
             f"- commit {commit}; machine: {machine()}",
             f"- command: `python bench/finetune_data.py` ({data['args']}); {data['minutes']:.0f} min", "",
             "Throughput: 2 gloo ranks, transformers Llama (hidden 128, 2 layers, vocab 4,096), fp32, micro-batch 2, "
             "global batch 8, chat SFT (assistant tokens trained). The trainers of every mode share one process group "
             f"and take turns: {data['args']['rounds']} rounds of {data['args']['steps']} steps each, the order "
             "reversed every other round; a round's trained tokens/s is its trained targets (the trainer's own count) "
             "over its wall time; median (min-max) over the rounds.", ""]
    if "throughput" in data:
        lines += _throughput(data["throughput"])
    if "loss" in data:
        lines += _loss(data["loss"])
    if "trainer" in data:
        lines += _trainer(data["trainer"])
    return "\n".join(lines) + "\n"
