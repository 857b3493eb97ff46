"""vLLM content parts for one item: the embeddings inline (`encoding_format: "vllm"`), or a reference to the
shared encoder-cache folder (`"vllm_ref"`).

What vLLM 0.33.0's chat parser and Qwen-VL processors take (tests/test_vllm_handoff.py and
tests/test_vllm_handoff_families.py feed these parts to that code):

- `image_embeds` / `video_embeds` parts, one per item. Tensors travel as base64 of `torch.save` and are
  loaded with `weights_only=True`; metadata may also be a JSON list of numbers. The grid is ONE item's
  (t, h, w), shape [3]: the parser stacks the grids of several parts and concatenates their embeddings
  (every part of a modality must carry the same fields).
- Qwen3-VL video parts carry `timestamps`, one float per temporal grid step: the mean time of the frames
  that step merges (first and last frame of the pair; frame index / source fps), from which the prompt's
  `<t seconds>` text is built, so they size the placeholder. Qwen2-VL and Qwen2.5-VL parts take no other
  field (a JSON array for anything but the grid is refused).
- Qwen2.5-VL's video embeddings reach M-RoPE without `second_per_grid_ts` (vLLM's field factory for
  embedding inputs has no such field, and the position code falls back to 1.0): exact only when the video
  was sampled at 2 fps. `warnings` says so for other rates.
- The Omni thinkers' parser (`Qwen2_5OmniThinkerMultiModalDataParser`, Qwen3-Omni's too) takes an optional
  `second_per_grid_ts` with video embeddings, a JSON list of one float, and M-RoPE spaces the temporal steps
  by it; without it vLLM assumes 1.0 s (Qwen2.5-Omni) or 2.0 s (Qwen3-Omni) per step. Their parts carry
  it; no `timestamps` (no field of theirs), nor `use_audio_in_video`: vLLM's processor sets that from the
  request's processor kwargs (False by default; vitserve hands off frames only).
- A reference part (`"vllm_ref"`) holds only the metadata and the `uuid`; an LLM server that consumes the
  shared-storage encoder cache (`ECExampleConnector`, role `ec_consumer`) accepts it without the tensor
  and loads `<path>/<uuid>/encoder_cache.safetensors` instead: it never decodes nor resizes the media.
"""

from __future__ import annotations

import io
from typing import Any

import pybase64  # SIMD base64: an image's embedding is megabytes
import torch

from service.engine.types import ItemView

VLLM_FORMATS = ("vllm", "vllm_ref")


def torch_b64(t: torch.Tensor) -> bytes:
    """base64 of `torch.save(t)`: the tensor serialisation vLLM's chat API accepts."""
    buf = io.BytesIO()
    torch.save(t.detach().contiguous().cpu(), buf)
    return pybase64.b64encode(buf.getbuffer())


def takes_timestamps(family: str) -> bool:
    """Qwen3-VL's video embedding fields require `timestamps` (vLLM's Qwen3VLMultiModalDataParser), and so
    do those of the families built on it that vLLM parses the same way (models/families/)."""
    from models.families import FAMILIES

    return family in FAMILIES and FAMILIES[family].video_timestamps


def takes_seconds_per_step(family: str) -> bool:
    """The Omni thinkers' video embedding fields take `second_per_grid_ts`, which vLLM's M-RoPE reads
    (models/families/)."""
    from models.families import FAMILIES

    return family in FAMILIES and FAMILIES[family].video_second_per_grid


def seconds_per_step(meta: dict[str, Any]) -> float | None:
    """The seconds one temporal grid step spans (temporal patch / sampling rate), as the sampler said."""
    seconds = meta.get("second_per_grid_ts")
    if hasattr(seconds, "tolist"):  # numpy and torch values
        seconds = seconds.tolist()
    if isinstance(seconds, (list, tuple)):
        seconds = seconds[0] if len(seconds) == 1 else None
    return None if seconds is None else float(seconds)


def grid_timestamps(meta: dict[str, Any], temporal_patch_size: int) -> list[float] | None:
    """Seconds of each temporal grid step, as vLLM and transformers compute them for Qwen3-VL: the sampled
    frame indices padded with the last one to a multiple of the temporal patch, divided by the source
    frame rate, then the mean of the first and last index of each patch."""
    indices = meta.get("frame_indices")
    fps = meta.get("video_fps")
    if not indices or not fps:
        return None
    indices = [int(i) for i in indices]
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / float(fps) for i in indices]
    return [(times[k] + times[k + temporal_patch_size - 1]) / 2 for k in range(0, len(times), temporal_patch_size)]


def part_uuid(r: ItemView) -> str | None:
    return r.uuid or r.id


def _video_fields(modality: str, grid_thw: tuple[int, int, int], meta: dict[str, Any], index: int, family: str,
                  temporal_patch_size: int) -> dict[str, list[float]]:
    """What vLLM reads with a video embedding besides the grid: Qwen3-VL's timestamps, which it requires,
    or the Omni thinkers' seconds per temporal step (vLLM's own default where the sampler gave none, so
    that every video part of a request has the same fields; `warnings` says so)."""
    if modality != "video":
        return {}
    if takes_timestamps(family):
        stamps = grid_timestamps(meta, temporal_patch_size)
        if stamps is None or len(stamps) != grid_thw[0]:
            raise ValueError(f"item {index}: no timestamps for each of its {grid_thw[0]} temporal steps")
        return {"timestamps": stamps}
    if takes_seconds_per_step(family):
        from models.families import FAMILIES

        seconds = seconds_per_step(meta)
        if seconds is None:
            seconds = FAMILIES[family].vllm_video_seconds
        return {} if seconds is None else {"second_per_grid_ts": [seconds]}
    return {}


def embeds_part(r: ItemView, family: str, temporal_patch_size: int = 2) -> dict[str, Any]:
    """`encoding_format: "vllm"`: the joined embedding [tokens, hidden * (1 + DeepStack layers)] inline."""
    assert r.joined is not None
    kind = r.modality
    payload: dict[str, Any] = {
        f"{kind}_embeds": torch_b64(r.joined),
        f"{kind}_grid_thw": torch_b64(torch.tensor(r.grid_thw, dtype=torch.int64)),
        **_video_fields(r.modality, r.grid_thw, r.meta, r.index, family, temporal_patch_size),
    }
    part: dict[str, Any] = {"type": f"{kind}_embeds", f"{kind}_embeds": payload}
    uuid = part_uuid(r)
    if uuid is not None:
        part["uuid"] = uuid
    return part


def ref_part(r: ItemView, family: str, temporal_patch_size: int = 2) -> dict[str, Any]:
    """`encoding_format: "vllm_ref"`: metadata only; the tensor waits under `uuid` (the shared folder, or
    `GET /v1/encoder_cache/{uuid}`)."""
    uuid = part_uuid(r)
    assert uuid is not None, "a reference part needs the uuid its output is kept under"
    return reference_part(r.modality, r.grid_thw, r.meta, uuid, family, temporal_patch_size, r.index)


def takes_embedding_parts(family: str) -> bool:
    """Whether vLLM's processor for the family takes embedding parts (models/family.py)."""
    from models.families import FAMILIES

    spec = FAMILIES.get(family)
    return spec.vllm_embedding_parts if spec else True


def reference_part(modality: str, grid_thw: tuple[int, int, int], meta: dict[str, Any], uuid: str, family: str,
                   temporal_patch_size: int = 2, index: int = 0) -> dict[str, Any]:
    """vLLM 0.33's metadata-only part for one item: the grid (and Qwen3-VL video's timestamps, the Omni
    thinkers' seconds per temporal step) and the uuid.

    For a family whose vLLM processor takes no embedding parts (GLM-4.1V, HyperCLOVAX), a media part naming only the
    uuid: the client's own `image_url` / `video_url` goes with it (`handed_off`), vLLM's processor sizes
    the placeholder from the media (the same grid: vitserve follows that family's processor) and, as an
    encoder-cache consumer, loads the tensor by the uuid instead of running its tower."""
    if not takes_embedding_parts(family):
        return {"type": f"{modality}_url", "uuid": uuid}
    payload: dict[str, Any] = {f"{modality}_grid_thw": list(grid_thw),
                               **_video_fields(modality, grid_thw, meta, index, family, temporal_patch_size)}
    return {"type": f"{modality}_embeds", f"{modality}_embeds": payload, "uuid": uuid}


def handed_off(media_part: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """What replaces a chat request's media part: vitserve's part, or, when that part is a media reference
    (`reference_part` for GLM-4.1V), the media part itself with the uuid."""
    if part.get("type") == media_part.get("type") and part["type"].endswith("_url"):
        return {**media_part, "uuid": part["uuid"]}
    return part


def content_part(r: ItemView, fmt: str, family: str, temporal_patch_size: int = 2) -> dict[str, Any]:
    if fmt == "vllm_ref":
        return ref_part(r, family, temporal_patch_size)
    return embeds_part(r, family, temporal_patch_size)


def unserved(r: ItemView, family: str) -> list[str]:
    """A warning where vLLM 0.33 takes no output of this item's kind for the family (models/family.py)."""
    from models.families import FAMILIES

    spec = FAMILIES.get(family)
    if spec is None or r.modality in spec.vllm_media:
        return []
    if not spec.vllm_media:
        return [f"vLLM 0.33 does not serve {spec.title}: no vLLM model takes this part"]
    return [f"vLLM 0.33's {spec.title} builds a prompt of its own for a {r.modality} and does not take this "
            f"{r.modality}'s output: hand it to vLLM as media, not as vitserve's output"]


def warnings(r: ItemView, family: str, fmt: str = "vllm_ref") -> list[str]:
    """What vLLM will not see as this server computed it."""
    if unserved(r, family):
        return unserved(r, family)
    if fmt == "vllm" and not takes_embedding_parts(family):
        return [f"vLLM 0.33's processor for {family} takes no {r.modality}_embeds parts (it reads them as media and "
                "fails): hand this item off with encoding_format vllm_ref, its media part and this uuid, to vLLM "
                "as an encoder-cache consumer"]
    if r.modality != "video":
        return []
    from models.families import FAMILIES

    spec = FAMILIES.get(family)
    if spec is None or spec.vllm_video_seconds is None:
        return []
    assumed = spec.vllm_video_seconds
    seconds = seconds_per_step(r.meta)
    if spec.video_second_per_grid:  # the part carries the seconds vitserve sampled at
        if seconds is not None:
            return []
        return [f"this video's seconds per temporal step are not known here: its part carries vLLM's default "
                f"second_per_grid_ts, {assumed:.1f} s, for {spec.title}'s M-RoPE, which may not be how it was sampled"]
    if seconds is None or abs(seconds - assumed) < 1e-6:
        return []
    fps = float(r.meta.get("fps") or 0)
    exact = f"sample at {fps * seconds / assumed:g} fps" if fps else f"sample at {assumed:g} s per temporal step"
    return [f"vLLM drops second_per_grid_ts for video embeddings and uses {assumed:.1f} in {spec.title}'s M-RoPE; this "
            f"video has {seconds:g} s per temporal step (sampled at {fps:g} fps), so its temporal positions there "
            f"are off by that factor: {exact} for exact positions"]
