"""Build data.kind=hf datasets on every rank under torchrun and report who tokenized.

Usage: hf_cache_worker.py OUT_JSON TOKENIZER_DIR DATA_FILE CACHE_DIR
Rank 0 writes OUT_JSON: per rank, whether it built the cache, the cache key and info.json's
built_at, and a digest of the first training samples (every rank must read the same data).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch.distributed as tdist

from fsdpkit import dist
from fsdpkit.config import compose_config
from fsdpkit.data import build_datasets


def main() -> None:
    out, tok, data, cache = sys.argv[1:5]
    dist.init_process_group(backend="gloo")
    cfg = compose_config(["data=hf", f"data.files=[{data}]", f"data.tokenizer={tok}", f"data.cache_dir={cache}",
                          "data.messages_field=messages", "data.seq_len=32"]).data
    train, _ = build_datasets(cfg, vocab_size=512, seed=0)
    mine = {"rank": dist.rank(), "built": train.corpus.built, "key": train.corpus.key,
            "built_at": train.corpus.info["built_at"],
            "samples": hashlib.sha256(train.labeled_batch(list(range(8)))[1].numpy().tobytes()).hexdigest()}
    everyone = [None] * dist.world_size()
    tdist.all_gather_object(everyone, mine)
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(everyone, f)
    del train
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
