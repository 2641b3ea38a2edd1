"""`fsdpkit ckpt export | inspect | verify | diff` as a user runs them, on a checkpoint that
`fsdpkit train --nproc 2` wrote. One real subprocess per kind of use; the rest call the CLI's
main() in-process (same parser, same exit codes) to keep the suite fast."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.checkpoint.hashing import file_checksum  # noqa: E402
from fsdpkit.checkpoint.manifest import SEAL, manifest_digest  # noqa: E402
from fsdpkit.cli.main import main  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ckpt_cli") / "run"
    proc = fsdpkit("train", "--nproc", "2", "experiment=demo", "train.max_steps=2", "train.eval_samples=4",
                   "train.progress=false", f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["ckpt", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_command_writes_a_hugging_face_folder(run_dir, tmp_path):
    out = tmp_path / "hf"
    proc = fsdpkit("ckpt", "export", str(run_dir), str(out), "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from {run_dir / 'checkpoints' / 'step_2'} (step 2) to {out}" in proc.stdout
    assert "dtype: wrote bfloat16, converted from the checkpoint's float32 (the run's master weights)" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_help_texts_describe_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["ckpt", "export", "--help"])
    text = capsys.readouterr().out
    for option in ("--dtype {bf16,fp16,fp32}", "--max-shard-size", "--format {hf,single}", "--strip-prefix",
                   "--add-prefix", "model.safetensors.index.json", "_checkpoint_wrapped_module."):
        assert option in text, option
    with pytest.raises(SystemExit):
        main(["ckpt", "--help"])
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in ("export", "inspect", "verify", "diff"))


def test_inspect_shows_the_run_and_its_tensors(run_dir, capsys):
    code, out, _ = cli(capsys, "inspect", str(run_dir / "checkpoints"))
    assert code == 0
    for text in ("kind        fsdpkit", "step        2", "world size  2", "mesh        shape [2] dims ['shard']",
                 "data cursor epoch=0, position=32",
                 "checksums   recorded for 3 files (xxh3_64) and 84 tensors (xxh3_64-rows)",
                 "AdamW step 2", "exp_avg     21 tensors", "bytes per rank  rank 0:",
                 "model.model.embed_tokens.weight", "dim 0: 2 x 256 rows", "26 pickled items (listed, never loaded)"):
        assert text in out, text
    code, out, _ = cli(capsys, "inspect", str(run_dir / "checkpoints"), "--json")
    report = json.loads(out)
    assert report["world_size"] == 2 and report["config"]["model"]["hidden_size"] == 128
    assert report["groups"]["model"]["tensors"] == 21 and report["optimizer_states"]["exp_avg"]["tensors"] == 21


@pytest.fixture
def damaged(run_dir, tmp_path) -> Path:
    ckpt = tmp_path / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", ckpt)
    return ckpt


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_passes_intact_and_names_every_bad_file(run_dir, damaged, capsys):
    code, out, _ = cli(capsys, "verify", str(run_dir), "--tensors")
    assert code == 0 and "OK: every file and chunk is present and intact" in out and "84 tensors" in out
    _flip(damaged / "__1_0.distcp")
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and f"BAD: {damaged / '__1_0.distcp'} fails its checksum" in out
    code, _, err = cli(capsys, "export", str(damaged), str(damaged.parent / "out"), "--verify")
    assert code == 2 and "failed verification; nothing was exported" in err and not (damaged.parent / "out").exists()
    os.truncate(damaged / "__0_0.distcp", 1000)
    (damaged / ".metadata").unlink()
    code, out, _ = cli(capsys, "verify", str(damaged), "--json")
    report = json.loads(out)
    assert code == 1 and report["bad_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert f"{damaged / '.metadata'} is missing" in report["problems"]
    assert f"{damaged / '__0_0.distcp'} has 1000 bytes, expected" in "\n".join(report["problems"])


def test_verify_catches_a_truncated_or_missing_file_on_its_own(damaged, capsys):
    os.truncate(damaged / "__1_0.distcp", 5000)
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and "FAILED: 1 problem(s) in __1_0.distcp" in out
    (damaged / "__1_0.distcp").unlink()
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and f"{damaged / '__1_0.distcp'} is missing" in out


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_inspect_export_and_diff_refuse_crafted_metadata_without_running_it(damaged, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (damaged / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((damaged / "manifest.json").read_text())  # a careful attacker fixes the checksums too
    size, digest = file_checksum(damaged / ".metadata")
    manifest["files"][".metadata"] = {"size": size, "xxh3_64": digest}
    manifest[SEAL] = manifest_digest(manifest)
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    for args in (["inspect", str(damaged)], ["export", str(damaged), str(tmp_path / "out")],
                 ["diff", str(damaged), str(damaged)]):
        code, _, err = cli(capsys, *args)
        assert code == 2 and "posix.system" in err and "refusing to unpickle it (nothing was executed)" in err, args
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and "refusing to unpickle" in out
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_diff_against_exports(run_dir, tmp_path, capsys):
    assert cli(capsys, "export", str(run_dir), str(tmp_path / "fp32"))[0] == 0
    bf16_export = ("export", str(run_dir), str(tmp_path / "bf16.safetensors"), "--format", "single", "--dtype", "bf16")
    assert cli(capsys, *bf16_export)[0] == 0
    code, out, _ = cli(capsys, "diff", str(run_dir), str(tmp_path / "fp32"))
    assert code == 0 and "21 tensors compared: 21 equal, 0 differ" in out and out.rstrip().endswith("identical")
    code, out, _ = cli(capsys, "diff", str(run_dir), str(tmp_path / "bf16.safetensors"), "--json")
    report = json.loads(out)
    assert code == 1 and len(report["dtype_changed"]) == 21 and not report["only_in_a"] and not report["only_in_b"]
    assert all(0 < s["rel"] < 4e-3 for s in report["tensors"].values() if not s["equal"])  # bf16 rounding (2**-8)


def test_user_errors_exit_2_with_a_reason(run_dir, tmp_path, capsys):
    code, _, err = cli(capsys, "inspect", str(tmp_path / "nothing"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    code, _, err = cli(capsys, "export", str(run_dir), str(tmp_path / "out"))
    assert code == 2 and "already exists; pass --overwrite" in err
    code, _, err = cli(capsys, "export", str(run_dir), str(tmp_path / "o2"), "--max-shard-size", "lots")
    assert code == 2 and "cannot read 'lots' as a size" in err


@pytest.fixture
def run_copy(run_dir, tmp_path) -> Path:
    """A private copy of the trained run (config.yaml, metrics.jsonl, checkpoints/step_2, latest)."""
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_never_overwrites_the_checkpoint_or_the_run(run_copy, tmp_path, capsys):
    before = _listing(run_copy)
    ckpts = run_copy / "checkpoints"
    (tmp_path / "alias").symlink_to(run_copy)
    cases = [(ckpts / "step_2", "is the source checkpoint"), (ckpts, "is its checkpoints root"),
             (run_copy, "is the run directory"), (ckpts / "step_2" / "hf", "lies inside the source checkpoint"),
             (ckpts / "hf", "lies inside its checkpoints root"), (tmp_path, "contains the source checkpoint"),
             (tmp_path / "alias" / "checkpoints", "is its checkpoints root")]
    for out, relation in cases:
        for source in (run_copy, ckpts, ckpts / "step_2"):
            code, _, err = cli(capsys, "export", str(source), str(out), "--overwrite")
            assert code == 2 and f"refusing to export to {out}: it {relation}" in err, (source, out, err)
    code, _, err = cli(capsys, "export", str(run_copy), str(run_copy / "metrics.jsonl"),
                       "--format", "single", "--overwrite")
    assert code == 2 and "refusing to replace" in err and "is not a safetensors file" in err
    assert _listing(run_copy) == before and not list(tmp_path.glob(".*tmp-*"))

    out = run_copy / "export"  # beside checkpoints/ (the default export.dir): allowed, and replaced only as an export
    assert cli(capsys, "export", str(run_copy), str(out))[0] == 0
    assert cli(capsys, "export", str(run_copy), str(out), "--overwrite", "--dtype", "bf16")[0] == 0
    (out / "README.md").write_text("my notes")
    code, _, err = cli(capsys, "export", str(run_copy), str(out), "--overwrite")
    assert code == 2 and "it holds README.md, which an export does not write" in err
    assert (out / "README.md").read_text() == "my notes"


def test_export_on_finish_deletes_nothing_it_did_not_write(run_copy):
    from fsdpkit.config import compose_config
    from fsdpkit.train.run import export_final

    before = _listing(run_copy)
    for export_dir, relation in ((run_copy, "is the run directory"),
                                 (run_copy / "checkpoints", "is its checkpoints root")):
        cfg = compose_config(["experiment=demo", f"run_dir={run_copy}", f"export.dir={export_dir}"])
        with pytest.raises(ValueError, match=f"it {relation}"):
            export_final(cfg)
    mine = run_copy / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"x")
    cfg = compose_config(["experiment=demo", f"run_dir={run_copy}", f"export.dir={mine}"])
    with pytest.raises(ValueError, match="refusing to replace .*it holds data.bin"):
        export_final(cfg)
    assert _listing(run_copy) == {**before, "mine/data.bin": 1}
    cfg = compose_config(["experiment=demo", f"run_dir={run_copy}"])  # the default export.dir: <run_dir>/export
    export_final(cfg)
    export_final(cfg)  # replaces its own earlier export
    exported = sorted(p.name for p in (run_copy / "export").iterdir())
    assert exported == ["config.json", "generation_config.json", "model.safetensors"]


def test_verify_names_an_uncommitted_checkpoint_and_a_junk_latest(run_copy, capsys):
    ckpts = run_copy / "checkpoints"
    shutil.copytree(ckpts / "step_2", ckpts / "step_4")
    (ckpts / "step_4" / "manifest.json").unlink()  # DCP files complete, never committed
    code, out, _ = cli(capsys, "verify", str(ckpts / "step_4"))
    assert code == 1 and f"BAD: NOT COMMITTED: {ckpts / 'step_4'} has no manifest.json" in out and "OK" not in out
    code, _, err = cli(capsys, "export", str(ckpts / "step_4"), str(run_copy / "out"))
    assert code == 2 and "NOT COMMITTED" in err
    for junk, what in ((b"\xff\xd8\xff\xe0binary", "is not text"), (b"", "is empty"),
                       (b"step_99\n", "names step_99, which does not exist")):
        (ckpts / "latest").write_bytes(junk)
        code, out, _ = cli(capsys, "verify", str(run_copy))
        assert code == 1 and f"BAD: {ckpts / 'latest'} {what}" in out and "FAILED: 1 problem(s) in latest" in out
        code, _, err = cli(capsys, "inspect", str(ckpts))
        assert code == 2 and f"{ckpts / 'latest'} {what}" in err


@pytest.mark.parametrize("args", [["ckpt", "inspect", "RUN", "--all"], ["config", "docs"]])
def test_a_closed_stdout_pipe_ends_quietly(run_dir, args):
    """`fsdpkit ... | head -1`: the reader is gone before the output is written; no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "fsdpkit", *[str(run_dir) if a == "RUN" else a for a in args]],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr[-2000:]  # 128 + SIGPIPE, as a shell reports `head`'s writer
    assert "Traceback" not in proc.stderr
    assert "BrokenPipeError" not in proc.stderr
    assert "Exception ignored" not in proc.stderr
