"""Checkpoint sets: one file per stage, made one set by a manifest written last.

A run with ``--checkpoint DIR`` leaves, after step N, ``stage{s}-step{N}-{run}.pt`` for every
stage (its module's and optimizer's state, plain tensors) and then ``checkpoint.json``::

    {"format": "umopt-checkpoint/1", "step": N, "run": "3f9a0c1e", "stages": S,
     "model": {...}, "optimizer": "sgd", "profile_sha256": ..., "schedules": [...],
     "files": [{"path": "stage0-step12-3f9a0c1e.pt", "sha256": ...}, ...]}

(``run`` is drawn once per run, so that no run overwrites a file the current manifest names.)

Each stage writes its own file atomically; once every stage has (all of them report the file's
hash), rank 0 replaces the manifest, and only then are the older files removed. A failure at any
point leaves the previous manifest and the files it names untouched: the last complete set is
always resumable, and a set that never completed is never read.

``--resume`` reads the manifest, refuses one that is not for this model, split and optimizer, and
checks every file against its hash before anything is loaded; files are then loaded as plain
tensors (``weights_only``), never unpickled as objects, so a tampered file cannot run code.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import UmoptError, first_line
from ..fileio import read_json, write_atomic, write_json
from ..formats.profile import Profile, pydantic_error_line

__all__ = [
    "MANIFEST",
    "CHECKPOINT_FORMAT",
    "Manifest",
    "stage_file",
    "model_identity",
    "file_sha256",
    "read_manifest",
    "write_manifest",
    "remove_stale",
]

MANIFEST = "checkpoint.json"
CHECKPOINT_FORMAT = "umopt-checkpoint/1"


class ManifestFile(BaseModel):
    model_config = ConfigDict(strict=True)
    path: str = Field(
        pattern=r"^stage\d+-step\d+-[0-9a-f]+\.pt$"
    )  # a name inside DIR, never a path out of it
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    format: str
    step: int = Field(ge=0)
    run: str = Field(pattern=r"^[0-9a-f]+$")
    stages: int = Field(ge=1)
    model: dict[str, Any]
    optimizer: str
    files: list[ManifestFile]


def stage_file(s: int, step: int, run: str) -> str:
    return f"stage{s}-step{step}-{run}.pt"


def model_identity(profile: Profile) -> dict[str, Any]:
    """What a stage's saved state depends on: the model, its seed and where the stages are cut."""
    return {
        "name": profile.model.name,
        "args": profile.model.args,
        "seed": profile.model.seed,
        "layers": [st.layers for st in profile.stages],
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(
    folder: str | Path, profile: Profile, optimizer: str, *, verify: Optional[list[int]] = None
) -> Manifest:
    """The manifest of ``folder``, checked against this run (one-line errors); the files of the
    stages in ``verify`` (default: all) are checked against their hashes."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        stray = sorted(p.name for p in folder.glob("stage*.pt")) if folder.is_dir() else []
        raise UmoptError(
            f"--resume: {folder} has no complete checkpoint set (no {MANIFEST}"
            + (f"; {len(stray)} stage file(s) without one are not a set" if stray else "")
            + ")"
        )
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise UmoptError(f"{path}: not a {CHECKPOINT_FORMAT} manifest")
    try:
        man = Manifest.model_validate(data)
    except ValidationError as exc:
        raise UmoptError(f"{path}: {pydantic_error_line(exc)}") from None
    want = model_identity(profile)
    if man.stages != profile.num_stages or len(man.files) != man.stages:
        raise UmoptError(f"{path}: a checkpoint of {man.stages} stages, this run has {profile.num_stages}")
    if man.model != want:
        raise UmoptError(
            f"{path}: a checkpoint of {_describe(man.model)}, this run's profile is {_describe(want)}"
        )
    if man.optimizer != optimizer:
        raise UmoptError(
            f"{path}: a checkpoint of the {man.optimizer} optimizer, this run uses {optimizer} (--optimizer)"
        )
    for s, f in enumerate(man.files):
        if f.path != stage_file(s, man.step, man.run):
            raise UmoptError(
                f"{path}: stage {s}'s file is {f.path}, expected {stage_file(s, man.step, man.run)}"
            )
    for s in range(man.stages) if verify is None else verify:
        f = folder / man.files[s].path
        if not f.is_file():
            raise UmoptError(f"--resume: {f} is missing: the set of step {man.step} is incomplete")
        if file_sha256(f) != man.files[s].sha256:
            raise UmoptError(
                f"--resume: {f} does not match its hash in {MANIFEST}: changed or corrupted since it was written"
            )
    return man


def _describe(identity: dict[str, Any]) -> str:
    args = ",".join(f"{k}={v}" for k, v in sorted(identity.get("args", {}).items()))
    cuts = (
        [lay[0] for lay in identity.get("layers", [])] + [identity["layers"][-1][1]]
        if identity.get("layers")
        else []
    )
    return f"{identity.get('name')}({args}) seed {identity.get('seed')} cut at {cuts}"


def write_manifest(
    folder: str | Path,
    step: int,
    run: str,
    profile: Profile,
    optimizer: str,
    hashes: list[str],
    schedules: list[dict],
) -> None:
    """Make the files of ``step`` (one per stage, hashes in stage order) the folder's set."""
    write_json(
        Path(folder) / MANIFEST,
        {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "run": run,
            "stages": len(hashes),
            "model": model_identity(profile),
            "optimizer": optimizer,
            "profile_sha256": profile.sha256,
            "schedules": schedules,
            "files": [{"path": stage_file(s, step, run), "sha256": h} for s, h in enumerate(hashes)],
        },
    )


def remove_stale(folder: str | Path, s: int, keep: str) -> None:
    """Remove stage ``s``'s files other than ``keep`` (once the manifest names it)."""
    for p in Path(folder).glob(f"stage{s}-step*.pt"):
        if re.fullmatch(rf"stage{s}-step\d+-[0-9a-f]+\.pt", p.name) and p.name != keep:
            p.unlink(missing_ok=True)


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` through a temporary file: the path holds the old file or the new one, whole."""
    import torch

    try:
        write_atomic(path, lambda tmp: torch.save(obj, tmp))
    except (OSError, RuntimeError) as exc:
        # torch.save reports a full disk as "unexpected pos 128 vs 0": say what failed, and how
        # much room there was
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        first = first_line(exc, 120) or exc.__class__.__name__
        raise OSError(
            f"cannot write {path} ({free / 2**20:.0f} MiB free there; disk full or a file size limit?): {first}"
        ) from None


def write_set(
    folder: Path,
    s: int,
    state: dict,
    step: int,
    run: str,
    profile: Profile,
    optimizer: str,
    schedules: list[str],
    io_group: Any,
    writes: bool,
    device: Any,
    delay_s: float = 0.0,
) -> None:
    """This stage's part of the checkpoint set of ``step`` (collective over the world, on the
    I/O group): its file (where ``writes``: replica 0), then, once every stage has written its
    own, the manifest (rank 0), then the old files go."""
    from .comm import TorchComm
    from .signals import waiting

    comm = TorchComm.current()

    name = stage_file(s, step, run)
    if writes:
        time.sleep(delay_s)
        save_atomic(state, folder / name)
    with waiting(f"every stage's checkpoint file of step {step}", io=True):
        hashes = comm.all_gather_object(file_sha256(folder / name) if writes else None, io_group)
    if comm.rank == 0:
        named = [
            {"path": str(p), "sha256": hashlib.sha256(Path(p).read_bytes()).hexdigest()} for p in schedules
        ]
        write_manifest(folder, step, run, profile, optimizer, [h for h in hashes if h is not None], named)
    with waiting(f"the checkpoint manifest of step {step}", io=True):
        comm.barrier(io_group, device)
    if writes:
        remove_stale(folder, s, name)


def load_stage(folder: str, s: int, profile: Profile, optimizer: str, device: Any) -> tuple[dict, int]:
    """Stage ``s``'s state in the folder's last complete set, and the step it was written after."""
    import torch

    man = read_manifest(folder, profile, optimizer, verify=[s])
    path = Path(folder) / man.files[s].path
    try:
        # weights_only: a checkpoint is data; unpickling anything else could run code
        return torch.load(path, map_location=device, weights_only=True), man.step
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is not this stage's state
        raise UmoptError(
            f"--resume: {path} is not stage {s}'s state ({exc.__class__.__name__}: {first_line(exc)})"
        ) from None
