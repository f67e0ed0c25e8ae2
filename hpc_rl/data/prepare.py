"""`hpc-rl data gsm8k|geometry3k OUT/`: a hub dataset as verl-format parquet (train.parquet, test.parquet, ...).

GSM8K rows: data_source, prompt (one chat message: the question + verl's step-by-step instruction),
ability, reward_model {style: rule, ground_truth}, extra_info {split, index, answer, question}; Geometry3K's
(prepare_geometry3k.py) have an `images` column too. The hub download needs internet (a login node); `--source`
takes a local copy in the hub's format (jsonl/parquet rows, a folder of train.*/test.* files, or a
`datasets.save_to_disk` folder).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError, first_line
from ..rewards.gsm8k import ground_truth_of

HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_FILE_EXT = (".jsonl", ".json", ".parquet")


def to_verl_row(raw: dict, split: str, index: int, where: str) -> dict:
    """One GSM8K row ({question, answer}) in verl's format; DataError naming the row when malformed."""
    q, a = raw.get("question"), raw.get("answer")
    if not isinstance(q, str) or not isinstance(a, str) or not q.strip():
        raise DataError(f"{where}: row {index} needs string fields 'question' and 'answer' (GSM8K format); "
                        f"it has {', '.join(map(str, raw)) or 'none'}")
    try:
        truth = ground_truth_of(a)
    except ValueError:
        raise DataError(f"{where}: row {index}: the answer has no '#### NUMBER' line; GSM8K answers end with one")\
            from None
    return {
        "data_source": HUB_NAME,
        "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": a, "question": q},
    }


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises many types for a bad file
            raise DataError(f"{path}: cannot read parquet ({first_line(e)})") from None
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); one JSON object per line") from None
    return rows


def _split_of(path: Path, splits=SPLITS) -> str:
    stem = path.stem.lower()
    return next((s for s in splits if s in stem), "train")


def load_source(source: str | None, hub: tuple[str, str | None] = (HUB_NAME, HUB_CONFIG), splits=SPLITS,
                what: str = "GSM8K") -> dict[str, list[dict]]:
    """{split: raw rows} from the hub (source None) or a local copy."""
    if source is None:
        try:
            import datasets
        except ImportError:
            raise DataError("hpc-rl data needs the `datasets` package; pip install 'hpc-rl[data]'") from None
        try:
            ds = datasets.load_dataset(*[h for h in hub if h])
        except Exception as e:  # offline, proxy, hub errors: all end here
            raise DataError(f"cannot download {hub[0]} ({type(e).__name__}: {first_line(e)}); "
                            "run this on a machine with internet, or pass --source a local copy") from None
        return {s: list(ds[s]) for s in splits if s in ds}
    p = Path(source)
    if p.is_file():
        if p.suffix not in _FILE_EXT:
            raise DataError(f"--source {p}: expected a .jsonl, .json or .parquet file of {what} rows")
        return {_split_of(p, splits): _read_file(p)}
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in _FILE_EXT and any(s in f.stem.lower() for s in splits))
        if files:
            out: dict[str, list[dict]] = {}
            for f in files:
                out.setdefault(_split_of(f, splits), []).extend(_read_file(f))
            return out
        try:
            import datasets

            ds = datasets.load_from_disk(str(p))
        except Exception:
            raise DataError(f"--source {p}: no train.*/test.* files and not a datasets.save_to_disk folder") from None
        if isinstance(ds, datasets.DatasetDict):
            return {s: list(ds[s]) for s in splits if s in ds}
        return {"train": list(ds)}
    raise DataError(f"--source {source}: not found; pass a {what} jsonl/parquet file or folder")


def prepare_dataset(name: str, out: str, source: str | None = None) -> int:
    """Write OUT/{split}.parquet in verl's format; returns the exit code."""
    if name == "geometry3k":
        from . import prepare_geometry3k as ds

        return write_splits(load_source(source, (ds.HUB_NAME, None), ds.SPLITS, "Geometry3K"), out,
                            source or ds.HUB_NAME, ds.to_verl_row, ds.REWARD)
    if name != "gsm8k":
        raise DataError(f"dataset {name!r} is not known; available: gsm8k, geometry3k")
    return write_splits(load_source(source), out, source or HUB_NAME, to_verl_row,
                        "hpc_rl.rewards.gsm8k:compute_score")


def write_splits(splits: dict[str, list[dict]], out: str, where: str, to_row, reward: str) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("writing parquet needs pyarrow; pip install 'hpc-rl[data]'") from None
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    for split, raw in splits.items():
        if not raw:
            raise DataError(f"{where}: the {split} split is empty")
        rows = [to_row(r, split, i, where) for i, r in enumerate(raw)]
        tmp = outdir / f".{split}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.replace(outdir / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows -> {outdir / f'{split}.parquet'}")
    print(f"use it with data.source: {outdir / 'train.parquet'} and reward.function: {reward}")
    return 0
