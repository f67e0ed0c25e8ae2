"""Vision-language prompts: images in the data (verl parquet, jsonl paths, the colour_digit toy) checked at load with
one-line errors naming row and field, a tiny Qwen2-VL built offline, and the HF engine generating from image + text
with log-probs that its scoring forward and the trainer's forward give again."""

import dataclasses
import io
import json

import pytest
import torch
from PIL import Image

from hpc_rl.config import TinyModelConfig, load_dict
from hpc_rl.data.datasets import PromptDataset, load_rows
from hpc_rl.data.toy import COLOURS, colour_digit_corpus, colour_image
from hpc_rl.errors import DataError
from hpc_rl.models import load_tokenizer
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.models.vision import IMAGE_PAD, VisionSpec, is_vision_model
from hpc_rl.rollout.server.engine_hf import HFEngine
from hpc_rl.rollout.wire.sampling import SamplingParams

TINY_VL = TinyModelConfig(arch="qwen2_vl", hidden_size=64, num_heads=2, num_kv_heads=2, head_dim=32,
                          intermediate_size=128, vision_layers=1, vision_width=32)


def png(w=56, h=56, colour=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_model(TINY_VL, colour_digit_corpus(), tmp_path_factory.mktemp("vlm") / "tiny-vl")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def engine(request, tmp_path_factory):
    """The HF engine on a tiny model of each architecture (Qwen2.5-VL: windowed attention in its tower)."""
    tiny = dataclasses.replace(TINY_VL, arch=request.param, vision_layers=2)
    folder = build_tiny_model(tiny, colour_digit_corpus(), tmp_path_factory.mktemp("vlm") / request.param)
    return HFEngine(load_dict({"model": {"path": str(folder)}, "rollout": {"engine": "hf"}}), "cpu")


def data_cfg(source, **kw):
    return load_dict({"data": {"source": str(source), **kw}, "model": {"path": "x"}}).data


# ---------------------------------------------------------------- data


def test_verl_parquet_with_image_bytes_and_jsonl_with_relative_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "<image> what colour ?"}], "images": [{"bytes": png(), "path": None}],
             "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (r,) = load_rows(data_cfg(tmp_path / "train.parquet"), 0)
    assert r["images"] == [png()] and r["ground_truth"] == "2"
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(colour=(1, 2, 3)))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "<image> colour :", "images": ["img/a.png"]}) + "\n")
    (r,) = load_rows(data_cfg(tmp_path / "p.jsonl"), 0)
    assert r["images"] == [png(colour=(1, 2, 3))]


@pytest.mark.parametrize("row, expect", [
    ({"prompt": "<image> x", "images": ["nope.png"]}, "row 0 field 'images'[0]: image file"),
    ({"prompt": "<image> x", "images": [{"bytes": None, "path": None}]}, "row 0 field 'images'[0]: an image mapping"),
    ({"prompt": "<image> <image> x", "images": ["ok.png"]}, "row 0 has 1 image(s) in 'images' but 2 <image>"),
    ({"prompt": "x", "images": ["ok.png"]}, "row 0 has 1 image(s) in 'images' but 0 <image>"),
    ({"prompt": "<image> x", "images": [3]}, "row 0 field 'images'[0]: an image is int"),
])
def test_bad_images_are_one_line_errors_naming_row_and_field(tmp_path, row, expect):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        load_rows(data_cfg(tmp_path / "p.jsonl"), 0)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_undecodable_bytes_and_too_many_pixels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>", "images": [b"not an image"]}]), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"row 0 field 'images'\[0\]: cannot decode the image"):
        load_rows(data_cfg(tmp_path / "a.parquet"), 0)
    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>", "images": [png(200, 100)]}]), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"200x100 = 20000 pixels, more than data.max_image_pixels=10000"):
        load_rows(data_cfg(tmp_path / "b.parquet", max_image_pixels=10000), 0)


def test_a_text_model_refuses_rows_with_images(tmp_path):
    from hpc_rl.models.tiny import build_tiny_model as build

    text = build(TinyModelConfig(), colour_digit_corpus(), tmp_path / "text")
    with pytest.raises(DataError, match="its rows hold images .* but the policy is a text model"):
        PromptDataset(data_cfg("toy:colour_digit", toy_size=4), load_tokenizer(text), 0)


@pytest.mark.parametrize("override, expect", [
    ("model.processor.min_pixels=100", "model.processor.min_pixels must be >= 784"),
    ("model.processor.max_pixels=1000", "model.processor.min_pixels must not exceed model.processor.max_pixels"),
    ("data.max_image_pixels=0", "data.max_image_pixels must be >= 1"),
])
def test_bad_vision_keys_are_named(override, expect):
    from hpc_rl.config import ConfigError, apply_overrides

    data = apply_overrides({"model": {"path": "x", "processor": {"min_pixels": 3136}}}, [override])
    with pytest.raises(ConfigError, match=expect):
        load_dict(data)


@pytest.mark.parametrize("override, key", [
    ("rollout.engine=vllm", "rollout.engine"), ("algorithm.name=ppo", "algorithm.name"), ("reward.model={path: rm}", "reward.model"),
])
def test_what_a_vision_policy_does_not_run_with_yet_is_refused_naming_the_key(vlm_dir, override, key):
    from hpc_rl.config import apply_overrides
    from hpc_rl.errors import ConfigError
    from hpc_rl.models.vision import check_vision_job

    cfg = load_dict(apply_overrides({"model": {"path": str(vlm_dir)}}, [override]))
    with pytest.raises(ConfigError, match=f"^{key}: a vision-language policy"):
        check_vision_job(cfg)


def test_lora_adapts_the_language_tower_only_unless_the_vision_tower_trains(vlm_dir):
    from hpc_rl.errors import ConfigError
    from hpc_rl.models.lora import check_targets, meta_model, policy_skip, resolve_targets

    def cfg(**model):
        return load_dict({"model": {"path": str(vlm_dir), "lora": {"rank": 4}, **model}})

    frozen, trained = cfg(), cfg(train_vision=True)
    assert policy_skip(frozen) == ("model.visual.", "visual.") and policy_skip(trained) == ()
    model = meta_model(frozen)
    language = resolve_targets(model, ["all-linear"], "model.lora", skip_prefixes=policy_skip(frozen))
    both = resolve_targets(model, ["all-linear"], "model.lora", skip_prefixes=policy_skip(trained))
    assert language and not [n for n in language if "visual" in n]
    assert {n for n in both if "visual" in n} == set(both) - set(language) != set()
    assert "model.language_model.layers.0.self_attn.q_proj" in language
    check_targets(trained)  # qkv is the tower's attention: adaptable once it trains
    with pytest.raises(ConfigError, match="^model.lora.target_modules: 'qkv' matches no linear module.*"
                                          "model.train_vision: true adapts them"):
        check_targets(load_dict({"model": {"path": str(vlm_dir), "lora": {"rank": 4, "target_modules": ["qkv"]}}}))
    tiny = load_dict({"model": {"tiny": dataclasses.asdict(TINY_VL), "lora": {"rank": 4}}})
    assert policy_skip(tiny) == policy_skip(frozen)
    assert resolve_targets(meta_model(tiny), ["all-linear"], "model.lora", skip_prefixes=policy_skip(tiny)) == language


def test_base_weights_are_found_under_the_names_the_folder_saves_them_with(vlm_dir):
    """transformers saves a Qwen2-VL's language tower as model.layers.* and loads it as model.language_model.layers.*;
    the LoRA merge reads W0 of an in-memory name from the file's name."""
    from safetensors import safe_open

    from hpc_rl.models.checkpoint_names import file_names
    from hpc_rl.rollout.server.engine_lora import read_base_weights
    from hpc_rl.rollout.wire.weights import WeightError

    q, tower = "model.language_model.layers.0.self_attn.q_proj.weight", "model.visual.blocks.0.attn.qkv.weight"
    where = file_names(vlm_dir, [q, tower, "lm_head.weight", "model.nope.weight"])
    assert where == {q: ("model.layers.0.self_attn.q_proj.weight", "model.safetensors"),
                     tower: ("visual.blocks.0.attn.qkv.weight", "model.safetensors"),
                     "lm_head.weight": ("lm_head.weight", "model.safetensors")}
    with safe_open(str(vlm_dir / "model.safetensors"), framework="pt") as sf:
        assert torch.equal(read_base_weights(str(vlm_dir), {q})[q], sf.get_tensor(where[q][0]))
    with pytest.raises(WeightError, match="has no tensor 'model.nope.weight' to merge an adapter into"):
        read_base_weights(str(vlm_dir), {q, "model.nope.weight"})


def test_a_batch_with_images_round_trips_through_a_checkpoint():
    from hpc_rl.orchestrator.batch import RolloutBatch

    imgs = [png(), png(colour=(1, 2, 3))]
    b = RolloutBatch(step=0, prompts=[[1], [2]], responses=[[3], [4]], loss_masks=[[1], [1]],
                     rollout_logprobs=[[-1.0], [-2.0]], versions=[0, 0], truncated=[False, False], group_ids=[0, 1],
                     prompt_ids=[0, 1], images=[[imgs[0]], [imgs[1]]])
    back = RolloutBatch.from_json(json.loads(json.dumps(b.to_json())))
    assert back.images == b.images and back.select([1]).images == [[imgs[1]]]
    both = RolloutBatch.concat([b, RolloutBatch.from_json({**b.to_json(), "images": None})])
    assert both.images == b.images + [[], []]
    assert b.with_fillers(1, 0).images == b.images + [b.images[0]]


# ---------------------------------------------------------------- model and engine


def test_the_tiny_vlm_is_a_qwen2_vl_folder_and_prompts_hold_each_images_tokens(vlm_dir):
    assert is_vision_model(vlm_dir) and (vlm_dir / "preprocessor_config.json").is_file()
    tok = load_tokenizer(vlm_dir)
    spec = VisionSpec.of(vlm_dir, tok)
    ds = PromptDataset(data_cfg("toy:colour_digit", toy_size=20), tok, 0, vision=spec)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    # 56x56 pixels: 4x4 patches of 14, merged 2x2 -> 4 image tokens, between vision start and end.
    assert all(ids.count(pad) == 4 for ids in ds.token_ids)
    assert len({tuple(ids) for ids in ds.token_ids}) == 1  # the answer is only in the image
    assert len({ds.rows[i]["ground_truth"] for i in range(20)}) > 3
    big = VisionSpec.of(vlm_dir, tok, max_pixels=112 * 112)
    assert big.tokens_per_image([png(112, 112)]) == [16] and spec.tokens_per_image([png(112, 112)]) == [16]
    small = VisionSpec.of(vlm_dir, tok, min_pixels=56 * 56, max_pixels=56 * 56)
    assert small.tokens_per_image([png(112, 112)]) == [4]


def test_engine_samples_from_the_image_and_scoring_gives_its_logprobs_again(engine):
    tok = load_tokenizer(engine.model.name_or_path)
    ds = PromptDataset(data_cfg("toy:colour_digit", toy_size=4), tok, 0, vision=engine.vision)
    prompt = ds.token_ids[0]
    images = [[colour_image(d)] for d in range(len(COLOURS))]
    params = SamplingParams(n=3, max_new_tokens=5, seed=7)
    out = engine.generate([prompt] * len(images), params, images=images)
    # Same ids, other pictures: the prefill's next-token distributions differ (the model sees the image).
    firsts = engine.prompt_top_logprobs([prompt + [out[0][0].token_ids[0]]] * 2, [len(prompt)] * 2, 5,
                                        images=[images[0], images[8]])
    assert firsts.top_logprobs[0] != firsts.top_logprobs[1]
    # Every sampled token's log-prob from the KV-cached, left-padded sampling loop is what a full right-padded
    # forward of prompt + completion gives (another batch, other padding).
    rows, lens, imgs, want = [], [], [], []
    for d, samples in enumerate(out):
        for s in samples:
            rows.append(prompt + s.token_ids)
            lens.append(len(prompt))
            imgs.append(images[d])
            want.append(s.logprobs)
    rows.append(prompt[-3:] + [5, 6])  # a text-only row in the same batch
    lens.append(3)
    imgs.append([])
    got = engine.prompt_logprobs(rows, lens, images=imgs)
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=2e-5), (g, w)
    # The learner's forward (left-padded prompts, right-padded responses, micro-batches of any rows) gives them too.
    from hpc_rl.models import load_causal_lm
    from hpc_rl.models.vision import RowPixels
    from hpc_rl.train.experience import pack, policy_forward

    learner = load_causal_lm(engine.model.name_or_path).eval()
    samples = [(prompt, s.token_ids, images[d], s.logprobs) for d, row in enumerate(out) for s in row]
    batch = pack([p for p, *_ in samples], [r for _, r, *_ in samples], tok.pad_token_id,
                 pixels=RowPixels.of(engine.vision, [i for _, _, i, _ in samples]))
    for rows_ in (torch.arange(len(samples)), torch.tensor([5, 0, 17]), slice(3, 9)):
        part = batch.slice(rows_).trim()
        with torch.no_grad():
            lp, _ = policy_forward(learner, part)
        for k, i in enumerate(range(len(samples))[rows_] if isinstance(rows_, slice) else rows_.tolist()):
            w = torch.tensor(samples[i][3])
            assert torch.allclose(lp[k, :len(w)], w, atol=2e-5), (i, lp[k], w)
    # Seeded: the same request samples the same tokens.
    again = engine.generate([prompt] * len(images), params, images=images)
    assert [[s.token_ids for s in r] for r in again] == [[s.token_ids for s in r] for r in out]


# ---------------------------------------------------------------- the toy learns, end to end


@pytest.mark.slow
def test_the_vlm_toy_learns_from_the_image_alone_and_its_export_reads_images(tmp_path):
    """jobs/toy-vlm-cpu.yaml as users run it (from an empty directory): GRPO on colour_digit, whose prompt is the same
    for every row, brings the reward from chance to the toys' criterion (last 5 steps >= 0.8 and >= the first + 0.5),
    so the policy reads the colour through its vision tower on both sides: the rollout server's HF engine and the
    ZeRO-3 learner. The weight-sync check compares their log-probs of an image prompt every step. The exported
    folder loads with its image processor and answers each colour greedily."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hpc_rl.metrics import read_metrics

    repo = Path(__file__).resolve().parent.parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(repo / "jobs" / "toy-vlm-cpu.yaml"),
                        f"output_dir={tmp_path / 'runs'}", "trainer.stop_at={reward_mean: 0.8}",
                        "trainer.check_sync_every=1", "eval.source=toy:colour_digit", "eval.every=20",
                        "eval.max_prompts=40", "eval.reward=hpc_rl.rewards.toy:repeat_digit", "data.toy_size=2000"],
                       capture_output=True, text=True, cwd=elsewhere, timeout=1200,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = list((tmp_path / "runs").iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    rewards = [row["reward_mean"] for row in rows]
    first, last5 = rewards[0], sum(rewards[-5:]) / 5
    print(f"toy-vlm: {len(rewards)} steps, first {first:.3f}, last-5 mean {last5:.3f}, curve "
          f"{[round(x, 2) for x in rewards[::5]]}")
    assert last5 >= 0.8 and last5 >= first + 0.5, rewards
    assert first < 0.2, rewards  # chance: the prompt alone says nothing
    # Held-out pictures, evaluated greedily on the servers with their images: better than at the start.
    evals = read_metrics(run / "eval.jsonl")
    assert evals[0]["step"] == 0 and evals[-1]["step"] >= 20, evals
    assert evals[-1]["eval/reward_mean"] > evals[0]["eval/reward_mean"] + 0.3, evals
    diffs = [row["sync_max_diff"] for row in rows]
    assert all(d is not None and d < 1e-3 for d in diffs), diffs
    out = tmp_path / "exported"
    e = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "export", str(run), str(out)], capture_output=True,
                       text=True, cwd=elsewhere, timeout=300)
    assert e.returncode == 0, e.stdout[-2000:] + e.stderr[-2000:]
    assert is_vision_model(out) and (out / "preprocessor_config.json").is_file()
    eng = HFEngine(load_dict({"model": {"path": str(out)}, "rollout": {"engine": "hf"}}), "cpu")
    tok = load_tokenizer(out)
    ds = PromptDataset(data_cfg("toy:colour_digit", toy_size=1), tok, 0, vision=eng.vision)
    greedy = SamplingParams(n=1, max_new_tokens=5, temperature=0.0)
    answers = eng.generate([ds.token_ids[0]] * 10, greedy, images=[[colour_image(d)] for d in range(10)])
    texts = [tok.decode(a[0].token_ids, skip_special_tokens=True) for a in answers]
    from hpc_rl.rewards.toy import repeat_digit

    right = sum(repeat_digit("", t, str(d)) >= 0.75 for d, t in enumerate(texts))
    assert right >= 8, texts


def test_doctor_checks_what_a_vision_job_needs(vlm_dir, capsys):
    from pathlib import Path

    from hpc_rl.doctor import run_doctor

    job = str(Path(__file__).resolve().parent.parent / "jobs" / "toy-vlm-cpu.yaml")

    def vision(*overrides):
        run_doctor(job=job, as_json=True, overrides=list(overrides))
        return {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["job:vision"]

    assert vision()["status"] == "ok"
    bad = vision("rollout.engine=vllm")
    assert bad["status"] == "FAIL" and bad["message"].startswith("rollout.engine: a vision-language policy"), bad
    folder = vision("model.tiny=null", f"model.path={vlm_dir}")
    assert folder["status"] == "ok" and "image processor and image tokens present" in folder["message"], folder
    (vlm_dir.parent / "no-proc").mkdir(exist_ok=True)
    for f in vlm_dir.iterdir():
        if f.name != "preprocessor_config.json":
            (vlm_dir.parent / "no-proc" / f.name).write_bytes(f.read_bytes())
    missing = vision("model.tiny=null", f"model.path={vlm_dir.parent / 'no-proc'}")
    assert missing["status"] == "FAIL" and "without preprocessor_config.json" in missing["message"], missing


def test_a_chat_template_kept_with_the_processor_renders_image_prompts(vlm_dir, tmp_path):
    """Qwen2-VL-family folders keep the chat template in chat_template.json (the processor's): it is the tokenizer's
    template when tokenizer_config.json has none, and a chat row's <image> becomes the vision tokens inside it."""
    import shutil

    folder = tmp_path / "with-template"
    shutil.copytree(vlm_dir, folder)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(folder)
    assert tok.chat_template == template
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "<image> colour"}],
                                                  "images": [str(tmp_path / "a.png")]}) + "\n")
    (tmp_path / "a.png").write_bytes(png())
    ds = PromptDataset(data_cfg(tmp_path / "p.jsonl"), tok, 0, vision=VisionSpec.of(folder, tok))
    assert ds.texts[0].startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|> colour")
    assert ds.token_ids[0].count(tok.convert_tokens_to_ids(IMAGE_PAD)) == 4


@pytest.mark.slow
def test_a_lora_vlm_syncs_checkpoints_evaluates_and_exports_its_language_adapters(tmp_path):
    """jobs/toy-vlm-cpu.yaml under model.lora with the vision tower frozen: the adapters go on the language tower only,
    the server merges each push into the weights it serves (its log-probs of an image prompt match the learner's),
    the checkpoint is a PEFT folder with the processor files, `hpc-rl eval --step` serves it merged and answers as the
    run's server did, and both export forms load without hpc-rl and agree on an image prompt."""
    from pathlib import Path

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from hpc_rl.metrics import read_metrics
    from tests.runs import hpc_rl, only_run

    job = Path(__file__).resolve().parent.parent / "jobs" / "toy-vlm-cpu.yaml"
    r = hpc_rl("run", job, "model.lora={rank: 8, alpha: 16}", "model.train_vision=false", "trainer.lr=3e-3",
               "trainer.steps=4", "checkpoint.every=4", "trainer.check_sync_every=1", "trainer.lr_schedule=constant",
               "eval.source=toy:colour_digit", "eval.every=4", "eval.max_prompts=10",
               "eval.reward=hpc_rl.rewards.toy:repeat_digit", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = only_run(tmp_path)
    assert "actor: LoRA rank 8 on 14 modules" in r.stdout  # 2 layers x 7 linear modules; none of the tower's
    rows = read_metrics(run / "metrics.jsonl")
    base_bytes = (run / "model-init" / "model.safetensors").stat().st_size
    for x in rows:
        assert x["sync_max_diff"] is not None and x["sync_max_diff"] < 1e-4, x
        assert 0 < x["sync_bytes"] < 0.25 * base_bytes, (x["sync_bytes"], base_bytes)
    hf = run / "checkpoints" / "step_4" / "hf"
    assert (hf / "preprocessor_config.json").is_file()
    conf = json.loads((hf / "adapter_config.json").read_text())
    assert conf["target_modules"] and not [t for t in conf["target_modules"] if "visual" in t], conf

    e = hpc_rl("eval", run.name, "--step", "4", cwd=tmp_path)
    assert e.returncode == 0, e.stdout[-2000:] + e.stderr[-3000:]
    online = read_metrics(run / "eval" / "step_4.jsonl")
    offline = read_metrics(run / "eval" / "step_4.offline.jsonl")
    assert [x["prompt_id"] for x in online] == [x["prompt_id"] for x in offline]
    assert sum(a["completion"] == b["completion"] for a, b in zip(online, offline)) >= 9, (online, offline)

    for form in ("--adapter", "--merged"):
        x = hpc_rl("export", run.name, tmp_path / form[2:], form, cwd=tmp_path)
        assert x.returncode == 0, x.stderr
    base_files, merged_files = load_file(run / "model-init" / "model.safetensors"), \
        load_file(tmp_path / "merged" / "model.safetensors")
    assert set(base_files) == set(merged_files)
    changed = {k for k in base_files if not torch.equal(base_files[k], merged_files[k])}
    assert len(changed) == 14 and not [k for k in changed if "visual" in k], sorted(changed)

    tok = load_tokenizer(run / "model-init")
    spec = VisionSpec.of(run / "model-init", tok)
    ds = PromptDataset(data_cfg("toy:colour_digit", toy_size=1), tok, 0, vision=spec)
    pv, grid = spec.pixels([colour_image(3)])
    ids = torch.tensor([ds.token_ids[0]])
    inputs = dict(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(ids == spec.image_pad_id).int())
    with torch.no_grad():
        base = AutoModelForImageTextToText.from_pretrained(run / "model-init").eval()
        base_logits = base(**inputs).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(**inputs).logits
        merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()(**inputs).logits
    assert (adapted - base_logits).abs().max() > 1e-4  # it trained
    assert torch.allclose(merged, adapted, atol=1e-5), (merged - adapted).abs().max()


def test_a_teacher_of_a_vision_policy_must_see_images(vlm_dir, tmp_path):
    from hpc_rl.errors import ConfigError
    from hpc_rl.models.vision import check_vision_job

    text = build_tiny_model(TinyModelConfig(), colour_digit_corpus(), tmp_path / "text")

    def job(teacher):
        return load_dict({"model": {"path": str(vlm_dir)}, "services": {"teacher": {"path": str(teacher)}},
                          "algorithm": {"distill": {"coef": 1.0}}})

    check_vision_job(job(vlm_dir))
    with pytest.raises(ConfigError, match="^services.teacher: a vision-language policy .* vision-language teacher"):
        check_vision_job(job(text))


@pytest.mark.slow
def test_a_vision_teacher_scores_the_policys_samples_with_their_images(vlm_dir, tmp_path):
    """Distillation of a vision-language policy: the teacher server gets each sample's pictures with its ids. With the
    policy's own initial weights as the teacher, the first step's reverse KL (rollout server vs teacher server) is
    zero, as it is only when both sides see the same image; the top-k term runs on the learner's image forward (it is
    -log of the student's mass on the teacher's top k there, not zero: see topk_forward_kl)."""
    from pathlib import Path

    from hpc_rl.metrics import read_metrics
    from tests.runs import hpc_rl, only_run

    job = Path(__file__).resolve().parent.parent / "jobs" / "toy-vlm-cpu.yaml"
    r = hpc_rl("run", job, "model.tiny=null", f"model.path={vlm_dir}", f"services.teacher={{path: {vlm_dir}, engine: hf}}",
               "algorithm.distill={coef: 1.0, only: true, baseline: position, top_k: 4}", "trainer.steps=2",
               "trainer.prompts_per_step=8", "trainer.mini_batch_size=64", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_metrics(only_run(tmp_path) / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2]
    first = rows[0]
    assert abs(first["distill/reverse_kl"]) < 1e-4, first
    assert 0 < first["distill/topk_kl"] < 10, first
    assert first["teacher_seconds"] > 0
