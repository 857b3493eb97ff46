"""Which decoder a blob of media bytes belongs to, from its first bytes (shared by HTTP and the CLI)."""

from __future__ import annotations

from service.media.images import sniff_format
from service.media.video import sniff_container

# HEIF/AVIF stills share MP4's box layout; they are images (which the image decoder then refuses by name).
_STILL_BRANDS = (b"heic", b"heix", b"avif", b"avis", b"mif1", b"msf1")


def sniff_modality(data: bytes | bytearray | memoryview) -> str:
    """Image if a supported image format is recognised, video for known containers, else image (its
    decoder then names the unsupported format in the error)."""
    if sniff_format(data):
        return "image"
    head = bytes(data[:16])
    if head[4:8] == b"ftyp" and head[8:12] in _STILL_BRANDS:
        return "image"
    return "video" if sniff_container(data) else "image"
