"""``omni-grpo export``: a run's checkpoint back into the full Qwen3-Omni layout (and pseudo-VL).

The reference is transformers itself: the exported directory must load with
``Qwen3OmniMoeForConditionalGeneration.from_pretrained`` with no missing or unexpected keys, and
its thinker must give the trained model's logits (the run's thinker with the checkpoint loaded)
on batches mixing audio, image, video and text. Everything the trainer does not touch must be the
base's bytes. Megatron checkpoints are built from the HF<->Megatron mapping table (megatron-core
needs Python 3.12 and cannot run here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from omni_extract.tiny import TinyOmniSpec, make_tiny_omni
from omni_grpo.cli import main
from omni_grpo.export import export_run
from omni_grpo.testing.export import make_trained_run, megatron_state, trained_thinker
from omni_grpo.testing.models import Ids, build_batch
from safetensors import safe_open
from safetensors.torch import save_file

TOL = 1e-5
TXT = [5, 6, 7]
SAMPLES = [  # audio, image, video and text inside one sample, and a text + audio one
    [("text", TXT), ("image", (1, 4, 4)), ("audio", 300), ("video", (2, 4, 4), 1.0), ("text", TXT)],
    [("text", TXT[:1]), ("audio", 150), ("text", TXT)],
    [
        ("text", TXT),
        ("video", (3, 4, 4), 0.75),
        ("audio", 101),
        ("image", (1, 4, 8)),
        ("text", [9]),
    ],
]


def _raw(directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors directory as (dtype, shape, raw bytes)."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                t = f.get_tensor(k)
                out[k] = (
                    str(t.dtype),
                    list(t.shape),
                    t.contiguous().view(torch.uint8).numpy().tobytes(),
                )
    return out


def _ids(vl_dir: Path) -> Ids:
    side = json.loads((vl_dir / "config.json").read_text())["omni_sideband"]
    gen = json.loads((vl_dir / "generation_config.json").read_text())
    return Ids.from_sideband(side, pad=gen["pad_token_id"])


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> Path:
    """A tiny Omni checkpoint WITH talker and code2wav, in three shards."""
    return make_tiny_omni(tmp_path_factory.mktemp("base") / "omni", TinyOmniSpec(num_shards=3))


@pytest.fixture(scope="module")
def run(omni, tmp_path_factory):
    """A torch-backend run whose checkpoint trained the language model, lm_head and vision tower."""
    return make_trained_run(
        tmp_path_factory.mktemp("run") / "run", omni, overrides=["model.freeze_visual=false"]
    )


def _check_against_trained(out: Path, run, omni: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    reference = model.thinker.eval()
    ours = trained_thinker(run)
    for side in ("left", "right"):
        batch = build_batch(SAMPLES, _ids(run.vl_dir), side, seed=7)
        with torch.no_grad():
            want = ours(**batch).logits
            got = reference(**batch).logits
        valid = batch["attention_mask"].bool()
        assert (want - got)[valid].abs().max().item() <= TOL
    base, exported = _raw(omni), _raw(out)
    assert base.keys() == exported.keys()
    frozen = [k for k in base if k.startswith(("talker.", "code2wav.", "thinker.audio_tower."))]
    assert frozen and all(base[k] == exported[k] for k in frozen)


def test_torch_checkpoint_exports_to_omni(run, omni, tmp_path):
    result, ckpt = export_run(run.run_dir, tmp_path / "out")
    assert ckpt.step == 3 and result.num_tensors == len(_raw(omni))
    _check_against_trained(tmp_path / "out", run, omni)
    base, exported = _raw(omni), _raw(tmp_path / "out")
    changed = {k for k in base if base[k] != exported[k]}
    assert any(k.startswith("thinker.visual.merger_list.") for k in changed)  # visual was trained
    assert all(
        k.startswith(("thinker.model.", "thinker.lm_head.", "thinker.visual.")) for k in changed
    )
    # laid out like the base: same shard files, same tensor -> file map, same side files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert (
        index["weight_map"]
        == json.loads((omni / "model.safetensors.index.json").read_text())["weight_map"]
    )
    for name in (
        "config.json",
        "tokenizer.json",
        "chat_template.json",
        "generation_config.json",
        "preprocessor_config.json",
    ):
        assert (tmp_path / "out" / name).read_bytes() == (omni / name).read_bytes()
    assert json.loads((tmp_path / "out" / "omni_export.json").read_text())["step"] == 3


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_megatron_checkpoint_exports_like_torch(run, omni, tmp_path, grouped):
    """A Megatron checkpoint of the same language model exports to the same bytes (+ frozen visual)."""
    text = json.loads((omni / "config.json").read_text())["thinker_config"]["text_config"]
    lm = {k: v for k, v in run.weights.items() if not k.startswith("model.visual.")}
    mega_run = make_trained_run(tmp_path / "mrun", omni, scale=0.0)  # config + model dirs
    ckpt = mega_run.checkpoint
    (ckpt / "model.safetensors").unlink()
    save_file(megatron_state(lm, text, grouped=grouped), str(ckpt / "model.safetensors"))
    export_run(mega_run.run_dir, tmp_path / "mega")
    export_run(run.run_dir, tmp_path / "torch")
    mega, torch_out, base = _raw(tmp_path / "mega"), _raw(tmp_path / "torch"), _raw(omni)
    for k in base:
        want = base[k] if k.startswith("thinker.visual.") else torch_out[k]
        assert mega[k] == want, k
    # the pseudo-VL format from the same Megatron checkpoint: the torch run's language model
    export_run(mega_run.run_dir, tmp_path / "mega-vl", fmt="vl")
    export_run(run.run_dir, tmp_path / "torch-vl", fmt="vl")
    mega_vl, torch_vl = _raw(tmp_path / "mega-vl"), _raw(tmp_path / "torch-vl")
    assert mega_vl.keys() == torch_vl.keys()
    lm_names = [k for k in torch_vl if not k.startswith("model.visual.")]
    assert lm_names and all(mega_vl[k] == torch_vl[k] for k in lm_names)
    if grouped:  # and the logits, through transformers
        mega_run.weights = lm
        _check_against_trained(tmp_path / "mega", mega_run, omni)


def test_untrained_run_reproduces_the_base(omni, tmp_path):
    run = make_trained_run(tmp_path / "run", omni, scale=0.0)  # checkpoint of the initial weights
    export_run(run.run_dir, tmp_path / "out")
    assert _raw(tmp_path / "out") == _raw(omni)
    # a run with no checkpoint at all: the untrained policy is the base
    import shutil

    shutil.rmtree(run.run_dir / "checkpoints")
    result, ckpt = export_run(run.run_dir, tmp_path / "out0")
    assert ckpt.path is None and result.num_replaced == 0
    assert _raw(tmp_path / "out0") == _raw(omni)


def test_vl_format_loads_as_qwen3_vl_and_matches(run, tmp_path):
    from omni_grpo.models import load_thinker
    from transformers import Qwen3VLMoeForConditionalGeneration

    export_run(run.run_dir, tmp_path / "vl", fmt="vl")
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tmp_path / "vl", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    state = model.state_dict()
    for name, value in run.weights.items():
        assert torch.equal(state[name], value), name
    ours = trained_thinker(run)
    exported = load_thinker(tmp_path / "vl", audio_dir=run.audio_dir, dtype="float32")
    batch = build_batch(SAMPLES, _ids(run.vl_dir), "left", seed=8)
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, exported(**batch).logits)


def test_dtype_and_shard_size(run, tmp_path):
    result, _ = export_run(run.run_dir, tmp_path / "bf16", dtype="bf16", shard_size=200_000)
    out = _raw(tmp_path / "bf16")
    assert {v[0] for v in out.values()} == {"torch.bfloat16"} and len(result.shards) > 3
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"  # the config says what the files hold
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)


def test_exported_dir_passes_the_fake_servers_name_check(run, tmp_path):
    """A disk weight update from the exported directory: every thinker name loads, none dropped."""
    from omni_rollout_client.testing import FakeOmniServer
    from omni_rollout_client.testing.loader_names import check_disk_checkpoint

    export_run(run.run_dir, tmp_path / "out")
    report = check_disk_checkpoint(tmp_path / "out")
    assert report.dropped == [] and report.missing == [] and report.loaded
    with FakeOmniServer.from_checkpoint(run.omni) as server:
        import httpx

        r = httpx.post(
            f"{server.url}/update_weights_from_disk",
            json={"model_path": str(tmp_path / "out"), "weight_version": "exported"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        assert server.weight_version == "exported"


# ----------------------------------------------------------------------------- refusals (CLI)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["export", *args])
    return result.exit_code, result.output


def _one_line_error(code: int, output: str, *needles: str) -> None:
    assert code == 1, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    for needle in needles:
        assert needle in output, output


def test_cli_exports_and_refuses_an_existing_destination(run, tmp_path):
    out = tmp_path / "out"
    code, output = _cli(str(run.run_dir), "--dst", str(out), "--quiet")
    assert code == 0, output
    assert json.loads(output.strip().splitlines()[-1])["step"] == 3
    _one_line_error(*_cli(str(run.run_dir), "--dst", str(out), "--quiet"), str(out), "--overwrite")
    code, output = _cli(str(run.run_dir), "--dst", str(out), "--quiet", "--overwrite")
    assert code == 0, output
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    _one_line_error(
        *_cli(str(run.run_dir), "--dst", str(mine), "--quiet", "--overwrite"),
        str(mine),
        "omni_export.json",
    )
    assert (mine / "notes.txt").read_text() == "keep me"


def test_cli_refuses_a_base_that_does_not_match(run, tmp_path):
    other = make_tiny_omni(
        tmp_path / "other", TinyOmniSpec(text={"moe_intermediate_size": 8}, with_talker=False)
    )
    _one_line_error(
        *_cli(str(run.run_dir), "--dst", str(tmp_path / "out"), "--base", str(other), "--quiet"),
        "mlp.experts",
        "shape",
    )
    assert not (tmp_path / "out").exists()


def test_cli_refuses_incomplete_checkpoints(run, tmp_path):
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(run.run_dir, broken)
    ckpt = broken / "checkpoints" / "step_000003"
    _one_line_error(
        *_cli(str(broken), "--dst", str(tmp_path / "o"), "--step", "7", "--quiet"), "step 7"
    )
    # a language-model tensor missing from the trained weights
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    weights.pop("model.language_model.layers.1.self_attn.q_proj.weight")
    save_file(weights, str(ckpt / "model.safetensors"))
    _one_line_error(
        *_cli(str(broken), "--dst", str(tmp_path / "o"), "--quiet"),
        "incomplete",
        "layers.1.self_attn.q_proj.weight",
    )
    # a truncated weight file
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(*_cli(str(broken), "--dst", str(tmp_path / "o"), "--quiet"), "truncated")
    # no state.json: not a complete checkpoint
    (ckpt / "state.json").unlink()
    _one_line_error(
        *_cli(str(broken), "--dst", str(tmp_path / "o"), "--quiet"), "incomplete", "state.json"
    )
    assert not (tmp_path / "o").exists()


def test_checkpoint_split_over_several_files_reads_as_one(run, tmp_path):
    """Per-rank shard files of the multi-process path: read as one list, shard by shard."""
    import shutil

    from safetensors.torch import load_file

    split = tmp_path / "run"
    shutil.copytree(run.run_dir, split)
    ckpt = split / "checkpoints" / "step_000003"
    weights = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(weights)
    save_file({k: weights[k] for k in names[::2]}, str(ckpt / "model-rank00000.safetensors"))
    save_file({k: weights[k] for k in names[1::2]}, str(ckpt / "model-rank00001.safetensors"))
    export_run(split, tmp_path / "split")
    export_run(run.run_dir, tmp_path / "single")
    assert _raw(tmp_path / "split") == _raw(tmp_path / "single")
    # the same tensor in two rank files is refused, naming it (never pick one silently)
    save_file({names[0]: weights[names[0]]}, str(ckpt / "model-rank00002.safetensors"))
    _one_line_error(*_cli(str(split), "--dst", str(tmp_path / "dup"), "--quiet"), names[0])


def test_checkpoint_directory_given_directly(run, tmp_path):
    ckpt = run.run_dir / "checkpoints" / "step_000003"
    code, output = _cli(str(ckpt), "--dst", str(tmp_path / "a"), "--quiet")
    assert code == 0 and json.loads(output.strip().splitlines()[-1])["step"] == 3, output
    _one_line_error(
        *_cli(str(ckpt), "--dst", str(tmp_path / "b"), "--step", "2", "--quiet"), "--step 2"
    )


def test_sharded_megatron_checkpoints_are_refused_naming_the_tensor(run, omni, tmp_path):
    """An expert-parallel shard (experts missing) or a tensor-parallel slice (wrong shape)."""
    text = json.loads((omni / "config.json").read_text())["thinker_config"]["text_config"]
    lm = {k: v for k, v in run.weights.items() if not k.startswith("model.visual.")}
    mega_run = make_trained_run(tmp_path / "mrun", omni, scale=0.0)
    target = mega_run.checkpoint / "model.safetensors"
    sequential = megatron_state(lm, text, grouped=False)
    ep_shard = {k: v for k, v in sequential.items() if ".local_experts.3." not in k}
    save_file(ep_shard, str(target))
    _one_line_error(
        *_cli(str(mega_run.run_dir), "--dst", str(tmp_path / "o"), "--quiet"), "lacks experts [3]"
    )
    grouped = megatron_state(lm, text, grouped=True)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    grouped[name] = grouped[name].chunk(2, dim=1)[0].contiguous()  # a TP=2 slice
    save_file(grouped, str(target))
    _one_line_error(
        *_cli(str(mega_run.run_dir), "--dst", str(tmp_path / "o"), "--quiet"), "o_proj", "shape"
    )
    assert not (tmp_path / "o").exists()


def test_missing_base_names_the_stored_config(run, tmp_path):
    import shutil

    moved = tmp_path / "run"
    shutil.copytree(run.run_dir, moved)
    cfg = (moved / "config.yaml").read_text().replace(str(run.omni), str(tmp_path / "gone"))
    (moved / "config.yaml").write_text(cfg)
    _one_line_error(
        *_cli(str(moved), "--dst", str(tmp_path / "o"), "--quiet"), "config.yaml", "--base"
    )


def test_cli_refuses_a_destination_over_its_inputs(run, omni, tmp_path):
    """Issue 30: ``--dst`` may not be, contain or lie inside the run directory or the base."""
    before = sorted(p.relative_to(run.run_dir) for p in run.run_dir.rglob("*"))
    for dst, needle in (
        (run.run_dir, "is the run directory"),
        (run.run_dir / "exported", "is inside the run directory"),
        (run.run_dir / "checkpoints" / "out", "is inside the run directory"),
        (run.run_dir.parent, "contains the run directory"),
        (omni / "exported", "is inside the base"),
    ):
        _one_line_error(*_cli(str(run.run_dir), "--dst", str(dst), "--quiet"), str(dst), needle)
    assert sorted(p.relative_to(run.run_dir) for p in run.run_dir.rglob("*")) == before
    assert not (omni / "exported").exists()
