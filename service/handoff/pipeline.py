"""The hand-off around the engine: content ids, the encoder-output cache and the shared encoder-cache folder.

For each request the HTTP layer hands its items here instead of straight to the engine:

1. every item gets a content id (`content_id.py`) from its bytes, its options and the served model's
   identity, before anything is decoded;
2. an item whose id is in the cache (`cache.py`), or whose file in the shared folder is valid (this model,
   this content, the right grid, shape and dtype in its metadata), is answered from there: no decoding, no
   preprocessing, no GPU. Items repeated within one request run once;
3. the rest go to the engine; their outputs are cached. An item whose content id another request is
   encoding right now waits for that encode and takes its output from the cache (request coalescing:
   identical concurrent items are encoded once);
4. with `--ec-shared-storage`, each item that needs a file there gets one before the response is sent
   (`vllm_ref`: every item; other formats: items with an `id`), unless a valid one is there already.
   Without it, `vllm_ref` items are held in the cache for the LLM server to fetch
   (`GET /v1/encoder_cache/{uuid}`, `encoder_cache_body`).

The uuid vLLM gets is the item's `id` when it has one, else its content id. Results point at shared-memory
segments; `release` hands them back (to the cache, or unlinked) once the response is encoded.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from service import shm
from service.engine.types import ItemResult, MediaItem, ModelInfo, OutputRef, RequestRejected
from service.handoff.cache import CachedOutput, EncoderCache
from service.handoff.content_id import checkpoint_fingerprint, content_id, model_identity
from service.handoff.ec_storage import SAFETENSORS_DTYPES, ECSharedStorage, StoredHeader, id_problem, safetensors_head
from service.handoff.vllm import VLLM_FORMATS
from service.settings import ServeSettings
from service.version import VERSION

log = logging.getLogger("vitserve.handoff")
Run = Callable[[list[MediaItem]], Awaitable[list[ItemResult]]]
InPool = Callable[..., Awaitable[Any]]
# The response fields of a video's meta, and what vLLM's parts are built from: all a stored file keeps.
STORED_META = ("timestamps", "second_per_grid_ts", "fps", "frame_indices", "video_fps")
# Media hashed on the event loop rather than on a thread: a 448x448 JPEG's 75 KB hash in about 40 us, where
# the round trip to a thread costs 0.1-0.3 ms.
HASH_HERE_BYTES = 1 << 20
# Client ids (an item's `id`) kept as names of content ids for `GET /v1/encoder_cache/{id}`, newest last.
MAX_ALIASES = 1 << 16


class Handoff:
    def __init__(self, settings: ServeSettings, names: shm.SegmentNames) -> None:
        self.settings = settings
        self.names = names  # for the segments of outputs read back from the shared folder
        self.cache = EncoderCache(settings.cache_bytes, settings.cache_hold_s)
        self.storage = (ECSharedStorage(settings.ec_shared_storage, settings.ec_max_bytes)
                        if settings.ec_shared_storage else None)
        self._identity: tuple[int, str] | None = None  # (id of the ModelInfo it was made for, identity)
        self.hits = {"memory": 0, "storage": 0}
        self.misses = 0
        self.aliases: OrderedDict[str, str] = OrderedDict()  # client id -> content id (vllm_ref, no folder)
        self.fetches = {"hit": 0, "miss": 0}  # GET /v1/encoder_cache/{id}
        self._inflight: dict[str, asyncio.Future[None]] = {}  # content id -> done when its encode is
        self.coalesced = 0  # items that waited for another request's encode of the same content

    def start(self) -> None:
        if self.storage is not None:
            self.storage.check()

    def stop(self) -> None:
        self.cache.close()

    # ---- identity ----------------------------------------------------------------------------
    def identity_parts(self, model: ModelInfo) -> dict[str, Any]:
        """Everything about the served model that changes an output: checkpoint, dtype, FP8 products, device kind,
        the preprocessing defaults, and this server's version (its preprocessing and towers)."""
        quantized = {"quantization": model.quantization["mode"]} if model.quantization else {}
        return {
            **quantized,
            "vitserve": VERSION,
            "checkpoint": checkpoint_fingerprint(self.settings.model),
            "family": model.family,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": model.device.split(":")[0],
            "out_hidden_size": model.out_hidden_size,
            "deepstack_layers": model.num_deepstack,
            "processor": repr(model.processor),
        }

    def identity(self, model: ModelInfo) -> str:
        if self._identity is None or self._identity[0] != id(model):
            self._identity = (id(model), model_identity(self.identity_parts(model)))
        return self._identity[1]

    def active(self, fmt: str) -> bool:
        """Content ids are worth computing: something keys on them."""
        return self.cache.enabled or self.storage is not None or fmt in VLLM_FORMATS

    async def content_ids(self, items: Sequence[MediaItem], model: ModelInfo, in_pool: InPool) -> list[str]:
        """The items' content ids (what `encode` names them by): on the event loop up to HASH_HERE_BYTES of
        media, else on a thread."""
        if sum(len(it.data) for it in items) <= HASH_HERE_BYTES:
            return _content_ids(items, self.identity(model))
        return await in_pool(_content_ids, items, self.identity(model))

    # ---- the request path --------------------------------------------------------------------
    async def encode(self, items: Sequence[MediaItem], fmt: str, model: ModelInfo, run: Run,
                     in_pool: InPool) -> list[ItemResult]:
        """Results in item order; `run` sends items to the engine, `in_pool` runs blocking work off the loop."""
        if fmt == "vllm_ref" and self.storage is None and not self.cache.enabled:
            raise RequestRejected("encoding_format vllm_ref keeps each item for the LLM server to fetch, in the "
                                  "encoder-output cache or the shared encoder-cache folder, and this server runs with "
                                  "--cache-bytes 0 and without --ec-shared-storage", "storage_not_configured")
        if not self.active(fmt):
            return await run(list(items))
        identity = self.identity(model)
        cids = await self.content_ids(items, model, in_pool)
        uuids = [it.id or cid for it, cid in zip(items, cids)]
        n = len(items)
        entries: dict[str, CachedOutput] = {}
        # memory | storage | request (a repeat) | coalesced (another request's encode); None: the engine ran it
        source: list[str | None] = [None] * n
        leaders: dict[str, int] = {}
        for i, cid in enumerate(cids):
            if cid in leaders:
                source[i] = "request"
                continue
            leaders[cid] = i
            entry = self.cache.get(cid) if self.cache.enabled else None
            if entry is not None:
                entries[cid] = entry
                source[i] = "memory"
        stored: set[str] = set()  # uuids whose file is known valid
        results: list[ItemResult | None] = [None] * n
        try:
            if self.storage is not None:
                look = [(i, uuids[i], cids[i]) for i in leaders.values() if cids[i] not in entries]
                found = await in_pool(self._from_storage, look, identity, model) if look else []
                for i, entry in found:
                    entries[cids[i]] = self._keep(cids[i], entry)
                    source[i] = "storage"
                    stored.add(uuids[i])
            wanted = [i for i in leaders.values() if cids[i] not in entries]
            # An item another request is encoding now waits for that encode and reads the cache after it.
            waits = {i: self._inflight[cids[i]] for i in wanted if cids[i] in self._inflight and self.cache.enabled}
            misses = [i for i in wanted if i not in waits]
            await self._run_leading(misses, items, cids, results, entries, run)
            for i, done in waits.items():
                await asyncio.shield(done)
                entry = self.cache.get(cids[i])
                if entry is not None:
                    entries[cids[i]] = entry
                    source[i] = "coalesced"
            late = [i for i in waits if source[i] != "coalesced"]  # the leader failed, or its entry is gone
            await self._run_leading(late, items, cids, results, entries, run)
            misses += late
            self.coalesced += len(waits) - len(late)
            for i in range(n):
                if results[i] is None:
                    entry = entries[cids[i]]
                    if source[i] == "request" and self.cache.owns(entry.output.segment):
                        self.cache.pin(entry.output.segment)  # every result holds its own pin
                    results[i] = ItemResult(i, entry.modality, items[i].id, entry.grid_thw,  # type: ignore[arg-type]
                                            entry.num_patches, entry.num_tokens, dict(entry.meta), entry.output)
                results[i].index = items[i].index  # type: ignore[union-attr]
            for i, r in enumerate(results):
                assert r is not None
                r.content_id, r.uuid, r.cached = cids[i], uuids[i], source[i] is not None
            self.misses += len(misses)
            for s in source:
                if s in ("memory", "storage", "request"):
                    self.hits["storage" if s == "storage" else "memory"] += 1
            if fmt == "vllm_ref":
                self._hold(items, cids, uuids)
            if self.storage is not None:
                todo: dict[str, tuple[str, CachedOutput]] = {}
                for i, it in enumerate(items):
                    if (fmt == "vllm_ref" or it.id is not None) and uuids[i] not in stored:
                        todo.setdefault(uuids[i], (cids[i], entries[cids[i]]))
                if todo:
                    await in_pool(self._store, todo, identity, model)
        except BaseException:
            self.release([r for r in results if r is not None])
            raise
        return results  # type: ignore[return-value]

    async def _run_leading(self, misses: list[int], items: Sequence[MediaItem], cids: list[str],
                           results: list[ItemResult | None], entries: dict[str, CachedOutput], run: Run) -> None:
        """The engine runs `misses`; meanwhile each is in flight under its content id for other requests to
        wait on (`_inflight`), released when the outputs are cached, or when the run fails."""
        if not misses:
            return
        mine: dict[str, asyncio.Future[None]] = {}
        if self.cache.enabled:
            loop = asyncio.get_running_loop()
            for i in misses:
                mine[cids[i]] = self._inflight[cids[i]] = loop.create_future()
        try:
            for i, r in zip(misses, await run([items[i] for i in misses])):
                results[i] = r
                entries[cids[i]] = self._keep(cids[i], CachedOutput(r.modality, r.grid_thw, r.num_patches,
                                                                     r.num_tokens, r.meta, r.output))
        finally:
            for cid, done in mine.items():
                del self._inflight[cid]
                done.set_result(None)

    def _hold(self, items: Sequence[MediaItem], cids: list[str], uuids: list[str]) -> None:
        """Answered by reference: each output stays for the LLM server's fetch (`EncoderCache.hold`), under its
        uuid too where a client id names it. Without a folder, an output the cache cannot keep (larger than
        --cache-bytes) cannot be answered by reference."""
        for it, cid, uuid in zip(items, cids, uuids):
            if self.cache.peek(cid) is None:
                if self.storage is None:
                    raise RequestRejected(f"item {it.index}: its output is larger than --cache-bytes "
                                          f"({self.cache.max_bytes} bytes), so it cannot be kept for the LLM server "
                                          "to fetch: raise --cache-bytes, or use --ec-shared-storage",
                                          "too_large_for_cache")
                continue
            self.cache.hold(cid)
            if uuid != cid:
                self.aliases[uuid] = cid
                self.aliases.move_to_end(uuid)
                while len(self.aliases) > MAX_ALIASES:
                    self.aliases.popitem(last=False)

    def _keep(self, cid: str, entry: CachedOutput) -> CachedOutput:
        """Into the cache when it takes it (the segment is then the cache's, pinned for this response)."""
        if self.cache.enabled:
            self.cache.put(cid, entry)
        return entry

    def releasable(self, results: Sequence[ItemResult]) -> list[bool]:
        """Per result: may its encoder retire its output once read (no other result of the response
        shares the segment, and the cache does not own it)? `release` then finds it gone."""
        uses = Counter(r.output.segment for r in results)
        return [uses[r.output.segment] == 1 and not self.cache.owns(r.output.segment) for r in results]

    def release(self, results: Sequence[ItemResult]) -> None:
        """The response is encoded: cached segments are unpinned, the others unlinked."""
        for r in results:
            segment = r.output.segment
            if self.cache.owns(segment):
                self.cache.unpin(segment)
            else:
                shm.unlink(segment)

    # ---- the shared folder (the server's thread pool) ------------------------------------------
    def _valid(self, header: StoredHeader | None, cid: str, identity: str, model: ModelInfo) -> bool:
        """The file holds this content's output from this model, in the served dtype and the right shape."""
        if header is None:
            return False
        md = header.metadata
        if md.get("content_id") != cid or md.get("model_identity") != identity:
            return False
        try:
            t, h, w = (int(x) for x in json.loads(md["grid_thw"]))
            rows = model.geometry.tokens((t, h, w), md["modality"])
        except (KeyError, ValueError, TypeError):
            return False
        return (header.shape == (rows, model.width)
                and header.dtype == SAFETENSORS_DTYPES.get(model.dtype))

    def _from_storage(self, look: list[tuple[int, str, str]], identity: str,
                      model: ModelInfo) -> list[tuple[int, CachedOutput]]:
        """Valid files, each read into a shared-memory segment of its own."""
        assert self.storage is not None
        found = []
        for i, uuid, cid in look:
            header = self.storage.header(uuid)
            if not self._valid(header, cid, identity, model):
                continue
            assert header is not None
            md = header.metadata
            segment = self.names.next("st")
            try:
                tensor = self.storage.load(uuid).contiguous()
                shm.write_array(segment, tensor.view(-1).view(torch.uint8).numpy())
                ref = OutputRef(segment, int(tensor.shape[0]), int(tensor.shape[1]), model.dtype_name)
                entry = CachedOutput(md["modality"], tuple(json.loads(md["grid_thw"])),  # type: ignore[arg-type]
                                     int(md["num_patches"]), int(md["num_tokens"]), json.loads(md["meta"]), ref)
            except Exception as exc:  # a file replaced or damaged under us: encode instead
                shm.unlink(segment)
                log.warning("shared encoder-cache file %s unusable, encoding again: %s", uuid, exc)
                continue
            self.storage.touch(uuid)
            found.append((i, entry))
        return found

    def _store(self, todo: dict[str, tuple[str, CachedOutput]], identity: str, model: ModelInfo) -> None:
        assert self.storage is not None
        for uuid, (cid, entry) in todo.items():
            if self._valid(self.storage.header(uuid), cid, identity, model):
                self.storage.touch(uuid)
                continue
            self.storage.write_parts(uuid, [self.file_body(uuid, cid, entry, identity, model)])

    def file_metadata(self, uuid: str, cid: str, entry: CachedOutput, identity: str,
                      model: ModelInfo) -> dict[str, str]:
        """What a stored file says of its tensor: `_valid` checks it before the file is served again, and the
        LLM server's connector that it got the output it asked for by `uuid`."""
        meta = {k: _plain(entry.meta[k]) for k in STORED_META if k in entry.meta}
        return {
            "format": "pt",
            "producer": f"vitserve {VERSION}",
            "model": self.settings.model_name,
            "model_identity": identity,
            "content_id": cid,
            "uuid": uuid,
            "modality": entry.modality,
            "grid_thw": json.dumps(list(entry.grid_thw)),
            "num_patches": str(entry.num_patches),
            "num_tokens": str(entry.num_tokens),
            "out_hidden_size": str(model.out_hidden_size),
            "deepstack_layers": str(model.num_deepstack),
            "meta": json.dumps(meta, separators=(",", ":")),
        }

    def file_head(self, uuid: str, cid: str, entry: CachedOutput, identity: str, model: ModelInfo) -> bytes:
        """The safetensors header of `entry`'s file: its rows follow it as they sit in the segment."""
        ref = entry.output
        return safetensors_head(SAFETENSORS_DTYPES[getattr(torch, ref.dtype)], (ref.rows, ref.width), ref.nbytes,
                                self.file_metadata(uuid, cid, entry, identity, model))

    def file_body(self, uuid: str, cid: str, entry: CachedOutput, identity: str, model: ModelInfo) -> bytearray:
        """The whole safetensors file of `entry` (one tensor `ec_cache`, the rows in the served dtype), read
        straight from its segment behind the header: one copy of the rows."""
        ref = entry.output
        head = self.file_head(uuid, cid, entry, identity, model)
        body = bytearray(len(head) + ref.nbytes)
        body[:len(head)] = head
        if ref.nbytes:
            shm.read_into(ref.segment, np.frombuffer(body, np.uint8, ref.nbytes, len(head)))
        return body

    # ---- GET /v1/encoder_cache/{id} ------------------------------------------------------------
    def encoder_cache_entry(self, item_id: str) -> tuple[str, CachedOutput] | None:
        """(content id, entry) the LLM server asks for by `item_id` (a content id, or a client id given with a
        vllm_ref item), pinned (`release_entry`), or None."""
        cid = self.aliases.get(item_id, item_id)
        entry = self.cache.get(cid) if self.cache.enabled else None
        return None if entry is None else (cid, entry)

    def holds(self, item_id: str) -> bool:
        """Whether `GET /v1/encoder_cache/{item_id}` would find the output; one it would is held again (the
        LLM server asks just before it fetches)."""
        cid = self.aliases.get(item_id, item_id)
        if self.cache.peek(cid) is not None:
            self.cache.hold(cid)
            return True
        if self.storage is not None and not id_problem(item_id):
            return self.storage.path_for(item_id).is_file()
        return False

    def release_entry(self, entry: CachedOutput) -> None:
        self.cache.unpin(entry.output.segment)

    def stored_file(self, item_id: str) -> bytes | None:
        """The shared folder's file for `item_id` as it is (the server's thread pool), or None."""
        if self.storage is None or id_problem(item_id):
            return None
        return self.storage.read_bytes(item_id)

    def count_fetch(self, found: bool) -> None:
        self.fetches["hit" if found else "miss"] += 1

    # ---- reporting ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"hits": dict(self.hits), "misses": self.misses, "memory": self.cache.stats(),
                "storage": self.storage.stats() if self.storage is not None else None,
                "fetches": dict(self.fetches), "coalesced": self.coalesced}

    def info(self) -> dict[str, Any]:
        """/info: the cache's settings and counters."""
        return {"cache_bytes": self.cache.max_bytes,
                "ec_shared_storage": str(self.storage.root) if self.storage is not None else None,
                "ec_max_bytes": self.storage.max_bytes if self.storage is not None else None,
                **self.stats()}



def _content_ids(items: Sequence[MediaItem], identity: str) -> list[str]:
    return [content_id(identity, it.modality, it.options, it.data) for it in items]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value
