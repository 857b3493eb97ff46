"""vitserve as SGLang's encoder, judged by SGLang 0.5.23's own receiving code, not by a fake.

Real vitserve servers on loopback (one per family SGLang disaggregates, tiny presets) take the parts SGLang's
language-only side sends them; tests/sglang_driver.py, in SGLang's own environment (tools/sglang_env.sh builds
it; .ci/run sets VITSERVE_SGLANG_PYTHON), plays that side with SGLang's code: the tokenizer's dispatch of
`/encode` parts, two scheduler ranks with their shared PULL sockets and `/scheduler_receive_url`
registrations, the unpickler, the aggregation of parts and the model's multimodal processor, which sizes the
placeholders from the grids (and Qwen3-VL's timestamps) and checks the rows against them. The driver runs once
for the module, as two processes (one per rank) started before the servers so that SGLang's imports overlap
their start; the tests read its report.

Without VITSERVE_SGLANG_PYTHON these tests skip and say how to build the environment; with it, a broken
environment fails them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from models.presets import PRESETS
from service.handoff import sglang_wire as wire
from tests.checkpoints import (
    SGLANG_KIMI_TOKENS,
    VLLM_MEDIA_TOKENS,
    write_glm5_next_folder,
    write_minimax_folder,
    write_muse_model_folder,
    write_sglang_kimi_folder,
    write_vllm_model_folder,
)
from tests.http_helpers import ROOT, ServerThread, image_bytes, settings
from tests.videos import make_video

PYTHON_VAR = "VITSERVE_SGLANG_PYTHON"
HOW = "build SGLang's environment with tools/sglang_env.sh and set VITSERVE_SGLANG_PYTHON=.ci/sglang-env/bin/python"
MAIN = "tiny-qwen3-vl"  # the scenarios run on it: DeepStack rows and Qwen3-VL's timestamps
MINIMAX = "tiny-minimax-m3"
MODELS = [MAIN, "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe",
          "tiny-qwen3-omni-moe", MINIMAX, "tiny-muse-spark", "tiny-kimi-k2.5", "tiny-glm5-next"]
# The folder SGLang's language side loads for a family, where vLLM's (write_vllm_model_folder) is not it
FOLDERS = {"minimax_m3_vl": write_minimax_folder, "muse_spark": write_muse_model_folder,
           "kimi_k25": write_sglang_kimi_folder, "glm5_next": write_glm5_next_folder}
QWEN_TURN = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
# A family's chat turn and placeholder per item, where not the Qwen-VL ones: (turn start, turn end, image,
# video). MiniMax's and Muse's are bare markers, which their processors expand; Kimi's video is its placeholder
# alone.
PROMPTS = {
    "minimax_m3_vl": (*QWEN_TURN, "]<]image[>[", "]<]video[>["),
    "muse_spark": (*QWEN_TURN, "<|patch|>", "<|video|>"),
    "kimi_k25": (*QWEN_TURN, SGLANG_KIMI_TOKENS["start"] + SGLANG_KIMI_TOKENS["image"] + SGLANG_KIMI_TOKENS["end"],
                 SGLANG_KIMI_TOKENS["video"]),
    "glm5_next": ("[gMASK]<sop><|user|>\n", "<|assistant|>\n", "<|begin_of_image|><|image|><|end_of_image|>",
                  "<|begin_of_video|><|video|><|end_of_video|>"),
}
IMAGES = [image_bytes(160, 120, seed=21, fmt="JPEG"), image_bytes(96, 96, seed=22, fmt="PNG")]
VIDEO = make_video(8, fps=4, width=64, height=48)  # 2 s: at the default 2 fps, 4 frames, 2 temporal steps
BROKEN = b"GIF89a not really"
# MiniMax-M3 takes a frame a second: of 9 s at 3 fps, frames 0, 3, ..., 24 (the last repeated), five temporal
# steps whose first frames are at 0, 2, 4, 6 and 8 s; more than the four of one attention clip of its tower,
# and still one grid row
STEPS_VIDEO = make_video(27, fps=3, width=64, height=48)
STEP_SECONDS = ["0.0", "2.0", "4.0", "6.0", "8.0"]
# vitserve's --sglang-timeout-s here: a part whose ranks never register fails after it, and so does a push its
# receiver has not taken by then (at 5 s, one push of the whole suite beside a busy core did: failed 1)
TIMEOUT_S = 12
# Both drivers, from the request to their reports (about 30 s on two cores; SGLang waits 60 s for a part)
DRIVERS_TIMEOUT_S = 300


def sglang_python() -> str:
    python = os.environ.get(PYTHON_VAR)
    if not python:
        pytest.skip(f"SGLang's environment is not configured: {HOW}")
    if not Path(python).is_file():
        pytest.fail(f"{PYTHON_VAR}={python} does not exist: {HOW}")
    return python


def data_url(kind: str, data: bytes) -> str:
    mime = {"image": "image/png", "video": "video/mp4"}[kind]
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def prompt(name: str, kinds: list[str]) -> str:
    """A chat turn with one placeholder per item, as the family's template writes them."""
    family = PRESETS[name].family
    if family in PROMPTS:
        turn_start, turn_end, image, video = PROMPTS[family]
    else:
        start, end, image_pad, video_pad = VLLM_MEDIA_TOKENS.get(family, (
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
        (turn_start, turn_end), image, video = QWEN_TURN, start + image_pad + end, start + video_pad + end
    return turn_start + "".join(image if k == "image" else video for k in kinds) + "Describe." + turn_end


def case(name: str, model: str, media: list[tuple[str, bytes]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "media": [{"modality": k, "url": data_url(k, d)} for k, d in media],
            "prompt": prompt(model, [k for k, _ in media]), **extra}


MEDIA = [("image", IMAGES[0]), ("image", IMAGES[1]), ("video", VIDEO)]


def takes_video(name: str) -> bool:
    return wire.MODEL_TYPES[PRESETS[name].family].takes_video


def model_cases(name: str) -> list[dict[str, Any]]:
    """Every family: two images and a video, over two encoder URLs (three parts); a family whose video SGLang
    takes from no encoder: the two images (two parts), and the three, whose video part vitserve refuses. The
    main model also: two ranks, the tokenizer backend, a broken image, a rank that registers late, ranks that
    never register."""
    if not takes_video(name):
        return [case("parts", name, MEDIA[:2], parts=2), case("video", name, MEDIA, parts=2)]
    cases = [case("parts", name, MEDIA, parts=2)]
    if name == MAIN:
        cases += [
            case("ranks", name, MEDIA, parts=2, ranks=2),
            case("tokenizer", name, MEDIA, parts=2, backend="zmq_to_tokenizer"),
            case("broken", name, [("image", IMAGES[0]), ("image", BROKEN)], parts=2),
            case("late", name, [("image", IMAGES[1])], register_after_s=1.5),
            case("never", name, [("image", IMAGES[0])], never_register=True),
            wire_case(),
        ]
    if name == MINIMAX:  # a video of several temporal steps, each timed in the prompt
        cases.append(case("steps", name, [("video", STEPS_VIDEO)]))
    return cases


WIRE_PARTS = [
    wire.PartMeta("r_local_part_0", 2, 0, "image", [(1, 8, 10), (1, 6, 6)], "float32", (29, 240)),
    wire.PartMeta("r_local_part_1", 2, 1, "video", [(2, 4, 4)], "bfloat16", (8, 64), video_timestamps=[[0.25, 1.5]]),
    wire.PartMeta("s_local_part_0", 1, 0, "video", [(2, 4, 4), (1, 4, 6)], "float16", (14, 32),
                  second_per_grid_ts=[1.0, 0.5]),
]


def wire_case() -> dict[str, Any]:
    """vitserve's frame 0 for some parts and an error, with what SGLang's own encoder would pickle for them."""
    frames = [{"bytes": base64.b64encode(wire.metadata_frame(p)).decode(),
               "fields": {"req_id": p.req_id, "num_parts": p.num_parts, "part_idx": p.part_idx,
                          "modality": p.modality, "grids": [list(g) for g in p.grids], "dtype": p.dtype,
                          "shape": list(p.shape), "video_timestamps": p.video_timestamps,
                          "second_per_grid_ts": p.second_per_grid_ts}} for p in WIRE_PARTS]
    frames.append({"bytes": base64.b64encode(wire.error_frame("e_local_part_1", 2, 1, "video", "item 0: bad", 422))
                   .decode(), "fields": {"req_id": "e_local_part_1", "num_parts": 2, "part_idx": 1,
                                         "modality": "video", "error_msg": "item 0: bad", "error_code": 422}})
    return {"name": "wire", "check_wire": True, "frames": frames, "globals": sorted(map(list, wire.GLOBALS))}


@dataclass
class Run:
    report: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    reference: dict[str, list[torch.Tensor]]  # model -> POST /encode's rows of each of MEDIA; model/case -> its
    metrics: dict[str, dict[str, float]]  # model -> vitserve's push counters after the run
    folders: dict[str, Path]

    def case(self, model: str, name: str) -> dict[str, Any]:
        return self.report[f"{model}/{name}"]


def reference_rows(client: httpx.Client, media: list[tuple[str, bytes]] = MEDIA) -> list[torch.Tensor]:
    """POST /encode's float rows of each of `media`: the main embedding, then the DeepStack levels."""
    items = [{"type": k, k: base64.b64encode(d).decode()} for k, d in media]
    r = client.post("/encode", json={"items": items, "include_deepstack": True})
    assert r.status_code == 200, r.text
    return [torch.cat([torch.tensor(p, dtype=torch.float32) for p in [e["embedding"], *e.get("deepstack", [])]], 1)
            for e in r.json()["data"]]


def push_counts(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vitserve_sglang_pushes_total"):
            out[line.split('result="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def wait_for_drivers(drivers: list[subprocess.Popen]) -> list[int | None]:
    """Each driver's exit code, None for one still running at the deadline: that one is first asked for its
    threads' stacks (SIGUSR1, into its log), so that the failure says where it waited."""
    deadline = time.monotonic() + DRIVERS_TIMEOUT_S
    codes: list[int | None] = []
    for d in drivers:
        try:
            codes.append(d.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            d.send_signal(signal.SIGUSR1)
            codes.append(None)
    if None in codes:
        time.sleep(1)  # the stacks reach the logs
    return codes


def end_session(driver: subprocess.Popen) -> None:
    """The driver and whatever it forked."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    python = sglang_python()  # skips here, before any server starts, where SGLang's environment is not set up
    work = tmp_path_factory.mktemp("sglang")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(SGLANG_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH="",
               SGLANG_ENCODER_RECV_TIMEOUT="60")
    init = f"file://{work / 'rendezvous'}"  # gloo's rendezvous in a file: no port to lose to another process
    logs = [open(work / f"rank{r}.log", "w") for r in range(2)]  # noqa: SIM115 - closed below
    # Each driver in a session of its own: the processes SGLang forks (its processors' pools) end with it.
    drivers = [subprocess.Popen([python, str(ROOT / "tests" / "sglang_driver.py"), str(r), "2", init],
                                stdin=subprocess.PIPE, stdout=logs[r], stderr=subprocess.STDOUT, text=True,
                                cwd=work, env=env, start_new_session=True) for r in range(2)]
    # Each family's folder first: this imports transformers' config classes here, not in the threads below
    # (whose concurrent lazy imports of transformers race).
    folders = {name: FOLDERS.get(PRESETS[name].family, write_vllm_model_folder)(name, work / name) for name in MODELS}
    servers = {name: ServerThread(settings(model=name, cache_bytes=32 << 20, sglang_timeout_s=TIMEOUT_S,
                                           preprocess_workers=1)) for name in MODELS}
    try:
        with ThreadPoolExecutor(len(servers)) as pool:  # the servers start side by side
            list(pool.map(lambda s: s.__enter__(), servers.values()))
        report_path = work / "report.json"
        request: dict[str, Any] = {"tensors_out": str(work / "out.safetensors"), "report_out": str(report_path),
                                   "models": []}
        reference = {}
        for name, srv in servers.items():
            folder = folders[name]
            with srv.client() as c:
                reference[name] = reference_rows(c)
                if name == MINIMAX:
                    reference[f"{name}/steps"] = reference_rows(c, [("video", STEPS_VIDEO)])
            request["models"].append({"name": name, "dir": str(folder), "url": srv.url, "cases": model_cases(name),
                                      # Kimi's released processor is remote code, as is this folder's
                                      "trust_remote_code": PRESETS[name].family == "kimi_k25"})
        request_path = work / "request.json"
        request_path.with_suffix(".part").write_text(json.dumps(request))
        request_path.with_suffix(".part").replace(request_path)
        for d in drivers:  # a line, which the pipe holds whether or not the driver reads it yet
            with contextlib.suppress(BrokenPipeError):  # a driver that died: its exit code and log say why
                d.stdin.write(f"{request_path}\n")  # type: ignore[union-attr]
                d.stdin.close()  # type: ignore[union-attr]
        codes = wait_for_drivers(drivers)
        if codes != [0, 0] or not report_path.is_file():
            tail = "\n".join((work / f"rank{r}.log").read_text()[-6000:] for r in range(2))
            pytest.fail(f"sglang_driver.py failed (exit {codes}); {HOW}\n{tail}")
        metrics = {}
        for name, srv in servers.items():
            with srv.client() as c:
                metrics[name] = push_counts(c)
        return Run(json.loads(report_path.read_text())["cases"], load_file(work / "out.safetensors"), reference,
                   metrics, folders)
    finally:
        for d in drivers:
            end_session(d)
        for f in logs:
            f.close()
        for srv in servers.values():
            if srv.thread.is_alive():
                srv.__exit__(None, None, None)


def assert_rows(run: Run, model: str, key: str, items: tuple[int, ...] = (0, 1, 2)) -> None:
    """The rows SGLang's processor put behind the placeholders of each modality are POST /encode's for the
    same items (`items`: indices into MEDIA), bit for bit."""
    for modality in ("image", "video"):
        want = [run.reference[model][i] for i in items if MEDIA[i][0] == modality]
        if want:
            assert torch.equal(run.tensors[f"{model}/{key}.{modality}"], torch.cat(want)), (model, key, modality)


def muse_prompt(run: Run, model: str) -> str:
    """The prompt as transformers' MuseSparkProcessor expands it for MEDIA, sized by POST /encode's rows: an
    image's tokens between its start and end, a video's clips each after its first frame's time. Muse samples
    VIDEO (8 frames at 4 fps) at 2 fps: frames 0, 2, 4 and 7, two clips of two, starting at 0 s and 1 s."""
    images = "".join("<|image_start|>" + "<|patch|>" * len(run.reference[model][i]) + "<|image_end|>" for i in (0, 1))
    clip = "<|video|>" * (len(run.reference[model][2]) // 2)
    video = f"<|vid_start|>Time: 0.0s{clip}<|vid_frame_separator|>Time: 1.0s{clip}<|vid_end|>"
    return prompt(model, []).replace("Describe.", images + video + "Describe.")


@pytest.mark.parametrize("model", MODELS)
def test_each_family_reaches_sglangs_processor(run, model):
    report = run.case(model, "parts")
    assert report["ok"], report
    if not takes_video(model):
        assert_rows(run, model, "parts.0", items=(0, 1))
        assert [i["modality"] for i in report["items"]] == ["image", "image"]
        assert [i["rows"] for i in report["items"]] == [len(run.reference[model][i]) for i in (0, 1)]
        return
    assert_rows(run, model, "parts.0")
    family = PRESETS[model].family
    field = wire.MODEL_TYPES[family].video_field
    videos = [i for i in report["items"] if i["modality"] == "video"]
    rows = len(run.reference[model][2])
    if family == "muse_spark":  # one item per video, a run of tokens per clip after the clip's time
        assert [(v["rows"], len(v["offsets"])) for v in videos] == [(rows, 2)]
        tokenizer = Tokenizer.from_file(str(run.folders[model] / "tokenizer.json"))
        assert tokenizer.decode(report["input_ids"], skip_special_tokens=False) == muse_prompt(run, model)
    elif field == "video_timestamps" and family != "minimax_m3_vl":  # one item per temporal step, its time in
        # the prompt (MiniMax-M3: one item per video, test_minimax_times_each_temporal_step)
        assert [v["rows"] for v in videos] == [rows // 2] * 2
    else:
        assert [v["rows"] for v in videos] == [rows]
    if field == "second_per_grid_ts":  # M-RoPE spaces the steps by the seconds vitserve sent
        config = json.loads((run.folders[model] / "config.json").read_text())
        rate = (config["thinker_config"]["position_id_per_seconds"] if "thinker_config" in config
                else config["vision_config"]["tokens_per_second"])
        steps = sorted({float(t) for t in report["t_positions"][-1]})  # the video's temporal positions
        assert len(steps) == 2 and steps[1] - steps[0] == pytest.approx(1.0 * rate), (steps, rate)


@pytest.mark.parametrize("model", [m for m in MODELS if not takes_video(m)])
def test_a_video_part_sglang_takes_from_no_encoder_fails_that_request(run, model):
    """SGLang's processor of such a model places image rows only (a video's rows would fail its check): vitserve
    refuses the video part with 501, and SGLang aborts the request with that message."""
    report = run.case(model, "video")
    assert report.get("aborted") and report["error_code"] == 501, report
    family = PRESETS[model].family
    assert report["error_msg"] == f"SGLang {wire.SGLANG_VERSION} takes no video of {family} from an encoder"


def test_minimax_times_each_temporal_step(run):
    """MiniMax-M3's video is one item whose placeholders are a run per temporal step, each after the time of
    the step's first frame, as vitserve sent them; its rows are POST /encode's."""
    report = run.case(MINIMAX, "steps")
    assert report["ok"], report
    want = run.reference[f"{MINIMAX}/steps"][0]
    assert torch.equal(run.tensors[f"{MINIMAX}/steps.0.video"], want)
    [video] = report["items"]
    assert video["rows"] == len(want) and len(video["offsets"]) == len(STEP_SECONDS)
    per_step = len(want) // len(STEP_SECONDS)
    assert [b - a + 1 for a, b in video["offsets"]] == [per_step] * len(STEP_SECONDS)
    text = Tokenizer.from_file(str(run.folders[MINIMAX] / "tokenizer.json")).decode(
        report["input_ids"], skip_special_tokens=False)
    frame = "]<]start of image[>[" + "]<]video[>[" * per_step + "]<]end of image[>["
    assert "user\n" + "".join(f"]<]{s} seconds[>[{frame}" for s in STEP_SECONDS) + "Describe." in text, text


def test_two_ranks_each_get_every_part(run):
    for key in ("ranks", "ranks@1"):
        report = run.case(MAIN, key)
        assert report["ok"], report
    assert_rows(run, MAIN, "ranks.0")
    assert_rows(run, MAIN, "ranks.1")


def test_the_tokenizer_backend(run):
    report = run.case(MAIN, "tokenizer")
    assert report["ok"], report
    assert_rows(run, MAIN, "tokenizer.0")


def test_a_broken_image_aborts_that_request(run):
    report = run.case(MAIN, "broken")
    assert report.get("aborted") and report["error_code"] == 422, report
    assert report["error_msg"].startswith("item 0: GIF data is corrupt")  # vitserve's message, as it answered


def test_a_rank_that_registers_late_still_gets_its_part(run):
    report = run.case(MAIN, "late")
    assert report["ok"], report
    assert_rows(run, MAIN, "late.0", items=(1,))


def test_ranks_that_never_register_fail_that_request_after_the_timeout(run):
    report = run.case(MAIN, "never")
    assert report.get("aborted") and report["error_code"] == 504, report
    assert f"timed out after {TIMEOUT_S}s" in report["error_msg"]
    # The part is dropped once. (Not `failed == 0`: the broken case's error frame, which SGLang no longer
    # needs once /encode answered 422, can wait on a rank past the timeout on a loaded box; it did once.)
    assert run.metrics[MAIN]["dropped"] == 1
    assert run.metrics[MAIN]["ok"] > 0


def test_vitserves_frame_is_what_sglangs_encoder_pickles(run):
    report = run.case(MAIN, "wire")
    assert sorted(map(tuple, report["allowed"])) == sorted(wire.GLOBALS)  # every global on SGLang's allowlist
    assert [f["type"] for f in report["frames"]] == ["EmbeddingData"] * 4
    assert [f["diffs"] for f in report["frames"]] == [[]] * 4
