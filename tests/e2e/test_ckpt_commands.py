"""`fsdpkit ckpt export | inspect | verify | diff` as a user runs them, on a checkpoint that
`fsdpkit train --nproc 2` wrote. One real subprocess per kind of use; the rest call the CLI's
main() in-process (same parser, same exit codes) to keep the suite fast."""

from __future__ import annotations

import json
import os
import pickle
import shutil
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
    for option in ("--dtype {bf16,fp16,fp32}", "--max-shard-size", "--format {hf,single}", "--strip-prefix", "--add-prefix",
                   "model.safetensors.index.json", "_checkpoint_wrapped_module."):
        assert option in text, option
    with pytest.raises(SystemExit):
        main(["ckpt", "--help"])
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in ("export", "inspect", "verify", "diff"))


def test_inspect_shows_the_run_and_its_tensors(run_dir, capsys):
    code, out, _ = cli(capsys, "inspect", str(run_dir / "checkpoints"))
    assert code == 0
    for text in ("kind        fsdpkit", "step        2", "world size  2", "mesh        shape [2] dims ['shard']",
                 "data cursor epoch=0, position=32", "checksums   recorded for 3 files (xxh3_64) and 84 tensors (xxh3_64-rows)",
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
    for args in (["inspect", str(damaged)], ["export", str(damaged), str(tmp_path / "out")], ["diff", str(damaged), str(damaged)]):
        code, _, err = cli(capsys, *args)
        assert code == 2 and "posix.system" in err and "refusing to unpickle it (nothing was executed)" in err, args
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and "refusing to unpickle" in out
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_diff_against_exports(run_dir, tmp_path, capsys):
    assert cli(capsys, "export", str(run_dir), str(tmp_path / "fp32"))[0] == 0
    assert cli(capsys, "export", str(run_dir), str(tmp_path / "bf16.safetensors"), "--format", "single", "--dtype", "bf16")[0] == 0
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
