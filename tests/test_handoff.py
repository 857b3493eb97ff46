"""The hand-off's parts alone: content ids, the encoder-output cache, the shared folder's writes, reads,
permissions, errors and bound (no server, no model)."""

from __future__ import annotations

import errno
import os
import stat
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from service import shm
from service.engine.types import OutputRef
from service.handoff import ec_storage
from service.handoff.cache import CachedOutput, EncoderCache
from service.handoff.content_id import checkpoint_fingerprint, content_id, model_identity, process_umask
from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY, ECSharedStorage, StorageError, id_problem
from service.handoff.vllm import grid_timestamps

DATA = b"\xff\xd8\xff" + bytes(range(256)) * 9000  # longer than one hashing chunk


def test_content_ids_name_model_options_and_bytes():
    ident = model_identity({"model": "m", "dtype": "bfloat16"})
    cid = content_id(ident, "image", {"max_pixels": 1000}, DATA)
    assert cid.startswith("vit-") and len(cid) == 68 and id_problem(cid) is None
    assert cid == content_id(ident, "image", {"max_pixels": 1000}, bytearray(DATA))  # same request, same id
    others = {
        content_id(ident, "image", {"max_pixels": 2000}, DATA),  # another option value
        content_id(ident, "image", {}, DATA),
        content_id(ident, "video", {"max_pixels": 1000}, DATA),
        content_id(model_identity({"model": "m", "dtype": "float32"}), "image", {"max_pixels": 1000}, DATA),
        content_id(ident, "image", {"max_pixels": 1000}, DATA[:-1] + b"\x00"),  # one byte differs
    }
    assert cid not in others and len(others) == 5
    assert content_id(ident, "image", {"a": 1, "b": None}, DATA) == content_id(ident, "image", {"a": 1}, DATA)
    assert content_id(ident, "image", {"a": 1, "b": 2}, DATA) == content_id(ident, "image", {"b": 2, "a": 1}, DATA)


def test_checkpoint_fingerprint(tmp_path):
    assert checkpoint_fingerprint("tiny-qwen2-vl") == {"preset": "tiny-qwen2-vl"}
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = checkpoint_fingerprint(str(tmp_path))
    assert first["weights"][0][:2] == ["model.safetensors", 10]
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert checkpoint_fingerprint(str(tmp_path)) != first


NAMES = shm.SegmentNames()


def entry(rows: int, hidden: int = 8, seed: int = 0) -> CachedOutput:
    """A cached output whose rows sit in a real shared-memory segment."""
    rng = np.random.default_rng(seed)
    name = NAMES.next("test")
    shm.write_array(name, rng.standard_normal((rows, hidden)).astype(np.float32))
    return CachedOutput("image", (1, 2, rows * 2), rows * 4, rows, {}, OutputRef(name, rows, hidden, "float32"))


def exists(e: CachedOutput) -> bool:
    return os.path.exists(f"/dev/shm/{e.output.segment}")


def test_cache_is_lru_and_bounded_in_bytes():
    made = [entry(10, seed=k) for k in range(4)]
    one = made[0].nbytes
    assert one == 10 * 8 * 4 + 512
    cache = EncoderCache(3 * one)
    for k in range(3):
        assert cache.put(f"k{k}", made[k])
        cache.unpin(made[k].output.segment)  # the response that made it is done
    assert cache.get("k0") is made[0]  # k0 is now the most recent: k1 goes first
    cache.unpin(made[0].output.segment)
    assert cache.put("k3", made[3])
    assert cache.get("k1") is None and not exists(made[1])  # evicted and unpinned: unlinked at once
    assert len(cache) == 3 and cache.bytes == 3 * one and cache.stats()["evictions"] == 1
    huge = entry(1000)
    assert not cache.put("huge", huge) and cache.get("huge") is None and exists(huge)  # not kept: the caller's
    shm.unlink(huge.output.segment)
    assert not EncoderCache(0).enabled
    cache.unpin(made[3].output.segment)
    cache.clear()
    assert not any(exists(e) for e in made)


def test_an_entry_evicted_while_a_response_reads_it_goes_when_that_response_is_done():
    a, b = entry(10, seed=1), entry(10, seed=2)
    cache = EncoderCache(a.nbytes)
    cache.put("a", a)  # pinned: its response is still being encoded
    cache.put("b", b)  # evicts a
    assert cache.get("a") is None and exists(a) and cache.owns(a.output.segment)
    cache.unpin(a.output.segment)
    assert not exists(a) and not cache.owns(a.output.segment)
    cache.pin(b.output.segment)  # an item repeated in the same request: a second reader
    cache.unpin(b.output.segment)
    cache.unpin(b.output.segment)
    assert exists(b)  # still cached
    cache.clear()
    assert not exists(b)


def test_closing_the_cache_unlinks_every_segment_pinned_or_not():
    a, b, c = entry(10, seed=1), entry(10, seed=2), entry(10, seed=3)
    cache = EncoderCache(2 * a.nbytes)
    cache.put("a", a)  # pinned: a response still reads it
    cache.put("b", b)
    cache.unpin(b.output.segment)
    cache.put("c", c)  # evicts a while pinned: doomed, not yet unlinked
    assert exists(a) and exists(b) and exists(c)
    cache.close()
    assert not any(exists(e) for e in (a, b, c)) and len(cache) == 0 and cache.bytes == 0


def test_grid_timestamps_follow_vllm():
    # Indices padded with the last to whole temporal patches, then the mean of each patch's first and last frame.
    assert grid_timestamps({"frame_indices": [0, 2, 5, 7], "video_fps": 4.0}, 2) == [0.25, 1.5]
    assert grid_timestamps({"frame_indices": [0, 3, 6], "video_fps": 3.0}, 2) == [0.5, 2.0]
    assert grid_timestamps({}, 2) is None


# ---- the shared folder ---------------------------------------------------------------------------
def test_storage_writes_atomically_with_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        store = ECSharedStorage(tmp_path / "cache")
        store.check()
        assert process_umask() == 0o022
    finally:
        os.umask(old)
    t = torch.randn(5, 12).to(torch.bfloat16)
    path = store.write("item-1", t, {"model": "m", "content_id": "c"})
    assert path == tmp_path / "cache" / "item-1" / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a consumer running as another user reads it
    loaded = load_file(str(path))
    assert list(loaded) == [TENSOR_KEY] and torch.equal(loaded[TENSOR_KEY], t)
    header = store.header("item-1")
    assert header.shape == (5, 12) and header.dtype == "BF16" and header.metadata["content_id"] == "c"
    assert store.header("absent") is None
    store.write("item-1", t * 2)
    assert torch.equal(store.load("item-1"), t * 2)
    assert [p.name for p in path.parent.iterdir()] == [FILE_NAME]
    with pytest.raises(ValueError):
        store.write("../outside", t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert store.stats()["items"] == 1 and store.bytes == path.stat().st_size


def test_storage_mode_follows_a_group_umask(tmp_path):
    old = os.umask(0o002)
    try:
        store = ECSharedStorage(tmp_path)
        store.check()
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.write("x", torch.zeros(2, 2)).stat().st_mode) == 0o664


@pytest.mark.parametrize("code,status,name", [(errno.ENOSPC, 507, "insufficient_storage"),
                                               (errno.EDQUOT, 507, "insufficient_storage"),
                                               (errno.EROFS, 503, "storage_unavailable")])
def test_storage_failures_leave_nothing(tmp_path, monkeypatch, code, status, name):
    store = ECSharedStorage(tmp_path)
    store.check()

    def failing_write(fd: int, buffers: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ec_storage.os, "writev", failing_write)
    with pytest.raises(StorageError) as err:
        store.write("new-item", torch.zeros(4, 4))
    assert (err.value.status, err.value.code) == (status, name)
    assert list(tmp_path.iterdir()) == []  # no temp file, no empty folder
    assert store.stats()["write_errors"] == 1


def test_storage_trim_oldest_first(tmp_path):
    store = ECSharedStorage(tmp_path, max_bytes=1, grace_s=0)
    store.check()
    for k in range(3):  # a bound of one byte: only the newest stays
        store.write(f"e{k}", torch.full((4, 4), float(k)))
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2"]
    assert store.evictions == 2 and store.stats()["items"] == 1


def test_storage_trim_spares_young_and_touched_entries(tmp_path):
    one = len(save({TENSOR_KEY: torch.zeros(4, 4)}, metadata={"format": "pt"}))
    store = ECSharedStorage(tmp_path, max_bytes=2 * one, grace_s=0)
    store.check()
    for k in range(2):
        store.write(f"e{k}", torch.zeros(4, 4))
        time.sleep(0.02)
    store.touch("e0")  # a hit: e0 becomes the newest
    time.sleep(0.02)
    store.write("e2", torch.zeros(4, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0", "e2"]
    store.grace_s = 3600  # everything young: the folder may pass its bound, a consumer may be reading
    store.write("e3", torch.zeros(4, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0", "e2", "e3"]


def test_storage_scan_counts_and_sweeps(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / FILE_NAME).write_bytes(b"x" * 100)
    (tmp_path / "empty").mkdir()  # what a vLLM 0.13 consumer leaves per lookup
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".tmp-crash.safetensors").write_bytes(b"y")
    past = time.time() - 3600
    for p in [tmp_path / "empty", tmp_path / "half" / ".tmp-crash.safetensors"]:
        os.utime(p, (past, past))
    store = ECSharedStorage(tmp_path, grace_s=60)
    store.check()
    assert store.bytes == 100 and store.stats()["items"] == 1
    assert not (tmp_path / "empty").exists() and not (tmp_path / "half" / ".tmp-crash.safetensors").exists()


def test_storage_header_refuses_other_files(tmp_path):
    store = ECSharedStorage(tmp_path)
    store.check()
    cases = [("short", b"\x01"), ("huge", (1 << 40).to_bytes(8, "little")), ("junk", b"\x04" + b"\0" * 7 + b"{}}}")]
    for name, data in cases:
        (tmp_path / name).mkdir()
        (tmp_path / name / FILE_NAME).write_bytes(data)
        assert store.header(name) is None
    assert store.write("fine", torch.zeros(1, 1)).exists() and store.header("fine") is not None
