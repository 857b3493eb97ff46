"""The graph pool on the CPU backend: packing properties, static-buffer refresh and padding,
fallback reasons, capture failures. The same scenarios run on the GPU in test_cuda_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs.budgets import BudgetError, BudgetPlan, GraphKey, auto_budgets
from graphs.learning import learn_budget
from graphs.packing import CostModel, PackItem, pack
from graphs.runner import GraphRunner, plan_for
from models import VisualInput, load_tower
from models.families import FAMILIES
from models.presets import PRESETS
from models.protocol import Geometry

CPU = torch.device("cpu")
POWERS_OF_TWO = auto_budgets(16384)  # the ladder the splitting tests' figures were made for


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_items(tower, grids, seed=0, modality="image"):
    rng = np.random.default_rng(seed)
    return [VisualInput(modality, rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), dtype=np.uint8),
                        (t, h, w)) for t, h, w in grids]


# ---- budgets --------------------------------------------------------------------------------
def test_auto_budgets_are_powers_of_two_or_finer_steps_plus_the_maximum():
    assert auto_budgets(16384) == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert auto_budgets(1000) == [64, 128, 256, 512, 1000]
    assert auto_budgets(1000, steps_per_octave=4) == [64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                                                      640, 768, 896, 1000]
    budgets = auto_budgets(16384, steps_per_octave=4)
    assert budgets[-1] == 16384 and all(b / a <= 1.25 for a, b in zip(budgets, budgets[1:]))
    # the budgets holding one 448x448 Qwen3-VL image (196 tokens) and 32 of 224x224 (1568) with 14% padding
    assert {224, 1792} <= set(budgets) and not set(range(196, 224)) & set(budgets)
    plan = BudgetPlan.create(max_batch_tokens=1000)
    assert plan.max_items == 256 and plan.max_budget == 1000


def test_budget_steps_reach_the_servers_plan():
    from service.engine.loading import build_runner
    from service.settings import ServeSettings

    def budgets(steps: int) -> tuple[int, ...]:
        settings = ServeSettings(model="tiny-qwen2-vl", device="cpu", dtype="float32", max_batch_tokens=1024,
                                 budget_steps=steps)
        return build_runner(settings).plan.budgets

    assert budgets(1) == (64, 128, 256, 512, 1024)
    assert budgets(4) == (64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_batch_tokens=0), "max-batch-tokens"),
    (dict(budgets=[0, 64]), "budgets"),
    (dict(max_items=16385), "max-batch-items"),
    (dict(t_capture=0), "t-capture"),
])
def test_invalid_settings_are_refused_with_the_flag_to_change(kwargs, message):
    with pytest.raises(BudgetError, match=message):
        BudgetPlan.create(**kwargs)


def test_every_key_capacity_is_consistent():
    from models.windows import Windows

    plan = BudgetPlan.create(max_batch_tokens=4096, layout=Windows(window=4, merge=2))
    keys = plan.keys()
    assert len(keys) == len(set(keys))
    assert [plan.capacity(k).patches for k in keys] == sorted((plan.capacity(k).patches for k in keys), reverse=True)
    for key in keys:
        cap = plan.capacity(key)
        assert cap.patches == key.budget * 4 and 1 <= cap.segments and cap.max_seqlen <= cap.patches
        assert cap.windows >= cap.segments


# ---- packing ---------------------------------------------------------------------------------
item_strategy = st.builds(
    lambda t, h, w, video: PackItem.of((t if video else 1, 2 * h, 2 * w), "video" if video else "image", Geometry()),
    st.integers(1, 12), st.integers(1, 40), st.integers(1, 40), st.booleans(),
)


def linear_costs(budgets, replay_overhead_tokens: float, launch_bound_tokens: float = float("inf")) -> CostModel:
    """Costs in tokens: a replay its budget plus a fixed overhead, an eager forward its tokens but at least
    `launch_bound_tokens` (infinite: never eager for padding)."""
    floor = max(launch_bound_tokens, 1.0)
    eager = ((1, floor),) if floor == float("inf") else ((int(floor), floor), (int(floor) + 1, floor + 1))
    return CostModel(tuple((b, b + replay_overhead_tokens) for b in sorted(budgets)), eager)


def replay_cost(batches, overhead):
    return sum(b.key.budget + overhead for b in batches if b.key is not None)


@settings(max_examples=200, deadline=None)
@given(st.lists(item_strategy, max_size=60), st.sampled_from([256, 1000, 4096]), st.integers(1, 64),
       st.sampled_from([None, 0.0, 48.0, 1000.0]))
def test_packing_properties(items, max_tokens, max_items, overhead):
    plan = BudgetPlan.create(max_batch_tokens=max_tokens, max_items=min(max_items, 64))
    cost = None if overhead is None else linear_costs(plan.budgets, overhead)
    batches = pack(items, plan, cost)
    seen = sorted(i for b in batches for i in b.items)
    assert seen == list(range(len(items)))  # every item exactly once
    for b in batches:
        members = [items[i] for i in b.items]
        if b.key is None:
            assert len(members) == 1 and b.reason in {"over_budget", "t_capture", "segment_too_long"}
            continue
        cap = plan.capacity(b.key)
        assert b.tokens == sum(m.tokens for m in members) <= b.key.budget
        assert len(members) <= plan.max_items
        assert sum(m.segments for m in members) <= cap.segments
        assert all(m.modality == b.key.modality for m in members)
        assert all(plan.length_class(m.segment_patches) == b.key.length_class for m in members)
        assert all(m.temporal <= plan.t_capture for m in members if m.modality == "video")
        smaller = [x for x in plan.budgets if x < b.key.budget and b.key.length_class in plan.length_classes(x)]
        assert all(x < b.tokens or plan.capacity(GraphKey(b.key.modality, x, b.key.length_class)).segments
                   < b.segments for x in smaller)  # the smallest budget that holds it
    assert [(b.key, b.items) for b in pack(items, plan, cost)] == [(b.key, b.items) for b in batches]
    if overhead is not None:  # splitting never costs more than the padded batches it replaces
        assert replay_cost(batches, overhead) <= replay_cost(pack(items, plan), overhead)


@pytest.mark.parametrize("count, overhead, budgets", [
    (9, None, [4096]),  # no measured overhead: one padded replay, as before calibration
    (9, 300.0, [2048, 256]),  # 2348 tokens of cost against 4396
    (7, 300.0, [2048]),  # 1024 + 1024 (or 512 + 256) plus overheads cost more than 2048 + 300
    (7, 0.0, [1024, 512, 256]),  # free replays: no padding at all
    (28, 100.0, [4096, 2048, 1024]),
])
def test_a_batch_just_over_a_budget_is_split_when_that_costs_less(count, overhead, budgets):
    plan = BudgetPlan.create(max_batch_tokens=16384, budgets=POWERS_OF_TWO)
    items = [PackItem(256, "image", 1, 1024)] * count
    batches = pack(items, plan, None if overhead is None else linear_costs(plan.budgets, overhead))
    assert [b.key.budget for b in batches] == budgets
    assert sorted(i for b in batches for i in b.items) == list(range(count))


def test_oversize_and_long_videos_run_alone_and_eagerly():
    plan = BudgetPlan.create(max_batch_tokens=256, t_capture=4)
    items = [PackItem(300, "image", 1, 1200), PackItem(40, "video", 5, 32, 5), PackItem(40, "video", 4, 40, 4)]
    batches = pack(items, plan)
    reasons = {b.items[0]: b.reason for b in batches if b.key is None}
    assert reasons == {0: "over_budget", 1: "t_capture"}


# ---- the pool on the CPU backend ----------------------------------------------------------------
@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"])
def runner(request):
    tower = load_tower(request.param, device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256, t_capture=4))
    r.capture()
    return r


def solo(runner, item):
    return runner.eager(item.pixels, [item.grid_thw])


def test_results_come_back_in_caller_order_and_match_eager(runner):
    m = runner.tower.merge
    rng = np.random.default_rng(3)
    for trial in range(12):
        count = int(rng.integers(1, 9))
        grids = [(1, m * int(rng.integers(1, 10)), m * int(rng.integers(1, 10))) for _ in range(count)]
        items = make_items(runner.tower, grids, trial)
        outs = runner.encode(items)
        for it, out in zip(items, outs):
            ref = solo(runner, it)
            assert out.embeds.shape == ref.embeds.shape
            assert rel_err(out.embeds, ref.embeds) < 1e-5
            for a, b in zip(out.deepstack, ref.deepstack):
                assert rel_err(a, b) < 1e-5
    assert runner.stats.graph_items > 0


def test_split_batches_match_eager(runner):
    items = make_items(runner.tower, [(1, 8, 8)] * 8 + [(1, 4, 8), (1, 12, 8)], seed=3)  # 136 + 24 tokens
    runner.cost = linear_costs(runner.plan.budgets, replay_overhead_tokens=0.0)
    try:
        batches = runner.pack_items(items)
        outs = runner.encode(items)
    finally:
        runner.cost = None
    assert len(batches) > len(runner.pack_items(items))  # the overhead made the packing split
    for item, out in zip(items, outs):
        assert rel_err(out.embeds, solo(runner, item).embeds) < 1e-5


def test_padding_rule_sends_mostly_padded_batches_eagerly(runner):
    items = make_items(runner.tower, [(1, 8, 8)] * 3)  # 48 tokens in a 64-token graph
    assert runner.pack_items(items)[0].reason is None  # no measured costs (the CPU): every batch replays
    runner.cost = linear_costs(runner.plan.budgets, 0.0, launch_bound_tokens=0)  # eager costs its tokens only
    try:
        batch = runner.pack_items(items)[0]
        assert (batch.reason, batch.key.budget) == ("padding", 64)
        eager_before = runner.stats.eager_items["padding"]
        for it, out in zip(items, runner.encode(items)):
            assert rel_err(out.embeds, solo(runner, it).embeds) < 1e-5
        assert runner.stats.eager_items["padding"] == eager_before + 3
        full = make_items(runner.tower, [(1, 8, 8)] * 4)  # 64 tokens: the graph is full, it replays
        assert runner.pack_items(full)[0].reason is None
    finally:
        runner.cost = None


def test_equal_tokens_different_boundaries_share_a_graph_and_stay_right(runner):
    m = runner.tower.merge
    a = make_items(runner.tower, [(1, 4 * m, 4 * m), (1, 4 * m, 4 * m)], 1)
    b = make_items(runner.tower, [(1, 2 * m, 4 * m), (1, 6 * m, 4 * m)], 2)
    assert sum(i.num_patches for i in a) == sum(i.num_patches for i in b)
    for items in (a, b, a):
        for it, out in zip(items, runner.encode(items)):
            assert rel_err(out.embeds, solo(runner, it).embeds) < 1e-5


def test_recurring_batches_reuse_their_packed_metadata_within_a_bound(runner, monkeypatch):
    from graphs import pool as graph_pool

    m = runner.tower.merge
    a = make_items(runner.tower, [(1, 4 * m, 4 * m), (1, 4 * m, 4 * m)], 1)
    b = make_items(runner.tower, [(1, 2 * m, 4 * m), (1, 6 * m, 4 * m)], 2)  # same graph, other boundaries
    cache = runner.pool._meta_cache
    cache.clear()
    runner.pool._meta_cache_bytes = 0
    first = [out.embeds for out in runner.encode(a)]
    (key_a, staged_a), = cache.items()
    runner.encode(b)
    assert len(cache) > 1 and runner.pool._meta_cache_bytes == sum(t.nbytes for t in cache.values())
    again = [out.embeds for out in runner.encode(a)]
    assert cache[key_a] is staged_a and list(cache)[-1] == key_a  # reused, and now the most recent
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    bound = max(t.nbytes for t in cache.values())
    monkeypatch.setattr(graph_pool, "META_CACHE_BYTES", bound)
    cache.clear()
    runner.pool._meta_cache_bytes = 0
    runner.encode(a)
    runner.encode(b)  # b's entries, packed after a's, push it out
    assert key_a not in cache and 0 < runner.pool._meta_cache_bytes <= bound
    assert all(torch.equal(x, y) for x, y in zip(first, (out.embeds for out in runner.encode(a))))


def small_batch(runner):
    """Two small images in one batch: (items, batch, its graph, its metadata region)."""
    m = runner.tower.merge
    items = make_items(runner.tower, [(1, 2 * m, 2 * m), (1, 2 * m, 4 * m)], 3)
    (batch,) = runner.pack_items(items)
    g = runner.pool.graphs[batch.key]
    return items, batch, g, runner.pool._regions[g.capacity.patches]


def test_a_batch_uploads_its_metadata_in_one_copy_into_its_budgets_own_buffers(runner):
    """Each budget's graphs read metadata buffers of their own, as long as that budget needs: a small batch's
    arrays lie side by side there, one copy (each copy the device waits for delays a lone batch)."""
    items, batch, g, region = small_batch(runner)
    pool = runner.pool
    largest = pool._regions[max(pool._regions)]
    assert batch.key.budget < runner.plan.max_budget and region.flat.numel() < largest.flat.numel()
    staged = pool._staged_metadata(batch.key, [it.grid_thw for it in items], g)
    assert len(staged.runs) == 1


def test_metadata_runs_land_at_their_buffers_offsets_and_recurring_batches_are_not_uploaded_again(
        runner, monkeypatch):
    """Arrays further apart than META_GAP_BYTES get a copy each (here every gap is "far"), at their own offsets;
    the region then holds that batch, and the same batch again copies nothing; a capture's empty batch written
    there makes the next one upload (another batch's layout does too:
    test_equal_tokens_different_boundaries_share_a_graph_and_stay_right)."""
    from graphs import pool as graph_pool

    monkeypatch.setattr(graph_pool, "META_GAP_BYTES", 1)
    items, batch, g, region = small_batch(runner)
    pool = runner.pool
    grids = [it.grid_thw for it in items]
    meta = runner.tower.build_metadata(grids, g.capacity)
    staged = pool._pack_metadata(meta, g.inputs, region)
    assert staged.nbytes == sum(size for _, _, size in staged.runs) and len(staged.runs) > 1
    for name, arr in meta.items():  # every array inside exactly one run, at its own offset
        start = region.offsets[name]
        (dst, src, size), = [r for r in staged.runs if r[0] <= start < r[0] + r[2]]
        assert start + arr.nbytes <= dst + size
        host = staged.host.numpy()[src + start - dst:src + start - dst + arr.nbytes]
        assert host.tobytes() == np.ascontiguousarray(arr).tobytes()
    pool._meta_cache.clear()
    first = runner.encode(items)[0].embeds
    for name, arr in meta.items():  # what the graph reads
        assert np.array_equal(g.inputs[name].numpy(), arr)
    assert region.loaded is pool._staged_metadata(batch.key, grids, g)
    assert not region.load(region.loaded)  # held: no copy
    assert torch.equal(runner.encode(items)[0].embeds, first)
    pool._input_views(g.capacity)  # a capture writes an empty batch there
    assert region.loaded is None
    assert torch.equal(runner.encode(items)[0].embeds, first)


def test_small_then_large_then_small(runner):
    m = runner.tower.merge
    small = make_items(runner.tower, [(1, 2 * m, 3 * m)], 4)
    large = make_items(runner.tower, [(1, 10 * m, 12 * m), (1, 8 * m, 8 * m)], 5)
    first = runner.encode(small)[0].embeds
    runner.encode(large)
    assert torch.equal(runner.encode(small)[0].embeds, first)
    assert rel_err(first, solo(runner, small[0]).embeds) < 1e-5


def test_images_and_videos_together_with_fallback_reasons(runner):
    m = runner.tower.merge
    before = dict(runner.stats.eager_items)
    video_ok = make_items(runner.tower, [(3, 2 * m, 2 * m)], 6, "video")
    video_long = make_items(runner.tower, [(6, 2 * m, 2 * m)], 7, "video")  # t > t_capture (4)
    huge = make_items(runner.tower, [(1, 18 * m, 16 * m)], 8)  # 288 tokens > 256
    image = make_items(runner.tower, [(1, 3 * m, 3 * m)], 9)
    items = video_ok + video_long + huge + image
    for it, out in zip(items, runner.encode(items)):
        assert rel_err(out.embeds, solo(runner, it).embeds) < 1e-5
    after = runner.stats.eager_items
    assert after["t_capture"] == before.get("t_capture", 0) + 1
    assert after["over_budget"] == before.get("over_budget", 0) + 1
    assert any(k.startswith("video/") for k in runner.stats.replays)


def test_injected_capture_failure_is_served_eagerly():
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=128), modalities=("image",))
    broken = GraphKey("image", 64, 64)
    capture_one = r.pool._capture_one

    def failing(key, cap):
        if key == broken:
            raise RuntimeError("injected capture failure")
        return capture_one(key, cap)

    r.pool._capture_one = failing
    r.capture()
    assert broken in r.pool.failed and "injected" in r.stats.as_dict()["capture_failures"][str(broken)]
    items = make_items(tower, [(1, 4, 4)], 10)
    assert (r.pack_items(items)[0].key, r.pack_items(items)[0].reason) == (broken, "capture_failed")
    assert rel_err(r.encode(items)[0].embeds, solo(r, items[0]).embeds) < 1e-6
    assert r.stats.eager_items["capture_failed"] == 1


def test_under_a_memory_budget_the_first_capture_out_of_memory_ends_the_capture():
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    order = sorted(r.plan.keys(r.modalities), key=lambda k: -r.plan.capacity(k).patches)
    short = next(k for k in order if k.budget == 128)
    capture_one, tried = r.pool._capture_one, []

    def running_short(key, cap):
        tried.append(key)
        if key == short:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 MiB.")
        return capture_one(key, cap)

    r.pool._capture_one = running_short
    r.capture(stop_at_out_of_memory=True)
    assert tried == order[:order.index(short) + 1]  # nothing after the failure was tried
    assert list(r.pool.failed) == [short] and set(r.pool.graphs) == set(order[:order.index(short)])
    r2 = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    r2.pool._capture_one = running_short
    r2.capture()  # without a budget, every other key is still captured
    assert list(r2.pool.failed) == [short] and len(r2.pool.graphs) == len(order) - 1


def test_the_cpu_says_once_that_it_captures_no_cuda_graphs(caplog):
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=128))
    keys = len(r.plan.keys(r.modalities))
    assert r.capture_plan() == f"no CUDA graphs on the CPU ({keys} fixed-shape eager keys)"
    with caplog.at_level("DEBUG", logger="vitserve.graphs"):
        r.capture()
    info = [rec.getMessage() for rec in caplog.records if rec.levelname == "INFO"]
    assert len(info) == 1 and "no CUDA graphs" in info[0] and "capturing" not in info[0], info
    assert sum(rec.levelname == "DEBUG" for rec in caplog.records) == keys  # one line per key, at DEBUG
    stats = r.stats.as_dict()
    assert stats["captured_graphs"] == 0 and stats["graph_keys"] == keys == len(r.pool.graphs)
    assert stats["graph_mode"] == "cpu_fixed_shape" and "CUDA device" in stats["no_graphs_reason"]
    off = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=128), use_graphs=False)
    off.capture()
    assert off.stats.as_dict()["graph_mode"] == "off" and off.capture_plan() == "no CUDA graphs (eager)"


def test_graphs_off_still_batches():
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=128), use_graphs=False)
    items = make_items(tower, [(1, 4, 4)] * 5, 11)
    outs = r.encode(items)
    assert r.stats.eager_batches == 1 and r.stats.eager_items["graphs_disabled"] == 5
    for it, out in zip(items, outs):
        assert rel_err(out.embeds, solo(r, it).embeds) < 1e-5


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"])
def test_video_chunking_equals_one_eager_pass(name):
    """No attention, merge or position term crosses a temporal patch: chunks of t_capture re-join exactly."""
    tower = load_tower(name, device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=512, t_capture=4), modalities=("video",),
                    video_chunking=True)
    r.capture()
    m = tower.merge
    videos = make_items(tower, [(11, 4 * m, 6 * m), (9, 3 * m, 3 * m), (3, 2 * m, 2 * m)], 12, "video")
    outs = r.encode(videos)
    for video, out in zip(videos, outs):
        whole = r.eager(video.pixels, [video.grid_thw])
        assert out.embeds.shape == whole.embeds.shape
        assert rel_err(out.embeds, whole.embeds) < 1e-5
        for a, b in zip(out.deepstack, whole.deepstack):
            assert rel_err(a, b) < 1e-5
    stats = r.stats.as_dict()
    assert stats["chunked_videos"] == 2 and stats["video_chunks"] == 3 + 3
    assert "t_capture" not in stats["eager_items"]


def test_more_windows_than_the_class_holds_falls_back_to_eager():
    """Qwen2.5-VL: extreme aspect ratios have ~n/16 windows per frame, beyond the class's n/32 + 4."""
    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    r.capture()
    items = make_items(tower, [(1, 2, 250), (1, 2, 250)], 13)  # 1 x 125 tokens each: 32 windows each
    batches = r.pack_items(items)
    assert len(batches) == 1 and batches[0].key is not None
    for it, out in zip(items, r.encode(items)):
        assert rel_err(out.embeds, solo(r, it).embeds) < 1e-5
    assert r.stats.eager_items["layout_capacity"] == 2


def test_per_frame_metadata_is_cached_read_only_and_batches_stay_independent():
    """Per-frame builders cache by shape; the cached arrays cannot be changed through a batch's metadata."""
    from models.metadata import block_order_positions
    from models.positions import frame_taps
    from models.windows import window_layout

    for cached in (block_order_positions(4, 6, 2), *frame_taps(4, 6, 2, 48), *window_layout(8, 8, 2, 2)):
        assert not cached.flags.writeable
    assert block_order_positions(4, 6, 2) is block_order_positions(4, 6, 2)
    from models.metadata import rotary_positions

    first = rotary_positions([(2, 4, 6)], 2, 64)
    first[:] = -1  # a batch's own array: the cache is untouched
    again = rotary_positions([(2, 4, 6)], 2, 64)
    assert (again[:48] == np.tile(block_order_positions(4, 6, 2), (2, 1))).all() and (again[48:] == 0).all()


def test_a_split_with_an_eager_part_loses_to_one_eager_pass_when_that_costs_less():
    """Eight 1344x756 images (1296 tokens each) with the H200's measured costs: the split (six replayed in
    8192 tokens, two eager) was 2.5-4% slower than one eager pass in every family. The graph's margin is
    for ties against an eager pass, not against a split with an eager part of its own (a 4096-token
    replay of 83 Qwen3-VL 224x224 images and an eager pass of 45: 52.6 ms, one eager pass 52.2 ms); a
    replay of everything still wins its ties."""
    plan = BudgetPlan.create(max_batch_tokens=16384, max_items=256, budgets=POWERS_OF_TWO)
    cost = linear_costs(plan.budgets, replay_overhead_tokens=92.0, launch_bound_tokens=1250.0)
    large = PackItem(1296, "image", 1, 5184)
    batches = pack([large] * 8, plan, cost)
    assert [(b.key.budget, len(b.items), b.reason) for b in batches] == [(16384, 8, "padding")]
    qwen3_224 = PackItem(49, "image", 1, 196)
    batches = pack([qwen3_224] * 128, plan, cost)
    assert [(b.key.budget, len(b.items), b.reason) for b in batches] == [(8192, 128, "padding")]
    small = PackItem(64, "image", 1, 256)  # 128 of them fill 8192 tokens: the replay is all of it
    batches = pack([small] * 128, plan, cost)
    assert [(b.key.budget, len(b.items), b.reason) for b in batches] == [(8192, 128, None)]


def test_measured_costs_interpolate_and_extend_by_the_largest_replays_cost_per_token():
    cost = CostModel(replays=((64, 2.0), (128, 3.0), (256, 5.0)), eager=((256, 12.0), (2048, 16.0)))
    assert cost.replay_cost(64) == 2.0 and cost.replay_cost(96) == 2.5 and cost.replay_cost(32) == 2.0
    assert cost.replay_cost(512) == 5.0 + 256 * (5.0 / 256)  # beyond: the largest replay's cost per token
    assert cost.eager_cost(1) == 12.0  # a small eager forward costs its launches
    assert cost.eager_cost(1152) == 14.0
    assert cost.eager_cost(4096) == 16.0 + 2048 * (5.0 / 256)
    with pytest.raises(ValueError):
        CostModel(replays=(), eager=((1, 1.0),))


def test_padding_goes_eager_only_when_the_measured_eager_forward_is_cheaper():
    """32 Qwen3-VL 224x224 images (1568 tokens) with budgets in quarter steps, costs as an H200 measured
    them (ms): the 1792 replay (about 14.6) beats an eager forward of 1568 tokens, bound by its host
    (13 ms for one frame, 16 for eight). The linear model this replaced priced that eager forward below
    the replay, and the batch ran eagerly (16.1 ms against 13.4 for a replay of exactly its tokens)."""
    plan = BudgetPlan.create(max_batch_tokens=16384, steps_per_octave=4)
    replays = ((1536, 13.0), (1792, 14.6), (2048, 16.4), (16384, 104.0))
    cost = CostModel(replays, eager=((256, 13.0), (2048, 16.0)))
    batches = pack([PackItem(49, "image", 1, 196)] * 32, plan, cost)
    assert [(b.key.budget, b.reason) for b in batches] == [(1792, None)]
    # An eager forward that costs less than the padded replay by the margin wins it.
    cheap = CostModel(replays, eager=((256, 5.0), (2048, 12.0)))
    batches = pack([PackItem(49, "image", 1, 196)] * 32, plan, cheap)
    assert [(b.key.budget, b.reason) for b in batches] == [(1792, "padding")]


def test_calibration_times_a_full_replay_of_every_budget_and_two_eager_forwards():
    """On the CPU's fixed-shape keys (which `capture` leaves uncalibrated): the frames that fill each budget
    replay in exactly that budget, in quarter steps too, and the model then prices every batch."""
    tower = load_tower("tiny-qwen3-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=512, steps_per_octave=4), modalities=("image",))
    runner.capture()
    assert runner.cost is None
    before = runner.stats.as_dict()
    runner.calibrate()
    assert runner.cost is not None
    assert [b for b, _ in runner.cost.replays] == list(runner.plan.budgets)
    assert all(c > 0 for _, c in runner.cost.replays)
    assert [t for t, _ in runner.cost.eager] == [256, 512]
    assert runner.stats.as_dict() == before  # calibration is not traffic
    items = make_items(tower, [(1, 2 * tower.merge, 2 * tower.merge)] * 3)
    assert [it for b in runner.pack_items(items) for it in b.items] == [0, 1, 2]


def test_a_video_only_runner_calibrates_on_its_video_graphs():
    """Without image graphs, image frames would all run eagerly and be timed as if they were replays."""
    tower = load_tower("tiny-qwen3-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("video",))
    runner.capture()
    runner.calibrate()
    assert runner.cost is not None
    assert [b for b, _ in runner.cost.replays] == list(runner.plan.budgets)  # each timed on its video graph


# ---- budgets learned while serving ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_a_learned_budget_replays_its_own_size_and_matches_eager(name):
    """A budget added after start-up: its graphs go into the same buffers, one replay per modality is checked,
    its replay is timed into the costs, and a batch of its size replays in it without padding."""
    tower = load_tower(name, device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256, t_capture=4))
    runner.capture()
    runner.calibrate()  # the CPU's fixed-shape keys priced, as CUDA's are at start-up
    m = tower.merge
    lone = make_items(tower, [(1, 10 * m, 8 * m)], 21)  # 80 tokens: 128 before
    assert runner.pack_items(lone)[0].key.budget == 128
    first = runner.encode(lone)[0].embeds
    before = runner.stats.as_dict()
    learned = learn_budget(runner, 80)
    assert learned.ok and learned.reason == "ok" and learned.plan.budgets == (64, 80, 128, 256)
    traffic = ("graph_items", "eager_items", "replays", "eager_batches")
    assert runner.plan.budgets == (64, 80, 128, 256)
    assert {k: runner.stats.as_dict()[k] for k in traffic} == {k: before[k] for k in traffic}  # not traffic
    assert {k for k in runner.pool.graphs if k.budget == 80} == set(runner.plan.budget_keys(80, runner.modalities))
    assert 80 in dict(runner.cost.replays) and learned.cost == runner.cost
    [batch] = runner.pack_items(lone)
    assert batch.replays and batch.key.budget == 80
    out = runner.encode(lone)[0].embeds
    assert rel_err(out, solo(runner, lone[0]).embeds) < 1e-5 and rel_err(out, first) < 1e-5
    # equal tokens, other boundaries, in the learned graph; then a large batch, then the small one again
    pair = make_items(tower, [(1, 6 * m, 6 * m), (1, 4 * m, 11 * m)], 22)  # 80 tokens, one length class
    assert runner.pack_items(pair)[0].key.budget == 80
    for it, o in zip(pair, runner.encode(pair)):
        assert rel_err(o.embeds, solo(runner, it).embeds) < 1e-5
    runner.encode(make_items(tower, [(1, 16 * m, 14 * m)], 23))
    assert torch.equal(runner.encode(lone)[0].embeds, out)
    assert learn_budget(runner, 80).reason == "already in the plan"


def test_a_budget_that_fails_to_capture_or_check_is_refused_and_the_plan_stays():
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    runner.capture()
    graphs, failed = set(runner.pool.graphs), dict(runner.pool.failed)
    capture_one = runner.pool._capture_one

    def failing(key, cap):
        if key.budget == 96 and key.length_class == 64:
            raise RuntimeError("injected capture failure")
        return capture_one(key, cap)

    runner.pool._capture_one = failing
    refused = learn_budget(runner, 96)
    assert not refused.ok and "injected capture failure" in refused.reason
    assert runner.plan.budgets == (64, 128, 256) and refused.plan == runner.plan
    assert set(runner.pool.graphs) == graphs and runner.pool.failed == failed  # its graphs dropped
    assert runner.stats.as_dict()["capture_failures"] == {}
    runner.pool._capture_one = capture_one

    replay = runner.pool.replay
    runner.pool.replay = lambda key, pixels, grids: replay(key, pixels, grids) + 1  # stale rows, say
    refused = learn_budget(runner, 96)
    assert not refused.ok and "differs from eager" in refused.reason
    assert runner.plan.budgets == (64, 128, 256) and set(runner.pool.graphs) == graphs
    runner.pool.replay = replay
    assert learn_budget(runner, 96).ok and runner.plan.budgets == (64, 96, 128, 256)
    with pytest.raises(BudgetError, match="between 1 and 255"):
        learn_budget(runner, 256 + 64)


def test_a_key_the_shared_buffers_cannot_hold_is_refused_not_reallocated():
    """Live graphs read the buffers made at start-up: a capacity past them is refused, nothing grows."""
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    runner.capture()
    pixels = runner.pool._pixels
    too_big = GraphKey("image", 512, 64)
    failures = runner.pool.capture_more([too_big])
    assert "pixels" in failures[too_big] and too_big not in runner.pool.graphs
    assert runner.pool._pixels is pixels


def test_a_budget_whose_timing_ran_eagerly_gets_no_replay_price():
    """A calibration batch the graph cannot hold (more attention windows than its class: Qwen2.5-VL's strips
    one token high) falls back to eager; its time is an eager forward's, 10x a replay's on the GPU, and as a
    replay's price it sent that budget's batches eagerly. Such a budget is left out (priced by its neighbours)."""
    from models.protocol import CapacityError

    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), modalities=("image",))
    runner.capture()
    replay = runner.pool.replay

    def no_room_in_128(key, pixels, grids):
        if key.budget == 128:
            raise CapacityError("more windows than the class holds")
        return replay(key, pixels, grids)

    runner.pool.replay = no_room_in_128
    runner.calibrate()
    assert [b for b, _ in runner.cost.replays] == [64, 256]
    runner.pool.replay = replay
    runner.calibrate()
    assert [b for b, _ in runner.cost.replays] == [64, 128, 256]
    assert runner.replay_cost(196) is None  # no graph of that budget
    assert learn_budget(runner, 196).ok and 196 in dict(runner.cost.replays)


@pytest.mark.parametrize("preset", [name for name in PRESETS if name.startswith("tiny-")])
def test_no_tower_writes_the_metadata_its_graphs_read(preset):
    """A budget's metadata is not uploaded again while its buffers hold that batch, so no forward may write the
    metadata it reads: every tiny preset's batch, run twice through one graph, leaves them as uploaded and gives the
    same rows (videos too where the family takes them)."""
    tower = load_tower(preset, device="cpu", dtype="float32")
    video = FAMILIES[tower.family].video
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256),
                         modalities=("image", "video") if video else ("image",))
    runner.capture()
    m = tower.merge
    for modality, t in [("image", 1), *([("video", 2)] if video else [])]:
        items = make_items(tower, [(t, 2 * m, 2 * m), (t, 2 * m, 4 * m)], 5, modality)
        (batch,) = runner.pack_items(items)
        g = runner.pool.graphs[batch.key]
        uploaded = tower.build_metadata([it.grid_thw for it in items], g.capacity)
        first = runner.run(batch, items).clone()
        staged = runner.pool._regions[g.capacity.patches].loaded
        again = runner.run(batch, items)
        assert runner.pool._regions[g.capacity.patches].loaded is staged  # not uploaded again
        assert all(np.array_equal(g.inputs[name].numpy(), arr) for name, arr in uploaded.items())
        assert torch.equal(again, first)
