"""Resume the checked-in format-3 checkpoint (a copy of tests/fixtures/ckpt_format3) on 2 gloo ranks.

    format3_fixture_worker.py FIXTURE_COPY OUT.json WORK_DIR

Builds the maker's model (another seed, so nothing matches by chance), resumes its step_2 as a user
would (resume=<path>: file checksums checked before loading, the shared files included; tensor
checksums after), writes the restored model and AdamW state, gathered, to
WORK_DIR/loaded_state.safetensors (rank 0), trains the step the maker recorded and reports its loss.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from make_ckpt_format3 import build, full_state, train_step  # noqa: E402  (the maker's model and dump)

from fsdpkit import dist  # noqa: E402
from fsdpkit.checkpoint.manager import Checkpointer  # noqa: E402


def main() -> None:
    fixture, out_path, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    expected = json.loads((fixture / "expected.json").read_text())
    dist.init_process_group(backend="gloo")
    model, opt = build(7)
    ck = Checkpointer(work / "checkpoints", model=model, optimizer=opt,
                      resume=str(fixture / "checkpoints" / f"step_{expected['saved_step']}"))
    start = ck.resume()
    loaded = full_state(model, opt)
    ck.close()
    loss = train_step(model, opt, expected["next_step"]["step"], dist.rank())
    if dist.is_main():
        save_file(loaded, str(work / "loaded_state.safetensors"))
        out_path.write_text(json.dumps({"start": start, "loss": loss, "resumed": ck.resumed.step}))
    del model, opt, ck
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
