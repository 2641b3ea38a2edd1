"""Save-plan caching (checkpoint/save.py PlanCache) on 2 gloo ranks. Usage: plan_cache_worker.py OUT.json WORK_DIR

Two Checkpointers in one process (a model with its optimizer, and an EMA copy without one, each with
a tensor in its `state`) save alternately, four times each; at the third save the `state` tensor of
the first changes shape (a new plan). After every save, the same state is saved again without plan
caching (save_checkpoint with a plain DCP planner) beside it, the independent reference: each rank
reports the SHA-256 of its DCP files and of what `.metadata` says (unpickled safely, its per-save ids
aside) for both, and whether DCP's local plan of the cached save was the cached one (sent empty).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.fsdp import fully_shard

from fsdpkit import dist
from fsdpkit.checkpoint.manager import Checkpointer
from fsdpkit.checkpoint.safe_io import read_dcp_metadata
from fsdpkit.checkpoint.save import save_checkpoint

SAVES = 4


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for layer in (m[0], m[2]):
        fully_shard(layer)
    return fully_shard(m)


def digests(ckpt: Path) -> dict[str, str]:
    """This rank's DCP data files and the metadata's content, by name -> sha256."""
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.glob(f"__{dist.rank()}_*.distcp"))}
    meta = read_dcp_metadata(ckpt / ".metadata")
    meta.storage_meta = None  # the save's own ids and path
    out[".metadata"] = hashlib.sha256(pickle.dumps((meta.state_dict_metadata, meta.storage_data,
                                                    meta.planner_data))).hexdigest()
    return out


def main() -> None:
    out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group(backend="gloo")
    net, ema = model(0), model(1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    extra = {"counts": torch.arange(4.0)}
    ckpts = {"net": Checkpointer(work / "net", model=net, optimizer=opt, state={"extra": extra}),
             "ema": Checkpointer(work / "ema", model=ema, state={"extra": {"decay": torch.tensor([0.99])}})}
    for c in ckpts.values():
        c.resume()
    local_plans: list[tuple[str, bool]] = []
    create_local_plan = DefaultSavePlanner.create_local_plan

    def recording(self):
        plan = create_local_plan(self)
        if self._enable_plan_caching:
            local_plans.append((self._cached_plans_key, bool(plan.items)))
        return plan

    DefaultSavePlanner.create_local_plan = recording
    report = []
    for step in range(1, SAVES + 1):
        net(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.5)
        if step == 3:
            extra["counts"] = torch.arange(6.0)  # the state's structure changes: DCP must plan again
        for name, c in ckpts.items():
            local_plans.clear()
            cached = c.save(step)
            reference = work / f"{name}_reference" / f"step_{step}"
            save_checkpoint(c.target, ckpt_dir=reference, step=step, meta={"run_id": c.run_id}, group=c.group)
            report.append({"name": name, "step": step, "planned": [sent for _, sent in local_plans],
                           "key": local_plans[0][0] if local_plans else None,
                           "cached": digests(cached), "reference": digests(reference)})
    for c in ckpts.values():
        c.close()
    everything = [None] * tdist.get_world_size()
    tdist.all_gather_object(everything, report)
    if dist.is_main():
        out_path.write_text(json.dumps(everything))
    dist.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
