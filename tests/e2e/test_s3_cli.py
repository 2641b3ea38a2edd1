"""`fsdpkit train checkpoint.dir=s3://...` as a user runs it, against moto's S3 server over HTTP:
the endpoint from AWS_ENDPOINT_URL, then from checkpoint.storage_options; an unreachable bucket
stops the run before it starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import fsdpkit  # noqa: E402
from fsdpkit.train.metrics import read_records  # noqa: E402

pytestmark = pytest.mark.e2e
DEMO = ["train", "experiment=demo", "train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every=0"]


def test_train_saves_to_s3_and_resumes_from_it(s3, tmp_path, monkeypatch):
    import s3fs

    bucket = s3.new_bucket()
    ckpts = f"s3://{bucket}/demo/checkpoints"
    run = tmp_path / "run"
    first = fsdpkit(*DEMO, "train.stop_at=2", f"run_dir={run}", f"checkpoint.dir={ckpts}")
    assert first.returncode == 0, first.stderr[-4000:]
    fs = s3fs.S3FileSystem(use_listings_cache=False)
    assert fs.cat_file(f"{bucket}/demo/checkpoints/latest").decode().strip() == "step_2"
    assert not (run / "checkpoints").exists() and not Path("s3:").exists()  # nothing went to local disk

    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the endpoint from the config this time
    second = fsdpkit(*DEMO, f"run_dir={run}", f"checkpoint.dir={ckpts}",
                     f"+checkpoint.storage_options.endpoint_url={s3.endpoint}")
    assert second.returncode == 0, second.stderr[-4000:]
    resumes = [e for e in read_records(run, events=True) if e["event"] == "resume"]
    assert [(e["step"], e["path"]) for e in resumes] == [(2, f"{ckpts}/step_2")]
    assert [r["step"] for r in read_records(run)] == [1, 2, 3, 4]
    assert fs.cat_file(f"{bucket}/demo/checkpoints/latest").decode().strip() == "step_4"
    assert fs.exists(f"{bucket}/demo/checkpoints/step_4/manifest.json")


def test_an_unwritable_bucket_stops_the_run_before_it_starts(s3, tmp_path):
    proc = fsdpkit(*DEMO, f"run_dir={tmp_path}", "checkpoint.dir=s3://no-such-bucket-fsdpkit/x")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checkpoint.dir=s3://no-such-bucket-fsdpkit/x cannot be written" in proc.stderr
    assert "Check the bucket name, the credentials" in proc.stderr


def test_a_store_that_stops_answering_fails_the_save_and_latest_stays_committed(s3, tmp_path):
    """The run's endpoint (a second server, sharing the first one's buckets) goes away after a
    commit: the client's bounded retries give up, the next save fails on every rank with a clear
    error, and what `latest` names is still a committed checkpoint (read through the first server)."""
    import os
    import subprocess
    import time

    import s3fs

    from conftest import ROOT
    from s3_server import s3_server

    bucket = s3.new_bucket()
    fs = s3fs.S3FileSystem(use_listings_cache=False, client_kwargs={"endpoint_url": s3.endpoint})
    with s3_server() as doomed:
        proc = subprocess.Popen([sys.executable, "-m", "fsdpkit", "train", "--nproc", "2", "experiment=demo",
                                 "train.max_steps=200", "checkpoint.every_steps=2", "train.eval_every=0",
                                 # no on_exception save: it would retry the dead store once more
                                 "checkpoint.on_exception=false", f"run_dir={tmp_path}",
                                 f"checkpoint.dir=s3://{bucket}/run"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                # botocore's own attempts per request: 1 (the standard AWS_MAX_ATTEMPTS); s3fs
                                # still retries each request 5 times with backoff, so the run gives up in seconds
                                env={**os.environ, **doomed.env, "OMP_NUM_THREADS": "1", "AWS_MAX_ATTEMPTS": "1"})
        deadline = time.monotonic() + 300
        while not fs.exists(f"{bucket}/run/latest"):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.1)
    # the run's endpoint is gone from here on
    _, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, None), err[-3000:]
    assert "CheckpointSaveError" in err and f"s3://{bucket}/run/step_" in err, err[-3000:]
    named = fs.cat_file(f"{bucket}/run/latest").decode().strip()
    assert fs.exists(f"{bucket}/run/{named}/manifest.json")
