"""Request and response bodies of the HTTP API (pydantic; they also make the OpenAPI document)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from service.handoff.ec_storage import id_problem

ID_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$"
MEDIA_DESCRIPTION = (
    "The media: standard base64 of the file's bytes, or a data URL (`data:<mime>;base64,<payload>`). "
    "An http(s) URL only when the server runs with --allow-url and the host is in --allowed-hosts; "
    "local paths and file:// URLs are never read."
)


def _check_id(value: str) -> str:
    problem = id_problem(value)
    if problem:
        raise ValueError(problem)
    return value


ItemId = Annotated[
    str,
    Field(pattern=ID_PATTERN, max_length=200,
          description="Client-chosen id, echoed back; also the uuid of vLLM content parts and the "
                      "--ec-shared-storage folder's name (letters, digits, _ . -; no leading '.', no '..'). "
                      "Without it both use the item's content id"),
    AfterValidator(_check_id),
]
EncodingFormat = Literal["float", "base64", "vllm", "vllm_ref"]
OutDtype = Literal["float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ImageOptions(_Strict):
    min_pixels: int | None = Field(None, ge=0, le=2**40, description="lower pixel bound of the resized image")
    max_pixels: int | None = Field(None, ge=1, le=2**40, description="upper pixel bound of the resized image")

    @model_validator(mode="after")
    def _bounds(self) -> Any:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is above max_pixels {self.max_pixels}")
        return self


class VideoOptions(ImageOptions):
    min_pixels: int | None = Field(None, ge=1, le=2**48, description="lower pixel bound (Qwen3-VL: of T*H*W)")
    max_pixels: int | None = Field(None, ge=1, le=2**48, description="upper pixel bound (Qwen3-VL: of T*H*W)")
    fps: float | None = Field(None, gt=0, le=1000, description="frames sampled per second (not with nframes)")
    nframes: int | None = Field(None, ge=2, le=100000, description="exact number of frames to sample")
    min_frames: int | None = Field(None, ge=1, le=100000)
    max_frames: int | None = Field(None, ge=1, le=100000)
    video_start: float | None = Field(None, ge=0, description="seconds")
    video_end: float | None = Field(None, ge=0, description="seconds")
    total_pixels: int | None = Field(None, ge=1, le=2**48, description="pixel budget over all frames")

    @model_validator(mode="after")
    def _video(self) -> Any:
        if self.fps is not None and self.nframes is not None:
            raise ValueError("give fps or nframes, not both")
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise ValueError(f"min_frames {self.min_frames} is above max_frames {self.max_frames}")
        if self.video_start is not None and self.video_end is not None and self.video_start >= self.video_end:
            raise ValueError(f"video_start {self.video_start} is not before video_end {self.video_end}")
        return self


# Options that only videos take (refused for an image: invalid_option).
VIDEO_ONLY = tuple(name for name in VideoOptions.model_fields if name not in ImageOptions.model_fields)


class ImageItem(ImageOptions):
    type: Literal["image"]
    image: str = Field(description=MEDIA_DESCRIPTION)
    id: ItemId | None = None


class VideoItem(VideoOptions):
    type: Literal["video"]
    video: str = Field(description=MEDIA_DESCRIPTION)
    id: ItemId | None = None


Item = Annotated[ImageItem | VideoItem, Field(discriminator="type")]


class OutputOptions(_Strict):
    encoding_format: EncodingFormat = Field(
        "float", description="float: nested lists; base64: raw little-endian row-major bytes; "
                             "vllm: a chat content part with the embeddings, for a vLLM server started with "
                             "--enable-mm-embeds; vllm_ref: a metadata-only content part whose tensor waits under its "
                             "uuid (GET /v1/encoder_cache/{uuid}, or --ec-shared-storage), for a vLLM "
                             "encoder-cache consumer (docs/sidecar.md)")
    dtype: OutDtype = Field("float32", description="dtype of the returned tensors")
    include_deepstack: bool = Field(False, description="also return Qwen3-VL's DeepStack features")


class EncodeRequest(OutputOptions):
    items: list[Item] = Field(min_length=1, description="images and videos, encoded in order")


class FileOptions(VideoOptions):
    """Per-file options of a multipart request (video-only keys are refused for images)."""

    id: ItemId | None = None


class MultipartOptions(OutputOptions):
    """The `options` field of a multipart request: the JSON request's keys other than the media."""

    items: list[FileOptions] | None = Field(None, description="one entry per file, in order")


# ---- responses ---------------------------------------------------------------------------------
Tensor2D = list[list[float]] | str


class EncodedItem(BaseModel):
    index: int
    type: Literal["image", "video"]
    id: str | None = None
    grid_thw: list[int] = Field(description="(t, h, w) in patches")
    num_tokens: int = Field(description="output rows, what the language model sees: the model's rule "
                                        "(`/info` geometry.tokens; t*h*w / merge_size**2 for the Qwen-VL families)")
    shape: list[int] = Field(description="[num_tokens, hidden] of the main embedding")
    dtype: OutDtype
    embedding: Tensor2D | None = Field(None, description="float or base64 formats")
    deepstack: list[Tensor2D] | None = Field(None, description="with include_deepstack, one per DeepStack layer")
    content_id: str | None = Field(None, description="hash of the model's identity, the options and the media: "
                                                     "the key of the encoder-output cache")
    content_part: dict[str, Any] | None = Field(None, description="vllm and vllm_ref formats: a chat content part")
    warnings: list[str] | None = Field(None, description="vllm formats: what vLLM will not see as computed here")
    timestamps: list[float] | None = Field(None, description="videos: seconds of each temporal token group")
    second_per_grid_ts: float | list[float] | None = None
    fps: float | None = Field(None, description="videos: the sampling rate used")
    requested_fps: float | None = Field(None, description="videos sampled by fps: the rate asked for (or the default)")
    fps_adjusted_by: str | None = Field(None, description="videos: why `fps` differs from `requested_fps` "
                                                          "(`min_frames`, `max_frames`, `frame_count`); absent "
                                                          "when it does not")


class Usage(BaseModel):
    images: int
    videos: int
    patches: int
    tokens: int


class EncodeResponse(BaseModel):
    id: str
    model: str
    data: list[EncodedItem]
    usage: Usage


class ErrorBody(BaseModel):
    type: str = Field(description="invalid_request, invalid_item, unauthorized, payload_too_large, overloaded, "
                                  "unavailable, timeout, internal, not_found, method_not_allowed, "
                                  "unsupported_media_type")
    message: str
    index: int | None = Field(None, description="the offending item, for invalid_item")
    code: str | None = Field(None, description="stable machine code")
    error_id: str | None = Field(None, description="5xx: the id that one line of the server's log carries")


class ErrorResponse(BaseModel):
    error: ErrorBody
