"""`hpc-rl data geometry3k` on a local copy in the hub's format (a datasets folder with an Image feature), the rows
it writes read back as multimodal prompts, and verl's geo3k reward (0.9 accuracy + 0.1 format) on hand-made
completions."""

import io

import pytest
from PIL import Image

from hpc_rl import cli
from hpc_rl.config import DataConfig
from hpc_rl.data.datasets import PromptDataset, load_rows
from hpc_rl.data.prepare_geometry3k import INSTRUCTION
from hpc_rl.errors import DataError
from hpc_rl.rewards.geometry3k import compute_score, last_boxed


def diagram(colour) -> Image.Image:
    return Image.new("RGB", (90, 60), colour)


def hub_copy(tmp_path, rows_per_split=3):
    import datasets

    feats = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                               "answer": datasets.Value("string")})
    splits = {}
    for s, n in (("train", rows_per_split), ("validation", 1), ("test", 2)):
        splits[s] = datasets.Dataset.from_dict(
            {"images": [[diagram((10 * i, 20, 30))] for i in range(n)],
             "problem": [f"<image>Find x. ({s} {i})" if i else f"Find y in the figure ({s})." for i in range(n)],
             "answer": [str(3 + i) for i in range(n)]}, features=feats)
    src = tmp_path / "hub"
    datasets.DatasetDict(splits).save_to_disk(str(src))
    return src


def test_prepare_writes_verl_multimodal_parquet_that_loads_as_image_prompts(tmp_path, capsys):
    out = tmp_path / "geo3k"
    assert cli.main(["data", "geometry3k", str(out), "--source", str(hub_copy(tmp_path))]) == 0
    printed = capsys.readouterr().out
    assert "train: 3 rows" in printed and "validation: 1 rows" in printed and "test: 2 rows" in printed
    assert "hpc_rl.rewards.geometry3k:compute_score" in printed
    rows = load_rows(DataConfig(source=str(out / "train.parquet")), 0)
    assert [r["ground_truth"] for r in rows] == ["3", "4", "5"]
    # A problem without <image> gets it in front (one image), as verl's rows have it; the instruction follows.
    assert rows[0]["prompt"] == [{"role": "user", "content": f"<image>Find y in the figure (train). {INSTRUCTION}"}]
    assert rows[1]["prompt"][0]["content"].startswith("<image>Find x. (train 1)")
    img = Image.open(io.BytesIO(rows[1]["images"][0]))
    assert img.size == (90, 60) and img.convert("RGB").getpixel((0, 0)) == (10, 20, 30)


def test_prepared_rows_become_prompts_with_the_images_tokens(tmp_path, capsys):
    from hpc_rl.data.toy import colour_digit_corpus
    from hpc_rl.models import load_tokenizer
    from hpc_rl.models.tiny import build_tiny_model
    from hpc_rl.models.vision import IMAGE_PAD, VisionSpec

    from .test_vision import TINY_VL

    out = tmp_path / "geo3k"
    cli.main(["data", "geometry3k", str(out), "--source", str(hub_copy(tmp_path))])
    folder = build_tiny_model(TINY_VL, colour_digit_corpus() + ["Find x y the figure train test"], tmp_path / "m")
    tok = load_tokenizer(folder)
    ds = PromptDataset(DataConfig(source=str(out / "test.parquet"), max_prompt_tokens=4096), tok, 0,
                       vision=VisionSpec.of(folder, tok))
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    # 90x60 resized to 84x56 (multiples of 28 within the tiny processor's pixel bounds): 6x4 patches -> 6 tokens.
    assert [ids.count(pad) for ids in ds.token_ids] == [6, 6]


def test_a_row_without_its_diagram_is_named(tmp_path):
    from hpc_rl.data.prepare_geometry3k import to_verl_row

    with pytest.raises(DataError, match="row 4 has no 'images'"):
        to_verl_row({"problem": "<image>x?", "answer": "1", "images": []}, "train", 4, "src")
    with pytest.raises(DataError, match=r"row 2 field 'images'\[0\]: cannot decode the image"):
        to_verl_row({"problem": "<image>x?", "answer": "1", "images": [{"bytes": b"junk"}]}, "train", 2, "src")
    with pytest.raises(DataError, match="row 0 has 1 image"):
        to_verl_row({"problem": "<image><image>x?", "answer": "1", "images": [diagram((1, 1, 1))]}, "train", 0, "s")


@pytest.mark.parametrize("completion, score", [
    ("<think>angles sum to 180</think> so \\boxed{3}", 1.0),
    ("<think>...</think> \\boxed{3.0}", 1.0),                  # numbers compare as decimals
    ("\\boxed{3}", 0.9),                                        # right, without the format
    ("<think>hm</think> the answer is \\boxed{4}", 0.1),      # formatted, wrong
    ("<think>hm</think> 3", 0.0),                             # no boxed answer at all
    ("<think>x</think> \\boxed{\\frac{6}{2}} then \\boxed{3}", 1.0),  # the last box counts
])
def test_reward_is_verls_geo3k_mix(completion, score):
    assert compute_score("", completion, "3") == pytest.approx(score)


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
