"""`fsdpkit ckpt export | inspect | verify | diff`: offline checkpoint tools (one process, no
process group). Exit codes: 0 success, 1 problems found (verify) or differences (diff), 2 a
usage error or an unreadable, incomplete or unsafe checkpoint (raised, reported by main)."""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdpkit import tunables
from fsdpkit.checkpoint.storage.urls import check_url
from fsdpkit.config.schema import ExportConfig

CKPT_PATH_HELP = ("a checkpoint directory (fsdpkit or plain DCP: .metadata + *.distcp; also as an s3:// URL, "
                  "credentials and endpoint from the AWS_* environment), a checkpoints or run directory "
                  "(its `latest` is used), an Accelerate save_state folder (its pytorch_model_fsdp_0/), a folder of "
                  "step directories (the newest by the number in its name), a Hugging Face folder or a .safetensors "
                  "file")

EXPORT_HELP = """\
Write a checkpoint's model weights as safetensors, streaming: tensors are read from the shards a
block at a time and written out, so memory stays bounded whatever the model size. Optimizer,
RNG and other state are ignored. The output appears atomically (written under a temporary name,
then renamed). OUT may not be, contain or lie inside the checkpoint or its checkpoints root, nor be
or contain the run directory (a new directory inside the run, such as RUN/export, is fine). Every
DCP file is first checked to hold every byte range its metadata lists.

OUT may be a URL (s3://bucket/out; endpoint and credentials from the AWS_* environment): the
export is written to a temporary local directory (TMPDIR: needs the export's size in free disk),
then uploaded, the weight files first and the index and config.json last, each object complete
when it appears. --overwrite replaces only an earlier fsdpkit export there (deleted first,
config.json first); OUT may not lie in or contain the source's prefix.

--format hf (default): OUT is a directory with model.safetensors, or model-0000X-of-0000N
.safetensors shards and model.safetensors.index.json when the weights exceed --max-shard-size,
plus config.json and generation_config.json: from --config, or from the run config an fsdpkit
checkpoint records, so that transformers.AutoModelForCausalLM.from_pretrained(OUT) loads it. A
tied lm_head (tied in the config, or equal to the embedding) is written once, as transformers
expects. --format single: OUT is one .safetensors file.

Runs built from a Hugging Face folder (model=hf model.path=DIR): config.json is the config the
run trained with; generation_config.json is DIR's own (copied; transformers' default only when
DIR has none); the run's tokenizer (data.tokenizer, else DIR when it holds one) is written by
transformers' AutoTokenizer save_pretrained, chat template included, so that
AutoTokenizer.from_pretrained(OUT) works. A folder that no longer exists does not stop the
export: the output lists the files it could not add and how to add them.

Hub layout: when the model is known (model=hf runs, or --config), the weights are written with
the names and layouts transformers' save_pretrained writes, which may differ from those it holds
in memory (and the checkpoint stores): MoE experts fused in memory are written one tensor per
expert (Mixtral, Qwen3-MoE...), legacy names are restored (GPT-NeoX's embed_out). Renamed tensors
stream as the others; each fused tensor is read whole, one at a time, and split by transformers'
own reverse operations. --no-hub-layout keeps the checkpoint's names and layouts.

Names: wrapper components (_orig_mod., _fsdp_wrapped_module., _checkpoint_wrapped_module.,
leading module.) are removed. A prefix every name shares that is not the model's (Lightning's
`model.`) is stripped, with a line saying so: judged against the names of the model --config
describes (transformers builds it on the meta device), else by the common first component;
--strip-prefix '' keeps names as they are, --strip-prefix/--add-prefix adapt other layouts.

LoRA runs (model.peft.method=lora): --adapter writes a PEFT adapter folder (adapter_model.safetensors,
adapter_config.json) that peft.PeftModel.from_pretrained(base_model, OUT) loads; --merge writes the
model with W + (alpha/r) * B @ A merged in, under the base model's names (a plain Hugging Face folder).

examples:
  fsdpkit ckpt export runs/demo/checkpoints exported/demo
  fsdpkit ckpt export runs/sft/checkpoints sft-adapter --adapter
  fsdpkit ckpt export runs/sft/checkpoints sft-merged --merge --dtype bf16
  fsdpkit ckpt export runs/demo/checkpoints/step_200 demo-bf16 --dtype bf16 --max-shard-size 2GB
  fsdpkit ckpt export accelerate_out/checkpoints exported/acc --config path/to/hf_model_folder
  fsdpkit ckpt export lightning_logs/version_0/checkpoints exported/pl --config config.json
  fsdpkit ckpt export other_tool_dcp_dir weights.safetensors --format single --namespace ''
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `ckpt` and its subcommands on the top-level subparsers."""
    ckpt = sub.add_parser("ckpt", help="export, inspect, verify or diff checkpoints (offline, one process)",
                          description="Offline checkpoint tools (one process, no process group). Checkpoint "
                                      "metadata is read through allow-lists: nothing a checkpoint brings is ever run. "
                                      "Exit codes: 0 success, 1 verify found problems or diff found differences, "
                                      "2 a usage error or an unreadable, incomplete or unsafe checkpoint.")
    cmds = ckpt.add_subparsers(dest="ckpt_command", required=True)

    e = cmds.add_parser("export", help="write the model weights as safetensors (Hugging Face folder or one file)",
                        description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("ckpt", metavar="CKPT", help=CKPT_PATH_HELP)
    e.add_argument("out", metavar="OUT", help="output directory (--format hf) or file (--format single)")
    e.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of floating-point tensors (default: as stored, i.e. fp32 master weights for fsdpkit "
                        "runs)")
    e.add_argument("--max-shard-size", default=ExportConfig.max_shard_size, metavar="SIZE",
                   help="largest output file of --format hf, e.g. 5GB, 500MB, 2GiB (default "
                        f"{ExportConfig.max_shard_size}, as export.max_shard_size)")
    e.add_argument("--format", dest="fmt", choices=["hf", "single"], default="hf",
                   help="hf: a Hugging Face folder (default); single: one .safetensors file")
    e.add_argument("--config", default=None, metavar="FILE_OR_DIR",
                   help="the model's config.json or Hugging Face folder: written into OUT (with generation_config.json "
                        "when beside it); names and tied weights are checked against the model it describes")
    e.add_argument("--namespace", default=None, metavar="NAME",
                   help="top-level state-dict entry holding the model in a plain DCP checkpoint (default: `model` "
                        "if present, else the top-level tensors); '' for model keys at the top level. Optimizer "
                        "state (optimizer, optim, ...) only with --format single, into a file not named model*")
    e.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                   help="remove PREFIX from names that start with it (repeatable), after wrapper components; "
                        "'' turns off the detection of a prefix that is not the model's")
    e.add_argument("--add-prefix", default="", metavar="PREFIX", help="prepend PREFIX to every name, last")
    e.add_argument("--reader", choices=["direct", "dcp"], default="direct",
                   help="direct: read chunk byte ranges (default); dcp: through dcp.load one tensor at a time "
                        "(needed only for DCP storage extensions such as compression)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is an earlier fsdpkit export (safetensors files marked exported_by=fsdpkit, "
                        "plus the index and config files an export writes, nothing else), once the new export is "
                        "complete; anything else at OUT is never deleted: the export is refused")
    e.add_argument("--no-config", action="store_true", help="do not write config.json/generation_config.json")
    e.add_argument("--no-hub-layout", action="store_true",
                   help="write the names and layouts the checkpoint holds (model.state_dict()'s), not those "
                        "save_pretrained writes (per-expert MoE tensors, legacy names)")
    e.add_argument("--verbose", action="store_true", help="show torch's own warnings (hidden by default)")
    e.add_argument("--verify", action="store_true",
                   help="recompute every file checksum of an fsdpkit checkpoint first (default: check presence and "
                        "sizes)")
    e.add_argument("--json", action="store_true", help="print the export report as JSON")
    lora = e.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true",
                      help="LoRA runs: write only the adapter as a PEFT folder (adapter_model.safetensors, "
                           "adapter_config.json)")
    lora.add_argument("--merge", action="store_true",
                      help="LoRA runs: write the model with the adapters merged into its weights (a Hugging Face "
                           "folder)")
    e.add_argument("--base-model", default="", metavar="NAME",
                   help="--adapter: base_model_name_or_path to record (default: the run's model.init_from folder)")

    i = cmds.add_parser("inspect", help="show what a checkpoint holds (never loads tensor data or pickled objects)",
                        description="Step, world size, mesh, versions, config summary, tensors (shape, dtype, bytes, "
                                    "how sharded), bytes per rank, optimizer state, data cursor and checksum status. "
                                    "Works on plain DCP directories and safetensors too, with what they record.")
    i.add_argument("ckpt", metavar="CKPT", help=CKPT_PATH_HELP)
    i.add_argument("--all", action="store_true", help="list every tensor (optimizer and RNG too), not just the model's")
    i.add_argument("--json", action="store_true", help="print the full report as JSON")

    v = cmds.add_parser("verify", help="recompute checksums and check every file and chunk is present and complete",
                        description="Recompute every file checksum recorded in manifest.json (in parallel), check that "
                                    "every file and every tensor chunk listed in the DCP metadata is present and "
                                    "complete, and name each bad file. Plain DCP directories and safetensors files "
                                    "carry no checksums: their structure is checked, not their tensor values, and the "
                                    "verdict says so. Exit 0 when nothing checked is wrong, 1 when anything is, 2 when "
                                    "CKPT is not a checkpoint at all.")
    v.add_argument("ckpt", metavar="CKPT", help=CKPT_PATH_HELP)
    v.add_argument("--threads", type=int, default=None,
                   help=f"parallel checks (default: FSDPKIT_VERIFY_THREADS, else {tunables.DEFAULTS.verify_threads})")
    v.add_argument("--tensors", action="store_true",
                   help="also recompute every tensor's checksum from the data and compare with the manifest (reads it "
                        "all again)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")

    d = cmds.add_parser("diff", help="compare two checkpoints tensor by tensor",
                        description="Keys only in A or B, shape and dtype changes, and per tensor the largest absolute "
                                    "difference and the relative L2 difference ||A-B||/||A||, streamed block by block. "
                                    "A and B may be checkpoints, DCP directories, Hugging Face folders or .safetensors "
                                    "files. Exit 0 when identical, 1 when they differ.")
    d.add_argument("a", metavar="A", help=CKPT_PATH_HELP)
    d.add_argument("b", metavar="B", help="the same kinds of path as A")
    d.add_argument("--all", action="store_true",
                   help="compare every tensor under its raw key (optimizer, RNG too); default: model weights by "
                        "exported name")
    d.add_argument("--namespace", default=None, metavar="NAME", help="as for export, for plain DCP checkpoints")
    d.add_argument("--json", action="store_true", help="print the full report as JSON")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _export_lora(args: argparse.Namespace) -> int:
    from fsdpkit.export.adapter import export_adapter, export_merged

    if args.fmt != "hf":
        raise ValueError("--adapter and --merge write folders: drop --format single")
    if args.adapter:
        report = _into_out(args, lambda out: export_adapter(args.ckpt, out, dtype=args.dtype,
                                                            base_model=args.base_model,
                                                            overwrite=args.overwrite, verify=args.verify))
    else:
        report = _into_out(args, lambda out: export_merged(args.ckpt, out, dtype=args.dtype, overwrite=args.overwrite,
                                                           verify=args.verify, write_config=not args.no_config))
    if args.json:
        _print_json(report)
        return 0
    if args.adapter:
        what = "adapter tensors"
    else:
        what = f"tensors ({report['merged']} with LoRA merged, scale {report['scale']:g})"
    print(f"exported {report['num_tensors']} {what} from {report['source']} (step {report['step']}) to {report['out']} "
          f"in {report['seconds']:.2f} s: {', '.join(report['files'])}")
    _print_folder_files(report)
    return 0


def _into_out(args: argparse.Namespace, export: Callable[[str | Path], dict[str, Any]]) -> dict[str, Any]:
    """`export(OUT)`; a URL OUT is exported to a temporary local directory first, then uploaded with
    the files that make it loadable last (export/remote_destination.py)."""
    from fsdpkit.export.remote_destination import export_to

    return export_to(args.out, export, fmt=args.fmt, overwrite=args.overwrite, source=args.ckpt)


def _export(args: argparse.Namespace) -> int:
    from fsdpkit.export.exporter import export_checkpoint

    if args.adapter or args.merge:
        return _export_lora(args)
    from fsdpkit.export.adapter import is_lora_checkpoint

    if is_lora_checkpoint(args.ckpt):
        raise ValueError(f"{args.ckpt} is a LoRA run (model.peft.method=lora): its weights carry peft's layer names, "
                         "which no model loads; pass --merge for the merged model or --adapter for the PEFT adapter")

    if args.no_config and args.config:
        raise ValueError("--config and --no-config contradict each other; pass one")
    with warnings.catch_warnings():
        if not args.verbose:  # dcp.load's notes on a process-group-less load are torch's business, not the user's
            warnings.simplefilter("ignore")
        report = _into_out(args, lambda out: export_checkpoint(
            args.ckpt, out, dtype=args.dtype, max_shard_size=args.max_shard_size, fmt=args.fmt,
            namespace=args.namespace,
            strip_prefixes=args.strip_prefix, add_prefix=args.add_prefix, reader=args.reader, overwrite=args.overwrite,
            write_config=not args.no_config, config=args.config, verify=args.verify,
            hub_layout=not args.no_hub_layout))
    if args.json:
        _print_json(report)
        return 0
    for note in report["notes"]:
        print(note)
    step = f" (step {report['step']})" if report["step"] is not None else ""
    print(f"exported {report['num_tensors']} tensors, {report['total_size'] / 2**20:.2f} MiB, from "
          f"{report['source']}{step} to {report['out']} in {report['seconds']:.2f} s")
    for name, info in report["files"].items():
        print(f"  {name}: {info['tensors']} tensors, {info['bytes']:,} bytes")
    if report["index"]:
        print(f"  {report['index']}: weight map and total_size")
    print(f"dtype: {report['dtype_note']}")
    for line in report["dropped"]:
        print(f"dropped: {line}")
    if report["config"]:
        print(report["config"])
    _print_folder_files(report)
    return 0


def _print_folder_files(report: dict[str, Any]) -> None:
    """The files added beside the weights, and those that could not be (with how to add them)."""
    for line in report.get("added", []):
        print(f"added: {line}")
    for line in report.get("not_added", []):
        print(f"NOT ADDED: {line}")


def _inspect(args: argparse.Namespace) -> int:
    from fsdpkit.export.inspection import inspect_checkpoint, render_text

    report = inspect_checkpoint(args.ckpt)
    if args.json:
        _print_json(report)
    else:
        print(render_text(report, all_tensors=args.all))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from fsdpkit.export.verification import verify_checkpoint

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    report = verify_checkpoint(args.ckpt, threads=args.threads, tensors=args.tensors)
    if args.json:
        _print_json(report)
    else:
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report["checked"].items())
        for note in report["notes"]:
            print(note)
        print(f"{report['path']} ({report['kind']}): checksums {report['checksums']}; checked {checked or 'nothing'}")
        for problem in report["problems"]:
            print(f"  BAD: {problem}")
        if report["ok"] and report["values_checked"]:
            print("OK: every file and chunk is present and intact")
        elif report["ok"]:
            print("STRUCTURE OK, VALUES NOT CHECKED: every file and chunk is present and well-formed, but the "
                  "checkpoint records no checksums, so tensor values could not be checked (a flipped bit in one "
                  "would pass)")
        else:
            print(f"FAILED: {len(report['problems'])} problem(s) in {', '.join(report['bad_files']) or 'the metadata'}")
    return 0 if report["ok"] else 1


def _diff(args: argparse.Namespace) -> int:
    from fsdpkit.export.diffing import diff_checkpoints, render_text

    report = diff_checkpoints(args.a, args.b, all_tensors=args.all, namespace=args.namespace)
    if args.json:
        _print_json(report)
    else:
        print(render_text(report))
    return 0 if report["identical"] else 1


def run(args: argparse.Namespace) -> int:
    """Run the chosen `ckpt` subcommand; returns the exit code."""
    # sources and the export's output may be URLs (s3://...: read by ranged GETs, written by
    # multipart uploads; credentials and endpoint from the AWS_* environment)
    for name in ("ckpt", "a", "b", "out"):
        if isinstance(getattr(args, name, None), str):
            check_url(getattr(args, name), setting=name.upper())
    return {"export": _export, "inspect": _inspect, "verify": _verify, "diff": _diff}[args.ckpt_command](args)
