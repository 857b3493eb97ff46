"""Every `vitserve serve` setting in one validated model.

Each setting comes from its flag, else from the environment variable `VITSERVE_<NAME>` (the flag's
long name in upper snake case), else from the default below. Values from the environment arrive as
strings; pydantic coerces them exactly like flag values, so `VITSERVE_EAGER=true` and `--eager`
mean the same thing and a bad value fails at start-up with the variable named.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from models.presets import DEFAULT_MODEL

ENV_PREFIX = "VITSERVE_"
MIB = 1024 * 1024
GIB = 1024 * MIB
# Values of --video-chunking that mean "off" (the helm chart leaves the variable out for null).
CHUNKING_OFF = {"", "off", "none", "false", "0"}
CHUNKING_ON = {"on", "true", "1", "yes"}


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _split_list(value: Any) -> Any:
    """`a,b c` (environment variables, or one flag value) -> ["a", "b", "c"]."""
    if isinstance(value, str):
        return [part for part in value.replace(",", " ").split() if part]
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        for part in value:
            out.extend(_split_list(part) if isinstance(part, str) else [part])
        return out
    return value


def visible_gpus() -> int:
    """CUDA devices this process may use (0 without CUDA); counting creates no CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class SettingsError(ValueError):
    """Settings the server cannot start with; the message names the flag and its variable."""


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="checkpoint folder or preset name")
    model_defaulted: bool = Field(False, description="no --model given: serving the embedded default")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = "auto"
    dtype: str = Field("auto", pattern="^(auto|bfloat16|float16|float32)$")
    served_model_name: str | None = None
    max_batch_tokens: int = Field(16384, ge=1)
    budgets: list[int] | None = Field(None, description="graph token budgets; None: powers of two")
    t_capture: int = Field(8, ge=1)
    max_wait_ms: float = Field(2.0, ge=0)
    max_queued_tokens: int | None = Field(None, ge=1, description="None: 8 x --max-batch-tokens")
    max_concurrent_requests: int = Field(512, ge=1)
    max_payload_bytes: int = Field(64 * MIB, ge=1024)
    request_timeout_s: float = Field(60.0, gt=0)
    api_key: SecretStr | None = None
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug|trace)$")
    eager: bool = False
    max_batch_items: int | None = Field(None, ge=1)
    max_items_per_request: int = Field(64, ge=1)
    preprocess_workers: int = Field(default_factory=default_workers, ge=1)
    allow_url: bool = False
    allowed_hosts: list[str] = Field(default_factory=list)
    url_timeout_s: float = Field(10.0, gt=0)
    ec_shared_storage: Path | None = None
    ec_max_bytes: int = Field(8 * GIB, ge=0, description="bound of the shared folder (oldest out first); 0: none")
    cache_bytes: int = Field(GIB, ge=0, description="host memory of the encoder-output cache; 0: no cache")
    video_chunking: bool = False
    data_parallel: int | Literal["auto"] = Field(1, description="engines, one per GPU (auto: every visible GPU)")
    # Test hook: sleep this long before every batch (a slow engine for timeout and drain tests).
    batch_delay_ms: float = Field(0.0, ge=0)

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, value: Any) -> Any:
        value = _split_list(value)
        if value in (None, [], ["auto"]):
            return None
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, value: Any) -> Any:
        hosts = _split_list(value) or []
        return [str(h).strip().lower().rstrip(".") for h in hosts]

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_key", "served_model_name", "ec_shared_storage", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("video_chunking", mode="before")
    @classmethod
    def _chunking(cls, value: Any) -> Any:
        if value is None or str(value).strip().lower() in CHUNKING_OFF:
            return False
        if str(value).strip().lower() in CHUNKING_ON:
            return True
        raise ValueError(f"--video-chunking takes on or off, got {value!r}")

    @field_validator("data_parallel", mode="before")
    @classmethod
    def _data_parallel(cls, value: Any) -> Any:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"--data-parallel takes a number of engines (1 or more) or auto, got {value!r}")
        return int(text)

    @model_validator(mode="after")
    def _consistent(self) -> ServeSettings:
        if self.data_parallel != 1:
            self._check_engines()
        if self.allow_url and not self.allowed_hosts:
            raise ValueError("--allow-url needs --allowed-hosts (VITSERVE_ALLOWED_HOSTS): a list of host names")
        if self.budgets and any(b < 1 for b in self.budgets):
            raise ValueError(f"--budgets must be positive token counts, got {self.budgets}")
        return self

    def _check_engines(self) -> None:
        """--data-parallel against the device: one GPU per engine, every engine on the same kind of device."""
        device = self.device.strip().lower()
        if device.startswith("cuda:") and self.data_parallel != "auto":
            raise ValueError(f"--data-parallel {self.data_parallel} with --device {self.device}: that names one GPU; "
                             "use --device cuda (engine i runs on cuda:i; pick the GPUs with CUDA_VISIBLE_DEVICES)")
        if device == "cpu" or self.data_parallel == "auto":
            return
        gpus = visible_gpus()
        if device == "cuda" or gpus:
            if self.data_parallel > gpus:
                raise ValueError(f"--data-parallel {self.data_parallel} (VITSERVE_DATA_PARALLEL) needs as many GPUs, "
                                 f"but {gpus} {'is' if gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")

    # ---- derived -------------------------------------------------------------------------
    def engine_devices(self) -> list[str]:
        """One device per engine: cuda:0..N-1 of the visible GPUs, or N CPU engines (for tests). A single
        entry means the in-process engine on `--device` as given."""
        if self.data_parallel == 1:
            return [self.device]
        device = self.device.strip().lower()
        on_cuda = device == "cuda" or (device == "auto" and visible_gpus() > 0)
        if self.data_parallel == "auto":
            count = visible_gpus() if on_cuda else 1
        else:
            count = self.data_parallel
        if count <= 1:
            return [self.device]
        return [f"cuda:{i}" for i in range(count)] if on_cuda else ["cpu"] * count

    @property
    def queue_tokens_limit(self) -> int:
        return self.max_queued_tokens or 8 * self.max_batch_tokens

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def api_key_bytes(self) -> bytes | None:
        return self.api_key.get_secret_value().encode() if self.api_key else None

    def public_dict(self) -> dict[str, Any]:
        """For /info and logs: everything except the secret."""
        data = self.model_dump(mode="json", exclude={"api_key", "model_defaulted", "batch_delay_ms"})
        data["api_key_set"] = self.api_key is not None
        return data

    # ---- sources -------------------------------------------------------------------------
    @classmethod
    def env_name(cls, field: str) -> str:
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                     **overrides: Any) -> ServeSettings:
        """Flags (None = not given) win over `VITSERVE_*` variables, which win over defaults."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name in cls.model_fields:
            if name == "model_defaulted":
                continue
            flag = (flags or {}).get(name)
            if flag is not None:
                values[name], origin[name] = flag, "--" + name.replace("_", "-")
            elif cls.env_name(name) in env:
                values[name], origin[name] = env[cls.env_name(name)], cls.env_name(name)
        values.update(overrides)
        if not values.get("model"):
            values["model"] = DEFAULT_MODEL
            values["model_defaulted"] = True
        try:
            return cls(**values)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, origin)) from None


def _describe(exc: ValidationError, origin: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        where = origin.get(field) or ("--" + field.replace("_", "-") if field else "settings")
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" if field else msg)
    return "invalid settings: " + "; ".join(lines)
