"""Which TP sizes can shard the thinker: sglang-omni 0.1.9's and the Megatron backend's rules,
``--plan`` refusing a layout that cannot start (naming the field and the sizes that fit), and the
launcher passing the thinker's TP to the server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from omni_grpo.cli import main
from omni_grpo.config import MegatronConfig, SglangLaunchConfig, load_config
from omni_grpo.layout import (
    RELEASED_30B_A3B,
    LayoutError,
    check_layout,
    find_shapes,
    megatron_tp_problems,
    sglang_tp_problems,
    shapes_from_config,
)
from omni_grpo.ray.placement import plan_run
from omni_grpo.serve import LaunchedServer, launch_args, launched_thinker_tp, thinker_tp_args

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "qwen3-omni-30b-avqa.yaml"


def test_sglang_rules_for_the_released_thinker() -> None:
    """32 heads, 4 KV heads (replicated above TP 4), expert width 768, 128 experts."""
    fits = [tp for tp in range(1, 17) if not sglang_tp_problems(RELEASED_30B_A3B, tp)]
    assert fits == [1, 2, 4, 8, 16]
    assert any("KV heads" in p for p in sglang_tp_problems(RELEASED_30B_A3B, 6))
    assert sglang_tp_problems(RELEASED_30B_A3B, 8) == []  # the example's server


def test_megatron_rules_for_the_released_thinker() -> None:
    fits = [tp for tp in range(1, 9) if not megatron_tp_problems(RELEASED_30B_A3B, tp)]
    assert fits == [1, 2, 4]  # tp 8: 4 KV groups are not split 8 ways by our loader
    assert megatron_tp_problems(RELEASED_30B_A3B, 8) == [
        "num_key_value_heads 4 is not divisible by 8"
    ]


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("ep", [1, 4, 8, 16])
def test_megatron_rules_agree_with_the_backends_own_check(tp: int, ep: int) -> None:
    """The plan refuses exactly what building the Megatron model would refuse (config_map)."""
    from omni_grpo.backends.megatron.config_map import MegatronConfigError, megatron_model_args

    s = RELEASED_30B_A3B
    text = {
        "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": 128,
        "moe_intermediate_size": s.moe_intermediate_size, "num_experts": s.num_experts,
        "num_experts_per_tok": 8, "vocab_size": s.vocab_size,
        "rope_parameters": {"rope_theta": 1e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    }  # fmt: skip
    try:
        megatron_model_args({"text_config": text}, MegatronConfig(tp=tp, ep=ep, sp=True))
        built = True
    except MegatronConfigError:
        built = False
    planned = not megatron_tp_problems(s, tp) and s.num_experts % ep == 0
    assert planned == built


def test_shapes_from_a_hub_config_and_an_extracted_one() -> None:
    hub = {
        "thinker_config": {
            "text_config": {"num_attention_heads": 16, "num_key_value_heads": 2,
                            "moe_intermediate_size": 96, "num_experts": 8, "vocab_size": 1024},
            "vision_config": {"num_heads": 4},
            "audio_config": {"encoder_attention_heads": 5},
        }
    }  # fmt: skip
    s = shapes_from_config(hub, "hub")
    assert (s.num_attention_heads, s.num_key_value_heads, s.vision_heads, s.audio_heads) == (
        16, 2, 4, 5,
    )  # fmt: skip
    vl = {"text_config": hub["thinker_config"]["text_config"], "vision_config": {"num_heads": 4}}
    assert shapes_from_config(vl, "vl").audio_heads is None
    with pytest.raises(LayoutError, match="has no num_key_value_heads, moe_intermediate_size"):
        shapes_from_config({"text_config": {"num_attention_heads": 2}}, "broken")


def _hub_checkpoint(root: Path, heads: int, kv: int) -> Path:
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps(
            {"thinker_config": {"text_config": {
                "num_attention_heads": heads, "num_key_value_heads": kv,
                "moe_intermediate_size": 768, "num_experts": 128, "vocab_size": 152064}}}
        )
    )  # fmt: skip
    return ckpt


def test_the_model_config_beats_the_released_shapes(tmp_path: Path) -> None:
    """A checkpoint readable at plan time is what is checked (here: 8 KV heads, so Megatron
    tp 8 fits, which the released thinker's 4 would refuse)."""
    ckpt = _hub_checkpoint(tmp_path, heads=32, kv=8)
    sets = [
        f"model.omni_checkpoint={ckpt}",
        "model.extracted_dir=null",
        "trainer.megatron.tp=8",
        "trainer.world_size=16",
    ]
    cfg = load_config(EXAMPLE, sets)
    assert find_shapes(cfg).source == str(ckpt / "config.json")
    notes = check_layout(cfg, plan_run(cfg))
    assert "megatron tp 8: 4 attention heads and 1 KV heads per rank" in "\n".join(notes)
    cfg = load_config(
        EXAMPLE,
        [s for s in sets if "omni_checkpoint" not in s] + ["model.omni_checkpoint=/nowhere"],
    )
    with pytest.raises(LayoutError, match=r"trainer.megatron.tp=8 .*released Qwen3-Omni-30B-A3B"):
        check_layout(cfg, plan_run(cfg))


def test_the_example_plans_and_says_why_it_starts() -> None:
    res = CliRunner().invoke(main, ["train", "--config", str(EXAMPLE), "--plan", "--gpus", "16"])
    assert res.exit_code == 0, res.output
    assert (
        "sglang-omni thinker TP 8: 4 attention heads, each of 4 KV heads on 2 ranks" in res.output
    )
    assert "towers (vision 16 and audio 20 heads) unsharded on the server's first GPU" in res.output
    assert "megatron tp 2: 16 attention heads and 2 KV heads per rank" in res.output


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.megatron.tp=8", "trainer.world_size=16"],
            r"^Error: trainer\.megatron\.tp=8 cannot shard this thinker \(num_key_value_heads 4 .*"
            r"tp that fit: 1, 2, 4 \(e\.g\. --set trainer\.megatron\.tp=4\)$",
        ),
        (
            ["rollout.sglang.launch.gpus_per_server=6"],
            r"^Error: rollout\.sglang\.launch\.gpus_per_server=6 runs the sglang-omni 0\.1\.9 thinker "
            r"at TP 6.*GPUs per server that fit: 1, 2, 4, 8 \(e\.g\. --set "
            r"rollout\.sglang\.launch\.gpus_per_server=8\)$",
        ),
        (
            ["rollout.sglang.launch.extra_args=[--thinker.tp_size, '3']"],
            r"^Error: rollout\.sglang\.launch\.gpus_per_server=8 runs .* at TP 3",
        ),
        (
            ["trainer.megatron.ep=3", "trainer.world_size=6", "trainer.megatron.tp=1"],
            r"^Error: trainer\.megatron\.ep=3 cannot shard this thinker's experts.*fit "
            r"trainer\.world_size 6: 1, 2$",
        ),
    ],
)
def test_plan_refuses_a_layout_that_cannot_start(overrides: list[str], message: str) -> None:
    args = ["train", "--config", str(EXAMPLE), "--plan"]
    for o in overrides:
        args += ["--set", o]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and re.search(message, error[0]), res.output
    assert "Traceback" not in res.output


def test_train_refuses_it_before_preparing_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        ["train", "--config", str(EXAMPLE), "--set", f"run.dir={run_dir}",
         "--set", "trainer.megatron.tp=8", "--set", "trainer.world_size=16"],
    )  # fmt: skip
    assert res.exit_code == 2 and "trainer.megatron.tp=8 cannot shard" in res.output
    assert not run_dir.exists()


def test_a_make_tiny_model_is_not_checked_before_it_exists(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [f"run.dir={tmp_path}", "model.make_tiny={}", "trainer.backend=megatron",
         "trainer.megatron.sp=true", "trainer.megatron.tp=2", "model.freeze_visual=true",
         "rollout.embedded.actors=1",
         "model.dtype=bfloat16", "trainer.micro_batch_size=1"],
    )  # fmt: skip
    assert check_layout(cfg, plan_run(cfg)) == [
        "layout: the model's shapes are not known before make_tiny runs; not checked"
    ]


# ------------------------------------------------------------------------------ the launcher
def test_launched_server_gets_the_thinker_tp_flags() -> None:
    launch = SglangLaunchConfig(gpus_per_server=8, extra_args=["--mem-fraction-static", "0.8"])
    assert launched_thinker_tp(launch) == 8
    assert launch_args(launch) == [
        "--thinker.tp_size", "8", "--thinker.gpu", "[0,1,2,3,4,5,6,7]",
        "--thinker.process", "thinker", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert launch_args(SglangLaunchConfig(gpus_per_server=1)) == []
    own = SglangLaunchConfig(gpus_per_server=8, extra_args=["--thinker.tp_size=4"])
    assert launched_thinker_tp(own) == 4 and launch_args(own) == ["--thinker.tp_size=4"]
    assert thinker_tp_args("fake", 2) == ["--tp-size", "2"]


def test_plan_rank_offsets_follow_the_launched_tp() -> None:
    cfg = load_config(EXAMPLE, ["rollout.sglang.launch.extra_args=[--thinker.tp_size, '4']"])
    (server,) = plan_run(cfg).servers
    assert (server.thinker_tp, server.gpus) == (4, 8)


def test_serve_without_sglang_omni_is_one_line(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_omni") is not None:
        pytest.skip("sglang-omni is installed here (the server extra)")
    res = CliRunner().invoke(main, ["serve", "--model-path", str(tmp_path), "--tp", "2"])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "an sglang-omni rollout server needs sglang-omni" in res.output
    assert "--extra server" in res.output
    server = LaunchedServer("sglang-omni", tmp_path, tmp_path / "s.log")
    assert "--thinker.tp_size" not in server.argv  # TP flags come from the callers
