"""Prompt data sets (`data.prompts`, `eval.prompts`): where the rows come from, what a row holds, and in which order a
run reads them.

A source is `builtin:<task>`, a local file (.parquet, .jsonl, .json, .csv, .arrow; .txt = one prompt a line), a folder
of such files, a folder written by `Dataset.save_to_disk`, s3://bucket/key (one such file) or s3://bucket/prefix (a
folder of them), or a hub data set id at `revision` (data.revision). Where each is on this machine is the resolver's
(models/resolve.py): an s3:// source is fetched once into the cache directory and checked by digest, a hub data set
is its snapshot in the Hugging Face cache, read as a local folder (nothing downloads unless the deployment allows
it). Rows are read with HF `datasets`. A data set with several configurations (subsets: GSM8K's `main` and
`socratic`) is read at `subset` (data.subset): hub data sets, and local folders whose README.md declares `configs`
as the hub's do. The prompt is the `prompt_key` column: a string, or chat messages (a list of {role, content})
rendered with the policy's chat template. Every other column travels with its prompt to the reward functions
(models/reward.py), one value per sample.

Everything here runs before any model loads (the policy's tokenizer only), so bad data fails the run at once, naming
the file and what is wrong.

Order: each epoch is a permutation of the rows drawn from the seed; a batch takes the next rows, crossing into the next
epoch when one ends, so no row is skipped or repeated within an epoch. The stream's (epoch, position) is saved with
the actor's checkpoint; a resumed run goes on with the next unseen rows.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from models.deploy import DeployConfig
from models.resolve import resolve_data
from models.tasks import sentiment

DATA_FILES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
BUILTIN = ("sentiment", "sentiment_target", "sentiment_sft", "sentiment_preference")
BUILTIN_GOLD = "models.tasks.sentiment:gold_reward"  # the shipped tasks' gold reward (both: review positively)


def builtin_gold(source: str | None) -> str | None:
    """The gold reward a prompt source brings: the shipped task's for builtin:<task>, none for any other data."""
    return BUILTIN_GOLD if source and source.startswith("builtin:") else None


@dataclass
class Batch:
    """Prompts of one iteration and, per prompt, the row's other columns (what a reward function receives)."""

    prompts: list[str]
    columns: list[dict] = field(default_factory=list)
    templated: bool = False  # the prompts are rendered chat templates (encoded without adding special tokens)

    def __post_init__(self):
        if not self.columns:
            self.columns = [{} for _ in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class PromptSet:
    """The rows of a prompt source, ready to batch: rendered prompts, their other columns, what was filtered."""

    prompts: list[str]
    columns: list[dict]
    source: str
    templated: bool = False
    filtered: int = 0  # rows dropped as longer than data.max_prompt_length (long_prompts='filter')
    truncated: int = 0  # rows that will be cut from the left (long_prompts='truncate_left')

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, indices: list[int]) -> Batch:
        return Batch([self.prompts[i] for i in indices], [self.columns[i] for i in indices], self.templated)

    def all(self) -> Batch:
        return self.batch(list(range(len(self))))

    def head(self, n: int) -> "PromptSet":
        """The first n rows (eval.max_prompts)."""
        return PromptSet(self.prompts[:n], self.columns[:n], self.source, self.templated, self.filtered, self.truncated)


class DataError(ValueError):
    """A prompt source that cannot be used; the message names the field, the source and what is wrong."""


# ---------------------------------------------------------------- reading a source


def read_rows(source: str, split: str = "train", field: str = "data.prompts", subset: str | None = None,
              revision: str | None = None, deploy: Optional[DeployConfig] = None):
    """The rows of `source` (at configuration `subset`, a hub data set at `revision`) as a `datasets.Dataset` (see
    the module docstring for the forms a source takes); `deploy`: the deployment's cache and download settings."""
    import datasets  # heavy (pyarrow, pandas: ~1 s): only reading a data set needs it

    datasets.disable_progress_bars()
    section = field.rsplit(".", 1)[0]
    if not source:
        raise DataError(f"{field}: not set; name the rows (a local file or folder, s3://..., a hub data set id, or "
                        f"builtin:<task>: models/data.py)")
    try:
        found = resolve_data(source, field, revision, deploy, subset)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(str(exc)) from None
    if revision is not None and found.source != "hub":
        raise DataError(f"{section}.revision: '{source}' is no hub data set id: a revision names a hub branch, tag "
                        f"or commit; leave {section}.revision unset")
    path = Path(found.path) if found.path else None
    if subset is not None and (path is None or path.is_file()):
        raise DataError(f"{section}.subset: '{source}' has no configurations (a builtin task or a single file); "
                        f"leave {section}.subset unset")
    if path is None:
        return datasets.Dataset.from_list(builtin_rows(source.split(":", 1)[1], split, field))
    try:
        return _read_folder(path, split, field, subset) if path.is_dir() else _read_file(path, split, field)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many kinds for an unreadable file
        if "corresponds to no data" in str(exc):  # datasets' way of saying the file has no row
            raise DataError(f"{field}: split '{split}' of '{source}' is empty") from exc
        raise DataError(f"{field}: cannot read '{source}': {type(exc).__name__}: {exc}") from exc


# rows of the stages' builtin data sets per split (train, test): generated from a seed of their own per split
STAGE_ROWS = {"sentiment_sft": (2000, 200), "sentiment_preference": (3000, 500)}


def builtin_rows(name: str, split: str = "train", field: str = "data.prompts") -> list[dict]:
    """The shipped tasks (models/tasks/sentiment.py): 'train' = the 40 template x noun prompts cycled to 200 rows;
    'test' = 40 held-out prompts (other templates). The stages' data (models/stages/): sentiment_sft (prompt,
    completion) and sentiment_preference (prompt, chosen, rejected: the gold reward's preference), whose 'test' split
    is drawn from another seed on the held-out templates (the stage never trains on it)."""
    if name not in BUILTIN:
        raise DataError(f"{field}: unknown builtin task {name!r}; known: {', '.join(BUILTIN)}")
    if split not in ("train", "test"):
        raise DataError(f"{field}: builtin:{name} has no split '{split}'; its splits: ['train', 'test']")
    n, templates = (200, sentiment.PROMPT_TEMPLATES) if split == "train" else (40, sentiment.EVAL_TEMPLATES)
    if name in STAGE_ROWS:
        rows = STAGE_ROWS[name][0 if split == "train" else 1]
        make = sentiment.sft_rows if name == "sentiment_sft" else sentiment.preference_rows
        return make(rows, seed=0 if split == "train" else 1, templates=templates)
    if name == "sentiment":
        return [{"prompt": p} for p in sentiment.prompts(n, 0, templates)]
    return sentiment.targeted_rows(n, 0, templates)


def _read_file(path: Path, split: str, field: str):
    import datasets  # heavy (pyarrow, pandas: ~1 s): only reading a data set needs it

    if path.suffix == ".txt":
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return datasets.Dataset.from_dict({"prompt": lines})
    if path.suffix not in DATA_FILES:
        raise DataError(f"{field}: '{path}' has an unknown extension {path.suffix!r}; expected one of "
                        f"{', '.join(sorted(DATA_FILES) + ['.txt'])}, a folder or builtin:<task>")
    # a single file is one split: the one asked for
    return datasets.load_dataset(DATA_FILES[path.suffix], data_files={split: str(path)}, split=split)


def _read_folder(path: Path, split: str, field: str, subset: str | None = None):
    import datasets  # heavy (pyarrow, pandas: ~1 s): only reading a data set needs it

    saved = any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))
    if subset is not None:
        return _read_configured_folder(path, split, field, subset, saved)
    if saved:
        loaded = datasets.load_from_disk(str(path))  # a save_to_disk folder: a Dataset or a DatasetDict
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{field}: '{path}' has no split '{split}' (data.split); its splits: {list(loaded)}")
            return loaded[split]
        return loaded
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in DATA_FILES)
    if not files:
        raise DataError(f"{field}: folder '{path}' holds no data file ({', '.join(sorted(DATA_FILES))}) and was not "
                        f"written by save_to_disk")
    kinds = {DATA_FILES[f.suffix] for f in files}
    if len(kinds) > 1:
        raise DataError(f"{field}: folder '{path}' mixes formats ({', '.join(sorted(kinds))}); keep one per folder")
    try:  # file names decide the splits (train-*.parquet, test.jsonl, ...), as for a hub dataset
        found = datasets.load_dataset(str(path))
    except ValueError as exc:
        if "pick one among the available configs" in str(exc):  # its README declares configurations
            subset_field = field.rsplit(".", 1)[0] + ".subset"
            raise DataError(f"{subset_field}: '{path}' has several configurations {_config_names(path)}: choose "
                            f"one with {subset_field}") from None
        found = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files])
    if split not in found:
        raise DataError(f"{field}: folder '{path}' has no split '{split}' (data.split); its splits: {list(found)}")
    return found[split]


def _read_configured_folder(path: Path, split: str, field: str, subset: str, saved: bool):
    """Configuration `subset` of a folder whose README.md declares `configs` (the hub's layout: each config its own
    files), read as the hub would."""
    import datasets  # heavy (pyarrow, pandas: ~1 s): only reading a data set needs it

    subset_field = field.rsplit(".", 1)[0] + ".subset"
    if saved:
        raise DataError(f"{subset_field}: '{path}' was written by save_to_disk and has no configurations; leave "
                        f"{subset_field} unset")
    try:
        found = datasets.load_dataset(str(path), name=subset)
    except ValueError as exc:
        known = _config_names(path)
        raise DataError(f"{subset_field}: '{path}' has no configuration '{subset}'"
                        + (f"; its configurations: {known}" if known else
                           " (configurations are declared as `configs` in its README.md, as on the hub)")) from exc
    if split not in found:
        raise DataError(f"{field}: configuration '{subset}' of '{path}' has no split '{split}'; its splits: {list(found)}")
    return found[split]


def _config_names(path: Path) -> list[str]:
    try:
        import datasets  # heavy (pyarrow, pandas: ~1 s): only reading a data set needs it

        return list(datasets.get_dataset_config_names(str(path)))
    except Exception:  # noqa: BLE001 - only for the message
        return []


# ---------------------------------------------------------------- rows -> prompts


def load_prompt_set(source: str, split: str, prompt_key: str, tokenizer, max_prompt_length: int | None = None,
                    long_prompts: str = "error", chat_template: bool = False, field: str = "data.prompts",
                    subset: str | None = None, revision: str | None = None,
                    deploy: Optional[DeployConfig] = None) -> PromptSet:
    """Read `source` (at configuration `subset`, revision `revision`: `read_rows`) and turn its rows into prompts
    for the policy whose `tokenizer` is given: checks the prompt column, renders chat messages, applies the length
    policy. Raises DataError naming what is wrong."""
    rows = read_rows(source, split, field, subset, revision, deploy)
    if prompt_key not in rows.column_names:
        raise DataError(f"{field}: '{source}' has no column '{prompt_key}' (the prompt_key); its columns: "
                        f"{rows.column_names}")
    if len(rows) == 0:
        raise DataError(f"{field}: split '{split}' of '{source}' is empty")
    values = rows[prompt_key]
    others = [c for c in rows.column_names if c != prompt_key]
    columns = rows.select_columns(others).to_list() if others else [{} for _ in values]
    chat = [isinstance(v, list) for v in values]
    if any(chat) and not all(chat):
        raise DataError(f"{field}: column '{prompt_key}' of '{source}' mixes strings and chat messages")
    templated = all(chat)
    if templated:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{field}: column '{prompt_key}' of '{source}' holds chat messages, but the policy's "
                            f"tokenizer has no chat template")
        prompts = [render_messages(tokenizer, m, f"{field}: row {i} of '{source}'") for i, m in enumerate(values)]
    else:
        bad = [i for i, v in enumerate(values) if not isinstance(v, str) or not v.strip()]
        if bad:
            raise DataError(f"{field}: column '{prompt_key}' of '{source}' must hold non-empty strings or chat "
                            f"messages; rows {bad[:5]} do not (e.g. {values[bad[0]]!r})")
        prompts = list(values)
    out = PromptSet(prompts, columns, source, templated)
    if max_prompt_length is None:
        return out
    lengths = [len(ids) for ids in encode(tokenizer, prompts, templated, chat_template)]
    long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if not long:
        return out
    if long_prompts == "error":
        raise DataError(f"{field}: {len(long)} of {len(prompts)} prompts of '{source}' are longer than "
                        f"max_prompt_length={max_prompt_length} tokens (row {long[0]}: {lengths[long[0]]} tokens); "
                        f"set data.long_prompts to 'filter' or 'truncate_left'")
    if long_prompts == "truncate_left":
        out.truncated = len(long)
        return out
    keep = [i for i in range(len(prompts)) if lengths[i] <= max_prompt_length]
    if not keep:
        raise DataError(f"{field}: every prompt of '{source}' is longer than max_prompt_length={max_prompt_length}")
    return PromptSet([prompts[i] for i in keep], [columns[i] for i in keep], source, templated, filtered=len(long))


def render_messages(tokenizer, messages, where: str) -> str:
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DataError(f"{where}: chat messages must be a list of {{role, content}}, got {messages!r:.200}")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(tokenizer, prompts: list[str], templated: bool, chat_template: bool = False) -> list[list[int]]:
    """Token ids of prompts for the policy: a rendered chat template as it is (its special tokens are in the text);
    a plain prompt wrapped as a user turn when `chat_template` (data.chat_template), else with the tokenizer's own
    special tokens (e.g. BOS)."""
    if templated:
        return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if chat_template:
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)) for p in prompts]
    return [tokenizer(p)["input_ids"] for p in prompts]


# ---------------------------------------------------------------- order


class RowStream:
    """Batches of row indices in seeded epochs; `position` rows of `epoch` are already consumed. Its state is saved
    with a checkpoint, so a resumed run goes on with the next unseen rows (an RL run's prompts, a stage's rows)."""

    def __init__(self, rows: int, batch_size: int, seed: int, epoch: int = 0, position: int = 0):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.position = epoch, position

    def order(self, epoch: int) -> list[int]:
        order = list(range(self.rows))
        random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            order = self.order(self.epoch)
            take = order[self.position:self.position + self.batch_size - len(indices)]
            indices += take
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return indices

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "rows": self.rows}

    def restored(self, saved: dict | None, field: str = "data.prompts") -> "RowStream":
        """This stream moved to where a checkpoint's `state()` left it (nothing saved: unchanged); saved on other
        rows than these, refused naming `field`."""
        if saved:
            if saved.get("rows") not in (None, self.rows):
                raise DataError(f"{field}: the checkpoint was made on {saved['rows']} rows, the source now has "
                                f"{self.rows}: resume with the same data (or a new run_name)")
            self.epoch, self.position = int(saved["epoch"]), int(saved["position"])
        return self


class PromptStream(RowStream):
    """Batches of a PromptSet in seeded epochs (a RowStream over its rows)."""

    def __init__(self, prompts: PromptSet, batch_size: int, seed: int, epoch: int = 0, position: int = 0):
        super().__init__(len(prompts), batch_size, seed, epoch, position)
        self.prompts = prompts

    def __next__(self) -> Batch:
        return self.prompts.batch(super().__next__())

    @classmethod
    def resume(cls, prompts: PromptSet, batch_size: int, seed: int, saved: dict | None, iteration: int) -> "PromptStream":
        """The stream after what a checkpoint consumed: its saved (epoch, position), or for a checkpoint without
        one, `iteration` batches of `batch_size`."""
        stream = cls(prompts, batch_size, seed)
        if saved:
            return stream.restored(saved)
        stream.epoch, stream.position = divmod(iteration * batch_size, len(prompts))
        return stream
