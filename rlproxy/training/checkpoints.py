"""Trainer checkpoints on disk, and fusing an adapter into a model.

A checkpoint is a directory `step_000123/` holding the adapter in mlx-lm's format
(`adapters.safetensors` + `adapter_config.json`, so `mlx_lm.load(model, adapter_path=...)` opens
it), the optimizer state (`optimizer.safetensors`) and `trainer_state.json` (step, adapter version,
settings). It is written into a temp directory and renamed, so a directory named `step_*` is
always complete; `trainer_state.json` is written last and its presence is checked anyway.

A file can still rot afterwards (a disk error, a hand edit). `read_checkpoint` reads the adapter
strictly (UNREADABLE: the caller falls back to an older checkpoint) and, with `partial`, gives
back None for an unreadable optimizer state or trainer_state.json, with why: the weights are
worth resuming from with a fresh optimizer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from rlproxy.paths import ADAPTER_CONFIG, TRAINER_STATE, complete_checkpoints


@contextmanager
def written_whole(final: Path):
    """A temporary folder beside FINAL to write into, renamed to FINAL (replacing it) when the
    block ends without an error; removed otherwise. A reader never sees half a checkpoint."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_optimizer(folder: Path, optimizer_state) -> None:
    flat = {k: v for k, v in tree_flatten(optimizer_state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(folder / "optimizer.safetensors"), flat)


def save_checkpoint(root: Path, step: int, version: int, adapter: dict[str, mx.array],
                    optimizer_state, lora_config: dict, settings: dict,
                    extra: dict | None = None) -> Path:
    """Write checkpoint STEP atomically (`written_whole`). Pruning is `prune_checkpoints`,
    apart, so that the trainer can prune under the lock a rollback request pins its target
    with."""
    final = Path(root) / f"step_{step:06d}"
    with written_whole(final) as tmp:
        mx.save_safetensors(str(tmp / "adapters.safetensors"), adapter)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2))
        save_optimizer(tmp, optimizer_state)
        (tmp / TRAINER_STATE).write_text(json.dumps(
            {"step": step, "adapter_version": version, "settings": settings, **(extra or {})},
            indent=2, default=str))
    return final


def prune_checkpoints(root: Path, keep: int, protect: set[str]) -> list[Path]:
    """Keep the KEEP newest complete checkpoints under ROOT, and every folder named in PROTECT
    (a rollback's target, pending or done, stays though older than the KEEP newest). Each other
    one is renamed out of the listing at once (quick, atomic) and returned for the caller to
    delete, with what an earlier prune left behind (a process that died before deleting)."""
    pruned = [p for p in Path(root).glob(".pruned-*") if p.is_dir()]
    for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        if old.name not in protect:
            trash = old.with_name(f".pruned-{old.name}-{uuid.uuid4().hex[:8]}")
            try:
                old.rename(trash)
            except OSError:  # as rmtree(ignore_errors=True) was: a prune never fails a save
                continue
            pruned.append(trash)
    return pruned


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def layout_mismatch(current: dict[str, mx.array], adapter: dict[str, mx.array],
                    current_opt=None, opt_state=None) -> str | None:
    """Why a checkpoint's adapter (and optimizer state) cannot replace CURRENT's, or None.
    MLX's `update` takes arrays of any shape without a word; serving or training fails later."""
    mine = {k: v.shape for k, v in current.items()}
    theirs = {k: v.shape for k, v in adapter.items()}
    if mine != theirs:
        diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs[k]]
        k = diff[0]
        return f"{k}: {theirs.get(k)} in the checkpoint, {mine.get(k)} here"
    shapes = lambda tree: {k: v.shape for k, v in tree_flatten(tree or {})  # noqa: E731
                           if isinstance(v, mx.array)}
    if shapes(current_opt) and shapes(opt_state) != shapes(current_opt):  # an unused one: any
        return "its optimizer state has other shapes than this trainer's"
    return None


# what reading a rotten checkpoint file raises (mx.load: RuntimeError, ValueError)
UNREADABLE = (OSError, RuntimeError, ValueError, TypeError, KeyError)


def load_checkpoint(path: Path) -> tuple[dict[str, mx.array], dict, dict]:
    """(adapter weights, optimizer state tree, trainer state); UNREADABLE if any is not."""
    adapter, optimizer, state, _ = read_checkpoint(path)
    return adapter, optimizer, state


def read_checkpoint(path: Path, partial: bool = False
                    ) -> tuple[dict[str, mx.array], dict | None, dict | None, list[str]]:
    """(adapter weights, optimizer state tree, trainer state, what could not be read). Raises
    UNREADABLE for an unreadable adapter; so for the others too unless PARTIAL, where each
    one that cannot be read is None and named in the list."""
    path = Path(path)
    adapter = mx.load(str(path / "adapters.safetensors"))
    mx.eval(adapter)
    problems: list[str] = []
    optimizer = state = None
    try:
        optimizer = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
        mx.eval(optimizer)
    except UNREADABLE as e:
        if not partial:
            raise
        problems.append(f"optimizer.safetensors: {type(e).__name__}: {e}")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        if not isinstance(state, dict) or not all(
                isinstance(state.get(k), int) for k in ("step", "adapter_version")):
            raise ValueError("no step number or adapter version in it")
    except UNREADABLE as e:
        if not partial:
            raise
        problems.append(f"{TRAINER_STATE}: {type(e).__name__}: {e}")
        state = None
    return adapter, optimizer, state, problems


def fuse(model_source: str, adapter_dir: Path, out_dir: Path, dequantize: bool = False) -> Path:
    """Merge the adapter into the base weights and save a plain model `mlx_lm.load` opens.
    DEQUANTIZE: every weight in full precision (GGUF export needs it), as `mlx_lm.fuse`'s."""
    import mlx_lm
    from mlx_lm.utils import dequantize_model, save

    model, tokenizer, config = mlx_lm.load(model_source, adapter_path=str(adapter_dir),
                                           return_config=True)
    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    save(Path(out_dir), model_source, model, tokenizer, config)
    return Path(out_dir)
