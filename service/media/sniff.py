"""Which decoder a blob of media bytes belongs to, from its first bytes (shared by HTTP and the CLI)."""

from __future__ import annotations

from service.media.images import sniff_format

# Boxes an ISO BMFF file (MP4/MOV/3GP) may start with.
_ISO_BMFF_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
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


def sniff_container(data: bytes | bytearray | memoryview) -> str | None:
    """'mp4' (MP4/MOV/3GP), 'matroska' (MKV/WebM) or 'avi' from the magic bytes, else None."""
    head = bytes(data[:16])
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] in (b"AVI ", b"AVIX"):
        return "avi"
    if head[4:8] in _ISO_BMFF_BOXES:
        return "mp4"
    return None
