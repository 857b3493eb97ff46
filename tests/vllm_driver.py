"""Feeds vitserve's outputs to vLLM's own code; run by tests/test_vllm_handoff.py in vLLM's environment.

    VLLM_TARGET_DEVICE=cpu <vllm-env>/bin/python tests/vllm_driver.py < request.json > report.json

Reads one JSON request on stdin, prints one JSON report on stdout, and writes the tensors vLLM made to the
safetensors file the request names. It imports only vLLM, torch and the standard library: it runs in its own
interpreter, with vLLM's pinned dependencies, never beside vitserve's.

For each model (a checkpoint folder without weights, from tests/checkpoints.py) it builds vLLM's config, its
renderer and its input processor as the OpenAI server does, and the model itself with dummy weights on the
CPU. For each case, a chat message holding vitserve's content parts goes through:

1. the renderer: `parse_chat_messages` (content parts, per-part merging), the chat template and the model's
   multimodal processor (embedding-field checks, placeholder sizing, `get_mm_hashes`);
2. the input processor, which turns the hashes into each item's cache identifier, and `Request`;
3. where the case asks, vLLM's M-RoPE positions of the prompt (the model class's
   `get_mrope_input_positions`, which reads only the config): the temporal steps of each item;
4. as an encoder-cache consumer (when the case names a shared folder): `ECExampleConnector`'s lookup
   (`has_cache_item`), its scheduler-side bookkeeping and the worker-side load into an encoder cache;
   otherwise the model's `embed_multimodal` on the parts' tensors;
5. the step of the GPU model runner that slices each item's encoder output to its placeholder
   (`_gather_mm_embeddings`, restated here for a whole prompt: that runner needs a GPU), then the model's
   `embed_input_ids`, which casts, splits off Qwen3-VL's DeepStack and merges into the prompt.

A case that fails reports vLLM's error message instead; the test decides whether that was expected. A case
with `"model": false` stops before building the model: Qwen2-VL's vision tower binds vLLM's compiled
QuickGELU kernel when it is constructed, which the CUDA wheel cannot load on a machine without a GPU driver
(the embedding path never runs the tower).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # nothing leaves the machine

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# On a CPU with AMX tiles vLLM repacks small linear weights with its CPU build's kernels
# (`torch.ops._C.convert_weight_packed`), which the CUDA wheel installed here does not have: the model then
# fails to build. Reported without AMX, vLLM keeps the torch path it takes on every other CPU.
torch.cpu._is_amx_tile_supported = lambda: False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Model:
    """vLLM's pieces for one checkpoint folder; the torch model is built once and shared by its cases."""

    def __init__(self, folder: str, dtype: str, hybrid: bool = False) -> None:
        self.folder = folder
        self.dtype = dtype
        # A hybrid model (linear-attention layers: GLM-5) gets a state cache whose block vLLM's config checks
        # against prefix caching, which the CPU platform turns off: one block of the whole length passes.
        self.hybrid = hybrid
        self.model: Any = None

    def config(self, consumer: str | None) -> Any:
        from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig
        from vllm.config.ec_transfer import ECTransferConfig

        model_config = ModelConfig(model=self.folder, tokenizer=self.folder, dtype=self.dtype, max_model_len=8192,
                                   enable_mm_embeds=consumer is None)
        ec = None
        if consumer is not None:
            ec = ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_consumer",
                                  ec_connector_extra_config={"shared_storage_path": consumer})
        cache = {"cache_config": CacheConfig(mamba_block_size=8192)} if self.hybrid else {}
        return VllmConfig(model_config=model_config, ec_transfer_config=ec, load_config=LoadConfig(load_format="dummy"),
                          **cache)

    def torch_model(self, vllm_config: Any) -> Any:
        if self.model is None:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader import get_model

            with set_current_vllm_config(vllm_config):
                self.model = get_model(vllm_config=vllm_config)
        return self.model


def init_distributed(vllm_config: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)


def gather(features: list[Any], encoder_cache: dict[str, torch.Tensor],
           num_tokens: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The GPU model runner's `_gather_mm_embeddings` for one request scheduled whole: each item's encoder
    output sliced to the embedding positions of its placeholder, and the mask of those positions."""
    mm_embeds = []
    is_mm_embed = torch.zeros(num_tokens, dtype=torch.bool)
    for feature in features:
        pos = feature.mm_position
        start_idx, end_idx = 0, pos.length
        lo, hi = pos.get_embeds_indices_in_range(start_idx, end_idx)
        output = encoder_cache[feature.identifier]
        if pos.is_embed is not None:
            item = output[lo:hi]
            is_mm_embed[pos.offset:pos.offset + pos.length] |= pos.is_embed
        else:
            item = output[start_idx:end_idx]
            is_mm_embed[pos.offset:pos.offset + pos.length] = True
        mm_embeds.append(item)
    return mm_embeds, is_mm_embed


def mrope_positions(vllm_config: Any, request: Any) -> torch.Tensor:
    """vLLM's M-RoPE positions [3, tokens] of the request's prompt: the model class's
    `get_mrope_input_positions` on the request's features, as the GPU model runner calls it. That code reads
    only the model's config, so it runs on an instance holding just the config (the Omni thinkers keep their
    thinker config as `config`): no model needs to be built for it."""
    from vllm.model_executor.model_loader import get_model_architecture

    cls, _ = get_model_architecture(vllm_config.model_config)
    bare = cls.__new__(cls)
    torch.nn.Module.__init__(bare)
    hf_config = vllm_config.model_config.hf_config
    bare.config = getattr(hf_config, "thinker_config", hf_config)
    positions, _ = bare.get_mrope_input_positions(request.prompt_token_ids, request.mm_features)
    return positions


def run_case(model: Model, case: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
    from vllm.multimodal.utils import group_and_batch_mm_kwargs
    from vllm.renderers.params import ChatParams
    from vllm.renderers.registry import renderer_from_config
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import Request

    consumer = case.get("consumer")
    vllm_config = model.config(consumer)
    report: dict[str, Any] = {"ok": False}
    renderer = renderer_from_config(vllm_config)
    messages = case.get("messages") or [{"role": "user", "content": [{"type": "text", "text": "Describe."},
                                                                       *case["parts"]]}]
    # A request's own media_io_kwargs / mm_processor_kwargs where the OpenAI server puts them
    # (OnlineRenderer.preprocess_chat): in the chat params, and the latter in the prompt too.
    params = ChatParams(media_io_kwargs=case.get("media_io_kwargs"),
                        mm_processor_kwargs=case.get("mm_processor_kwargs"))
    extras = {"mm_processor_kwargs": case["mm_processor_kwargs"]} if case.get("mm_processor_kwargs") else None
    _, prompts = renderer.render_chat([messages], params, prompt_extras=extras)
    prompt = prompts[0]
    report["mm_hashes"] = prompt["mm_hashes"]
    report["stage"] = "rendered"

    processor = InputProcessor(vllm_config, renderer)
    core_request = processor.process_inputs(f"req-{prefix}", prompt, SamplingParams(max_tokens=1),
                                            supported_tasks=("generate",))
    request = Request.from_engine_core_request(core_request, block_hasher=None)
    features = request.mm_features
    report["features"] = [
        {"modality": f.modality, "identifier": f.identifier, "mm_hash": f.mm_hash, "offset": f.mm_position.offset,
         "length": f.mm_position.length, "num_embeds": request.get_num_encoder_embeds(i),
         "data_keys": sorted(f.data.keys()) if f.data is not None else []}
        for i, f in enumerate(features)
    ]
    report["stage"] = "processed"
    if case.get("positions"):  # the temporal M-RoPE position of each item's embedding rows, from its first
        positions = mrope_positions(vllm_config, request)
        for entry, f in zip(report["features"], features):
            pos = f.mm_position
            t = positions[0, pos.offset:pos.offset + pos.length]
            if pos.is_embed is not None:
                t = t[pos.is_embed]
            entry["t_steps"] = torch.unique_consecutive(t - t[0]).tolist()
        report["stage"] = "positioned"

    encoder_cache: dict[str, torch.Tensor] = {}
    if consumer is not None:
        scheduler = ECExampleConnector(vllm_config, ECConnectorRole.SCHEDULER)
        worker = ECExampleConnector(vllm_config, ECConnectorRole.WORKER)
        found = []
        for i, f in enumerate(features):
            found.append(scheduler.has_cache_item(f.identifier))
            scheduler.update_state_after_alloc(request, i)
        report["has_cache"] = found
        worker.bind_connector_metadata(scheduler.build_connector_meta(None))
        worker.start_load_caches(encoder_cache)
        worker.clear_connector_metadata()
        report["loaded"] = sorted(encoder_cache)
        report["stage"] = "loaded"
        for k, f in enumerate(features):
            if f.identifier in encoder_cache:
                tensors[f"{prefix}.enc.{k}"] = encoder_cache[f.identifier].contiguous()
    if not case.get("model", True):  # the processor's side only (the model cannot be built here)
        report["ok"] = True
        return report

    torch_model = model.torch_model(vllm_config)
    if consumer is None:
        with torch.inference_mode():
            batch = [(f.modality, f.data) for f in features]
            outputs: list[torch.Tensor] = []
            for _, _, kwargs in group_and_batch_mm_kwargs(batch, device="cpu"):
                outputs.extend(torch_model.embed_multimodal(**kwargs))
        for k, (f, out) in enumerate(zip(features, outputs)):
            encoder_cache[f.identifier] = out
            tensors[f"{prefix}.enc.{k}"] = out.contiguous()
        report["stage"] = "embedded"

    input_ids = torch.tensor(request.prompt_token_ids, dtype=torch.long)
    mm_embeds, is_mm_embed = gather(features, encoder_cache, len(input_ids))
    with torch.inference_mode():
        inputs_embeds = torch_model.embed_input_ids(input_ids, mm_embeds, is_multimodal=is_mm_embed)
    deepstack = None
    if getattr(torch_model, "use_deepstack", False):
        deepstack = torch_model._get_deepstack_input_embeds(len(input_ids))
    for k, f in enumerate(features):
        pos = f.mm_position
        rows = torch.arange(pos.offset, pos.offset + pos.length)
        if pos.is_embed is not None:
            rows = rows[pos.is_embed]
        tensors[f"{prefix}.merged.{k}"] = inputs_embeds[rows].contiguous()
        if deepstack is not None:
            for j in range(torch_model.deepstack_num_level):
                tensors[f"{prefix}.deepstack.{k}.{j}"] = deepstack[f"deepstack_input_embeds_{j}"][rows].contiguous()
    report["model_dtype"] = str(inputs_embeds.dtype).removeprefix("torch.")
    report["stage"] = "merged"
    report["ok"] = True
    return report


def main() -> int:
    request = json.load(sys.stdin)
    tensors: dict[str, torch.Tensor] = {}
    reports: dict[str, dict[str, Any]] = {}
    initialised = False
    for spec in request["models"]:
        model = Model(spec["dir"], spec.get("dtype", "bfloat16"), spec.get("hybrid", False))
        if not initialised:
            init_distributed(model.config(None))
            initialised = True
        for case in spec["cases"]:
            key = f"{spec['name']}/{case['name']}"
            try:
                reports[key] = run_case(model, case, tensors, key)
            except Exception as exc:  # the report says what vLLM refused, the test judges it
                reports[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=-6)}
    save_file(tensors, request["tensors_out"])
    import vllm

    print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "cases": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
