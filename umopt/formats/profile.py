"""The profile file (``umopt-profile/1``): what each pipeline stage costs.

A profile holds, for every stage, forward and backward milliseconds of one chunk at each measured
chunk size, the bytes it receives, sends and keeps for backward per sample, its static memory and
its optimizer step, plus the links between neighbouring stages. ``umopt profile`` writes it and
``umopt solve`` reads it; the field meanings are fixed by docs/formats.md.

Profiles are looked up by path or, failing that, by the name of a file bundled in
``umopt.profiles`` (``umopt solve gpt-sim ...``).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from annotated_types import Len
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_serializer,
    model_validator,
)

from ..errors import UmoptError
from ..fileio import read_json, write_json
from ..limits import MAX_BYTES, MAX_CELLS, MAX_MINIBATCH, MAX_MS, MAX_STAGES

__all__ = [
    "PROFILE_FORMAT",
    "StageProfile",
    "LayerProfile",
    "TokenFit",
    "TokenCosts",
    "LengthsInfo",
    "LinkProfile",
    "AllReduceProfile",
    "Profile",
    "ProfileMeta",
    "NoiseMeta",
    "ProbesMeta",
    "CalibrationMeta",
    "bundled_profiles",
    "resolve_profile_path",
    "load_profile",
    "save_profile",
    "pydantic_error_line",
    "load_model_file",
    "default_sizes",
]

PROFILE_FORMAT = "umopt-profile/1"

# bounded (umopt.limits) so that no sum over a schedule overflows and nothing huge is allocated
NonNegFloat = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_BYTES)]


class _Strict(BaseModel):
    # Strict: a number written as a string is a malformed file, not something to guess at.
    # Extra fields are allowed: the spec lets writers add metadata freely.
    model_config = ConfigDict(strict=True, extra="allow")


class TokenFit(_Strict):
    """An op's time on a chunk of sequences: ``a_ms + b_ms * tokens + c_ms * squares + d_ms *
    sequences``, tokens the sum of its sequences' lengths and squares the sum of their squares
    (padded: every sequence counted at the chunk's longest); ``d_ms`` what each sequence costs
    of its own (a packed chunk's attention runs once per document where no varlen kernel takes
    them all). ``residual``: the fit's root-mean-square relative error."""

    a_ms: NonNegFloat
    b_ms: NonNegFloat
    c_ms: NonNegFloat = 0.0
    d_ms: NonNegFloat = 0.0
    residual: Optional[NonNegFloat] = None


class TokenCosts(_Strict):
    """A stage's costs on sequences of different lengths, in one mode: "packed" (a chunk's
    sequences concatenated, attention within each) or "padded" (each padded to the chunk's
    longest). docs/formats.md, "Sequences of different lengths"."""

    forward: TokenFit
    backward: TokenFit
    backward_input: Optional[TokenFit] = None
    backward_weight: Optional[TokenFit] = None
    input_bytes_per_token: NonNegInt
    output_bytes_per_token: NonNegInt
    stash_bytes_per_token: NonNegInt
    # what an op allocates while it runs beyond what it keeps, per token (beside the stage's
    # work_bytes; 0 where not measured)
    work_bytes_per_token: NonNegInt = 0


class LengthsInfo(_Strict):
    """What a profile knows of sequence lengths: the longest it timed, and its modes."""

    max_length: Annotated[int, Field(ge=1)]
    modes: list[Literal["packed", "padded"]]


class StageProfile(_Strict):
    layers: Annotated[list[NonNegInt], Len(2, 2)]
    forward_ms: list[NonNegFloat]
    backward_ms: list[NonNegFloat]
    input_bytes_per_sample: NonNegInt
    output_bytes_per_sample: NonNegInt
    stash_bytes_per_sample: NonNegInt
    static_bytes: NonNegInt
    optimizer_ms: NonNegFloat
    # what the runtime spends on each op beyond its compute (dispatch, posting and waiting on
    # messages, buffer views): fitted to runs in the pipeline; 0 where not known
    op_overhead_ms: NonNegFloat = 0.0
    # the spread of each entry's repeats (interquartile range), where it was measured
    forward_iqr_ms: Optional[list[NonNegFloat]] = None
    backward_iqr_ms: Optional[list[NonNegFloat]] = None
    # bytes of the stage's gradients: what data-parallel replicas all-reduce (None: not recorded)
    param_bytes: Optional[NonNegInt] = None
    # the backward split into the input gradient (a B op where the stage has W ops) and the
    # weight gradient (a W op), one value per size each (None: not measured)
    backward_input_ms: Optional[list[NonNegFloat]] = None
    backward_weight_ms: Optional[list[NonNegFloat]] = None
    # sequences of different lengths: the stage's costs by tokens, per mode (None: not profiled so)
    tokens: Optional[dict[Literal["packed", "padded"], TokenCosts]] = None
    # what an op allocates while it runs beyond what the stage keeps, and the optimizer step's
    # temporaries (see [Note: what an op allocates while it runs]); 0 where not measured (CPUs)
    work_bytes: NonNegInt = 0
    work_bytes_per_sample: NonNegInt = 0
    optimizer_work_bytes: NonNegInt = 0


class LayerProfile(_Strict):
    """One layer (or block) of the model, timed on its own: what a virtual stage of several
    chunks per rank is summed from (docs/formats.md, "Several chunks per rank")."""

    forward_ms: list[NonNegFloat]
    backward_ms: list[NonNegFloat]
    input_bytes_per_sample: NonNegInt
    output_bytes_per_sample: NonNegInt
    stash_bytes_per_sample: NonNegInt
    static_bytes: NonNegInt
    param_bytes: Optional[NonNegInt] = None
    backward_input_ms: Optional[list[NonNegFloat]] = None
    backward_weight_ms: Optional[list[NonNegFloat]] = None
    work_bytes: NonNegInt = 0
    work_bytes_per_sample: NonNegInt = 0
    optimizer_work_bytes: NonNegInt = 0
    # sequences of different lengths: the layer's costs by tokens, per mode (what a virtual stage
    # of several chunks per rank sums; None: not profiled so)
    tokens: Optional[dict[Literal["packed", "padded"], TokenCosts]] = None


class LinkProfile(_Strict):
    latency_ms: NonNegFloat
    bytes_per_ms: Annotated[float, Field(gt=0, le=MAX_BYTES, allow_inf_nan=False)]
    # what each message costs beyond its transfer inside a running pipeline (fitted to runs)
    message_overhead_ms: NonNegFloat = 0.0
    source: Optional[str] = None  # "measured" or "given" (umopt profile --link-latency-ms)


class AllReduceProfile(_Strict):
    """The all-reduce between data-parallel replicas of a stage: ``latency_ms`` plus
    ``2 (N - 1) / N * bytes / bus_bytes_per_ms`` for N replicas (a ring; the bus bandwidth of
    nccl-tests). In a profile: measured among ``replicas`` processes; in a schedule: what its
    prediction assumed for ``replicas``."""

    replicas: Annotated[int, Field(ge=1, le=MAX_STAGES)]
    latency_ms: NonNegFloat
    bus_bytes_per_ms: Annotated[float, Field(gt=0, le=MAX_BYTES, allow_inf_nan=False)]


class ModelInfo(_Strict):
    name: str
    args: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0  # the runtime builds the model with it: every rank the same weights


class DeviceInfo(_Strict):
    type: Literal["cuda", "cpu", "sim"]
    name: str = ""
    dtype: str = "float32"
    # the settings the kernels were timed under (TF32, matmul precision, cuDNN autotuning:
    # umopt.devices.numerics); None where not recorded
    numerics: Optional[dict[str, Union[bool, str]]] = None
    threads: Optional[int] = None  # CPU: intra-op threads per stage it was timed with (the runtime's default)


class _Meta(BaseModel):
    # what a profile says of how it was made: free-form beyond the fields umopt reads, and left
    # out of the file where empty
    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _without_empty(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None and v != [] and v != {}}


class NoiseMeta(_Meta):
    """How noisy the machine was while profiling (umopt.measure.noise)."""

    median_spread: Optional[float] = None  # the median interquartile spread over entries
    p90_spread: Optional[float] = None
    max_repeats: Optional[int] = None
    drift: list[float] = []  # per stage: how much the machine's speed changed between rounds
    reference_ms: list[float] = []  # per stage: a fixed matmul's median time


class ProbesMeta(_Meta):
    """The probe runs of the runtime the profile was fitted to (umopt.probes)."""

    ran: bool = False
    why: Optional[str] = None  # where they did not run
    minibatch: Optional[int] = None
    schedules: Optional[int] = None
    measured: Optional[dict[str, Any]] = None  # the op times before the fit
    measured_over_fitted: dict[str, float] = {}  # per probe schedule, what the fit left
    order_ratio: dict[str, float] = {}  # per order, the geometric mean of measured / fitted


class CalibrationMeta(_Meta):
    """What ``umopt calibrate`` (or the probes) fitted the profile to (umopt.measure.calibrate)."""

    reports: list[str] = []
    ratios: dict[str, dict[str, float]] = {}  # "stage1.F": {size: measured / profiled}
    op_overhead_ms: float = 0.0
    message_overhead_ms: float = 0.0
    step_overhead_ms: float = 0.0
    residual_rms: Optional[float] = None
    # costs by tokens fitted to runs of sequences: "stage0.packed.forward": {"ratio", "per_op_ms",
    # "ops", "rms_before", "rms_after"} (umopt.measure.calibrate_tokens)
    tokens: dict[str, dict[str, float]] = {}


class ProfileMeta(_Meta):
    """``meta``: how the profile was made; no number of the cost model comes from here."""

    torch: Optional[str] = None
    date: Optional[str] = None
    command: Optional[str] = None
    optimizer: Optional[str] = None
    warmup: Optional[int] = None
    repeats: Optional[int] = None
    stages_timed_concurrently: Optional[bool] = None
    memory_limit: Optional[str] = None  # where the memory limit came from
    noise: Optional[NoiseMeta] = None
    warnings: list[str] = []
    probes: Optional[ProbesMeta] = None
    calibration: Optional[CalibrationMeta] = None


class Profile(_Strict):
    format: Literal["umopt-profile/1"]
    model: ModelInfo
    device: DeviceInfo
    sizes: Annotated[list[Annotated[int, Field(ge=1, le=MAX_MINIBATCH)]], Len(1)]
    stages: Annotated[list[StageProfile], Len(1, MAX_STAGES)]
    links: list[LinkProfile]
    # the link from the last rank back to the first, which looped placement of several chunks
    # per rank uses (None: not measured; the slowest of ``links`` stands in)
    wrap_link: Optional[LinkProfile] = None
    # per model layer (index = the layer numbers of ``stages[s].layers``), where the model was
    # profiled finely enough to cut a rank's layers into several chunks (None: not profiled so)
    layers: Optional[list[LayerProfile]] = None
    memory_limit_bytes: Optional[Annotated[int, Field(gt=0, le=MAX_BYTES)]] = None
    allreduce: Optional[AllReduceProfile] = None
    # sequences of different lengths: set where every stage has its costs by tokens
    lengths: Optional[LengthsInfo] = None
    # where `umopt profile` cut the model into stages, and each layer's time that chose the cut
    split: Optional[list[int]] = None
    layer_ms: Optional[list[float]] = None
    meta: ProfileMeta = Field(default_factory=ProfileMeta, strict=False)

    _path: Optional[str] = PrivateAttr(default=None)
    _sha256: Optional[str] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        sizes = self.sizes
        if sizes[0] != 1:
            raise ValueError(f"sizes must start at 1, got {sizes[0]}")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError("sizes must be strictly ascending")
        n = len(sizes)
        for s, st in enumerate(self.stages):
            if (st.backward_input_ms is None) != (st.backward_weight_ms is None):
                raise ValueError(
                    f"stages[{s}] has one of backward_input_ms and backward_weight_ms without the other"
                )
            for key in (
                "forward_ms",
                "backward_ms",
                "forward_iqr_ms",
                "backward_iqr_ms",
                "backward_input_ms",
                "backward_weight_ms",
            ):
                values = getattr(st, key)
                if values is not None and len(values) != n:
                    raise ValueError(f"stages[{s}].{key} has {len(values)} values for {n} sizes")
            if st.layers[0] >= st.layers[1]:
                raise ValueError(f"stages[{s}].layers {st.layers} is an empty range")
            if s > 0 and st.layers[0] != self.stages[s - 1].layers[1]:
                raise ValueError(f"stages[{s}].layers does not start where stage {s - 1} ends")
            if (
                s + 1 < len(self.stages)
                and st.output_bytes_per_sample != self.stages[s + 1].input_bytes_per_sample
            ):
                raise ValueError(
                    f"stages[{s}].output_bytes_per_sample differs from stages[{s + 1}].input_bytes_per_sample"
                )
        if self.layers is not None:
            _check_layers(self.layers, self.stages, n)
        if self.lengths is not None:
            for s, st in enumerate(self.stages):
                missing = [m for m in self.lengths.modes if not st.tokens or m not in st.tokens]
                if missing:
                    raise ValueError(f"stages[{s}] has no costs by tokens for mode {missing[0]}")
            if self.layers is not None and any(ly.tokens for ly in self.layers):
                for i, ly in enumerate(self.layers):
                    missing = [m for m in self.lengths.modes if not ly.tokens or m not in ly.tokens]
                    if missing:
                        raise ValueError(f"layers[{i}] has no costs by tokens for mode {missing[0]}")
        if len(self.stages) * sizes[-1] > MAX_CELLS:
            raise ValueError(
                f"{len(self.stages)} stages x chunk size {sizes[-1]} is over umopt's limit of {MAX_CELLS} cells"
            )
        if len(self.links) != len(self.stages) - 1:
            raise ValueError(
                f"{len(self.stages)} stages need {len(self.stages) - 1} links, got {len(self.links)}"
            )
        return self

    # --- convenience -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def path(self) -> Optional[str]:
        return self._path

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self.to_json_bytes()).hexdigest()
        return self._sha256

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(indent=1).encode()

    def with_memory_limit(self, limit: Optional[int]) -> "Profile":
        """The same profile with another memory limit (``--memory-limit``)."""
        other = self.model_copy(update={"memory_limit_bytes": limit})
        other._path, other._sha256 = self._path, self._sha256
        return other


def _check_layers(layers: list[LayerProfile], stages: list[StageProfile], n: int) -> None:
    if stages[0].layers[0] != 0 or len(layers) != stages[-1].layers[1]:
        raise ValueError(
            f"layers has {len(layers)} entries; the stages cover layers "
            f"{stages[0].layers[0]}..{stages[-1].layers[1] - 1} (layers needs one entry per layer from 0)"
        )
    for i, ly in enumerate(layers):
        if (ly.backward_input_ms is None) != (ly.backward_weight_ms is None):
            raise ValueError(
                f"layers[{i}] has one of backward_input_ms and backward_weight_ms without the other"
            )
        for key in ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms"):
            values = getattr(ly, key)
            if values is not None and len(values) != n:
                raise ValueError(f"layers[{i}].{key} has {len(values)} values for {n} sizes")
        if i > 0 and ly.input_bytes_per_sample != layers[i - 1].output_bytes_per_sample:
            raise ValueError(
                f"layers[{i}].input_bytes_per_sample differs from layers[{i - 1}].output_bytes_per_sample"
            )


def default_sizes(max_size: int) -> list[int]:
    """Powers of two below ``max_size``, then ``max_size``: the chunk sizes measured by default."""
    sizes, b = [], 1
    while b < max_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_size]


def pydantic_error_line(exc: ValidationError) -> str:
    """First validation error as ``where: what`` on one line."""
    err = exc.errors()[0]
    where = ""
    for part in err["loc"]:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = "missing field"
    elif err["type"] == "less_than_equal":
        shown = repr(err.get("input"))
        msg = (
            f"{shown if len(shown) <= 24 else shown[:20] + '...'} is over umopt's limit of {err['ctx']['le']}"
        )
    elif err["type"] == "literal_error" and where == "format":
        msg = f"format is {err.get('input')!r}, expected {PROFILE_FORMAT!r}"
    return f"{where}: {msg}" if where else msg


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped with umopt."""
    root = resources.files("umopt.profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def resolve_profile_path(name_or_path: str) -> Path:
    """A path as given if it exists, else the bundled profile of that name."""
    p = Path(name_or_path)
    if p.exists():
        return p
    name = name_or_path[:-5] if name_or_path.endswith(".json") else name_or_path
    if "/" not in name and name in bundled_profiles():
        return Path(str(resources.files("umopt.profiles") / f"{name}.json"))
    raise UmoptError(
        f"{name_or_path}: no such file and no bundled profile of that name "
        f"(bundled: {', '.join(bundled_profiles()) or 'none'})"
    )


def load_model_file(path: str | Path, model: type[BaseModel], fmt: str, what: str):
    """Read a JSON file of format ``fmt`` into ``model``; every problem is a one-line :class:`UmoptError`."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise UmoptError(f"{path}: a {what} must be a JSON object")
    if data.get("format") != fmt:
        raise UmoptError(f"{path}: format is {data.get('format')!r}, expected {fmt!r}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise UmoptError(f"{path}: {pydantic_error_line(exc)}") from None


def load_profile(name_or_path: str | Path) -> Profile:
    """Read and validate a profile file, by path or bundled name."""
    path = resolve_profile_path(str(name_or_path))
    prof = load_model_file(path, Profile, PROFILE_FORMAT, "profile")
    prof._path = str(path)
    prof._sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return prof


def save_profile(profile: Profile, path: str | Path) -> None:
    write_json(path, profile.model_dump(mode="json"))
