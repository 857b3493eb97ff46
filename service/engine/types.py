"""What the engine's parts exchange: the items a request hands over, the outputs it asks for, the results
it gets back, the served model's description, and the errors the HTTP layer maps to statuses."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from graphs.budgets import BudgetPlan
from graphs.runner import GraphRunner
from models.config import ProcessorConfig, VisualInput

Modality = Literal["image", "video"]
IMAGE_OPTIONS = ("min_pixels", "max_pixels")
VIDEO_OPTIONS = ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end", "min_pixels",
                 "max_pixels", "total_pixels")


# ---- errors the HTTP layer maps to statuses --------------------------------------------------
class EngineError(Exception):
    code = "internal"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code


class ItemError(EngineError):
    """One item cannot be used (422); `index` is its position in the request."""

    def __init__(self, index: int, message: str, code: str) -> None:
        super().__init__(message, code)
        self.index = index


class RequestRejected(EngineError):
    """The request as a whole is invalid for this server (422)."""


class Overloaded(EngineError):
    """Admission refused: too much queued or in flight (429)."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(EngineError):
    """Still loading, draining or stopped (503)."""

    code = "not_ready"


class EngineFailure(EngineError):
    """The device run failed (500); the traceback is logged under `error_id`."""

    def __init__(self, message: str, error_id: str) -> None:
        super().__init__(message, "engine_failure")
        self.error_id = error_id


class EngineDied(EngineError):
    """The engine process running the item exited (503); the other engines keep serving."""

    code = "engine_failed"


# ---- units of work ---------------------------------------------------------------------------
@dataclass
class MediaItem:
    """What the HTTP layer hands over: one item's bytes and its preprocessing options."""

    index: int
    modality: Modality
    data: bytes
    options: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class OutputSpec:
    """What the response needs from each item, produced on the host by the engine thread."""

    dtype: torch.dtype = torch.float32
    deepstack: bool = False  # per-layer DeepStack tensors
    joined: bool = False  # main embedding and DeepStack concatenated along hidden (vLLM's layout)
    ec_cache: bool = False  # the joined tensor in the served dtype (service.handoff caches and stores it)


@dataclass
class ItemResult:
    index: int
    modality: Modality
    id: str | None
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    meta: dict[str, Any]
    embeds: torch.Tensor  # host, [tokens, D], spec dtype
    deepstack: list[torch.Tensor] = field(default_factory=list)
    joined: torch.Tensor | None = None
    ec_cache: torch.Tensor | None = None
    preprocess_s: float = 0.0
    queue_s: float = 0.0
    gpu_s: float = 0.0
    # Set by service.handoff, never by the engine: the content id, the uuid vLLM gets (the id, else the
    # content id) and whether the encoder-output cache answered.
    content_id: str | None = None
    uuid: str | None = None
    cached: bool = False


@dataclass(eq=False)
class Work:
    item: MediaItem
    visual: VisualInput
    tokens: int
    spec: OutputSpec
    want_ec: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    preprocess_s: float
    enqueued: float = 0.0
    cancelled: bool = False  # set on the event loop, read by the engine thread


@dataclass(frozen=True)
class ModelInfo:
    """What the front needs to know of the served model, whichever backend runs it (picklable)."""

    family: str | None
    processor: ProcessorConfig
    dtype: torch.dtype  # served dtype: parameters and raw outputs
    device: str
    out_hidden_size: int
    num_deepstack: int
    plan: BudgetPlan
    captured: tuple[str, ...]
    capture_failures: dict[str, str]
    replay_overhead_tokens: float | None = None  # measured at start-up; the packing weighs it

    @property
    def merge_unit(self) -> int:
        return self.plan.merge_unit

    @classmethod
    def from_runner(cls, runner: GraphRunner) -> ModelInfo:
        tower = runner.tower
        return cls(
            family=getattr(tower, "family", None),
            processor=tower.processor,
            dtype=next(tower.parameters()).dtype,
            device=str(runner.device),
            out_hidden_size=tower.out_hidden_size,
            num_deepstack=tower.num_deepstack,
            plan=runner.plan,
            captured=tuple(sorted(str(k) for k in runner.pool.graphs)),
            capture_failures={str(k): v for k, v in runner.pool.failed.items()},
            replay_overhead_tokens=runner.replay_overhead_tokens,
        )



def new_error_id() -> str:
    return "err-" + uuid.uuid4().hex[:12]
