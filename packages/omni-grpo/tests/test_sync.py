"""Weight sync against the fake sglang-omni server over real loopback HTTP (disk, skip, failures).

The source is a real transformers ``Qwen3OmniMoeThinkerForConditionalGeneration`` loaded from the
tiny hub checkpoint (fused experts in transformers' in-memory layout); the reference is computed
from the hub files directly (``expected_server_tensors``), not through omni-extract's table.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from omni_extract.errors import UnmappedTensorError
from omni_grpo.aio import BackgroundLoop
from omni_grpo.config import SglangOmniConfig
from omni_grpo.sync import SkipWeightSync, WeightSync, WeightSyncError, make_weight_sync
from omni_grpo.sync.buckets import buckets, dtype_runs, flatten, unflatten
from omni_grpo.sync.disk_writer import INDEX_NAME, MANIFEST_NAME
from omni_grpo.testing.sync import expected_server_tensors, read_hub_tensors
from omni_rollout_client.client import OmniRolloutClient
from omni_rollout_client.errors import ActiveRequestsError
from omni_rollout_client.testing import FakeGeneration, FakeOmniServer, FakeRequest


@pytest.fixture(scope="module")
def thinker_state(tiny_omni_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        str(tiny_omni_dir), dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def expected(tiny_omni_dir: Path) -> dict[str, torch.Tensor]:
    return expected_server_tensors(tiny_omni_dir)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    for name, tensor in want.items():
        g = got[name]
        assert g.dtype == tensor.dtype and g.shape == tensor.shape, (
            name,
            g.dtype,
            g.shape,
            tensor.dtype,
            tensor.shape,
        )
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bool else g, tensor), name
        assert (
            g.view(-1).view(torch.uint8).tolist() == tensor.view(-1).view(torch.uint8).tolist()
            if g.numel() < 64
            else True
        )


def _routes(server: FakeOmniServer) -> list[str]:
    return [route for route, _ in server.admin_log]


def test_expected_reference_is_non_square_and_complete(
    expected: dict[str, torch.Tensor], tiny_omni_dir: Path
) -> None:
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]["text_config"]
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    assert expected["thinker.model.layers.0.mlp.experts.gate_up_proj"].shape == (e, h, 2 * i)
    assert expected["thinker.model.layers.0.mlp.experts.down_proj"].shape == (e, i, h)
    assert "thinker.lm_head.weight" in expected and not any(
        "visual" in k or "audio" in k for k in expected
    )


def test_buckets_bound_size_and_mark_last() -> None:
    pairs = [
        (f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])
    ]
    out = list(buckets(iter(pairs), max_bytes=80))
    assert [b.names for b in out] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [b.last for b in out] == [False, False, True]
    assert out[1].dtypes == ["float32"] and out[1].shapes == [[30]]


def test_a_bucket_travels_as_one_flat_tensor_per_dtype_and_comes_back_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 4, generator=g),
        torch.randn(2, generator=g).to(torch.bfloat16),
        torch.randn(5, 1, 2, generator=g),
        torch.arange(6).reshape(2, 3),
        torch.randn(0, 4, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
    ]
    bucket = next(buckets(((f"t{i}", t) for i, t in enumerate(tensors)), 1 << 20))
    runs = dtype_runs(bucket.dtypes)
    assert runs == [("float32", [0, 2, 4]), ("bfloat16", [1, 5]), ("int64", [3])]
    back: dict[int, torch.Tensor] = {}
    for dtype, idx in runs:
        flat = flatten(bucket.tensors, idx).clone()  # what the receiver's buffer holds
        assert flat.dim() == 1 and str(flat.dtype) == f"torch.{dtype}"
        back.update(zip(idx, unflatten(flat, [bucket.shapes[i] for i in idx]), strict=True))
    for i, t in enumerate(tensors):
        assert back[i].dtype == t.dtype and torch.equal(back[i], t), i
    with pytest.raises(ValueError, match="elements"):
        unflatten(torch.zeros(5), [[2], [2]])


def test_disk_sync_writes_server_names_bit_exact_and_updates(
    tmp_path: Path, thinker_state, expected
) -> None:
    with FakeOmniServer() as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="disk", sync_dir=tmp_path / "sync")
        sync = make_weight_sync(cfg, run_dir=tmp_path)
        assert isinstance(sync, WeightSync)
        try:
            report = sync.push(thinker_state, "step-1", layout="hf_memory")
            wdir = tmp_path / "sync" / "step-1"
            _assert_bit_exact(read_hub_tensors(wdir), expected)
            index = json.loads((wdir / INDEX_NAME).read_text())
            assert sorted(index["weight_map"]) == sorted(expected)
            manifest = json.loads((wdir / MANIFEST_NAME).read_text())
            assert manifest["weight_version"] == "step-1"
            assert report.tensors == len(expected) and report.skipped_tower_tensors > 0
            assert report.bytes == sum(t.numel() * t.element_size() for t in expected.values())
            assert server.weight_version == "step-1" and not server.engine_paused
            log = server.admin_log
            routes = [r for r, _ in log]
            assert routes[-4:] == [
                "/pause_generation",
                "/update_weights_from_disk",
                "/continue_generation",
                "/model_info",
            ]
            pause, update = log[-4][1], log[-3][1]
            assert pause["mode"] == "retract" and pause["stages"] == ["thinker"]
            assert update["model_path"] == str(wdir) and update["weight_version"] == "step-1"
            assert update["stages"] == ["thinker"] and update["flush_cache"] is True
            assert not list((tmp_path / "sync").glob(".tmp-*"))
            # the next version replaces the previous directory (servers hold weights in memory)
            sync.push(thinker_state, "step-2")
            assert server.weight_version == "step-2"
            assert not wdir.exists() and (tmp_path / "sync" / "step-2").is_dir()
        finally:
            sync.close()


def test_disk_sync_vl_hub_layout_from_extracted_files(
    tmp_path: Path, tiny_omni_dir: Path, expected
) -> None:
    from omni_extract import extract

    vl = tmp_path / "vl"
    extract(tiny_omni_dir, vl, "vl")
    vl_tensors = read_hub_tensors(vl)
    assert (
        vl_tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape
        == expected["thinker.model.layers.0.mlp.experts.gate_up_proj"].shape
    )
    with FakeOmniServer() as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="disk")
        sync = make_weight_sync(cfg, run_dir=tmp_path / "run")
        try:
            sync.push(iter(vl_tensors.items()), "v1", layout="vl_hub")
            _assert_bit_exact(read_hub_tensors(tmp_path / "run" / "weight_sync" / "v1"), expected)
            assert server.weight_version == "v1"
        finally:
            sync.close()


def test_wrong_layout_flag_is_not_silently_accepted(
    tmp_path: Path, thinker_state, expected
) -> None:
    """Declaring in-memory tensors as ``vl_hub`` would send [E,2I,H]; the shapes then differ."""
    with FakeOmniServer() as server:
        sync = make_weight_sync(
            SglangOmniConfig(urls=[server.url], sync_mode="disk"), run_dir=tmp_path
        )
        try:
            sync.push(thinker_state, "bad", layout="vl_hub")
        finally:
            sync.close()
    got = read_hub_tensors(tmp_path / "weight_sync" / "bad")
    name = "thinker.model.layers.0.mlp.experts.gate_up_proj"
    assert got[name].shape != expected[name].shape


def test_unmapped_name_fails_before_anything_is_sent(tmp_path: Path, thinker_state) -> None:
    bad = dict(thinker_state)
    bad["model.language_model.layers.0.mlp.experts.gate_up"] = torch.zeros(2)
    with FakeOmniServer() as server:
        for mode in ("disk", "distributed"):
            sync = make_weight_sync(
                SglangOmniConfig(urls=[server.url], sync_mode=mode), run_dir=tmp_path
            )
            try:
                with pytest.raises(UnmappedTensorError, match="experts.gate_up"):
                    sync.push(bad, "v1")
                # an iterator (e.g. a Megatron export) is checked before its bucket is sent
                with pytest.raises(UnmappedTensorError, match="body.model"):
                    sync.push(iter([("body.model.layers.0.mlp.gate.weight", torch.zeros(2))]), "v1")
            finally:
                sync.close()
        assert server.admin_log == []
        assert server.weight_version == "default"
    assert not (tmp_path / "weight_sync" / "v1").exists()


def test_only_towers_is_an_error_not_an_empty_update(tmp_path: Path, thinker_state) -> None:
    towers = {
        k: v
        for k, v in thinker_state.items()
        if k.startswith(("model.visual.", "model.audio_tower."))
    }
    with FakeOmniServer() as server:
        sync = make_weight_sync(
            SglangOmniConfig(urls=[server.url], sync_mode="disk"), run_dir=tmp_path
        )
        try:
            with pytest.raises(WeightSyncError, match="zero server tensors"):
                sync.push(towers, "v1")
        finally:
            sync.close()
        assert server.admin_log == []


def test_update_with_active_requests_pauses_first(tmp_path: Path, thinker_state) -> None:
    """A generation in flight: a bare update is refused (the contract), our sync pauses first."""

    def long_generation(req: FakeRequest) -> FakeGeneration:
        return FakeGeneration(
            token_ids=[7] * req.max_new_tokens, logprobs=[-0.5] * req.max_new_tokens
        )

    with FakeOmniServer(token_delay_s=0.05, generator=long_generation) as server:
        loop = BackgroundLoop()
        client = OmniRolloutClient(server.url)
        try:
            inflight = loop.submit(
                client.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 40, "seed": 3})
            )
            while server.active_count() == 0:
                threading.Event().wait(0.01)
            with pytest.raises(ActiveRequestsError):  # the negative control: no pause -> refused
                loop.run(client.update_weights_from_disk(str(tmp_path), weight_version="x"))
            sync = make_weight_sync(
                SglangOmniConfig(urls=[server.url], sync_mode="disk"), run_dir=tmp_path, loop=loop
            )
            sync.push(thinker_state, "v2")
            assert server.weight_version == "v2" and not server.engine_paused
            result = inflight.result(30)  # the retracted request finishes, with the new weights
            assert result.weight_version == "v2"
            routes = _routes(server)
            i = routes.index("/update_weights_from_disk", routes.index("/pause_generation"))
            assert server.admin_log[i - 1][1]["mode"] == "retract"
        finally:
            loop.run(client.aclose())
            loop.close()


def test_failed_disk_update_sends_continue_and_raises(tmp_path: Path, thinker_state) -> None:
    with FakeOmniServer() as server:
        sync = make_weight_sync(
            SglangOmniConfig(urls=[server.url], sync_mode="disk"), run_dir=tmp_path
        )
        server.faults.fail_next(1, status=400, route="/update_weights_from_disk")
        try:
            with pytest.raises(WeightSyncError, match="update_weights_from_disk"):
                sync.push(thinker_state, "v3")
        finally:
            sync.close()
        assert _routes(server)[-1] == "/continue_generation"
        assert not server.engine_paused and server.weight_version == "default"


def test_skip_sync_logs_once_and_sends_nothing(
    caplog: pytest.LogCaptureFixture, thinker_state
) -> None:
    sync = make_weight_sync(SglangOmniConfig(sync_mode="skip"), run_dir=Path("."))
    assert isinstance(sync, SkipWeightSync)
    with caplog.at_level("WARNING"):
        sync.push(thinker_state, "1")
        sync.push(thinker_state, "2")
    assert sum("weight sync is 'skip'" in r.message for r in caplog.records) == 1


def test_pause_refused_by_one_server_resumes_the_others(tmp_path: Path, thinker_state) -> None:
    with FakeOmniServer() as a, FakeOmniServer() as b:
        cfg = SglangOmniConfig(urls=[a.url, b.url], sync_mode="disk")
        sync = make_weight_sync(cfg, run_dir=tmp_path)
        b.faults.fail_next(1, status=400, route="/pause_generation")
        try:
            with pytest.raises(WeightSyncError):
                sync.push(thinker_state, "p1")
        finally:
            sync.close()
        for server in (a, b):
            assert _routes(server)[-1] == "/continue_generation"
            assert "/update_weights_from_disk" not in _routes(server)
            assert not server.engine_paused and server.weight_version == "default"


def test_prefetch_keeps_order_and_reraises_source_errors() -> None:
    from omni_grpo.aio import Prefetch

    with Prefetch(iter(range(5)), depth=2) as it:
        assert list(it) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise UnmappedTensorError("bad name 'x'")

    with Prefetch(failing()) as it, pytest.raises(UnmappedTensorError, match="bad name"):
        list(it)
    with Prefetch(iter(range(10**6))) as it:  # leaving early stops the producer
        assert next(it) == 0


def test_close_releases_what_the_sync_owns(tmp_path: Path) -> None:
    """Clients are always the sync's; the loop only when ``make_weight_sync`` started it."""
    import asyncio

    with FakeOmniServer() as server:
        cfg = SglangOmniConfig(urls=[server.url], sync_mode="disk", sync_dir=tmp_path / "s")
        own = make_weight_sync(cfg, run_dir=tmp_path)
        own.close()
        own.close()  # idempotent
        assert own.loop.loop.is_closed()
        assert all(c.is_closed for c in own.clients)
        shared = BackgroundLoop()
        try:
            sync = make_weight_sync(cfg, run_dir=tmp_path, loop=shared)
            sync.close()
            assert all(c.is_closed for c in sync.clients)
            assert shared.run(asyncio.sleep(0, result=1), 5) == 1  # the caller's loop lives on
        finally:
            shared.close()
