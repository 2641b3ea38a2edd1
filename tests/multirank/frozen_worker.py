"""Frozen weights written once (checkpoint/frozen.py) on 2 gloo ranks. Usage: frozen_worker.py OUT_DIR

A LoRA-shaped model: a frozen `base` (requires_grad=False, not in the optimizer) and trainable
`head` and adapters, FSDP2-sharded, saved with keep_last=2:
- steps 1-4: every save references one shared directory (written by step 1);
- step 5: a frozen weight is changed on purpose through `.data` (which no version counter sees)
  before the save: the save must write the frozen tensors again;
- step 6: retention deletes step_4, the last reference to the first shared directory;
- then a second model (another seed) resumes with resume=auto and dumps what it holds;
- a third Checkpointer saves twice with async_save.
Rank 0 writes OUT_DIR/report.json and full state dicts (torch.save, for the test to compare with
torch.equal): dump_<step>.pt after each of steps 4, 5, 6, and resumed.pt after the resume.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from fsdpkit import dist
from fsdpkit.checkpoint.manager import Checkpointer
from fsdpkit.checkpoint.safe_io import read_dcp_metadata


class LoraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 8)
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x)) + self.lora_b(self.lora_a(x))


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LoraNet()
    model.base.requires_grad_(False)
    for layer in (model.base[0], model.base[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole, on CPU (collective)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, state in osd.get("state", {}).items():  # rank 0 alone holds the full state
        out.update({f"optim.{fqn}.{name}": v.clone() for name, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def describe(root: Path, step: int) -> dict:
    ckpt = root / f"step_{step}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return {"step": step, "format_version": manifest["format_version"],
            "shared": [ref["dir"] for ref in manifest.get("shared", [])],
            "shared_keys": [ref["keys"] for ref in manifest.get("shared", [])],
            "bytes": sum(manifest["bytes_per_rank"]),
            "metadata_keys": sorted(read_dcp_metadata(ckpt).state_dict_metadata),
            "on_disk": sorted(p.name for p in root.iterdir()),
            "shared_on_disk": sorted(p.name for p in (root / "shared").iterdir()) if (root / "shared").is_dir() else []}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group(backend="gloo")
    root = out / "ckpt"
    model, opt = build(0)
    ck = Checkpointer(root, model=model, optimizer=opt, keep_last=2)
    ck.resume()
    report: dict = {"saves": []}
    for step in range(1, 7):
        train_step(model, opt)
        if step == 5:
            with torch.no_grad():
                model.base[0].weight.data.add_(1.0)  # `.data`: invisible to the version counter
        ck.save(step)
        if dist.is_main():
            report["saves"].append(describe(root, step))
        if step >= 4:
            dump = full_state(model, opt)
            if dist.is_main():
                torch.save(dump, out / f"dump_{step}.pt")
    ck.close()

    fresh, fresh_opt = build(1)
    resumed = Checkpointer(root, model=fresh, optimizer=fresh_opt, keep_last=2)
    report["resumed_step"] = resumed.resume()
    dump = full_state(fresh, fresh_opt)
    if dist.is_main():
        torch.save(dump, out / "resumed.pt")
    resumed.close()

    amodel, aopt = build(2)
    background = Checkpointer(out / "async", model=amodel, optimizer=aopt, async_save=True)
    background.resume()
    for step in (1, 2):
        train_step(amodel, aopt)
        background.save(step)
    background.close()
    if dist.is_main():
        report["async"] = [describe(out / "async", step) for step in (1, 2)]
        (out / "report.json").write_text(json.dumps(report))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
