"""The request flow next to vLLM, as a small client and a runnable example: client -> vitserve -> vLLM.

A chat request with media parts (`image_url` / `video_url`: data URLs, or http(s) URLs when vitserve runs
with `--allow-url`) is rewritten before it reaches vLLM: its media go to vitserve in one `POST /encode`, and
each media part is replaced by the content part vitserve returns. Every turn of a chat resends the earlier
turns' images; vitserve answers those from its encoder-output cache.

Two modes (docs/sidecar.md walks through both):

- `ref` (recommended): `encoding_format: "vllm_ref"`. vitserve keeps each item's tensor (in its
  encoder-output cache for `GET /v1/encoder_cache/{uuid}`, or in its `--ec-shared-storage` folder) and
  returns metadata-only parts (grid, Qwen3-VL timestamps, uuid); vLLM, an encoder-cache consumer
  (`VitserveConnector` over HTTP, or the shared-storage connector of the same folder), loads the tensors.
  Nothing large travels in the chat request, and vLLM never decodes nor resizes the media. vitserve's own
  OpenAI front (`vitserve serve --llm-url`) does this rewrite in the server.
- `embeds`: `encoding_format: "vllm"`. The parts carry the embeddings (base64 of `torch.save`); vLLM
  needs `--enable-mm-embeds`.

In `ref` mode vLLM looks the tensor up by the part's uuid only when the chat request has no
`mm_processor_kwargs`, no `media_io_kwargs` (nor the server's `--media-io-kwargs`) and no tower LoRA;
otherwise it hashes the uuid and misses: `rewrite_chat` refuses such a request.

Only the standard library is needed (`urllib`), so the module can be copied into a proxy container; torch
is imported only by `decode_content_part`.

    python -m service.handoff.sidecar --vitserve http://127.0.0.1:8100 --vllm http://127.0.0.1:8000 \\
        --model qwen2.5-vl-7b --prompt "What is in the picture?" cat.jpg
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MediaSource = bytes | str | os.PathLike[str]
MODES = {"ref": "vllm_ref", "embeds": "vllm"}
DEFAULT_TIMEOUT_S = 120.0
# The hand-off is pod-local (127.0.0.1): environment proxies must not capture it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_MIME = [(b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"), (b"GIF8", "image/gif"),
         (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff")]
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}


class SidecarError(RuntimeError):
    """An HTTP call of the hand-off failed, or a request cannot be handed off; `status` is the HTTP status
    (0: no answer)."""

    def __init__(self, message: str, status: int = 0, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def read_media(media: MediaSource) -> bytes:
    """Bytes as given, or the file a path names (the client reads it; the server never reads paths)."""
    if isinstance(media, (bytes, bytearray, memoryview)):
        return bytes(media)
    return Path(media).read_bytes()


def mime_type(data: bytes) -> str:
    """The image type from the first bytes; anything else is sent as a video (vitserve sniffs the container)."""
    for magic, mime in _MIME:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "video/mp4"


def media_part(media: MediaSource, uuid: str | None = None) -> dict[str, Any]:
    """An OpenAI chat media part with the file as a data URL: what a client sends before the rewrite."""
    data = read_media(media)
    mime = mime_type(data)
    kind = "image_url" if mime.startswith("image/") else "video_url"
    part: dict[str, Any] = {"type": kind, kind: {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def post_json(url: str, body: dict[str, Any], *, api_key: str | None = None,
              timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """POST JSON, return the JSON answer; any non-2xx status raises SidecarError with the body."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        raise SidecarError(f"POST {url}: HTTP {exc.code}: {text[:500]}", exc.code, text) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise SidecarError(f"POST {url}: {getattr(exc, 'reason', exc)}") from None


def encode_request(parts: Sequence[dict[str, Any]], *, mode: str = "ref", dtype: str = "bfloat16") -> dict[str, Any]:
    """The `POST /encode` body for chat media parts: their URLs (data URLs are the media itself) as items, a
    part's `uuid` as the item's `id` (vitserve then names the file by it; without one it uses the content id)."""
    items = []
    for part in parts:
        kind = MEDIA_PARTS[part["type"]]
        item: dict[str, Any] = {"type": kind, kind: part[part["type"]]["url"]}
        if part.get("uuid"):
            item["id"] = part["uuid"]
        items.append(item)
    return {"items": items, "encoding_format": MODES[mode], "dtype": dtype}


def encode_parts(vitserve_url: str, parts: Sequence[dict[str, Any]], *, mode: str = "ref", dtype: str = "bfloat16",
                 api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """vitserve's content parts for chat media parts, in order (one request for all of them).

    `dtype` matters in `embeds` mode only (the LLM's dtype halves the bytes; vLLM casts to its own anyway);
    in `ref` mode the files hold the served dtype."""
    if not parts:
        return []
    answer = post_json(vitserve_url.rstrip("/") + "/encode", encode_request(parts, mode=mode, dtype=dtype),
                       api_key=api_key, timeout=timeout)
    return [entry["content_part"] for entry in answer["data"]]


def rewrite_chat(body: dict[str, Any], vitserve_url: str, *, mode: str = "ref", dtype: str = "bfloat16",
                 api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """A copy of an OpenAI chat request whose media parts, in every message, are vitserve's content parts."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "ref":
        for key in ("mm_processor_kwargs", "media_io_kwargs"):
            if body.get(key):
                raise SidecarError(f"the chat request sets {key}: vLLM then hashes each uuid instead of looking it up, "
                                   "so the shared encoder cache would miss; drop it, or use mode 'embeds'")
    out = copy.deepcopy(body)
    slots: list[tuple[list[Any], int]] = []
    for message in out.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            slots += [(content, i) for i, part in enumerate(content)
                      if isinstance(part, dict) and part.get("type") in MEDIA_PARTS]
    new = encode_parts(vitserve_url, [content[i] for content, i in slots], mode=mode, dtype=dtype, api_key=api_key,
                       timeout=timeout)
    for (content, i), part in zip(slots, new, strict=True):
        # A media reference (GLM-4.1V, whose vLLM processor takes no embedding parts) keeps the media: only
        # the uuid is added (service.handoff.vllm.handed_off; restated here to stay free of imports).
        same_media = part.get("type") == content[i].get("type") and part["type"].endswith("_url")
        content[i] = {**content[i], "uuid": part["uuid"]} if same_media else part
    return out


def chat_request(model: str, text: str, parts: Sequence[dict[str, Any]],
                 max_tokens: int | None = None) -> dict[str, Any]:
    """An OpenAI chat completion body: one user message, the text part then the media parts in order."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def decode_content_part(part: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings, grid) of an inline `image_embeds` / `video_embeds` part, decoded the way vLLM decodes
    it: base64, then `torch.load(io.BytesIO(...), weights_only=True)`."""
    import torch

    kind = part["type"].removesuffix("_embeds")
    payload = part[f"{kind}_embeds"]

    def load(b64: str) -> torch.Tensor:
        return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)

    return load(payload[f"{kind}_embeds"]), load(payload[f"{kind}_grid_thw"])


def run(vitserve_url: str, vllm_url: str, model: str, prompt: str, media: Sequence[MediaSource], *,
        mode: str = "ref", api_key: str | None = None, vllm_api_key: str | None = None, dtype: str = "bfloat16",
        max_tokens: int | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The whole flow for one question: the chat request a client would send, rewritten, posted to vLLM;
    returns vLLM's answer."""
    body = chat_request(model, prompt, [media_part(m) for m in media], max_tokens)
    body = rewrite_chat(body, vitserve_url, mode=mode, dtype=dtype, api_key=api_key, timeout=timeout)
    return post_json(vllm_url.rstrip("/") + "/v1/chat/completions", body, api_key=vllm_api_key, timeout=timeout)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.handoff.sidecar",
                                description="Encode media on vitserve and ask a vLLM server about them.")
    p.add_argument("media", nargs="+", type=Path, metavar="FILE", help="images or videos")
    p.add_argument("--vitserve", required=True, help="vitserve base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--vllm", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name vLLM serves")
    p.add_argument("--prompt", required=True, help="the question about the media")
    p.add_argument("--mode", choices=list(MODES), default="ref",
                   help="ref: metadata-only parts, the tensors kept by vitserve for vLLM's encoder-cache consumer "
                        "(VitserveConnector, or the --ec-shared-storage folder); embeds: embeddings inline (vLLM "
                        "with --enable-mm-embeds)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="embedding dtype in embeds mode: the LLM's dtype")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = p.parse_args(argv)
    try:
        answer = run(args.vitserve, args.vllm, args.model, args.prompt, args.media, mode=args.mode,
                     api_key=os.environ.get("VITSERVE_API_KEY"), vllm_api_key=os.environ.get("VLLM_API_KEY"),
                     dtype=args.dtype, max_tokens=args.max_tokens, timeout=args.timeout)
    except (SidecarError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
