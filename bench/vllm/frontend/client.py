"""The client (another process): streaming completions, optionally a scraper."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from ...common import median
from .frontend import MODEL_NAME

SCRAPE_INTERVAL_S = 0.1


async def _client_round(
    port: int, requests: int, tokens: int, scrape: bool, loads: int, tenants: int
) -> dict[str, Any]:
    import aiohttp

    url = f"http://127.0.0.1:{port}"
    gaps: list[float] = []
    chunks = [0]
    scrapes: list[float] = []
    statuses: list[int] = []
    done = asyncio.Event()

    async def stream(session: Any, i: int) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": [5 + (i + k) % 400 for k in range(40 + i)],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        if tenants:
            body["priority"] = i % tenants
        headers = {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            statuses.append(response.status)
            last = None
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                chunks[0] += 1

    async def scraper(session: Any) -> None:
        while not done.is_set():
            start = time.perf_counter()
            async with session.get(f"{url}/metrics") as response:
                await response.read()
                statuses.append(response.status)
            scrapes.append(time.perf_counter() - start)
            try:
                await asyncio.wait_for(done.wait(), SCRAPE_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        scraping = asyncio.create_task(scraper(session)) if scrape else None
        start = time.perf_counter()
        for _ in range(loads):  # one after the other: a load's requests all arrive at once
            await asyncio.gather(*(stream(session, i) for i in range(requests)))
        seconds = time.perf_counter() - start
        done.set()
        if scraping is not None:
            await scraping
    gaps.sort()
    return {
        "chunks": chunks[0],
        "seconds": seconds,
        "statuses": sorted(set(statuses)),
        "max_gap_ms": 1000 * gaps[-1] if gaps else 0.0,
        "p99_gap_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "scrapes": len(scrapes),
        "scrape_ms_median": 1000 * median(scrapes) if scrapes else None,
    }


def client_main() -> int:
    """Rounds on request: a line ``port requests tokens scrape loads tenants`` in, a JSON line out."""
    for line in sys.stdin:
        port, requests, tokens, scrape, loads, tenants = (int(x) for x in line.split())
        result = asyncio.run(_client_round(port, requests, tokens, bool(scrape), loads, tenants))
        print(json.dumps(result), flush=True)
    return 0
