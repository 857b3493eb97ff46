"""Drives `service.handoff.vllm_connector.VitserveConnector` with vLLM's own code; run by
tests/test_vllm_connector.py in vLLM's environment, with a vitserve server on loopback.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=<repo> <vllm-env>/bin/python tests/vllm_connector_driver.py < req.json

For each chat (messages as vitserve's proxy forwards them, or as a client writes them with vllm_ref parts) it
builds vLLM's config as an encoder-cache consumer with the connector's `--ec-transfer-config`, renders and
processes the chat as the OpenAI server does (identifiers from the uuids), creates both roles of the connector
through vLLM's `ECConnectorFactory`, and makes the calls vLLM's scheduler and GPU model runner make:
`ensure_cache_available` each step until it is ready, `has_cache_item`, `update_state_after_alloc`,
`build_connector_meta` (pickled, as it crosses to the workers), then on the worker side
`bind_connector_metadata`, `start_load_caches` and `clear_connector_metadata`. It writes the loaded tensors
to the safetensors file the request names and prints one JSON report. A chat may carry its own connector
config (`extra`); with `hosts_file`, names in it resolve from that file (tests/hooks/hosts.py).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

STEP_TIMEOUT_S = 20.0


def consumer_config(folder: str, extra: dict[str, Any]) -> Any:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig
    from vllm.config.ec_transfer import ECTransferConfig

    model_config = ModelConfig(model=folder, tokenizer=folder, dtype="bfloat16", max_model_len=8192)
    ec = ECTransferConfig(ec_connector="VitserveConnector", ec_connector_module_path="service.handoff.vllm_connector",
                          ec_role="ec_consumer", ec_connector_extra_config=extra)
    return VllmConfig(model_config=model_config, ec_transfer_config=ec, load_config=LoadConfig(load_format="dummy"))


def request_for(vllm_config: Any, messages: list[dict[str, Any]], name: str) -> Any:
    from vllm.renderers.params import ChatParams
    from vllm.renderers.registry import renderer_from_config
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import Request

    renderer = renderer_from_config(vllm_config)
    _, prompts = renderer.render_chat([messages], ChatParams())
    core = InputProcessor(vllm_config, renderer).process_inputs(f"req-{name}", prompts[0],
                                                                SamplingParams(max_tokens=1),
                                                                supported_tasks=("generate",))
    return Request.from_engine_core_request(core, block_hasher=None)


def schedule(scheduler: Any, request: Any) -> tuple[bool, int, set[str]]:
    """The scheduler's calls for one request until it is ready or failed: (ready, steps, failed ids)."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    steps = 0
    while time.monotonic() < deadline:
        steps += 1
        ready = scheduler.ensure_cache_available(request, 0)
        failed = scheduler.take_unavailable_requests()
        if ready or failed:
            return ready, steps, failed
        time.sleep(0.001)  # the engine core's next step
    return False, steps, set()


def run_chat(folder: str, extra: dict[str, Any], chat: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    report: dict[str, Any] = {"ok": False}
    vllm_config = consumer_config(folder, extra)
    report["mm_embeds_enabled"] = bool(vllm_config.model_config.multimodal_config.enable_mm_embeds)
    request = request_for(vllm_config, chat["messages"], chat["name"])
    features = request.mm_features
    report["features"] = [{"identifier": f.identifier, "modality": f.modality,
                           "num_embeds": request.get_num_encoder_embeds(i)} for i, f in enumerate(features)]
    report["stage"] = "processed"
    scheduler = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.WORKER)
    report["class"] = f"{type(scheduler).__module__}.{type(scheduler).__name__}"
    ready, steps, failed = schedule(scheduler, request)
    report.update(ready=ready, steps=steps, failed=sorted(failed))
    report["has_cache"] = [scheduler.has_cache_item(f.identifier) for f in features]
    if not ready:
        report["ok"] = True
        return report
    for i in range(len(features)):
        scheduler.update_state_after_alloc(request, i)
    meta = pickle.loads(pickle.dumps(scheduler.build_connector_meta(None)))
    report["meta_items"] = len(meta.items)
    report["meta_after_reset"] = len(scheduler.build_connector_meta(None).items)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(meta)
    started = time.perf_counter()
    worker.start_load_caches(encoder_cache)
    report["load_ms"] = (time.perf_counter() - started) * 1000
    worker.clear_connector_metadata()
    report["loaded"] = sorted(encoder_cache)
    report["members"] = list(scheduler.replicas.membership.members)
    report["found_by_check"] = {i: scheduler._known[i][2] for i in scheduler._known}
    report["worker_found"] = dict(worker.replicas.found)
    for f in features:
        tensors[f"{chat['name']}.{f.identifier}"] = encoder_cache[f.identifier].contiguous()
    worker.shutdown()
    scheduler.shutdown()
    report["stage"] = "loaded"
    report["ok"] = True
    return report


def main() -> int:
    request = json.load(sys.stdin)
    if request.get("hosts_file"):
        from tests.hooks import hosts

        hosts.install(request["hosts_file"])
    tensors: dict[str, torch.Tensor] = {}
    reports: dict[str, Any] = {}
    for chat in request["chats"]:
        try:
            reports[chat["name"]] = run_chat(request["model_dir"], chat.get("extra", request["extra"]), chat, tensors)
        except Exception as exc:
            reports[chat["name"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc(limit=-8)}
    save_file(tensors, request["tensors_out"])
    from service.handoff import vllm_connector  # noqa: F401 - loaded by the factory already

    loaded = sorted(m for m in sys.modules if m == "service" or m.startswith("service."))
    print(json.dumps({"chats": reports, "service_modules": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
