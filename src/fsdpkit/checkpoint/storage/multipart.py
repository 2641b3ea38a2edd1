"""An upload stream to S3 that overlaps the parts of one object, with bounded memory.

Why: DCP's fsspec writer streams each file through s3fs's `S3File`, which uploads its multipart
parts one after another, in the writing thread: serializing and checksumming the next bytes waits
for every part's round trip. `s3fs.put` overlaps the parts of a file (up to `max_concurrency` at
once). This stream does the same for a file that is being written: each full part is handed to
s3fs's event loop as an `upload_part` request and the writer goes on filling the next part; at most
`in_flight` parts are in flight (IOSettings.remote_parts_in_flight), so the memory one stream holds
is bounded by (parts in flight + 1) x `part_bytes` (IOSettings.remote_part_bytes; the part being
filled included), whatever the file's size.

Every request goes through s3fs's `_call_s3`, so each part keeps s3fs's own retries with backoff.
A file smaller than one part is one PUT. Nothing is visible under the key until `close()`
completes the multipart upload; `abort()` (on any error while writing) aborts it, so a failed
write leaves no object, as an interrupted PUT does.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import Future
from typing import Any

MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload
_MIN_PART = 5 << 20  # S3: every part but the last


def is_s3(fs: Any) -> bool:
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return False
    return isinstance(fs, S3FileSystem)


class OverlappedUpload(io.RawIOBase):
    """A write-only stream into one S3 object (see the module docstring). `tell()` counts the
    bytes written, as DCP's writer needs for its item offsets. `part_bytes` and `in_flight`
    default to the environment's IOSettings (FSDPKIT_REMOTE_PART_BYTES, FSDPKIT_REMOTE_PARTS_IN_FLIGHT)."""

    def __init__(self, fs: Any, path: str, *, part_bytes: int | None = None, in_flight: int | None = None):
        super().__init__()
        if part_bytes is None or in_flight is None:
            from fsdpkit.checkpoint.settings import IOSettings

            tuned = IOSettings.from_environment()
            part_bytes = tuned.remote_part_bytes if part_bytes is None else part_bytes
            in_flight = tuned.remote_parts_in_flight if in_flight is None else in_flight
        if part_bytes < _MIN_PART or in_flight < 1:
            raise ValueError(f"FSDPKIT_REMOTE_PART_BYTES must be >= {_MIN_PART} (S3's smallest part) and "
                             f"FSDPKIT_REMOTE_PARTS_IN_FLIGHT >= 1; got {part_bytes} and {in_flight}")
        self._fs, self._path = fs, path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_bytes, self._in_flight = part_bytes, in_flight
        self._buf = bytearray()
        self._written = 0
        self._upload_id: str | None = None
        self._pending: list[tuple[int, Future]] = []  # (part number, its upload_part request)
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, b) -> int:
        data = memoryview(b).cast("B")
        n = len(data)
        while len(data):
            room = self._part_bytes - len(self._buf)
            self._buf += data[:room]
            data = data[room:]
            if len(self._buf) == self._part_bytes:
                self._send_part()
        self._written += n
        return n

    def flush(self) -> None:
        """Nothing to flush: a part leaves when it is full (S3 parts are >= 5 MiB)."""

    def _call(self, method: str, **kwargs: Any) -> dict:
        from fsspec.asyn import sync

        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, Key=self._key, **kwargs)

    def _send_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        number = len(self._parts) + len(self._pending) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self._path}: more than {MAX_PARTS} parts of {self._part_bytes} bytes; raise "
                             "FSDPKIT_REMOTE_PART_BYTES or checkpoint.thread_count (more, smaller files)")
        while len(self._pending) >= self._in_flight:
            self._collect_oldest()
        body, self._buf = self._buf, bytearray()  # handed over, not copied: the next part gets a new buffer
        coro = self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                                 PartNumber=number, Body=body)
        self._pending.append((number, asyncio.run_coroutine_threadsafe(coro, self._fs.loop)))

    def _collect_oldest(self) -> None:
        number, future = self._pending.pop(0)
        self._parts.append({"PartNumber": number, "ETag": future.result()["ETag"]})

    def commit(self) -> None:
        """Make the object visible: one PUT for a small file, else the last part, every part
        finished, and the multipart upload completed."""
        if self._upload_id is None:
            self._call("put_object", Body=self._buf)
        else:
            if self._buf:
                self._send_part()
            while self._pending:
                self._collect_oldest()
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": self._parts})
        self._buf = bytearray()
        self._fs.invalidate_cache(self._path)
        super().close()

    def abort(self) -> None:
        """Drop the upload: nothing appears under the key. Best effort (the error that led here
        is the one to report); a bucket lifecycle rule cleans up what an abort cannot reach."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._buf = bytearray()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        super().close()
