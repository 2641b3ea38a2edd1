"""`checkpoint.local_dir`: a node-local copy of checkpoints saved to object storage, for the
fastest restart on the same node. The remote copy stays the source of truth.

- Saving: every file a rank uploads is also written to `local_dir/<checkpoint name>/` from the
  same bytes (a tee in the upload stream: no second read, no second copy of the state). Before
  writing, the mirror's manifest of that name is deleted, so a half-written mirror is never a
  checkpoint.
- Commit: the checkpoint is committed when the remote `manifest.json` exists (one PUT, as without
  a mirror). Then rank 0 copies that manifest's bytes into the mirror (tmp + fsync + rename) and
  prunes the mirror: every checkpoint directory there without a remote twin whose manifest is the
  same bytes goes (its manifest first). Retention thus reaches the mirror at the next commit.
- Restart: the remote checkpoint to resume is resolved as without a mirror; its mirror is read
  instead when the mirror's manifest equals the remote one byte for byte and every file it names
  is there with its size. The load then verifies file checksums from its own read of the local
  files, as for any local checkpoint; a corrupt mirror is moved aside and the remote copy loaded.

One node only: the mirror holds the files of the ranks on this node, so a job over several nodes
could never read a complete one; `check_single_node` refuses it. One run per `local_dir`: a
`.mirror_of` file names the remote root the directory mirrors. A `Mirror` object belongs to one
Checkpointer and is handed to the writers that tee into it (safe_fsspec.py): nothing here is
process-wide.
"""

from __future__ import annotations

import io
import json
import os
from typing import IO

from fsdpkit.checkpoint.catalog import CHECKPOINT_NAME, candidates
from fsdpkit.checkpoint.layout import INCOMING, MANIFEST, CkptPath, remove_checkpoint
from fsdpkit.checkpoint.storage.local import LocalPath
from fsdpkit.checkpoint.storage.remote import RemotePath
from fsdpkit.dist import local_world_size, world_size

MIRROR_OF = ".mirror_of"


class Mirror:
    """The node-local copy of the checkpoints under one remote root; each Checkpointer holds its
    own (None without `checkpoint.local_dir`), so two in one process never share one."""

    def __init__(self, local_dir: str | os.PathLike, *, root: CkptPath):
        """Mirror the checkpoints under the remote `root` into `local_dir` (created, and marked
        with `.mirror_of`). Use `Mirror.open` for a setting that may be empty.

        Raises:
            ValueError: `root` is local, or `local_dir` already mirrors another remote root or
                holds checkpoints no mirror wrote.
        """
        if not isinstance(root, RemotePath):
            raise ValueError(f"checkpoint.local_dir={local_dir} mirrors checkpoints on object storage, and "
                             f"checkpoint.dir={root} is local; set checkpoint.dir to a URL or leave local_dir empty")
        local = LocalPath(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        marker = local / MIRROR_OF
        if marker.is_file() and marker.read_text().strip() != root.url:
            raise ValueError(f"checkpoint.local_dir={local} mirrors {marker.read_text().strip()}, not checkpoint.dir="
                             f"{root.url}; give each run its own local_dir (or delete {local} if that run is gone)")
        if not marker.is_file():
            # pruning deletes checkpoint-shaped directories here: never ones this mirror did not write
            foreign = sorted(p.name for p in candidates(local))
            if foreign:
                raise ValueError(f"checkpoint.local_dir={local} already holds {', '.join(foreign[:5])}, which no "
                                 "mirror wrote (it has no .mirror_of); the mirror would delete them. Give it an empty "
                                 "directory")
            # every rank of the node may get here at once: a temporary of its own
            tmp = local / f"{MIRROR_OF}.{os.getpid()}.tmp"
            tmp.write_text(root.url + "\n")
            os.replace(tmp, marker)
        self.root, self.local = root, local

    @classmethod
    def open(cls, local_dir: str, *, root: CkptPath) -> Mirror | None:
        """The mirror `checkpoint.local_dir` asks for, or None when it is empty (see __init__)."""
        check_single_node(local_dir)
        return cls(local_dir, root=root) if local_dir else None

    def __repr__(self) -> str:
        return f"Mirror({str(self.local)!r}, root={self.root.url!r})"

    def mirror_dir(self, ckpt_dir: CkptPath) -> LocalPath | None:
        """The mirror of the remote checkpoint directory `ckpt_dir` (None: not mirrored). A
        replacement written to `<name>.incoming` is mirrored under `<name>`: it becomes `<name>`
        once committed."""
        if not isinstance(ckpt_dir, RemotePath) or ckpt_dir.parent != self.root:
            return None
        if not CHECKPOINT_NAME.match(ckpt_dir.name):
            return None
        return self.local / ckpt_dir.name.removesuffix(INCOMING)

    def start_writing(self, ckpt_dir: CkptPath) -> LocalPath | None:
        """Before a rank writes `ckpt_dir`'s files: its mirror, emptied of its manifest (no longer a
        checkpoint until the remote commit says so), or None."""
        local = self.mirror_dir(ckpt_dir)
        if local is not None:
            (local / MANIFEST).unlink(missing_ok=True)
            local.mkdir(parents=True, exist_ok=True)
        return local

    def publish(self, committed: CkptPath) -> None:
        """Rank 0, after the remote commit of `committed`: its mirror gets the remote manifest's bytes;
        mirrored checkpoints without a matching remote manifest are removed."""
        local = self.mirror_dir(committed)
        if local is None:
            return
        manifest = (committed / MANIFEST).read_bytes()
        if local.is_dir():
            (local / MANIFEST).write_atomic(manifest)  # the same bytes: restart compares them
        self.prune()

    def prune(self) -> None:
        """Remove every mirrored checkpoint whose manifest is missing or differs from the remote one
        (retention deleted it, it never committed, or a newer save replaced it)."""
        for path in sorted(candidates(self.local)):
            if matching(path, self.root / path.name) is None:
                remove_checkpoint(path)

    def usable(self, remote: CkptPath) -> tuple[LocalPath | None, str]:
        """(the mirror to read instead of the remote checkpoint `remote`, or None; why, for the log)."""
        local = self.mirror_dir(remote)
        if local is None:
            return None, "no mirror"
        manifest = matching(local, remote)
        if manifest is None:
            return None, f"{local / MANIFEST} is missing or differs from {remote / MANIFEST}"
        parsed = json.loads(manifest)
        if parsed.get("shared"):  # frozen tensors written once (checkpoint/frozen.py): never mirrored
            return None, "it references shared frozen tensors, which live in the bucket only"
        for name, info in parsed.get("files", {}).items():
            f = local / name
            if not f.is_file() or f.stat().st_size != info["size"]:
                return None, f"{f} is missing or has the wrong size"
        return local, "its manifest equals the remote one and every file is there"


def check_single_node(local_dir: str) -> None:
    """Raise ValueError when the ranks span several nodes (fewer ranks on this host than in the world)."""
    world, local = world_size(), local_world_size()
    if local_dir and local < world:
        raise ValueError(f"checkpoint.local_dir={local_dir}: this job runs {world} ranks on several nodes "
                         f"({local} on this one); a node-local mirror holds only this node's files and could never "
                         "serve a restart. Leave checkpoint.local_dir empty for multi-node jobs")


def matching(local: LocalPath, remote: CkptPath) -> bytes | None:
    """The remote manifest's bytes when `local` holds the same bytes as its manifest, else None."""
    try:
        mine = (local / MANIFEST).read_bytes()
        theirs = (remote / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    return theirs if mine == theirs else None


class TeeStream(io.RawIOBase):
    """Writes to `primary` (the upload) and to the local file `copy`; `tell()` is the upload's."""

    def __init__(self, primary: IO[bytes], copy: IO[bytes]):
        super().__init__()
        self._primary, self._copy = primary, copy

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = memoryview(b).cast("B")
        n = self._primary.write(data)
        n = len(data) if n is None else n
        self._copy.write(data[:n])
        return n

    def tell(self) -> int:
        return self._primary.tell()

    def flush(self) -> None:
        self._primary.flush()
        self._copy.flush()
