"""The scheduler gauges once per engine when one ``vllm serve`` runs several API servers.

With ``--api-server-count N`` (N > 1; ``--data-parallel-size`` starts as many API servers as
engines by default), every API-server process loads the plugin, and vLLM's engine core attaches
each step's ``SchedulerStats`` to the outputs of one of those processes only. A gauge set from
them (running, waiting, waiting by reason, KV fetch stages, KV usage) is therefore, in each
process, the engine's state as of the last outputs that process handled: summing over processes
over-counts, and a process that handled none lately keeps an old value. vLLM's own gauges are
Prometheus ``multiprocess_mode="mostrecent"``: the value most recently set in any process.

Here every API server writes, per engine, the gauge values of the last ``SchedulerStats`` it
recorded with a ``time.monotonic()`` stamp (system-wide, so comparable between processes) into
one small file shared by the API servers of that serve (:class:`SharedRecord`: one record per
process and engine, each with a single writer, guarded by a sequence number and a CRC so that a
reader never uses a torn record). API server 0 reports, at each collection, the freshest record
over the processes; the others report none of these gauges. Summed over processes, per engine,
they equal vLLM's values. vLLM's periodic ``log()`` leaves them alone: every collection reads the
shared file itself, so there is nothing to refresh.

With a single API server nothing here runs. When the file cannot be made, the gauges stay per
process (one warning).
"""

from __future__ import annotations

import functools
import logging
import mmap
import multiprocessing.util
import os
import struct
import tempfile
import time
import zlib
from multiprocessing import resource_tracker
from typing import Any, Mapping, Optional, Sequence

_log = logging.getLogger(__name__)

__all__ = ["SharedRecord", "SchedulerGauges", "share", "SCHEDULER_GAUGES"]

# vLLM's "mostrecent" gauges that its logger sets from SchedulerStats. The first three are the
# core telemetry's (metric keys in CORE_KEYS); the others are VllmSeries families.
SCHEDULER_GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting_by_reason",
        "vllm:num_requests_kv_fetch_by_stage",
    }
)
CORE_KEYS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
# vLLM's other "mostrecent" gauges, which every API server sets itself: the designated one
# reports them, the others do not (summed over processes, they would count once per server).
# cache_config_info is the same everywhere; engine_sleep_state too, but for a /sleep or
# /wake_up that another API server handled, which the designated one does not see.
REPORTED_BY_ONE_SERVER = ("vllm:cache_config_info", "vllm:engine_sleep_state")
_CORE_POSITION = {key: position for position, key in enumerate(CORE_KEYS)}
DESIGNATED_RANK = 0
READ_PATIENCE_S = 0.01  # a record being rewritten is retried this long, then skipped for this read

_SEQ = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class SharedRecord:
    """``processes`` x ``slots`` records of a stamp and ``width`` numbers in one mmap'd file.

    Process ``rank`` writes only its own records (one per slot), so each record has one writer:
    the sequence number is odd while it is being written, and a CRC of the payload catches what
    the sequence check alone would miss on a weakly ordered CPU. ``freshest(slot)`` is the
    newest record of a slot over the processes.
    """

    def __init__(self, path: str, processes: int, rank: int, slots: int, width: int) -> None:
        if not 0 <= rank < processes:
            raise ValueError(f"rank {rank} outside 0..{processes - 1}")
        self.path, self.processes, self.rank, self.slots = path, processes, rank, slots
        self._body = struct.Struct(f"<d{width}d")
        self._crc_at = _SEQ.size + self._body.size
        self._stride = self._crc_at + 8  # CRC and padding: records stay 8-byte aligned
        size = processes * slots * self._stride
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # every process asks for the same size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._seqs = [0] * slots
        for slot in range(slots):  # a left-over file of a dead serve: its records are not ours
            self._map[self._offset(rank, slot) : self._offset(rank, slot) + self._stride] = bytes(self._stride)

    def _offset(self, rank: int, slot: int) -> int:
        return (rank * self.slots + slot) * self._stride

    def write(self, slot: int, values: Sequence[float]) -> None:
        m, off = self._map, self._offset(self.rank, slot)
        seq = self._seqs[slot] + 1
        body = self._body.pack(time.monotonic(), *values)
        _SEQ.pack_into(m, off, seq)
        m[off + _SEQ.size : off + self._crc_at] = body
        _CRC.pack_into(m, off + self._crc_at, zlib.crc32(body))
        _SEQ.pack_into(m, off, seq + 1)
        self._seqs[slot] = seq + 1

    def read(self, rank: int, slot: int) -> Optional[tuple[float, ...]]:
        """(stamp, *values) of one record; None when never written, still being rewritten after
        ``READ_PATIENCE_S``, or no longer mapped."""
        m, off = self._map, self._offset(rank, slot)
        deadline = None
        while True:
            try:
                before = _SEQ.unpack_from(m, off)[0]
                if not before:
                    return None
                body = m[off + _SEQ.size : off + self._crc_at]
                crc = _CRC.unpack_from(m, off + self._crc_at)[0]
                after = _SEQ.unpack_from(m, off)[0]
            except ValueError:  # unmapped at shutdown while a last collection reads it
                return None
            if not before & 1 and after == before and zlib.crc32(body) == crc:
                return self._body.unpack(body)
            now = time.monotonic()
            deadline = deadline or now + READ_PATIENCE_S
            if now > deadline:
                return None
            os.sched_yield()

    def freshest(self, slot: int) -> Optional[tuple[float, ...]]:
        records = (self.read(rank, slot) for rank in range(self.processes))
        return max((r for r in records if r is not None), key=lambda r: r[0], default=None)

    def close(self) -> None:
        """Unmap and remove the file (the other processes keep their mappings)."""
        m = self._map
        if m.closed:
            return
        m.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class SchedulerGauges:
    """The scheduler gauges of this process' engines, published to and read from a
    :class:`SharedRecord`. ``engines``: engine index -> the VllmSeries values set from its
    SchedulerStats (in the same order in every API server)."""

    def __init__(self, record: SharedRecord, engines: Mapping[int, Sequence[Any]]) -> None:
        self.record = record
        self.designated = record.rank == DESIGNATED_RANK
        self._slots = {idx: slot for slot, idx in enumerate(sorted(engines))}
        self._series = [tuple(engines[idx]) for idx in sorted(engines)]

    def publish(self, idx: int, running: int, waiting: int, usage: float) -> None:
        """This process' latest SchedulerStats of engine ``idx`` (after vLLM's logger set the
        series values from them). An engine added at run time has no record: not shared."""
        slot = self._slots.get(idx)
        if slot is not None:
            self.record.write(slot, (running, waiting, usage, *[v.value for v in self._series[slot]]))

    def value(self, slot: int, position: int) -> Optional[float]:
        """The freshest value over the API servers in the designated process (0 before any
        step, as vLLM's zero series), None in the others."""
        if not self.designated:
            return None
        freshest = self.record.freshest(slot)
        return freshest[1 + position] if freshest is not None else 0.0

    def core_value(self, slot: int, key: str) -> Optional[float]:
        """:meth:`value` of a core gauge, by metric key (the recorder's gauge source)."""
        position = _CORE_POSITION.get(key)
        return None if position is None else self.value(slot, position)

    def route(self, telemetry: Mapping[int, Any]) -> None:
        """Make the core gauges and the VllmSeries values of every engine read :meth:`value`."""
        for idx, slot in self._slots.items():
            telemetry[idx].metrics.set_gauge_source(functools.partial(self.core_value, slot))
            for position, series_value in enumerate(self._series[slot], len(CORE_KEYS)):
                series_value.read = functools.partial(self.value, slot, position)

    def close(self) -> None:
        self.record.close()


def api_servers(vllm_config: Any) -> tuple[int, int]:
    """(API-server count, this process' rank) as vLLM's ``vllm serve`` sets them."""
    parallel = getattr(vllm_config, "parallel_config", None)
    count = getattr(parallel, "_api_process_count", 1)
    rank = getattr(parallel, "_api_process_rank", 0)
    return (count, rank) if isinstance(count, int) and isinstance(rank, int) else (1, 0)


def serve_key() -> str:
    """What the API servers of one ``vllm serve`` share and no other process does: their parent
    (the serve process), by pid and start time (a pid can be reused, not with the same start)."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat", "rb") as f:
            start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        start = "0"
    return f"{os.getuid()}-{ppid}-{start}"


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def share(vllm_config: Any, series: Any, telemetry: Mapping[int, Any]) -> Optional[SchedulerGauges]:
    """The shared scheduler gauges of this API server, routed into ``telemetry`` (engine index
    -> EngineTelemetry) and ``series`` (VllmSeries or None); None with a single API server, or
    (after one warning) when they cannot be shared: each process then reports its own."""
    count, rank = api_servers(vllm_config)
    if count <= 1 or not 0 <= rank < count:
        return None
    engines = {idx: _series_values(series, idx) for idx in telemetry}
    widths = {len(values) for values in engines.values()}
    if len(widths) != 1 or not all(t.metrics.takes_gauge_source for t in telemetry.values()):
        _log.warning(
            "otel-llm vLLM adapter: API server %d of %d reports the scheduler gauges as of the outputs it "
            "handled (they cannot be shared with this telemetry): sum them over processes with care",
            rank,
            count,
        )
        return None
    width = len(CORE_KEYS) + widths.pop()
    path = os.path.join(_directory(), f"otel-llm-vllm-{serve_key()}-{count}x{len(engines)}x{width}")
    try:
        record = SharedRecord(path, count, rank, len(engines), width)
    except (OSError, ValueError) as exc:
        _log.warning(
            "otel-llm vLLM adapter: API server %d of %d reports the scheduler gauges as of the outputs it "
            "handled: the shared record %s cannot be made (%s)",
            rank,
            count,
            path,
            exc,
        )
        return None
    gauges = SchedulerGauges(record, engines)
    gauges.route(telemetry)
    if not gauges.designated and series is not None:
        series.withheld.update(REPORTED_BY_ONE_SERVER)
    _remove_at_exit(gauges)
    _log.info(
        "otel-llm: API server %d of %d, scheduler gauges shared through %s, reported by API server %d",
        rank,
        count,
        path,
        DESIGNATED_RANK,
    )
    return gauges


def _remove_at_exit(gauges: SchedulerGauges) -> None:
    """The file goes at this process' exit, or, when vLLM kills its API servers (it does at
    shutdown), when multiprocessing's resource tracker of the serve ends: it unlinks the
    ``/dev/shm`` names left registered with it, as for ``SharedMemory``."""
    multiprocessing.util.Finalize(None, gauges.close, exitpriority=0)
    if os.path.dirname(gauges.record.path) == "/dev/shm":
        name = "/" + os.path.basename(gauges.record.path)
        resource_tracker.register(name, "shared_memory")
        multiprocessing.util.Finalize(None, resource_tracker.unregister, (name, "shared_memory"), exitpriority=1)


def _series_values(series: Any, idx: int) -> list[Any]:
    """The VllmSeries values of engine ``idx`` set from SchedulerStats, in a fixed order."""
    if series is None:
        return []
    engine = str(idx)
    found: list[Any] = []
    for name in sorted(SCHEDULER_GAUGES & set(series.families)):
        family = series.families[name]
        if not family.recording or "engine" not in family.labelnames:
            continue
        at = family.labelnames.index("engine")
        found.extend(family.children[key] for key in sorted(family.children) if key[at] == engine)
    return found
