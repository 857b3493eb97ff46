"""`VitserveConnector`: vLLM's encoder-cache connector that fetches vitserve's outputs over HTTP.

vLLM 0.33 loads it by module path (`vllm/config/ec_transfer.py`), in its scheduler process and in each worker:

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "VitserveConnector",
        "ec_connector_module_path": "service.handoff.vllm_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://vitserve:8100"}}'

`ec_connector_extra_config`: `replicas_from` (`dns:NAME[:PORT]`, the name of vitserve's headless Service: its
ready pods are the replicas, resolved again every few seconds, as vitserve's front resolves them; PORT
defaults to 8000), and/or `url` or `urls` (fixed replica URLs); `api_key` (vitserve's --api-key),
`timeout_s` (per HTTP call, default 10), `recheck_s` (how long an id found stays trusted without asking
again, default 30: below vitserve's --cache-hold-s, which each check renews). An id is looked up on the
replicas in its rendezvous order (`ec_client`), as vitserve's front placed it. vitserve serves `vllm_ref`
outputs from its encoder-output cache (`GET /v1/encoder_cache/{id}`), so no folder is shared: vLLM may run on
another node.

Scheduler side (the engine core's loop, which must not wait on the network):
- `ensure_cache_available(request)`: the request's ids not known yet are queued for a check, and the request
  waits (False) until they are known. A thread asks the replicas about everything queued in one request per
  replica (`POST /v1/encoder_cache/check`), so a step costs no round trip and a burst costs one per replica;
  an id not found on its replica is asked of the next ones in its order.
  A request with an id no replica holds is failed through `take_unavailable_requests` (vLLM finishes it with
  an error; with metadata-only parts it has nothing to encode itself), instead of reaching the worker.
- `has_cache_item(id)`: whether the check found it (no I/O).
- `update_state_after_alloc` / `build_connector_meta`: the step's ids to load with their placeholder
  lengths and the replica each was found on, handed to the workers in `VitserveConnectorMetadata`.

Worker side: `start_load_caches` fetches the step's outputs (`GET /v1/encoder_cache/{id}` from the replica the
check found it on, else the next in the id's order that holds it, in parallel on
keep-alive connections), checks each (the tensor `ec_cache`, the content id it names, at least as many rows
as the placeholder: vLLM's runner slices without checking) and puts it on the worker's device in vLLM's
encoder cache. vLLM casts it to the model's dtype when it merges it.

Imports: vLLM's connector base (vLLM has loaded it already) and the standard library; torch when a tensor is
made. Nothing of vitserve's server: `pip install vitserve` beside vLLM is enough.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from service.handoff.ec_client import CheckIncomplete, Loader, Replicas, check_output
from service.handoff.membership import Membership, parse_source

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vitserve.vllm_connector")

PRESENT, MISSING, PENDING = "present", "missing", "pending"
MAX_KNOWN = 1 << 16  # ids whose answer the scheduler side remembers, newest last
LOAD_THREADS = 8
DEFAULT_PORT = 8000  # vitserve's default --port, for a replicas_from without one


@dataclass
class LoadItem:
    identifier: str
    rows: int  # the placeholder's embeddings: the fewest rows the output may have
    url: str | None = None  # the replica the scheduler's check found it on


@dataclass
class VitserveConnectorMetadata(ECConnectorMetadata):
    """What the workers load this step."""

    items: list[LoadItem] = field(default_factory=list)


class VitserveConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refuses a config without it
        extra = config.ec_connector_extra_config or {}
        self.replicas = Replicas(membership_from(extra), extra.get("api_key"), float(extra.get("timeout_s", 10.0)))
        self.recheck_s = float(extra.get("recheck_s", 30.0))
        # scheduler side
        self._known: OrderedDict[str, tuple[str, float, str | None]] = OrderedDict()  # id -> (state, when, where)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._checker: threading.Thread | None = None
        self._unavailable: set[str] = set()
        self._to_load: dict[str, tuple[int, str | None]] = {}
        # worker side
        self._loader: ThreadPoolExecutor | None = None
        self._device_loader: Loader | None = None
        self.fetches = 0
        self.fetch_seconds = 0.0

    # ---- scheduler side --------------------------------------------------------------------
    def _state(self, identifier: str) -> str | None:
        with self._lock:
            known = self._known.get(identifier)
            if known is None:
                return None
            state, when, _ = known
            if state == PRESENT and time.monotonic() - when > self.recheck_s:
                del self._known[identifier]
                return None
            return state

    def _ask(self, identifier: str) -> None:
        with self._lock:
            self._known[identifier] = (PENDING, time.monotonic(), None)
            self._known.move_to_end(identifier)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)
            if self._checker is None:
                self._checker = threading.Thread(target=self._check_loop, name="vitserve-ec-check", daemon=True)
                self._checker.start()
        self._queue.put(identifier)

    def _check_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            ids = [first]
            while True:  # everything queued meanwhile goes in the same request
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                ids.append(more)
            try:
                found = self.replicas.check(sorted(set(ids)))
            except CheckIncomplete as exc:
                log.error("vitserve did not answer an encoder-cache check: %s", exc)
                found = exc.found
            now = time.monotonic()
            with self._lock:
                for identifier, where in found.items():
                    if identifier in self._known:
                        self._known[identifier] = (PRESENT if where else MISSING, now, where)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        ready = True
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # its tokens are computed already (prefix cache): not needed
            state = self._state(feature.identifier)
            if state is None:
                self._ask(feature.identifier)
                ready = False
            elif state == PENDING:
                ready = False
            elif state == MISSING:
                log.error("request %s: no vitserve replica holds encoder output %s (never made there, or evicted "
                          "before vLLM asked: raise vitserve's --cache-bytes or --cache-hold-s); the request fails",
                          request.request_id, feature.identifier)
                with self._lock:
                    self._known.pop(feature.identifier, None)  # asked again by the next request that names it
                self._unavailable.add(request.request_id)
                return False
        return ready

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_cache_item(self, identifier: str) -> bool:
        return self._state(identifier) == PRESENT

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.is_consumer and self.has_cache_item(identifier):
            with self._lock:
                where = self._known[identifier][2] if identifier in self._known else None
            self._to_load[identifier] = (request.get_num_encoder_embeds(index), where)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> VitserveConnectorMetadata:
        meta = VitserveConnectorMetadata([LoadItem(i, rows, url) for i, (rows, url) in self._to_load.items()])
        self._to_load = {}
        return meta

    # ---- worker side -----------------------------------------------------------------------
    def _worker_loader(self) -> Loader:
        if self._device_loader is None:
            from vllm.platforms import current_platform

            device = current_platform.device_type
            if current_platform.is_cuda_alike():
                device = f"{device}:{current_platform.current_device()}"
            self._device_loader = Loader(self.replicas, device)
        return self._device_loader

    def load_one(self, item: LoadItem) -> torch.Tensor:
        """One output from its replica onto this worker's device, checked."""
        started = time.perf_counter()
        loader = self._worker_loader()
        if loader.device == "cpu":
            tensor, header = loader.load(item.identifier, item.url)
        else:
            with _sync_allowed():
                tensor, header = loader.load(item.identifier, item.url)
        check_output(item.identifier, header, item.rows)
        self.fetches += 1
        self.fetch_seconds += time.perf_counter() - started
        return tensor

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, VitserveConnectorMetadata)
        todo = [item for item in metadata.items if item.identifier not in encoder_cache]
        if not todo:
            return
        if len(todo) == 1:  # no thread hand-off for the usual single item
            encoder_cache[todo[0].identifier] = self.load_one(todo[0])
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="vitserve-ec-load")
        for item, tensor in zip(todo, self._loader.map(self.load_one, todo)):
            encoder_cache[item.identifier] = tensor

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """A consumer saves nothing: vitserve produces the outputs."""
        return None

    def shutdown(self) -> None:
        if self._checker is not None:
            self._queue.put(None)
        if self._loader is not None:
            self._loader.shutdown(wait=False)
        self.replicas.close()
        self.replicas.membership.close()


def membership_from(extra: dict[str, Any]) -> Membership:
    """The ring of `ec_connector_extra_config`: `replicas_from` and/or `url` / `urls`, resolved once now (the
    first check must find the replicas) and then every few seconds on a thread."""
    urls = extra.get("urls") or ([extra["url"]] if extra.get("url") else [])
    if isinstance(urls, str):
        urls = [u for u in urls.replace(",", " ").split() if u]
    spec = extra.get("replicas_from")
    source = parse_source(str(spec), DEFAULT_PORT) if spec else None
    if source is None and not urls:
        raise ValueError("no vitserve replica: set 'replicas_from' (dns:NAME[:PORT]), 'url' or 'urls' in "
                         "ec_connector_extra_config")
    membership = Membership(urls, source)
    membership.refresh()
    membership.start()
    return membership


def _sync_allowed() -> Any:
    """vLLM's permission to wait on the device (the copy from the staging buffer), where vLLM checks it."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # a vLLM without the sync checker
        from contextlib import nullcontext

        return nullcontext()
    return gpu_sync_allowed()
