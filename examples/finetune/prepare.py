"""Train the example's tokenizer on its own data (byte-level BPE with the `tokenizers` library, a
few seconds, no download) and save it as a transformers tokenizer folder with a chat template."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdpkit.data.tokenizer import train_bpe_tokenizer

HERE = Path(__file__).resolve().parent


def texts() -> list[str]:
    out = [json.loads(line)["text"] for line in open(HERE / "data" / "text.jsonl")]
    for line in open(HERE / "data" / "chat.jsonl"):
        out.extend(m["content"] for m in json.loads(line)["messages"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="tokenizer folder to write")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="at most the model's vocabulary (512 for hf_llama_tiny)")
    args = parser.parse_args()
    tok = train_bpe_tokenizer(texts(), vocab_size=args.vocab_size, out_dir=args.out)
    print(f"tokenizer with {len(tok)} tokens written to {args.out}")


if __name__ == "__main__":
    main()
