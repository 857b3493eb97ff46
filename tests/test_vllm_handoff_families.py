"""The hand-off of the families beyond Qwen2/2.5/3-VL, judged by vLLM 0.33.0's own code.

As tests/test_vllm_handoff.py (whose helpers and driver this reuses), on fewer cases: each family's
inline parts (`encoding_format: "vllm"`) through vLLM's parser, processor and, where vLLM's model can be
built on the CPU, its `embed_input_ids` (the cast, the DeepStack split, the merge); and its reference
parts (`"vllm_ref"`) through `ECExampleConnector`. What each family must get right: the output width
(out_hidden_size times one plus the DeepStack levels), placeholders as long as the item's tokens, and
video timestamps exactly where vLLM's parser for that family asks for them.

The Omni models (Qwen2.5-Omni, Qwen3-Omni) go through their thinker's processor, which loads the audio
feature extractor as well (tests/checkpoints.py writes a default one into the image processor's
preprocessor_config.json, as the releases ship it, and the tokenizer names the Omni media tokens) and
keeps `second_per_grid_ts` with video embeddings: their parts carry it, and vLLM's M-RoPE positions
(`get_mrope_input_positions`) space each video's temporal steps by it, for a video sampled at 2 fps and
one at 1 fps; without it vLLM assumes its own default (1.0 s per step for Qwen2.5-Omni, 2.0 s for
Qwen3-Omni).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.families import FAMILIES
from models.presets import PRESETS
from tests.checkpoints import OMNI_POSITIONS_PER_SECOND, write_vllm_model_folder
from tests.http_helpers import ServerThread, settings
from tests.test_vllm_handoff import IMAGES, LONG_VIDEO, VIDEO, VLLM_DTYPE, post, reference, run_driver, vllm_python

# preset -> whether vLLM's model is built on the CPU here: for Qwen3-VL-MoE, Qwen3.5(-MoE) and Qwen3-Omni its
# text part does not build from these tiny configs (no unquantized MoE backend on the CPU for the MoE ones),
# so those cases stop after the processor and the connector
MODELS = {"tiny-qwen3-vl-moe": False, "tiny-qwen3.5": False, "tiny-qwen3.5-moe": False, "tiny-exaone4.5": True,
          "tiny-cohere-compass": True, "tiny-qwen2.5-omni": True, "tiny-qwen3-omni-moe": False}
MODELS["tiny-cosmos3-edge"] = True
MODELS.update({"tiny-qwen4-exp": False, "tiny-cosmos3-omni": True})


def seconds_per_step(name: str) -> bool:
    """vLLM's parser for the family keeps `second_per_grid_ts` with video embeddings (the Omni thinkers)."""
    return FAMILIES[PRESETS[name].family].video_second_per_grid


def media(name: str) -> list[tuple[str, bytes, dict]]:
    """Two images and, for a family that takes videos, a 2 s video at the default 2 fps (1 s per temporal
    step); where vLLM reads the seconds per step, an 8 s one at 1 fps too (2 s per step)."""
    out: list[tuple[str, bytes, dict]] = [("image", IMAGES[0], {}), ("image", IMAGES[1], {})]
    if FAMILIES[PRESETS[name].family].video:
        out.append(("video", VIDEO, {}))
    if seconds_per_step(name):
        out.append(("video", LONG_VIDEO, {"fps": 1.0}))
    return out


def items(name: str) -> list[dict]:
    import base64

    return [{"type": kind, kind: base64.b64encode(data).decode(), **options} for kind, data, options in media(name)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")
    work = tmp_path_factory.mktemp("vllm")
    http: dict = {}
    request: dict = {"models": [], "tensors_out": str(work / "out.safetensors")}
    for name, builds in MODELS.items():
        cfg = settings(model=name, ec_shared_storage=str(store), cache_bytes=64 << 20)
        with ServerThread(cfg) as srv, srv.client() as c:
            got = {
                "float": post(c, {"items": items(name), "include_deepstack": True}),
                "vllm": post(c, {"items": items(name), "encoding_format": "vllm"}),
                "ref": post(c, {"items": items(name), "encoding_format": "vllm_ref"}),
            }
        http[name] = got
        parts = {k: [e["content_part"] for e in got[k]["body"]["data"]] for k in ("vllm", "ref")}
        positions = seconds_per_step(name)  # vLLM's M-RoPE positions, where they take the part's seconds
        cases = [{"name": "embeds", "parts": parts["vllm"], "model": builds, "positions": positions},
                 {"name": "ref", "parts": parts["ref"], "consumer": str(store), "model": builds,
                  "positions": positions}]
        if positions:  # what vitserve used to send: no seconds per step
            old = json.loads(json.dumps(parts["ref"]))
            for part in old:
                part.get("video_embeds", {}).pop("second_per_grid_ts", None)
            cases.append({"name": "no_seconds", "parts": old, "consumer": str(store), "model": False,
                          "positions": True})
        folder = write_vllm_model_folder(name, work / name)
        request["models"].append({"name": name, "dir": str(folder), "dtype": "bfloat16", "cases": cases})
    report = run_driver("vllm_driver.py", request, work)
    return http, report["cases"], load_file(request["tensors_out"])


@pytest.mark.parametrize("name", list(MODELS))
def test_inline_parts_parse_size_and_merge(run, name):
    http, cases, tensors = run
    case = cases[f"{name}/embeds"]
    assert case["ok"], case.get("error")
    data = http[name]["vllm"]["body"]["data"]
    assert [f["num_embeds"] for f in case["features"]] == [e["num_tokens"] for e in data]
    assert [f["modality"] for f in case["features"]] == [kind for kind, _, _ in media(name)]
    family = FAMILIES[PRESETS[name].family]
    for entry, feature in zip(data, case["features"]):
        video = entry["content_part"].get("video_embeds")
        if video is not None:
            assert ("timestamps" in video) == family.video_timestamps
            assert ("second_per_grid_ts" in video) == family.video_second_per_grid
            assert ("second_per_grid_ts" in feature["data_keys"]) == family.video_second_per_grid
    floats = http[name]["float"]["body"]["data"]
    levels = len(PRESETS[name].vision.get("deepstack_visual_indexes", [])) if family.deepstack else 0
    out_hidden = PRESETS[name].vision["out_hidden_size"]
    for k, entry in enumerate(floats):
        main, deepstack = reference(entry)
        assert main.shape[1] == out_hidden and len(deepstack) == levels
        if not MODELS[name]:
            continue
        enc = tensors[f"{name}/embeds.enc.{k}"]
        assert enc.shape[1] == out_hidden * (1 + levels)
        assert torch.equal(enc, torch.cat([main, *deepstack], -1).to(VLLM_DTYPE))
        assert torch.equal(tensors[f"{name}/embeds.merged.{k}"], main.to(VLLM_DTYPE))
        for j, layer in enumerate(deepstack):
            assert torch.equal(tensors[f"{name}/embeds.deepstack.{k}.{j}"], layer.to(VLLM_DTYPE))


REFS_REFUSED = {"tiny-cohere-compass"}  # vLLM 0.33's parser for it requires the embeddings in every part


@pytest.mark.parametrize("name", [m for m in MODELS if m not in REFS_REFUSED])
def test_reference_parts_load_from_the_shared_folder(run, name):
    http, cases, tensors = run
    case = cases[f"{name}/ref"]
    assert case["ok"], case.get("error")
    data = http[name]["ref"]["body"]["data"]
    assert [f["identifier"] for f in case["features"]] == [e["content_part"]["uuid"] for e in data]
    assert case["has_cache"] == [True] * len(data)
    for k, (feature, entry) in enumerate(zip(case["features"], http[name]["float"]["body"]["data"])):
        main, deepstack = reference(entry)
        loaded = tensors[f"{name}/ref.enc.{k}"]
        assert torch.equal(loaded, torch.cat([main, *deepstack], -1))
        assert feature["num_embeds"] == loaded.shape[0] == entry["num_tokens"]


@pytest.mark.parametrize("name", sorted(REFS_REFUSED))
def test_vllm_refuses_reference_parts_of_some_families(run, name):
    """Cohere Compass's parser in vLLM 0.33 (`CohereCompassMultiModalDataParser`) declares no metadata fields
    (a JSON grid is refused) and requires `image_embeds` in every part (a tensor grid alone is refused too),
    even on an encoder-cache consumer: only inline parts reach that model."""
    _, cases, _ = run
    case = cases[f"{name}/ref"]
    assert not case["ok"] and "image_grid_thw" in case["error"]


OMNI = [m for m in MODELS if seconds_per_step(m)]


def temporal_steps(name: str, seconds: float, steps: int) -> list[int]:
    """Where M-RoPE places a video's temporal steps, from its first: k * seconds * positions per second,
    truncated (`t_index` in vLLM's and transformers' Omni position code)."""
    rate = OMNI_POSITIONS_PER_SECOND[PRESETS[name].family]
    return [int(k * (seconds * rate)) for k in range(steps)]


@pytest.mark.parametrize("name", OMNI)
@pytest.mark.parametrize("fmt", ["embeds", "ref"])
def test_omni_video_positions_follow_the_sampled_seconds(run, name, fmt):
    """The Omni parts carry the seconds each temporal step spans (`second_per_grid_ts`, temporal patch /
    sampling rate): vLLM keeps them with the embeddings, and its M-RoPE spaces the video's steps by them,
    at 2 fps (1 s per step) and at 1 fps (2 s per step) alike; images and placeholders as usual."""
    http, cases, _ = run
    case = cases[f"{name}/{fmt}"]
    assert case["ok"], case.get("error")
    data = http[name]["vllm" if fmt == "embeds" else "ref"]["body"]["data"]
    seen = []
    for entry, feature in zip(data, case["features"]):
        assert feature["num_embeds"] == feature["length"] == entry["num_tokens"]
        if entry["type"] == "image":
            assert feature["t_steps"] == [0]
            continue
        assert feature["t_steps"] == temporal_steps(name, entry["second_per_grid_ts"], entry["grid_thw"][0])
        part = entry["content_part"]["video_embeds"]
        assert part["second_per_grid_ts"] == [entry["second_per_grid_ts"]] and "warnings" not in entry
        seen.append(entry["second_per_grid_ts"])
    assert seen == [1.0, 2.0]


@pytest.mark.parametrize("name", OMNI)
def test_omni_video_without_seconds_takes_vllm_default(run, name):
    """Why the parts carry the field: without it vLLM accepts the part and places the video as if each
    step spanned its default, 1.0 s (Qwen2.5-Omni) or 2.0 s (Qwen3-Omni), wrong for one of the two videos."""
    http, cases, _ = run
    case = cases[f"{name}/no_seconds"]
    assert case["ok"], case.get("error")
    default = FAMILIES[PRESETS[name].family].vllm_video_seconds
    assert default == {"tiny-qwen2.5-omni": 1.0, "tiny-qwen3-omni-moe": 2.0}[name]
    wrong = 0
    for entry, feature in zip(http[name]["ref"]["body"]["data"], case["features"]):
        if entry["type"] == "video":
            assert "second_per_grid_ts" not in feature["data_keys"]
            assert feature["t_steps"] == temporal_steps(name, default, entry["grid_thw"][0])
            wrong += feature["t_steps"] != temporal_steps(name, entry["second_per_grid_ts"], entry["grid_thw"][0])
    assert wrong == 1
