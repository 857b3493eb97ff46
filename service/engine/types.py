"""What the engine's parts exchange: the items a request hands over, where their pixels and embeddings
live, the batches sent to a device, the served model's description, and the errors the HTTP layer maps
to statuses."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from graphs.budgets import BudgetPlan
from graphs.packing import Batch, CostModel
from models.config import ProcessorConfig
from models.protocol import Geometry

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
    """One item cannot be used: bad (422), or more work than the server's limits allow (413). `index` is
    its position in the request."""

    def __init__(self, index: int, message: str, code: str, status: int = 422) -> None:
        super().__init__(message, code)
        self.index = index
        self.status = status


class RequestRejected(EngineError):
    """The request as a whole is invalid for this server (422)."""


class Overloaded(EngineError):
    """Admission refused: too much queued or in flight, or more work ahead than the request's deadline
    leaves time for (429, with the seconds to wait before a retry)."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


class NotReady(EngineError):
    """Still loading, draining or stopped (503)."""

    code = "not_ready"


class EngineFailure(EngineError):
    """A device run or a worker job failed (500); the traceback is logged under `error_id`."""

    def __init__(self, message: str, error_id: str) -> None:
        super().__init__(message, "engine_failure")
        self.error_id = error_id


class EngineDied(EngineError):
    """The engine process running the item exited (503); the other engines keep serving."""

    code = "engine_failed"


class WorkerLost(EngineError):
    """The worker process preparing an item, or rendering a response, died of a cause that was not the
    item's own (killed from outside, its channel failed, ...) (503: a retry finds a fresh worker)."""

    code = "worker_lost"


class StorageFull(EngineError):
    """Shared memory or the encoder-cache folder has no room left (507); nothing half-written stays."""

    code = "insufficient_storage"


def new_error_id() -> str:
    return "err-" + uuid.uuid4().hex[:12]


# ---- what a request hands over and gets back ---------------------------------------------------
@dataclass
class MediaItem:
    """One item of a request: its bytes and its preprocessing options."""

    index: int
    modality: Modality
    data: bytes
    options: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class OutputRef:
    """Where an item's embedding lives: rows [tokens, width] of the served dtype in a shared-memory
    segment, the main embedding then each DeepStack level side by side (`width` = hidden * (1 + levels))."""

    segment: str
    rows: int
    width: int
    dtype: str  # the served dtype's name, e.g. "bfloat16"

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class ItemResult:
    index: int
    modality: Modality
    id: str | None
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    meta: dict[str, Any]
    output: OutputRef
    preprocess_s: float = 0.0
    queue_s: float = 0.0
    gpu_s: float = 0.0
    # Set by service.handoff: the content id, the uuid vLLM gets (the id, else the content id) and whether
    # the encoder-output cache (or the shared folder) answered instead of the engine.
    content_id: str | None = None
    uuid: str | None = None
    cached: bool = False


@dataclass
class ItemView:
    """An item's result as the response encoders read it (in a worker process): the embedding, the
    DeepStack levels and both side by side (vLLM's layout), in the requested dtype, on the host."""

    index: int
    modality: str
    id: str | None
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    meta: dict[str, Any]
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    joined: torch.Tensor
    content_id: str | None = None
    uuid: str | None = None


# ---- what crosses to a device ------------------------------------------------------------------
@dataclass(frozen=True)
class JobItem:
    modality: str
    grid_thw: tuple[int, int, int]
    pixels: str  # segment holding uint8 rows [t*h*w, patch_dim]
    output: str  # segment to create for the item's joined rows


@dataclass(frozen=True)
class BatchJob:
    id: int
    batch: Batch
    items: tuple[JobItem, ...]


@dataclass(frozen=True)
class LearnBudget:
    """A control job: capture the graphs of one more budget (`graphs.learning.learn_budget`), between batches."""

    budget: int


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
    cost: CostModel | None = None  # measured at start-up; the batcher weighs it
    uses_graphs: bool = True  # False on the CPU (fixed-shape eager runs) and with --eager
    geometry: Geometry = Geometry()  # how an item's grid maps onto segments and output rows
    quantization: dict[str, Any] | None = None  # `--quantization fp8`: its load-time agreement figures

    @property
    def merge_unit(self) -> int:
        return self.plan.merge_unit

    @property
    def width(self) -> int:
        return self.out_hidden_size * (1 + self.num_deepstack)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def from_runner(cls, runner: Any) -> ModelInfo:
        tower = runner.tower
        cuda_graphs = runner.use_graphs and runner.device.type == "cuda"
        return cls(
            family=getattr(tower, "family", None),
            processor=tower.processor,
            dtype=next(tower.parameters()).dtype,
            device=str(runner.device),
            out_hidden_size=tower.out_hidden_size,
            num_deepstack=tower.num_deepstack,
            plan=runner.plan,
            captured=tuple(sorted(str(k) for k in runner.pool.graphs)) if cuda_graphs else (),
            capture_failures={str(k): v for k, v in runner.pool.failed.items()},
            cost=runner.cost,
            uses_graphs=cuda_graphs,
            geometry=tower.geometry,
            quantization=getattr(tower, "quantization", None),
        )
