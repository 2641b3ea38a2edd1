"""The architectures the test matrix does not name: one tiny random folder per transformers model
type (written by `save_pretrained` in bf16, sizes shrunk generically), each trained on 2 gloo ranks
by tests/multirank/hf_matrix_worker.py (one torchrun each, so one failure does not hide the next),
and checked as the matrix checks it: step 1's loss against transformers' own, every buffer against
`from_pretrained`, a bitwise resume, fp32 masters. Minutes per architecture on 2 CPU cores: not
part of `make test`.

Usage: python tests/hf_sweep.py WORK_DIR [MODEL_TYPE ...]   (default: SWEEP below)
All 30 of SWEEP passed at e1df8f0 with transformers 5.24.0 (run through an earlier draft of this
script with the same configs; stablelm and falcon rerun through this one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from hf_folders import VOCAB, _perturb_constant_params  # noqa: E402

SWEEP = ["olmo", "olmo2", "cohere", "falcon", "stablelm", "granite", "phi", "gptj", "bloom", "opt", "qwen2_moe",
         "deepseek_v2", "deepseek_v3", "starcoder2", "gemma", "smollm3", "olmoe", "granitemoe", "glm", "exaone4",
         "llama4_text", "ernie4_5", "seed_oss", "hunyuan_v1_dense", "gpt_oss", "minimax", "lfm2", "mamba", "falcon_h1",
         "jamba"]
# Applied where the model type's config has the field. Dropout off: a training forward with dropout
# is random, and the first loss is compared with an eval-mode forward.
SMALL = dict(hidden_size=64, n_embd=64, d_model=64, num_hidden_layers=2, n_layer=2, num_layers=2,
             intermediate_size=96, ffn_dim=96, n_inner=96, num_attention_heads=4, n_head=4, num_key_value_heads=2,
             head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, n_positions=256,
             moe_intermediate_size=48, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=48, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attention_dropout=0.0, hidden_dropout=0.0,
             residual_dropout=0.0, dropout=0.0, ffn_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1,
             rotary_dim=8, partial_rotary_factor=0.5, word_embed_proj_dim=64, n_group=1, topk_group=1,
             sliding_window=32, decoder_sparse_step=1, mlp_only_layers=[])
SPECIAL = {  # what the generic sizes get wrong for a model type
    "bloom": dict(n_embed=64),
    "falcon": dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=1),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
}
NO_HEAD_DIM = {"phi", "falcon", "deepseek_v3"}  # derived from other fields there


def make(model_type: str, out: Path) -> None:
    import transformers

    base = transformers.AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in SMALL.items()
              if hasattr(base, k) and not (k == "head_dim" and model_type in NO_HEAD_DIM)}
    config = transformers.AutoConfig.for_model(model_type, **kwargs, **SPECIAL.get(model_type, {}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, seed=0)
    model.to(torch.bfloat16).save_pretrained(out)


def verdict(r: dict) -> str:
    rel = abs(r["loss"][0] - r["reference_loss"]) / r["reference_loss"]
    problems = [f"first loss {rel:.1e} from transformers'"] if not rel <= 1e-5 else []
    problems += [f"buffer {k} differs" for k, ok in r["buffers"].items() if not ok] + r["buffers_extra"]
    problems += [] if r["resumed"] == [[3, r["loss"][2], r["grad_norm"][2]]] else ["resume not bitwise"]
    problems += [] if r["param_dtypes"] == ["torch.float32"] else [f"masters {r['param_dtypes']}"]
    return "ok" if not problems else "; ".join(problems)


def main() -> None:
    work = Path(sys.argv[1])
    types = sys.argv[2:] or SWEEP
    rows = []
    for model_type in types:
        folder, out = work / "folders" / model_type, work / f"{model_type}.json"
        try:
            if not (folder / "config.json").is_file():
                make(model_type, folder)
        except Exception:  # noqa: BLE001 - a config this sweep cannot build: say so, go on
            rows.append((model_type, "no folder: " + traceback.format_exc().strip().splitlines()[-1]))
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE / "multirank" / "hf_matrix_worker.py"), str(out), str(work / "runs"), f"{model_type}={folder}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            last = [line for line in proc.stderr.splitlines() if "Error" in line]
            rows.append((model_type, f"FAILED (exit {proc.returncode}): {last[-1] if last else proc.stderr[-300:]}"))
            continue
        rows.append((model_type, verdict(json.loads(out.read_text())[model_type])))
        print(f"{model_type}: {rows[-1][1]}", flush=True)
    print("\n".join(f"| {t} | {v} |" for t, v in rows))
    sys.exit(0 if all(v == "ok" for _, v in rows) else 1)


if __name__ == "__main__":
    main()
