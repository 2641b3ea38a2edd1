"""Checkpoints on object storage (issue 13), against moto's S3 server over real HTTP: sync and async
saves, bitwise same-world-size resume, elastic 2->3 resume, a rank killed mid-upload, retention,
verification of corrupt and missing objects, and a crafted `.metadata` refused. One module fixture
runs the three launches of s3_worker.py; the tests read what they left behind."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, torchrun  # noqa: E402
from faults import env as faults_env  # noqa: E402
from faults import fired, kill_mid_write, mid_tensor_bytes  # noqa: E402
from fsdpkit.checkpoint.errors import UnsafeCheckpointError  # noqa: E402

pytestmark = pytest.mark.dist
WORKER = ROOT / "tests" / "multirank" / "s3_worker.py"


def _launch_expecting_failure(nproc: int, *args: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode != 0, f"the launch with a rank killed mid-upload succeeded:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):
    import s3fs

    out = tmp_path_factory.mktemp("s3")
    work = out / "work"
    bucket = s3.new_bucket()
    res: dict = {}
    torchrun(2, WORKER, "ws2", str(out / "ws2.json"), str(work), bucket, env=s3.env)
    res.update(json.loads((out / "ws2.json").read_text()))
    fs = s3fs.S3FileSystem(use_listings_cache=False)
    res["latest_before_kill"] = fs.cat_file(f"{bucket}/src/checkpoints/latest").decode().strip()
    # rank 1 dies halfway through the tensor bytes of its step-8 shard (sized like its step-4 one)
    first_tensor, size, after = mid_tensor_bytes(f"s3://{bucket}/src/checkpoints/step_4", rank=1)
    marker = out / "faults.jsonl"
    killed = _launch_expecting_failure(2, "kill", str(out / "kill.json"), str(work), bucket,
                                       env={**s3.env, **faults_env(kill_mid_write(step=8, rank=1, after_bytes=after),
                                                                   marker=marker)})
    res["killed_stderr"] = killed.stderr
    res["kill_fired"], res["kill_span"] = fired(marker), (first_tensor, after, size)
    res["latest_after_kill"] = fs.cat_file(f"{bucket}/src/checkpoints/latest").decode().strip()
    res["step8_after_kill"] = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/src/checkpoints/step_8"))
    # the source run's step 4 as a Hugging Face folder, on local disk and in the bucket (init_from)
    from fsdpkit.export import export_checkpoint

    fs.get(f"{bucket}/src/checkpoints/step_4", str(work / "src_step_4"), recursive=True)
    export_checkpoint(work / "src_step_4", work / "hf")
    fs.put(str(work / "hf"), f"{bucket}/hf", recursive=True)
    torchrun(3, WORKER, "ws3", str(out / "ws3.json"), str(work), bucket, env=s3.env)
    res.update(json.loads((out / "ws3.json").read_text()))
    return res, work, bucket, fs


def test_sync_and_async_saves_resume_bitwise_from_s3(runs):
    res, _, bucket, _ = runs
    reference = res["full"]["losses"]
    assert len(reference) == 8
    for name in ("sync", "async"):
        parts = res[name]
        starts = [0, 3, 6] if name == "sync" else [0, 6]
        assert [p["start"] for p in parts] == starts, name
        assert parts[0]["resumed_from"] is None
        for part, start in zip(parts[1:], starts[1:], strict=True):  # the resume event and its step
            assert part["resumed_from"] == f"s3://{bucket}/{name}/checkpoints/step_{start}"
        assert [x for p in parts for x in p["losses"]] == reference, name  # exact float equality


def test_retention_on_s3_keeps_the_newest_and_latest(runs):
    _, _, bucket, fs = runs
    for name in ("sync", "async"):
        root = f"{bucket}/{name}/checkpoints"
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["latest", "step_8"], name
        assert fs.cat_file(f"{root}/latest").decode().strip() == "step_8"
        manifest = json.loads(fs.cat_file(f"{root}/step_8/manifest.json"))
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/step_8"))
        assert names == sorted([*manifest["files"], "manifest.json"])  # shards, .metadata, the commit
        for file, info in manifest["files"].items():
            assert fs.size(f"{root}/step_8/{file}") == info["size"]


def test_rank_killed_mid_upload_leaves_latest_on_the_previous_checkpoint(runs):
    res, _, bucket, _ = runs
    assert res["latest_before_kill"] == "step_4"
    (kill,), (first_tensor, after, size) = res["kill_fired"], res["kill_span"]  # it landed in the upload's tensor bytes
    assert (kill["step"], kill["rank"], kill["file"]) == (8, 1, "__1_0.distcp"), kill
    assert first_tensor < kill["bytes_written"] == after < size, (kill, first_tensor, size)
    assert "SIGKILL" in res["killed_stderr"]  # the launch failed because rank 1 was killed
    assert res["latest_after_kill"] == "step_4"
    assert "manifest.json" not in res["step8_after_kill"]  # never committed
    after = res["after_kill"]  # auto-resume, on 3 ranks
    assert after["resumed_from"] == f"s3://{bucket}/src/checkpoints/step_4" and after["start"] == 4
    assert after["losses"] and after["mesh"] == [3]


def test_elastic_two_to_three_from_s3_restores_state_bitwise(runs):
    res, work, bucket, fs = runs
    saved, loaded = torch.load(work / "saved_src.pt"), torch.load(work / "loaded_elastic.pt")
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    elastic = res["elastic"]
    assert elastic["resumed_from"] == f"s3://{bucket}/src/checkpoints/step_4" and elastic["start"] == 4
    assert elastic["mesh"] == [3]
    reference = res["full"]["losses"][4:]
    assert max(abs(a - b) / b for a, b in zip(elastic["losses"], reference, strict=True)) < 1e-5
    manifest = json.loads(fs.cat_file(f"{bucket}/elastic/checkpoints/step_8/manifest.json"))
    assert manifest["world_size"] == 3 and len([f for f in manifest["files"] if f.endswith(".distcp")]) == 3


def test_ckpt_tools_read_s3_and_export_equals_the_local_export(runs, tmp_path, capsys):
    from fsdpkit.cli.main import main

    _, _, bucket, fs = runs
    source = f"s3://{bucket}/sync/checkpoints"
    fs.get(f"{bucket}/sync/checkpoints", str(tmp_path / "checkpoints"), recursive=True)  # the same bytes, local
    assert main(["ckpt", "inspect", source]) == 0
    assert f"{source}/step_8" in capsys.readouterr().out
    assert main(["ckpt", "verify", source]) == 0
    assert "OK: every file and chunk is present and intact" in capsys.readouterr().out
    assert main(["ckpt", "diff", f"{source}/step_8", str(tmp_path / "checkpoints" / "step_8")]) == 0
    assert main(["ckpt", "export", source, str(tmp_path / "from_s3")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "checkpoints"), str(tmp_path / "from_local")]) == 0
    files = sorted(p.name for p in (tmp_path / "from_local").iterdir())
    assert "model.safetensors" in files and sorted(p.name for p in (tmp_path / "from_s3").iterdir()) == files
    for name in files:
        assert (tmp_path / "from_s3" / name).read_bytes() == (tmp_path / "from_local" / name).read_bytes(), name
    # to the bucket: the same bytes as the local export, refused over an existing output without --overwrite
    out = f"{bucket}/exports/hf"
    assert main(["ckpt", "export", str(tmp_path / "checkpoints"), f"s3://{out}"]) == 0
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(out)) == files
    for name in files:
        assert fs.cat_file(f"{out}/{name}") == (tmp_path / "from_local" / name).read_bytes(), name
    capsys.readouterr()
    assert main(["ckpt", "export", source, f"s3://{out}"]) == 2
    assert f"s3://{out} already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["ckpt", "export", source, f"s3://{out}", "--overwrite"]) == 0
    assert fs.cat_file(f"{out}/model.safetensors") == (tmp_path / "from_local" / "model.safetensors").read_bytes()
    fs.pipe_file(f"{bucket}/exports/notes/readme.txt", b"mine")
    assert main(["ckpt", "export", source, f"s3://{bucket}/exports/notes", "--overwrite"]) == 2
    assert "it holds readme.txt, which an export does not write" in capsys.readouterr().err
    assert main(["ckpt", "export", source, f"{source}/step_8/out"]) == 2
    assert "it overlaps the source" in capsys.readouterr().err
    assert fs.cat_file(f"{bucket}/exports/notes/readme.txt") == b"mine"
    single = ["--format", "single", "--dtype", "fp32"]  # one object, complete when it appears
    assert main(["ckpt", "export", source, str(tmp_path / "one.safetensors"), *single]) == 0
    assert main(["ckpt", "export", source, f"s3://{bucket}/exports/one.safetensors", *single]) == 0
    assert fs.cat_file(f"{bucket}/exports/one.safetensors") == (tmp_path / "one.safetensors").read_bytes()


def test_verify_names_a_corrupt_object_and_a_missing_shard(runs, capsys):
    from fsdpkit.checkpoint.manifest import read_manifest
    from fsdpkit.checkpoint.resolve import committed_candidates
    from fsdpkit.checkpoint.resume import verify_files
    from fsdpkit.checkpoint.storage import open_storage
    from fsdpkit.cli.main import main

    _, _, bucket, fs = runs
    src, dst = f"{bucket}/sync/checkpoints/step_8", f"{bucket}/damaged/checkpoints/step_8"
    fs.copy(src, dst, recursive=True)
    ckpt = open_storage(f"s3://{dst}")
    manifest = read_manifest(ckpt)
    assert verify_files(ckpt, manifest) == []
    shard0, shard1 = sorted(f for f in manifest["files"] if f.endswith(".distcp"))
    data = bytearray(fs.cat_file(f"{dst}/{shard0}"))
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    fs.pipe_file(f"{dst}/{shard0}", bytes(data))
    fs.rm_file(f"{dst}/{shard1}")
    problems = verify_files(ckpt, manifest)
    assert len(problems) == 2
    assert any(f"s3://{dst}/{shard0} fails its checksum" in p for p in problems)
    assert any(f"s3://{dst}/{shard1} is missing" in p for p in problems)
    assert committed_candidates(open_storage(f"s3://{bucket}/damaged/checkpoints")) == []  # never resumed
    assert main(["ckpt", "verify", f"s3://{dst}"]) == 1
    out = capsys.readouterr().out
    assert f"BAD: s3://{dst}/{shard0} fails its checksum" in out and f"s3://{dst}/{shard1} is missing" in out


def test_crafted_metadata_on_s3_is_refused_without_running_code(runs, tmp_path):
    from fsdpkit.checkpoint.io import safe_reader
    from fsdpkit.checkpoint.storage import open_storage

    _, _, bucket, fs = runs
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    fs.pipe_file(f"{bucket}/crafted/step_1/.metadata", pickle.dumps(Exploit()))
    with pytest.raises(UnsafeCheckpointError, match=r"asks to load `(posix|os)\.system`"):
        safe_reader(open_storage(f"s3://{bucket}/crafted/step_1")).read_metadata()
    assert not marker.exists()


def test_init_from_a_hugging_face_folder_in_the_bucket_equals_the_local_folder(runs):
    """model.init_from=hf:s3://...: 3 ranks (vocab 1001 splits unevenly) each read their own rows by
    ranged GETs; the weights equal those loaded from the same folder on local disk, bit for bit."""
    res, work, bucket, fs = runs
    local, remote = torch.load(work / "init_local.pt"), torch.load(work / "init_s3.pt")
    weights = [k for k in local if k.startswith("model.")]
    assert weights and any("embed_tokens" in k for k in weights)
    for key in weights:
        assert torch.equal(local[key], remote[key]), key
    saved = torch.load(work / "saved_src.pt")  # what the folder was exported from (fp32: exact)
    for key in weights:
        assert torch.equal(saved[key], remote[key]), key


def test_local_dir_mirror_serves_the_restart_until_its_manifest_differs(runs):
    """checkpoint.local_dir: the resume event names the local copy and the remote checkpoint it
    mirrors; a copy whose manifest differs from the remote one by one byte is not read, nor one
    whose shard is corrupt; retention of the bucket reaches the copy; the resumed run's losses
    equal an uninterrupted run's, bit for bit."""
    res, work, bucket, fs = runs
    first, second, third, fourth = res["mirror"]
    remote, local = f"s3://{bucket}/mirror/checkpoints", work / "mirror"
    assert first["resume_event"] is None
    assert list(first["mirror_after"]) == ["step_3"]
    assert second["resume_event"] == {"step": 3, "path": str(local / "step_3"), "mirror_of": f"{remote}/step_3"}
    assert second["resumed_from"] == str(local / "step_3") and second["start"] == 3
    assert list(second["mirror_after"]) == ["step_6"]  # step_3 went with the bucket's keep_last=1
    assert third["resume_event"] == {"step": 6, "path": f"{remote}/step_6", "mirror_of": None}  # changed copy: bucket
    assert [x for p in res["mirror"] for x in p["losses"]] == res["full"]["losses"]
    manifest = json.loads(fs.cat_file(f"{bucket}/mirror/checkpoints/step_8/manifest.json"))
    assert third["mirror_after"] == {"step_8": sorted([*manifest["files"], "manifest.json"])}
    # a shard of the copy corrupted (same size): the load's checksums catch it, the bucket is read
    assert fourth["resume_event"] == {"step": 8, "path": f"{remote}/step_8", "mirror_of": None}
    aside = [n for n in fourth["mirror_after"] if n.startswith("step_8.corrupt")]  # moved aside, not deleted
    assert len(aside) == 1 and "step_8" not in fourth["mirror_after"]
    corrupted = sorted(f for f in manifest["files"] if f.endswith(".distcp"))[0]
    for name in [*manifest["files"], "manifest.json"]:  # else the copy holds the bucket's bytes
        mine, theirs = (local / aside[0] / name).read_bytes(), fs.cat_file(f"{bucket}/mirror/checkpoints/step_8/{name}")
        assert (sum(a != b for a, b in zip(mine, theirs,
                                           strict=True)) == 1) if name == corrupted else mine == theirs, name


def test_overlapped_upload_writes_parts_small_files_and_aborts_cleanly(s3):
    """storage/multipart.py on the S3 server: a file of several parts written in odd-sized pieces, a file
    smaller than a part (one PUT), and an aborted upload that leaves no object and no upload behind."""
    import boto3
    import s3fs

    from fsdpkit.checkpoint.storage.multipart import OverlappedUpload

    bucket, fs = s3.new_bucket(), s3fs.S3FileSystem(use_listings_cache=False)
    data = os.urandom((11 << 20) + 12345)
    for size in (1000, len(data)):
        upload = OverlappedUpload(fs, f"{bucket}/f{size}", part_bytes=5 << 20, in_flight=2)
        for start in range(0, size, 777_777):
            upload.write(data[start:min(size, start + 777_777)])
        assert upload.tell() == size and not fs.exists(f"{bucket}/f{size}")  # nothing visible before commit
        upload.commit()
        assert fs.cat_file(f"{bucket}/f{size}") == data[:size]
    upload = OverlappedUpload(fs, f"{bucket}/aborted", part_bytes=5 << 20, in_flight=2)
    upload.write(data)
    upload.abort()
    assert not fs.exists(f"{bucket}/aborted")
    assert not boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads")
    with pytest.raises(ValueError, match="FSDPKIT_REMOTE_PART_BYTES must be >= 5242880"):
        OverlappedUpload(fs, f"{bucket}/x", part_bytes=1 << 20)


def test_export_on_finish_to_a_bucket_equals_the_local_export(runs, tmp_path):
    """export.dir=s3://...: the trainer's end-of-run export (preflight probe and destination check
    included) writes the objects the same export writes to local disk."""
    from fsdpkit.config import compose_config
    from fsdpkit.train.preflight import check_directories
    from fsdpkit.train.run import export_final

    _, _, bucket, fs = runs
    fs.get(f"{bucket}/sync/checkpoints", str(tmp_path / "checkpoints"), recursive=True)
    base = [f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'checkpoints'}", "export.on_finish=true"]
    local, remote = tmp_path / "export", f"{bucket}/final"
    for out in (str(local), f"s3://{remote}"):
        cfg = compose_config([*base, f"export.dir={out}"])
        check_directories(cfg)
        assert export_final(cfg)["out"] == out
    files = sorted(p.name for p in local.iterdir())
    assert "config.json" in files and sorted(p.rsplit("/", 1)[-1] for p in fs.find(remote)) == files
    for name in files:
        assert fs.cat_file(f"{remote}/{name}") == (local / name).read_bytes(), name
