"""Hand-off from vitserve to a vLLM server: a small client and a runnable example.

Two modes (docs/sidecar.md walks through both):

- embeds: POST the images to vitserve with `encoding_format: "vllm"` and put the returned
  `image_embeds` content parts into an OpenAI chat request for a vLLM server started with
  `--enable-mm-embeds`; vLLM then skips its own vision encoder for them.
- ec (`--ec`): POST the images to a vitserve running with `--ec-shared-storage` with an `id` per image,
  so vitserve writes `PATH/<id>/encoder_cache.safetensors`; then send vLLM the images themselves with
  `uuid` = that id, and vLLM's shared-storage encoder-cache connector (consumer role) reads the
  embeddings from the shared folder instead of computing them.

Only the standard library is needed to talk HTTP (`urllib`), so the module can be copied into a proxy
container; torch is imported only by `decode_content_part`.

    python -m service.handoff.sidecar --vitserve http://127.0.0.1:8100 --vllm http://127.0.0.1:8000 \
        --model qwen2.5-vl-7b --prompt "What is in the picture?" cat.jpg
"""

from __future__ import annotations

import argparse
import base64
import hashlib
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

ImageSource = bytes | str | os.PathLike[str]
DEFAULT_TIMEOUT_S = 120.0
# The hand-off is pod-local (127.0.0.1): environment proxies must not capture it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_MIME = [(b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"), (b"GIF8", "image/gif"),
         (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff")]


class SidecarError(RuntimeError):
    """An HTTP call of the hand-off failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def read_image(image: ImageSource) -> bytes:
    """Bytes as given, or the file a path names (the client reads it; the server never reads paths)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    return Path(image).read_bytes()


def content_id(data: bytes) -> str:
    """A stable id from the image's bytes: the same picture maps to the same cache entry."""
    return "sha256-" + hashlib.sha256(data).hexdigest()[:32]


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


def encode_request(images: Sequence[ImageSource], *, ids: Sequence[str] | None = None,
                   encoding_format: str = "vllm", dtype: str = "bfloat16") -> dict[str, Any]:
    """The `POST /encode` body for these images (ids, when given, name them for the encoder cache)."""
    if ids is not None and len(ids) != len(images):
        raise ValueError(f"{len(ids)} ids for {len(images)} images")
    items = []
    for i, image in enumerate(images):
        item: dict[str, Any] = {"type": "image", "image": base64.b64encode(read_image(image)).decode("ascii")}
        if ids is not None:
            item["id"] = ids[i]
        items.append(item)
    return {"items": items, "encoding_format": encoding_format, "dtype": dtype}


def encode_for_vllm(vitserve_url: str, images: Sequence[ImageSource], api_key: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S, *, ids: Sequence[str] | None = None,
                    dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """vitserve's `content_part`s (`encoding_format: "vllm"`) for `images`, in order.

    `dtype` should be the LLM's dtype (vLLM does not convert the embeddings it is given). With `ids`
    each part carries `uuid` = its id, and a server with `--ec-shared-storage` also writes the cache.
    """
    body = encode_request(images, ids=ids, encoding_format="vllm", dtype=dtype)
    answer = post_json(vitserve_url.rstrip("/") + "/encode", body, api_key=api_key, timeout=timeout)
    return [entry["content_part"] for entry in answer["data"]]


def chat_request(model: str, text: str, content_parts: Sequence[dict[str, Any]],
                 max_tokens: int | None = None) -> dict[str, Any]:
    """An OpenAI chat completion body: one user message, the text part then the media parts in order."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *content_parts]}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def image_url_parts(images: Sequence[ImageSource], ids: Sequence[str]) -> list[dict[str, Any]]:
    """`image_url` parts (data URLs) carrying `uuid`: the encoder-cache mode sends the media itself,
    since vLLM still preprocesses it to size the placeholder; the uuid names the cached embedding."""
    parts = []
    for image, item_id in zip(images, ids, strict=True):
        data = read_image(image)
        mime = next((m for magic, m in _MIME if data.startswith(magic)), None)
        if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            mime = "image/webp"
        url = f"data:{mime or 'image/jpeg'};base64,{base64.b64encode(data).decode('ascii')}"
        parts.append({"type": "image_url", "image_url": {"url": url}, "uuid": item_id})
    return parts


def decode_content_part(part: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings, grid) of an `image_embeds` / `video_embeds` part, decoded the way vLLM decodes it:
    base64, then `torch.load(io.BytesIO(...), weights_only=True)`."""
    import torch

    kind = part["type"].removesuffix("_embeds")
    payload = part[f"{kind}_embeds"]

    def load(b64: str) -> torch.Tensor:
        return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)

    return load(payload[f"{kind}_embeds"]), load(payload[f"{kind}_grid_thw"])


def run(vitserve_url: str, vllm_url: str, model: str, prompt: str, images: Sequence[ImageSource], *,
        ec: bool = False, api_key: str | None = None, vllm_api_key: str | None = None,
        dtype: str = "bfloat16", max_tokens: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Encode on vitserve, then POST the chat request to vLLM; returns vLLM's answer."""
    if ec:
        data = [read_image(i) for i in images]
        ids = [content_id(d) for d in data]
        # The response is not needed: the server answers after every cache file is in place.
        post_json(vitserve_url.rstrip("/") + "/encode",
                  encode_request(data, ids=ids, encoding_format="base64", dtype=dtype),
                  api_key=api_key, timeout=timeout)
        parts = image_url_parts(data, ids)
    else:
        parts = encode_for_vllm(vitserve_url, images, api_key, timeout, dtype=dtype)
    body = chat_request(model, prompt, parts, max_tokens)
    return post_json(vllm_url.rstrip("/") + "/v1/chat/completions", body, api_key=vllm_api_key, timeout=timeout)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.handoff.sidecar",
                                description="Encode images on vitserve and ask a vLLM server about them.")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
    p.add_argument("--vitserve", required=True, help="vitserve base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--vllm", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name vLLM serves")
    p.add_argument("--prompt", required=True, help="the question about the images")
    p.add_argument("--ec", action="store_true",
                   help="encoder-cache mode: vitserve writes --ec-shared-storage, vLLM reads it by uuid")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="embedding dtype: the LLM's dtype")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = p.parse_args(argv)
    try:
        answer = run(args.vitserve, args.vllm, args.model, args.prompt, args.images, ec=args.ec,
                     api_key=os.environ.get("VITSERVE_API_KEY"), vllm_api_key=os.environ.get("VLLM_API_KEY"),
                     dtype=args.dtype, max_tokens=args.max_tokens, timeout=args.timeout)
    except (SidecarError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
