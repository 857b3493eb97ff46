"""Feeds what a real `vitserve serve` sends to SGLang 0.5.23's own receiving code; run by
tests/test_sglang_handoff.py in SGLang's environment (tools/sglang_env.sh), one process per scheduler rank:

    <sglang-env>/bin/python tests/sglang_driver.py RANK WORLD file:///RENDEZVOUS-FILE <<< /path/to/request.json

Every rank reads the same request; rank 0 writes the report (`report_out`) and the tensors (`tensors_out`).
SIGUSR1 writes every thread's stack to stderr (the test asks for it before it kills a driver that overran).

It imports only SGLang, torch and the standard library. For each model (a checkpoint folder without weights,
from tests/checkpoints.py) it publishes SGLang's configuration as a language-only server's
(`--language-only --encoder-urls ... --encoder-transfer-backend zmq_to_scheduler`) and builds:

- the tokenizer side's `MMReceiverHTTP` (rank 0): for zmq_to_scheduler it sends every part's `/encode` to
  vitserve (`send_encode_request`: the assignment of items to encoder URLs, one part each, `<rid>_local_part_<k>`)
  and reports a failed dispatch (`EncoderDispatchErrorReq`) as SGLang's tokenizer manager does; for
  zmq_to_tokenizer (`recv_mm_data`) it binds its own PULL socket, sends the parts and assembles them itself;
- each scheduler rank's `MMReceiverHTTP`, with its shared PULL socket and its registration thread
  (`/scheduler_receive_url` to vitserve), ticked as SGLang's scheduler ticks it (`process_waiting_requests`):
  it drains the socket, unpickles each message with `safe_pickle_loads`, aggregates the parts, agrees on the
  status over the TP group (gloo) and hands the rows to the model's multimodal processor
  (`get_validated_mm_data`: placeholders sized from the grids and, for Qwen3-VL video, the timestamps; the
  rows checked against them; M-RoPE positions), or aborts the request with the error it got.

Not SGLang's: the scheduler process around the receiver (the driver ticks it and passes the dispatch errors
on, over the TP group, as the scheduler's input broadcast does) and a TP group built by hand on gloo. A case
`"check_wire"` compares vitserve's frame 0 with what SGLang's own encoder pickles for the same part.
"""

from __future__ import annotations

import asyncio
import base64
import faulthandler
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from array import array
from typing import Any

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # receivers bind and name themselves on loopback
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

CASE_TIMEOUT_S = 60.0


def black_hole() -> tuple[socket.socket, str]:
    """A loopback port that accepts connections and never answers: a registration sent there never
    reaches vitserve."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def groups(rank: int, world: int) -> tuple[Any, Any]:
    """SGLang's group coordinators on gloo: every rank, and each rank alone."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    def coordinator(ranks: list[list[int]], name: str) -> Any:
        return GroupCoordinator(ranks, rank, "gloo", use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                                use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                                use_xpu_communicator=False, group_name=name)

    return coordinator([list(range(world))], "tp_all"), coordinator([[r] for r in range(world)], "tp_solo")


class Model:
    """One checkpoint folder: its published configuration and, made when a case first needs them, its
    receivers: this rank's scheduler side for a TP group of one or of every rank, and (rank 0) the tokenizer
    side."""

    def __init__(self, spec: dict[str, Any], rank: int, tp: tuple[Any, Any]) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig

        self.spec, self.rank, self.tp = spec, rank, tp
        # No radix cache: on the CPU SGLang refuses Qwen3.5's (hybrid attention) cache snapshots, and the
        # receiving code never reads the cache.
        self.args = ServerArgs(model_path=spec["dir"], language_only=True, encoder_urls=[spec["url"]],
                               encoder_transfer_backend="zmq_to_scheduler", device="cpu", disable_radix_cache=True,
                               trust_remote_code=spec.get("trust_remote_code", False))
        publish(self.args, role="scheduler")
        self.hf_config = AutoConfig.from_pretrained(spec["dir"], trust_remote_code=self.args.trust_remote_code)
        self.model_config = ModelConfig.from_server_args(self.args)
        self.schedulers: dict[int, Any] = {}
        self._tokenizer_side: Any = None

    def scheduler(self, size: int) -> Any:
        """This rank's scheduler-side receiver in a TP group of `size` ranks (1: rank 0 alone)."""
        if size not in self.schedulers:
            from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP
            from sglang.srt.disaggregation.utils import DisaggregationMode
            from sglang.srt.runtime_context import get_parallel

            group = self.tp[1] if size == 1 else self.tp[0]
            scheduler = Scheduler(self.model_config, DisaggregationMode.NULL)
            with get_parallel().override(tp_rank=self.rank, tp_size=size, tp_group=group, attn_tp_size=size,
                                         moe_tp_size=size, pp_rank=0):
                receiver = MMReceiverHTTP(self.args, hf_config=self.hf_config, scheduler=scheduler)
            scheduler.tokenizer = receiver.mm_processor._tokenizer
            self.schedulers[size] = receiver
        return self.schedulers[size]

    @property
    def tokenizer_side(self) -> Any:
        if self._tokenizer_side is None:
            from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP

            self._tokenizer_side = MMReceiverHTTP(self.args, hf_config=self.hf_config)
        return self._tokenizer_side


class Scheduler:
    """What `MMReceiverBase.create_req` reads of SGLang's scheduler when it aborts a request."""

    def __init__(self, model_config: Any, mode: Any) -> None:
        from types import SimpleNamespace

        self.model_config = model_config
        self.disaggregation_mode = mode
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.metrics_collector = None
        self.dllm_config = None
        self.tokenizer = None


def generate_input(case: dict[str, Any]) -> Any:
    from sglang.srt.managers.io_struct import GenerateReqInput

    images = [m["url"] for m in case["media"] if m["modality"] == "image"]
    videos = [m["url"] for m in case["media"] if m["modality"] == "video"]
    obj = GenerateReqInput(text=case["prompt"], image_data=images or None, video_data=videos or None)
    obj.rid = f"{case['name']}-{uuid.uuid4().hex[:8]}"
    return obj


def tokenized(plan: dict[str, Any], tokenizer: Any) -> Any:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return TokenizedGenerateReqInput(
        rid=plan["rid"], input_text=plan["prompt"], input_ids=array("q", tokenizer.encode(plan["prompt"])),
        input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
        need_wait_for_mm_inputs=True, num_items_assigned=plan["num_items_assigned"],
        encoder_urls=plan["encoder_urls"])


def describe(mm: Any, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the processor made of the rows: its items (per modality, in order), the prompt and positions."""
    rows: dict[str, list[torch.Tensor]] = {}
    items = []
    for item in mm.mm_items:
        name = item.modality.name.lower()
        rows.setdefault(name, []).append(item.precomputed_embeddings)
        items.append({"modality": name, "offsets": [list(o) for o in item.offsets],
                      "rows": int(item.precomputed_embeddings.shape[0])})
    for name, parts in rows.items():
        tensors[f"{key}.{name}"] = torch.cat(parts).contiguous()
    positions = mm.mrope_positions
    return {"items": items, "input_ids": list(mm.input_ids),
            "t_positions": [positions[0, o[0]:o[1] + 1].tolist() for it in mm.mm_items for o in it.offsets]
            if positions is not None else None}


def run_scheduler_case(model: Model, case: dict[str, Any], rank: int, tp: tuple[Any, Any],
                       tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """zmq_to_scheduler: the tokenizer side dispatches (rank 0), every rank of the case ticks its receiver."""
    from sglang.srt.managers.io_struct import EncoderDispatchErrorReq

    size = case.get("ranks", 1)
    group = tp[0] if size > 1 else tp[1]
    receiver = model.scheduler(size)
    errors: list[Any] = []
    plan: list[Any] = [None]
    hole = None
    if size > 1:
        dist.barrier(group=group.cpu_group)  # every rank of the case is ticking before its parts are sent
    if rank == 0:
        tok = model.tokenizer_side
        tok.encode_urls[:] = [model.spec["url"]] * case.get("parts", 1)
        obj = generate_input(case)
        ready = tok.send_encode_request(obj, on_dispatch_error=errors.append)
        urls = list(obj.encoder_urls)
        if case.get("never_register"):  # the ranks register somewhere vitserve never hears of
            hole, url = black_hole()
            urls = [url] * len(urls)
        plan[0] = {"rid": obj.rid, "prompt": case["prompt"], "num_items_assigned": dict(obj.num_items_assigned),
                   "encoder_urls": urls}
        ready.set()  # the scheduler has the request: dispatch errors may be reported
    if size > 1:
        dist.broadcast_object_list(plan, src=0, group=group.cpu_group)
    recv_req = tokenized(plan[0], receiver.mm_processor._tokenizer)
    time.sleep(case.get("register_after_s", 0))
    pending: list[Any] = [recv_req]
    deadline = time.monotonic() + CASE_TIMEOUT_S
    report: dict[str, Any] = {"ok": False}
    try:
        while True:
            # Rank 0 decides for every rank of the case, so that they stop at the same tick: a rank that left
            # the loop alone would leave the others waiting in this broadcast.
            news: list[Any] = [None]
            if rank == 0:
                news[0] = ([errors.pop(0) for _ in range(len(errors))], time.monotonic() > deadline)
            if size > 1:
                dist.broadcast_object_list(news, src=0, group=group.cpu_group)
            dispatch_errors, overdue = news[0]
            if overdue:
                break
            pending += [e for e in dispatch_errors if isinstance(e, EncoderDispatchErrorReq)]
            ready_reqs, aborts = receiver.process_waiting_requests(pending)
            pending = []
            if aborts:
                _, message, code = aborts[0]
                report.update(aborted=True, error_msg=message, error_code=int(code) if code is not None else None)
                return report
            if any(r is recv_req for r in ready_reqs):
                key = f"{model.spec['name']}/{case['name']}.{rank}"
                report.update(describe(recv_req.mm_inputs, key, tensors), ok=True)
                return report
            time.sleep(0.01)
        report["error"] = f"no result within {CASE_TIMEOUT_S}s"
        return report
    finally:
        if hole is not None:
            hole.close()


def run_tokenizer_case(model: Model, case: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """zmq_to_tokenizer: the tokenizer side binds its PULL socket, sends the parts and assembles them."""
    tok = model.tokenizer_side
    tok.encode_urls[:] = [model.spec["url"]] * case.get("parts", 1)
    obj = generate_input(case)
    processor = model.scheduler(1).mm_processor  # the tokenizer manager's own is the same class, made alike
    mm = asyncio.run(tok.recv_mm_data(obj, processor, case["prompt"], need_wait_for_mm_inputs=True))
    if mm is None:
        return {"ok": False, "aborted": True}
    return {**describe(mm, f"{model.spec['name']}/{case['name']}.0", tensors), "ok": True}


def check_wire(case: dict[str, Any]) -> dict[str, Any]:
    """vitserve's frame 0 beside SGLang's own for the same part: both read by `safe_pickle_loads`."""
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.utils.common import SafeUnpickler, safe_pickle_loads

    out: dict[str, Any] = {"allowed": [list(g) for g in case["globals"]
                                       if tuple(g) in SafeUnpickler.ALLOWED_GLOBALS], "frames": []}
    for frame in case["frames"]:
        ours = safe_pickle_loads(base64.b64decode(frame["bytes"]))
        f = frame["fields"]
        modality = Modality[f["modality"].upper()]
        if f.get("error_msg") is not None:
            theirs = EmbeddingData(f["req_id"], f["num_parts"], f["part_idx"], None, modality,
                                   error_msg=f["error_msg"], error_code=f["error_code"])
        else:
            embedding = torch.zeros(f["shape"], dtype=getattr(torch, f["dtype"]))
            seconds = f.get("second_per_grid_ts")
            theirs = EmbeddingData(f["req_id"], f["num_parts"], f["part_idx"], torch.tensor(f["grids"]), modality,
                                   embedding, video_timestamps=f.get("video_timestamps"),
                                   second_per_grid_ts=None if seconds is None else torch.tensor(
                                       seconds, dtype=torch.float32))
        theirs = safe_pickle_loads(pickle.dumps(theirs.copy_without_embedding()))
        diffs = []
        if list(ours.__dict__) != list(theirs.__dict__):
            diffs.append(f"fields {list(ours.__dict__)} != {list(theirs.__dict__)}")
        for name, value in theirs.__dict__.items():
            mine = ours.__dict__.get(name)
            same = (type(mine) is type(value) and (torch.equal(mine, value) and mine.dtype == value.dtype
                                                   if isinstance(value, torch.Tensor) else mine == value))
            if not same:
                diffs.append(f"{name}: {mine!r} != {value!r}")
        out["frames"].append({"type": type(ours).__name__, "diffs": diffs})
    return out


def main() -> int:
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    started = time.monotonic()
    # SGLang's imports first (what its receiver loads for its processors), while vitserve's servers start
    from sglang.srt.managers.multimodal_processor import import_processors

    import_processors("sglang.srt.multimodal.processors")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tp = groups(rank, world)
    log(rank, f"ready in {time.monotonic() - started:.1f}s")
    with open(sys.stdin.readline().strip()) as f:  # the request's path, once the test has written it
        request = json.load(f)
    tensors: dict[str, torch.Tensor] = {}
    reports: dict[str, Any] = {}
    for spec in request["models"]:
        mine = [c for c in spec["cases"] if rank < c.get("ranks", 1)]
        if not mine:
            continue
        try:
            model = Model(spec, rank, tp)
        except Exception as exc:
            for case in mine:
                reports[f"{spec['name']}/{case['name']}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                                              "traceback": traceback.format_exc(limit=-8)}
            continue
        for case in mine:
            log(rank, f"{spec['name']}/{case['name']} at {time.monotonic() - started:.1f}s")
            try:
                if case.get("check_wire"):
                    report = check_wire(case)
                elif case.get("backend") == "zmq_to_tokenizer":
                    report = run_tokenizer_case(model, case, tensors)
                else:
                    report = run_scheduler_case(model, case, rank, tp, tensors)
            except Exception as exc:  # the report says what SGLang refused; the test judges it
                report = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=-8)}
            reports[f"{spec['name']}/{case['name']}" + (f"@{rank}" if rank else "")] = report
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (reports, tensors))
    if rank == 0:
        save_file({k: v for _, part in gathered for k, v in part.items()}, request["tensors_out"])
        import sglang

        report = json.dumps({"sglang": sglang.__version__, "torch": torch.__version__,
                             "cases": {k: v for part, _ in gathered for k, v in part.items()}})
        written = request["report_out"] + ".part"  # whole or absent: renamed once written
        with open(written, "w") as f:
            f.write(report)
        os.replace(written, request["report_out"])
    log(rank, f"done in {time.monotonic() - started:.1f}s")
    return 0


def log(rank: int, message: str) -> None:
    print(f"sglang driver, rank {rank}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the receivers' daemon threads and ZMQ contexts need no orderly end here
