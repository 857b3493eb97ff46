"""Every `vitserve serve` setting in one validated model.

Each setting comes from its flag, else from the environment variable `VITSERVE_<NAME>` (the flag's
long name in upper snake case), else from the default below. Values from the environment arrive as
strings; pydantic coerces them exactly like flag values, so `VITSERVE_EAGER=true` and `--eager`
mean the same thing and a bad value fails at start-up with the variable named.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from models.presets import DEFAULT_MODEL

ENV_PREFIX = "VITSERVE_"
MIB = 1024 * 1024
GIB = 1024 * MIB
# Values of VITSERVE_VIDEO_CHUNKING that mean off / on (the helm chart leaves the variable out for null).
CHUNKING_OFF = {"", "off", "none", "false", "0"}
CHUNKING_ON = {"on", "true", "1", "yes"}


def default_workers(engines: int = 1) -> int:
    """Worker processes of the whole server: the cores but two per engine (its front's event loop and its
    engine process), at least two, at most 16 per engine: each engine's images need their own decoding."""
    return max(2, min(16 * engines, (os.cpu_count() or 1) - 2 * engines))


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


def flag(help: str, **kwargs: Any) -> Any:
    """A setting that is also a `vitserve serve` flag: `help` is its --help text, which names its default.
    A bool setting is a switch: `--x` / `--no-x` on the command line."""
    return Field(description=help, **kwargs)


class ServeSettings(BaseModel):
    """Every setting of `vitserve serve`, each also its flag (`--max-batch-tokens`) and its variable
    (`VITSERVE_MAX_BATCH_TOKENS`): the one definition the CLI, the docs and the chart are checked against."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = flag(f"checkpoint folder or preset; default: the embedded {DEFAULT_MODEL} preset (random weights)",
                      default=DEFAULT_MODEL)
    model_defaulted: bool = Field(False, json_schema_extra={"flag": False})  # no --model given
    host: str = flag("bind address (default 127.0.0.1)", default="127.0.0.1")
    port: int = flag("listen port (default 8000; 0 picks a free one)", default=8000, ge=0, le=65535)
    device: str = flag("auto | cpu | cuda | cuda:N (default auto)", default="auto")
    dtype: str = flag("auto | bfloat16 | float16 | float32 (default auto: bf16 on CUDA, fp32 on the CPU)",
                      default="auto", pattern="^(auto|bfloat16|float16|float32)$")
    attention: str = flag("auto | varlen | cudnn | sdpa (default auto: cuDNN where it passes its load-time check, "
                          "else varlen_attn, on CUDA; SDPA on the CPU)", default="auto",
                          pattern="^(auto|varlen|cudnn|sdpa)$")
    batch_invariant: bool = flag("matrix products whose rows do not depend on the batch, so an item's embedding is "
                                 "the same bytes alone or in any batch (default on)", default=True)
    quantization: str = flag("none | fp8: the tower's linear layers as FP8 (e4m3) products with per-channel weight "
                             "and per-token activation scales; at load its first blocks stay unquantized as far as "
                             "the agreement bar with its float32 self asks, refused past half (default none)",
                             default="none", pattern="^(none|fp8)$")
    served_model_name: str | None = flag("model name reported by the API (default: --model)", default=None)
    max_batch_tokens: int = flag("token budget of the largest batch and graph (default 16384)", default=16384, ge=1)
    budgets: list[int] | None = flag("graph token budgets, separated by commas or spaces, or auto (default: powers "
                                     "of two up to --max-batch-tokens); auto with sizes (auto,196,1568) adds them to "
                                     "the automatic ones", default=None)
    budget_steps: int = flag("automatic budgets per doubling (default 1, powers of two; 4 adds 1.25, 1.5 and 1.75 "
                             "times each: a batch pads at most a quarter, for about 4x the graphs to capture)",
                             default=1, ge=1, le=8)
    learn_budgets: int = flag("budgets the server may add while serving: batch sizes that recur and pay much padding "
                              "(/info padding) get graphs of their own, captured between batches (default 4; 0: "
                              "off)", default=4, ge=0, le=16)
    t_capture: int = flag("temporal patches per video slot captured in graphs (default 8)", default=8, ge=1)
    gpu_memory: str | None = flag("device memory the server may use, in bytes (4GiB, 4096MiB) or as a fraction of "
                                  "the device (0.5); the graph budgets shrink to fit (default: no bound)", default=None)
    max_wait_ms: float = flag("how long a batch may wait to fill, while other requests are still being prepared "
                              "(default 2)", default=2.0, ge=0)
    max_queued_tokens: int | None = flag("queue bound in tokens, estimated before decoding; 429 above (default 8x "
                                         "--max-batch-tokens)", default=None, ge=1)
    max_concurrent_requests: int = flag("requests in flight, 429 above (default 512)", default=512, ge=1)
    max_payload_bytes: int = flag("request body limit, 413 above (default 64 MiB)", default=64 * MIB, ge=1024)
    request_timeout_s: float = flag("per-request timeout, 504 after; also the drain deadline (default 60)",
                                    default=60.0, gt=0)
    api_key: SecretStr | None = flag("require 'Authorization: Bearer <key>' on /encode and /info (prefer the "
                                     "VITSERVE_API_KEY variable: flags show in process lists; default none)",
                                     default=None)
    log_level: str = flag("critical | error | warning | info | debug | trace (default info)", default="info",
                          pattern="^(critical|error|warning|info|debug|trace)$")
    eager: bool = flag("no CUDA graphs: eager PyTorch only (default off)", default=False)
    max_batch_items: int | None = flag("items per batch (default 256, at most the largest budget)", default=None,
                                       ge=1)
    max_items_per_request: int = flag("items per request, 422 above (default 64)", default=64, ge=1)
    max_item_tokens: int = flag("merged tokens of one item, estimated before decoding; 413 above (default 65536)",
                                default=65536, ge=1)
    max_decoded_frames: int = flag("video frames the decoder may be sent for one item (from the keyframes before "
                                   "the sampled frames), 413 above (default 7200)", default=7200, ge=1)
    preprocess_workers: int = flag("worker processes that decode and preprocess media and encode responses "
                                   "(default: the cores but two per engine, from 2 to 16 per engine)",
                                   default_factory=default_workers, ge=1)
    worker_max_rss_mib: int = flag("a worker whose memory passes this while it works on an item is killed, and the "
                                   "item refused (default 4096)", default=4096, ge=64)
    allow_url: bool = flag("fetch http(s) media URLs whose host is in --allowed-hosts (default off)", default=False)
    allowed_hosts: list[str] = flag("hosts URLs may name, separated by commas or spaces (*.example.com allowed; "
                                    "default none)",
                                    default_factory=list)
    url_timeout_s: float = flag("total time to fetch one URL (default 10)", default=10.0, gt=0)
    ec_shared_storage: Path | None = flag("folder shared with vLLM's encoder-cache connector: vllm_ref items, and "
                                          "items with an id, are written to PATH/<uuid>/encoder_cache.safetensors "
                                          "(default none)", default=None)
    ec_max_bytes: int = flag("bound of the --ec-shared-storage folder, oldest files out first; 0: no bound (default "
                             "8 GiB)", default=8 * GIB, ge=0)
    cache_bytes: int = flag("host memory (in /dev/shm) of the encoder-output cache, keyed by content id; 0: no cache "
                            "(default 1 GiB)", default=GIB, ge=0)
    cache_hold_s: float = flag("seconds an output answered by reference (vllm_ref without --ec-shared-storage) is kept "
                               "for the LLM server's fetch, past --cache-bytes up to twice it (default 120)",
                               default=120.0, ge=0)
    llm_url: str | None = flag("base URL of an OpenAI-compatible LLM server (vLLM): serve /v1/chat/completions and "
                               "/v1/models in front of it, media parts encoded here (default none)", default=None)
    replicas: list[str] = flag("the base URLs (commas or spaces) of every vitserve replica the LLM server's connector "
                               "fetches from (its 'urls'): the proxy sends each item to the replica its id picks "
                               "(default: this server alone)", default_factory=list)
    advertise_url: str | None = flag("this server's URL as it appears in --replicas: its items are encoded in "
                                     "process (default: every item goes over HTTP; with --replicas-from, "
                                     "http://$POD_IP at its PORT)", default=None)
    replicas_from: str | None = flag("dns:NAME[:PORT]: the replicas are NAME's A and AAAA records (a headless "
                                     "Service's ready pods), resolved again every few seconds, each at PORT "
                                     "(default --port); this server's own address is POD_IP's; --replicas adds "
                                     "fixed URLs (default none)", default=None)
    sglang_timeout_s: float = flag("SGLang's encoder disaggregation (docs/sglang.md): how long a part's /encode waits "
                                   "for its receivers to register, a registration for its /encode, and a push for "
                                   "its receiver; SGLang's SGLANG_ENCODER_SEND_TIMEOUT (default 180)", default=180.0,
                                   gt=0)
    video_chunking: bool = flag("serve videos longer than --t-capture as exact chunks of t_capture temporal "
                                "patches through graphs instead of eagerly (default off)", default=False)
    data_parallel: int | Literal["auto"] = flag("engines, one per GPU, each in its own process: a number, or auto "
                                                "for every visible GPU (default 1)", default=1)
    fronts: int | Literal["auto"] = flag("HTTP front processes sharing the port: 1 (every engine behind one), or one "
                                         "per engine, each with its share of the worker processes, connections, "
                                         "request slots and cache, so that parsing and response writing use more "
                                         "cores (default auto: one per engine on GPUs)", default="auto")
    # Bounds on a request's head and on connections, enforced by the HTTP protocol before the app
    # (service/http/protocol.py): 431, 408 or 503, and the connection closed.
    max_header_bytes: int = flag("request line and headers together, 431 above (default 65536)", default=64 * 1024,
                                 ge=1024)
    max_header_line_bytes: int = flag("the request target (414 above) or one header field (431 above) "
                                      "(default 8192)",
                                      default=8 * 1024, ge=256)
    max_header_fields: int = flag("header fields of one request, 431 above (default 100)", default=100, ge=1)
    header_timeout_s: float = flag("time a client has to send a request's head, 408 after (default 10)",
                                   default=10.0, gt=0)
    # Above the idle expiry of common clients and balancers (httpx 5 s, aiohttp 15 s, AWS ALB 60 s), so
    # that they close an idle connection first: a server that closes it first races the next request
    # sent on it, which the client then sees dropped.
    keep_alive_timeout_s: float = flag("an idle kept-alive connection is closed after it (default 75)",
                                       default=75.0, gt=0)
    max_connections: int = flag("open connections; requests beyond get 503, except GET /health (default 1024)",
                                default=1024, ge=1)

    @classmethod
    def flag_fields(cls) -> list[str]:
        """The settings that are flags, in definition order."""
        return [name for name, f in cls.model_fields.items()
                if not (isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("flag") is False)]

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, value: Any) -> Any:
        value = _split_list(value)
        if value in (None, [], ["auto"]):
            return None
        return value

    @model_validator(mode="before")
    @classmethod
    def _auto_and_sizes(cls, data: Any) -> Any:
        """`--budgets auto,196,1568`: the automatic ladder (of --max-batch-tokens and --budget-steps) and these
        sizes, for traffic whose common sizes fall just past a rung and would pay the padding."""
        parts = _split_list(data.get("budgets")) if isinstance(data, dict) else None
        if not isinstance(parts, list) or len(parts) < 2 or "auto" not in [str(p).lower() for p in parts]:
            return data
        sizes = [p for p in parts if str(p).lower() != "auto"]
        try:
            top, steps = int(data.get("max_batch_tokens", 16384)), int(data.get("budget_steps", 1))
        except (TypeError, ValueError):
            return {**data, "budgets": sizes}  # their own errors name the flags at fault
        from graphs.budgets import auto_budgets

        ladder = auto_budgets(top, steps_per_octave=steps) if top >= 1 and steps >= 1 else []  # BudgetPlan's own
        try:
            numbers = [int(p) for p in sizes]
        except (TypeError, ValueError):
            return {**data, "budgets": [*ladder, *sizes]}  # the field's own check names the bad size
        if any(n > top for n in numbers):
            raise ValueError(f"--budgets auto with sizes: {max(numbers)} is over --max-batch-tokens {top}")
        return {**data, "budgets": sorted(set(ladder) | set(numbers))}

    @field_validator("replicas", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> Any:
        return [str(u).strip().rstrip("/") for u in (_split_list(value) or []) if str(u).strip()]

    @field_validator("replicas_from")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        if value:
            from service.handoff.membership import parse_source

            parse_source(value, 1)  # the port is checked here, defaulted where the source is used
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

    @field_validator("api_key", "served_model_name", "ec_shared_storage", "llm_url", "advertise_url", "replicas_from",
                     mode="before")
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
        raise ValueError(f"--video-chunking takes on or off (or true / false), got {value!r}")

    @field_validator("data_parallel", "fronts", mode="before")
    @classmethod
    def _count_or_auto(cls, value: Any, info: ValidationInfo) -> Any:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if not text.isdigit() or int(text) < 1:
            what = {"data_parallel": "engines", "fronts": "front processes"}[str(info.field_name)]
            raise ValueError(f"--{str(info.field_name).replace('_', '-')} takes a number of {what} (1 or more) or "
                             f"auto, got {value!r}")
        return int(text)

    @model_validator(mode="after")
    def _consistent(self) -> ServeSettings:
        if self.data_parallel != 1:
            self._check_engines()
        if self.fronts not in ("auto", 1) and self.data_parallel != "auto" and self.fronts != self.data_parallel:
            raise ValueError(f"--fronts {self.fronts} with --data-parallel {self.data_parallel}: fronts are 1 or one "
                             "per engine")
        if self.allow_url and not self.allowed_hosts:
            raise ValueError("--allow-url needs --allowed-hosts (VITSERVE_ALLOWED_HOSTS): a list of host names")
        if not self.replicas_from and self.advertise_url and self.advertise_url.rstrip("/") not in self.replicas:
            raise ValueError(f"--advertise-url {self.advertise_url} is not one of --replicas {','.join(self.replicas)}")
        if self.max_header_line_bytes > self.max_header_bytes:
            raise ValueError(f"--max-header-line-bytes {self.max_header_line_bytes} is over --max-header-bytes "
                             f"{self.max_header_bytes}")
        if self.budgets and any(b < 1 for b in self.budgets):
            raise ValueError(f"--budgets must be positive token counts, got {self.budgets}")
        if self.gpu_memory is not None:
            from service.engine.memory import parse_memory

            parse_memory(self.gpu_memory)
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

    def front_count(self) -> int:
        """HTTP front processes: 1, or one per engine (auto: one per engine when the engines are GPUs)."""
        devices = self.engine_devices()
        if self.fronts == "auto":
            return len(devices) if len(devices) > 1 and devices[0].startswith("cuda") else 1
        if self.fronts not in (1, len(devices)):
            raise SettingsError(f"--fronts {self.fronts} with {len(devices)} engine(s): fronts are 1 or one per engine")
        return self.fronts

    def worker_processes(self) -> int:
        """--preprocess-workers as given, else its default for this server's engines."""
        if "preprocess_workers" in self.model_fields_set:
            return self.preprocess_workers
        return default_workers(len(self.engine_devices()))

    def for_front(self, index: int, count: int) -> ServeSettings:
        """The settings of front `index` of `count`: its own engine, and its share of what the server bounds
        as a whole (worker processes, connections, request slots, queued tokens, cache bytes)."""
        if count == 1:
            return self
        share = lambda total: max(1, -(-total // count))  # noqa: E731 - rounded up, at least one
        return self.model_copy(update={
            "data_parallel": 1, "fronts": 1, "device": self.engine_devices()[index],
            "preprocess_workers": share(self.worker_processes()),
            "max_connections": share(self.max_connections),
            "max_concurrent_requests": share(self.max_concurrent_requests),
            "max_queued_tokens": share(self.max_queued_tokens) if self.max_queued_tokens else None,
            "cache_bytes": self.cache_bytes // count,
        })

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
        data = self.model_dump(mode="json", exclude={"api_key", "model_defaulted"})
        data["preprocess_workers"] = self.worker_processes()  # the count in use, default or given
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


# ---- the `serve` flags: one per setting ---------------------------------------------------------
def serve_flags() -> list[tuple[str, dict[str, Any]]]:
    """(flag, argparse keyword arguments) of every setting: the flag is the field's name in kebab case, its
    help the field's description."""
    out = []
    for name in ServeSettings.flag_fields():
        field = ServeSettings.model_fields[name]
        kind = field.annotation
        kwargs: dict[str, Any] = {"help": field.description}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind in (int, int | None):
            kwargs["type"] = int
        elif kind in (float, float | None):
            kwargs["type"] = float
        out.append(("--" + name.replace("_", "-"), kwargs))
    return out


FLAGS = serve_flags()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in FLAGS:
        parser.add_argument(flag, default=None, **kwargs)
