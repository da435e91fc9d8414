"""``--drain-migrate``: a decode being drained moves its running requests to the other decodes
(``POST /migrate`` on it, with every other available decode as a target; the decode gives each
request to the least loaded one) instead of waiting for them to end.

The drain ends once the decode's scheduler holds nothing (``GET /get_load`` reports no request):
the moved requests' streams still pass through its front end, which relays the target's output,
so a server that switches its role (the autoscaler) keeps serving them; it is asked again every
``RETRY_S`` while requests still wait there for their KV (those cannot move until they decode).
The targets are the other decodes among the drained one's ``--migration-peers`` (as its
``/server_info`` reports them; a server that reports none of its own decides alone): a decode
that may move to none of them is waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdserve.peers import MigrationPeers
from pdserve.router.workers import DECODE, Worker, WorkerPool

logger = logging.getLogger(__name__)

RETRY_S = 0.2


def peer_targets(worker: Worker, urls: list[str]) -> list[str]:
    """Those of ``urls`` that ``worker`` may move requests to, by the ``migration_peers`` of its
    server info (all of them when it reports no such field: an older server decides itself)."""
    info = worker.info or {}
    if "migration_peers" not in info:
        return urls
    try:
        peers = MigrationPeers.of(info["migration_peers"])
    except ValueError:
        return urls
    return [url for url in urls if peers.allows_url(url)]


async def _held(client: httpx.AsyncClient, worker: Worker) -> int:
    """Requests the worker's scheduler holds (running, waiting or in its PD queues)."""
    load = (await client.get(f"{worker.url}/get_load")).json()
    return sum(int(g.get("num_reqs", 0)) for g in load if isinstance(g, dict))


async def migrate_away(pool: WorkerPool, worker: Worker, deadline: float) -> bool:
    """Move what ``worker`` (a decode being drained) runs to the other decodes; True once it
    holds nothing, False when no decode could take its requests or it does not answer."""
    client = pool.client
    moved = 0
    while time.monotonic() < deadline:
        others = [w.url for w in pool.available(DECODE, exclude={worker})]
        targets = peer_targets(worker, others)
        if not targets or client is None:
            logger.warning(
                "drain of %s: no other decode to move its requests to%s",
                worker.url,
                " among its --migration-peers" if others else "",
            )
            return False
        try:
            if await _held(client, worker) == 0:
                logger.info("drain of %s: %d request(s) moved", worker.url, moved)
                return True
            resp = await client.post(
                f"{worker.url}/migrate", json={"rid": "all", "target": targets}, timeout=30.0
            )
            if resp.status_code != 200:
                logger.warning("drain of %s: /migrate answered %s", worker.url, resp.text[:300])
                return False
            moved += len(resp.json().get("moved", []))
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("drain of %s: %s: %s", worker.url, type(e).__name__, e)
            return False
        await asyncio.sleep(RETRY_S)
    return False
