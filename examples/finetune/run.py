"""Fine-tune end to end on this machine, with nothing downloaded:

  1. train a BPE tokenizer on the example's data (prepare.py);
  2. pretrain model=hf_llama_tiny on data/text.jsonl and export it (a Hugging Face folder);
  3. chat SFT with LoRA from that export (model.init_from=hf:), assistant-only loss;
  4. export the adapter (PEFT folder) and the merged model; load both back with peft and
     transformers, check they agree, and answer a question with the merged model.

    python examples/finetune/run.py [--out runs/finetune] [--nproc 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sh(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def train(nproc: int, *overrides: str) -> None:
    sh(sys.executable, "-m", "fsdpkit", "train", "--nproc", str(nproc), f"--config-dir={HERE / 'conf'}",
       "train.progress=false", *overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/finetune"))
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    out = args.out.resolve()
    tok, cache = out / "tokenizer", out / "data-cache"
    data = [f"data.tokenizer={tok}", f"data.cache_dir={cache}"]
    sh(sys.executable, str(HERE / "prepare.py"), str(tok))
    train(args.nproc, "experiment=finetune_pretrain", f"data.files=[{HERE / 'data' / 'text.jsonl'}]", *data,
          f"run_dir={out / 'pretrain'}", "checkpoint.resume=none")
    base = out / "pretrain" / "export"
    train(args.nproc, "experiment=finetune_sft", f"data.files=[{HERE / 'data' / 'chat.jsonl'}]", *data,
          f"model.init_from=hf:{base}", f"run_dir={out / 'sft'}", "checkpoint.resume=none")
    sh(sys.executable, "-m", "fsdpkit", "ckpt", "export", str(out / "sft"), str(out / "adapter"), "--adapter",
       "--overwrite")
    sh(sys.executable, "-m", "fsdpkit", "ckpt", "export", str(out / "sft"), str(out / "merged"), "--merge",
       "--overwrite")
    check(base=base, adapter=out / "adapter", merged=out / "merged", tokenizer=tok)


def check(*, base: Path, adapter: Path, merged: Path, tokenizer: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
    messages = [{"role": "system", "content": "You answer arithmetic questions in words."},
                {"role": "user", "content": "What is two plus three?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (peft_model(ids).logits - merged_model(ids).logits).abs().max().item()
        answer = merged_model.generate(ids, max_new_tokens=12, do_sample=False,
                                       eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                                       pad_token_id=tok.pad_token_id)
    print(f"peft adapter vs merged model: max |logit difference| {diff:.2e}")
    print(f"Q: What is two plus three?\nA: {tok.decode(answer[0, ids.shape[1]:], skip_special_tokens=True)}")


if __name__ == "__main__":
    main()
