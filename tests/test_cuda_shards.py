"""tools/cuda_shards.py: the GPU tests dealt into processes that run side by side, a preset's tests together."""

from __future__ import annotations

from tools.cuda_shards import collect, shards


def test_every_test_lands_once_and_a_presets_tests_share_a_shard() -> None:
    ids = [f"tests/t.py::test_{name}[random:{preset}]" for name in "abcde" for preset in ("x", "y", "z")]
    ids += ["tests/t.py::test_alone", "tests/u.py::test_video[cudnn-80]", "tests/u.py::test_image[cudnn-80]"]
    dealt = shards(ids, 2)
    assert sorted(sum(dealt, [])) == sorted(ids)
    for preset in ("x", "y", "z", "cudnn-80"):
        assert sum(any(i.endswith(f"{preset}]") for i in shard) for shard in dealt) == 1, preset
    assert sorted(len(s) for s in dealt) == [8, 10]  # groups of 5, 5, 5, 2, 1: the fewest apart
    for shard in dealt:  # collection order kept within a shard
        assert shard == [i for i in ids if i in shard]


def test_the_gpu_files_collect_into_shards_that_cover_them() -> None:
    ids = collect(["tests/test_cuda_graphs.py"])
    dealt = shards(ids, 3)
    assert len(ids) > 100 and sorted(sum(dealt, [])) == sorted(ids)
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 5  # one preset's tests at most
