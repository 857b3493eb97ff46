"""Response encoders and the shared-storage writer, on hand-made results (no server, no model)."""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY, ECSharedStorage, id_problem
from service.http import encoders
from service.workers.jobs import ItemView as ItemResult


def json_body(results, *, request_id: str, model: str, fmt: str, dtype: str, include_deepstack: bool,
              family: str = "", temporal_patch_size: int = 2) -> bytes:
    """A whole response body from its entries, as the server joins them."""
    return b"".join(encoders.spliced_parts({
        "id": request_id, "model": model,
        "data": [encoders.item_entry(r, fmt, dtype, include_deepstack, family, temporal_patch_size)
                 for r in results],
        "usage": encoders.usage(results)}))


def result(index=0, modality="image", tokens=6, hidden=8, layers=0, dtype=torch.float32, item_id=None, meta=None):
    gen = torch.Generator().manual_seed(index)
    embeds = torch.randn(tokens, hidden, generator=gen).to(dtype)
    deepstack = [torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(layers)]
    grid = (2, 2, tokens) if modality == "video" else (1, 2, 2 * tokens)  # 4 patches per merged token
    return ItemResult(index=index, modality=modality, id=item_id, grid_thw=grid, num_patches=tokens * 4,
                      num_tokens=tokens, meta=meta or {}, embeds=embeds, deepstack=deepstack,
                      joined=torch.cat([embeds, *deepstack], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_base64_is_row_major_little_endian(dtype):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).div(7).to(dtype)
    data = base64.b64decode(encoders.raw_base64(t.t().contiguous().t()))  # non-contiguous input too
    assert len(data) == t.numel() * t.element_size()
    if dtype == torch.bfloat16:
        back = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(4, 6)
    else:
        np_dtype = {torch.float32: "<f4", torch.float16: "<f2"}[dtype]
        back = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np_dtype).reshape(4, 6).copy())
    assert torch.equal(back, t)


def test_float_rows_are_exact():
    t = torch.randn(3, 5).to(torch.bfloat16)
    rows = encoders.float_rows(t)
    assert torch.equal(torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16), t)
    assert torch.equal(torch.tensor(encoders.float_rows(t.float())), t.float())


def test_vllm_content_parts():
    img = result(item_id="im-1", layers=2)
    vid = result(1, modality="video", meta={"frame_indices": [0, 2, 4, 6], "video_fps": 4.0})
    vid.uuid = "vit-abc"
    body = json.loads(json_body([img, vid], request_id="x", model="m", fmt="vllm", dtype="float32",
                                         include_deepstack=False, family="qwen3_vl"))
    part = body["data"][0]["content_part"]
    assert part["type"] == "image_embeds" and part["uuid"] == "im-1"
    embeds = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"]["image_embeds"])), weights_only=True)
    grid = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"]["image_grid_thw"])), weights_only=True)
    assert torch.equal(embeds, torch.cat([img.embeds, *img.deepstack], -1)) and embeds.shape == (6, 24)
    assert grid.dtype == torch.int64 and grid.shape == (3,) and grid.tolist() == list(img.grid_thw)
    part = body["data"][1]["content_part"]
    assert part["type"] == "video_embeds" and part["uuid"] == "vit-abc"
    assert set(part["video_embeds"]) == {"video_embeds", "video_grid_thw", "timestamps"}
    assert part["video_embeds"]["timestamps"] == [0.25, 1.25]  # one per temporal step: mean of its two frames
    assert "embedding" not in body["data"][0] and "warnings" not in body["data"][1]


def test_vllm_ref_parts():
    img = result(item_id="im-1", layers=2)
    vid = result(1, modality="video", meta={"frame_indices": [0, 2, 4], "video_fps": 2.0, "second_per_grid_ts": 2.0,
                                            "fps": 1.0})
    vid.uuid = "vit-abc"
    for family, stamps in [("qwen3_vl", {"timestamps": [0.5, 2.0]}), ("qwen2_5_vl", {}), ("qwen2_vl", {})]:
        body = json.loads(json_body([img, vid], request_id="x", model="m", fmt="vllm_ref", dtype="float32",
                                             include_deepstack=False, family=family))
        image, video = body["data"]
        assert image["content_part"] == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 12]},
                                         "uuid": "im-1"}
        assert video["content_part"] == {"type": "video_embeds",
                                         "video_embeds": {"video_grid_thw": [2, 2, 6], **stamps}, "uuid": "vit-abc"}
        # Qwen2.5-VL video off 2 fps: vLLM would place it with 1.0 s per temporal step
        assert ("warnings" in video) == (family == "qwen2_5_vl")


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe", "qwen3_omni_moe_thinker"])
@pytest.mark.parametrize("fmt", ["vllm", "vllm_ref"])
def test_omni_video_parts_carry_their_seconds_per_step(family, fmt):
    """vLLM's Omni thinkers keep `second_per_grid_ts` with video embeddings (a JSON list of one float) and
    M-RoPE reads it; images carry only the grid, no video carries timestamps, and nothing needs a warning."""
    img = result(item_id="im-1")
    vid = result(1, modality="video", item_id="v-1", meta={"frame_indices": [0, 2, 4], "video_fps": 2.0,
                                                           "second_per_grid_ts": 2.0, "fps": 1.0})
    body = json.loads(json_body([img, vid], request_id="x", model="m", fmt=fmt, dtype="float32",
                                include_deepstack=False, family=family))
    image, video = body["data"]
    assert set(image["content_part"]["image_embeds"]) <= {"image_embeds", "image_grid_thw"}
    fields = video["content_part"]["video_embeds"]
    assert fields["second_per_grid_ts"] == [2.0] and "timestamps" not in fields
    assert "warnings" not in image and "warnings" not in video


def test_omni_video_without_seconds_gets_vllm_default_and_a_warning():
    """A video whose sampler gave no seconds per step (never from this server's sampler) still carries
    the field, vLLM's own default, so that every video part of a request has the same fields; the entry
    says so."""
    vid = result(1, modality="video", item_id="v-1", meta={})
    for family, default in [("qwen2_5_omni", 1.0), ("qwen3_omni_moe", 2.0)]:
        body = json.loads(json_body([vid], request_id="x", model="m", fmt="vllm_ref", dtype="float32",
                                    include_deepstack=False, family=family))
        (video,) = body["data"]
        assert video["content_part"]["video_embeds"]["second_per_grid_ts"] == [default]
        assert "second_per_grid_ts" in video["warnings"][0]


def test_json_body_and_video_fields():
    meta = {"timestamps": np.array([0.0, 1.0]), "second_per_grid_ts": 1.0, "fps": np.float64(2.0), "frames": 4}
    results = [result(0, item_id="a"), result(1, modality="video", meta=meta, layers=1)]
    body = json.loads(json_body(results, request_id="enc-x", model="m", fmt="float", dtype="float32",
                                         include_deepstack=True))
    assert body["id"] == "enc-x" and body["model"] == "m"
    img, vid = body["data"]
    assert img["id"] == "a" and "timestamps" not in img and img["deepstack"] == []
    assert vid["timestamps"] == [0.0, 1.0] and vid["fps"] == 2.0 and vid["second_per_grid_ts"] == 1.0
    assert "frames" not in vid and len(vid["deepstack"]) == 1
    assert vid["embedding"] == results[1].embeds.tolist()
    assert body["usage"] == {"images": 1, "videos": 1, "patches": 48, "tokens": 12}
    with pytest.raises(ValueError):  # never emit NaN: it is not JSON
        bad = result()
        bad.embeds[0, 0] = float("nan")
        json_body([bad], request_id="x", model="m", fmt="float", dtype="float32", include_deepstack=False)


def test_safetensors_body():
    results = [result(0, layers=2, item_id="first"), result(1, tokens=3, layers=2)]
    data = encoders.safetensors_body(results, request_id="enc-y", model="the-model", dtype="float32",
                                     include_deepstack=True)
    tensors = load_safetensors(data)
    assert set(tensors) == {"embeds.0", "grid_thw.0", "deepstack.0.0", "deepstack.0.1",
                            "embeds.1", "grid_thw.1", "deepstack.1.0", "deepstack.1.1"}
    assert tensors["grid_thw.1"].shape == (1, 3) and tensors["grid_thw.1"].dtype == torch.int64
    assert torch.equal(tensors["deepstack.0.1"], results[0].deepstack[1])
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    assert meta["model"] == "the-model" and meta["id"] == "enc-y"
    assert json.loads(meta["inputs"])[0] == {"index": 0, "type": "image", "id": "first",
                                             "grid_thw": list(results[0].grid_thw), "num_tokens": 6}
    plain = load_safetensors(encoders.safetensors_body(results, request_id="z", model="m", dtype="float32",
                                                       include_deepstack=False))
    assert not any(k.startswith("deepstack") for k in plain)


@pytest.mark.parametrize("item_id,ok", [
    ("img-1", True), ("a.b_c-D9", True), ("x" * 200, True),
    ("", False), ("x" * 201, False), ("../x", False), ("a/b", False), ("a\\b", False), ("..", False),
    (".hidden", False), ("a..b", False), ("a b", False), ("é", False), ("a\x00", False),
])
def test_id_rules(item_id, ok):
    assert (id_problem(item_id) is None) == ok


def test_ec_storage_writes_atomically(tmp_path):
    store = ECSharedStorage(tmp_path / "cache")
    store.check()
    assert (tmp_path / "cache").is_dir() and not list((tmp_path / "cache").iterdir())
    t = torch.randn(5, 12).to(torch.bfloat16)
    path = store.write("item-1", t, {"model": "m"})
    assert path == tmp_path / "cache" / "item-1" / FILE_NAME
    loaded = load_file(str(path))
    assert list(loaded) == [TENSOR_KEY] and torch.equal(loaded[TENSOR_KEY], t)
    store.write("item-1", t * 2)
    assert torch.equal(load_file(str(path))[TENSOR_KEY], t * 2)
    assert [p.name for p in path.parent.iterdir()] == [FILE_NAME]
    with pytest.raises(ValueError):
        store.write("../outside", t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
