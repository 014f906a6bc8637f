"""The scheduler gauges with several API servers (otel_llm.integrations.vllm.frontend.gauges): the shared
record never yields a torn value, the freshest record wins, only API server 0 reports, and the
gauges stay per process (one warning) when the record cannot be made.

Two API servers are simulated in one test process: two plugin instances, each with its own
providers and reader, and a VllmConfig saying "API server r of 2"."""

from __future__ import annotations

import copy
import multiprocessing
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from samples import otel_family_names, otel_samples

from otel_llm.integrations.vllm.frontend import gauges as vllm_gauges
from otel_llm.integrations.vllm.frontend.gauges import SharedRecord

GAUGES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
}
WIDTH = 8
WRITES = 20_000


@pytest.fixture
def record_path(tmp_path: Path) -> str:
    return str(tmp_path / "record")


def test_freshest_record_over_the_processes_wins(record_path: str) -> None:
    first, second = SharedRecord(record_path, 2, 0, 2, 3), SharedRecord(record_path, 2, 1, 2, 3)
    assert first.freshest(0) is None and second.read(1, 1) is None  # never written
    first.write(0, (3, 5, 0.5))
    second.write(0, (1, 0, 0.25))
    second.write(1, (7, 7, 0.75))
    assert first.freshest(0)[1:] == second.freshest(0)[1:] == (1, 0, 0.25)
    assert first.freshest(1)[1:] == (7, 7, 0.75)
    first.write(0, (2, 2, 0.125))
    assert second.freshest(0)[1:] == (2, 2, 0.125)
    assert first.read(1, 0)[1:] == (1, 0, 0.25)  # each process' own record stays readable
    second.close()
    assert not os.path.exists(record_path)
    assert first.freshest(0)[1:] == (2, 2, 0.125)  # a mapping outlives the file
    first.close()
    assert first.freshest(0) is None  # a last collection after its own shutdown reads nothing


def test_a_record_being_written_or_corrupt_is_skipped(record_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_gauges, "READ_PATIENCE_S", 0.001)
    writer, reader = SharedRecord(record_path, 2, 1, 1, 3), SharedRecord(record_path, 2, 0, 1, 3)
    reader.write(0, (1, 1, 0.5))
    writer.write(0, (9, 9, 0.9))
    assert reader.freshest(0)[1:] == (9, 9, 0.9)
    mapping, offset = writer._map, writer._offset(1, 0)
    seq = struct.unpack_from("<Q", mapping, offset)[0]
    struct.pack_into("<Q", mapping, offset, seq + 1)  # a writer stopped half-way: odd sequence
    assert reader.read(1, 0) is None
    assert reader.freshest(0)[1:] == (1, 1, 0.5)
    struct.pack_into("<Q", mapping, offset, seq)
    struct.pack_into("<d", mapping, offset + 16, 8.0)  # a value changed under an unchanged sequence
    assert reader.read(1, 0) is None
    writer.write(0, (4, 4, 0.4))
    assert reader.freshest(0)[1:] == (4, 4, 0.4)
    writer.close()
    reader.close()


def _hammer(path: str, done: Any) -> None:
    record = SharedRecord(path, 2, 1, 1, WIDTH)
    for i in range(1, WRITES + 1):
        record.write(0, (float(i),) * WIDTH)
        os.sched_yield()  # the reader gets the CPU between writes as well as during them
    done.set()


def test_a_reader_never_sees_a_torn_record(record_path: str) -> None:
    """Another process rewrites its record as fast as it can, every value of a write equal; the
    reader must only ever see whole writes, in order."""
    reader = SharedRecord(record_path, 2, 0, 1, WIDTH)
    context = multiprocessing.get_context("fork")
    done = context.Event()
    writer = context.Process(target=_hammer, args=(record_path, done))
    writer.start()
    seen: list[tuple[float, ...]] = []
    try:
        while not done.is_set():
            record = reader.read(1, 0)
            if record is not None:
                seen.append(record)
        writer.join(30)
    finally:
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0
    final = reader.read(1, 0)
    assert final[1:] == (float(WRITES),) * WIDTH
    seen.append(final)
    assert all(len(set(r[1:])) == 1 for r in seen), [r for r in seen if len(set(r[1:])) != 1][:3]
    assert [r[1] for r in seen] == sorted(r[1] for r in seen)
    assert [r[0] for r in seen] == sorted(r[0] for r in seen)
    assert len({r[1] for r in seen}) > 10  # the reads really interleaved with the writes
    reader.close()


# ---------------------------------------------------------------------------------------
# The plugin, two API servers of one serve in this process


def _config(vllm_config: Any, count: int, rank: int) -> Any:
    config = copy.deepcopy(vllm_config)
    config.parallel_config._api_process_count = count
    config.parallel_config._api_process_rank = rank
    return config


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The shared files of this test's "serve" go to tmp_path."""
    monkeypatch.setattr(vllm_gauges, "_directory", lambda: str(tmp_path))
    monkeypatch.setattr(vllm_gauges, "serve_key", lambda: "test")
    return tmp_path


def _api_server(otel: Any, vllm_config: Any, count: int, rank: int) -> tuple[Any, Any]:
    from otel_llm.integrations.vllm.frontend.adapter import VllmAdapter

    o = otel()
    impl = VllmAdapter(_config(vllm_config, count, rank), [0], handle=o.handle)
    return impl, o


def _stats(running: int, waiting: int, skipped: int, usage: float) -> Any:
    from vllm.v1.metrics.stats import SchedulerStats

    return SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=skipped, kv_cache_usage=usage
    )


def _gauges(o: Any) -> dict[tuple[str, str], float]:
    return {
        (name, dict(labels).get("reason", "")): value
        for (name, labels), value in otel_samples(o.reader, GAUGES).items()
    }


def _expected(running: int, waiting: int, skipped: int, usage: float) -> dict[tuple[str, str], float]:
    return {
        ("vllm:num_requests_running", ""): running,
        ("vllm:num_requests_waiting", ""): waiting + skipped,
        ("vllm:kv_cache_usage_perc", ""): usage,
        ("vllm:num_requests_waiting_by_reason", "capacity"): waiting,
        ("vllm:num_requests_waiting_by_reason", "deferred"): skipped,
    }


def test_api_server_0_reports_the_freshest_values_the_others_none(otel, vllm_config, serve: Path) -> None:
    first, first_otel = _api_server(otel, vllm_config, 2, 0)
    second, second_otel = _api_server(otel, vllm_config, 2, 1)
    assert first.gauges.designated and not second.gauges.designated
    assert len(list(serve.iterdir())) == 1  # one record file for the serve
    assert _gauges(first_otel) == _expected(0, 0, 0, 0.0)  # at zero before any step, as vLLM's
    assert not otel_family_names(second_otel.reader) & GAUGES
    first.record(_stats(3, 5, 1, 0.5), None, 0)
    second.record(_stats(1, 2, 0, 0.25), None, 0)  # the latest SchedulerStats went to API server 1
    assert _gauges(first_otel) == _expected(1, 2, 0, 0.25)
    first.record(_stats(2, 0, 4, 0.125), None, 0)
    assert _gauges(first_otel) == _expected(2, 0, 4, 0.125)
    second.record(None, None, 0)  # no SchedulerStats: nothing changes
    assert _gauges(first_otel) == _expected(2, 0, 4, 0.125)
    # API server 1 reports no scheduler gauge nor the gauges every server sets itself, its other
    # series as before.
    assert not otel_family_names(second_otel.reader) & GAUGES
    info = {"vllm:cache_config_info", "vllm:engine_sleep_state"}
    for impl in (first, second):
        impl.call_series("log_engine_initialized")  # as vLLM does once its engine is up
    assert otel_family_names(first_otel.reader) & info == info
    assert not otel_family_names(second_otel.reader) & info
    assert otel_samples(second_otel.reader, {"vllm:prefix_cache_queries"})
    first.gauges.close()
    second.gauges.close()
    assert not list(serve.iterdir())


def test_per_engine_with_data_parallel_engines(otel, vllm_config, serve: Path) -> None:
    from otel_llm.integrations.vllm.frontend.adapter import VllmAdapter

    impls, otels = [], []
    for rank in (0, 1):
        o = otel()
        impls.append(VllmAdapter(_config(vllm_config, 2, rank), [0, 1], handle=o.handle))
        otels.append(o)
    impls[0].record(_stats(1, 1, 0, 0.5), None, 0)
    impls[1].record(_stats(4, 0, 0, 0.75), None, 1)
    impls[1].record(_stats(2, 0, 0, 0.25), None, 0)
    got = {
        (name, dict(labels)["engine"]): value
        for (name, labels), value in otel_samples(
            otels[0].reader, {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
        ).items()
    }
    assert got == {
        ("vllm:num_requests_running", "0"): 2,
        ("vllm:kv_cache_usage_perc", "0"): 0.25,
        ("vllm:num_requests_running", "1"): 4,
        ("vllm:kv_cache_usage_perc", "1"): 0.75,
    }
    assert not otel_family_names(otels[1].reader) & GAUGES
    for impl in impls:
        impl.gauges.close()


def test_one_api_server_shares_nothing(otel, vllm_config, serve: Path) -> None:
    impl, o = _api_server(otel, vllm_config, 1, 0)
    assert impl.gauges is None
    assert not list(serve.iterdir())
    impl.record(_stats(3, 5, 1, 0.5), None, 0)
    assert _gauges(o) == _expected(3, 5, 1, 0.5)


def test_without_a_shared_record_each_process_reports_its_own(
    otel, vllm_config, serve: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setattr(vllm_gauges, "_directory", lambda: str(serve / "missing"))
    with caplog.at_level("WARNING", logger=vllm_gauges.__name__):
        first, first_otel = _api_server(otel, vllm_config, 2, 0)
        second, second_otel = _api_server(otel, vllm_config, 2, 1)
    assert first.gauges is None and second.gauges is None
    warnings = [r.getMessage() for r in caplog.records if r.name == vllm_gauges.__name__]
    assert len(warnings) == 2 and all("cannot be made" in w for w in warnings), warnings
    first.record(_stats(3, 5, 1, 0.5), None, 0)
    second.record(_stats(1, 2, 0, 0.25), None, 0)
    assert _gauges(first_otel) == _expected(3, 5, 1, 0.5)
    assert _gauges(second_otel) == _expected(1, 2, 0, 0.25)
