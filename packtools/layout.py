"""Pack format v1: the one module that knows the on-disk layout of experts.pack and manifest.json.

experts.pack
    [0, 4096)           header page (HEADER below, zero padded), written last by the builder
    [data_start, size)  per MoE layer, n_expert blocks of `stride` bytes, expert-major:
                        offset(layer, e) = layers[layer].offset + e * layers[layer].stride
    A block holds every per-expert tensor ("role") of one expert, each at a sub-offset that is a
    multiple of 256 (the format's contract; this builder uses 4096 so that every role can be written
    and read with O_DIRECT), copied verbatim from the source (same ggml type, same bytes);
    `payload_bytes` is the un-padded block length the per-block sha256 and crc32 cover; the rest is
    zeros.

manifest.json
    The keys DESIGN.md fixes (format, version, fingerprint, alignment, pack, trunk, source, model,
    layers) plus what this project adds (model.moe_layers, trunk.size_bytes, trunk.tensor_sha256,
    created_utc, minor_version, layers[].crc32). `fingerprint` is the sha256 of the canonical JSON (keys sorted, no spaces,
    ASCII) of the manifest as stored, every key, without NON_FINGERPRINT_KEYS; it is also stored in the pack header and in trunk.gguf, which is how a
    pack, its manifest and its trunk are known to belong together.

Revisions of v1 (additive: `version` stays 1, so a reader of an earlier revision still reads a pack of
a later one; `minor_version`, absent before 1.1, says which revision wrote it):
    1.0  per-block sha256 (`layers[].sha256`), checked on demand by `expertpack verify`.
    1.1  (2026-11-30) `layers[].crc32`: the CRC-32 (zlib's, as `zlib.crc32` and `crc32` tools print
         it, 8 lowercase hex digits) of each block's payload, one per expert beside its sha256, so
         that expertd can check every block as it reads it (~0.25 CPU-s per GB, BENCHMARKS.md;
         sha256 costs twice that). A 1.0 pack (no `crc32`) is still served, unchecked at read time.

This module does no I/O beyond reading and writing these two small structures.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .errors import ManifestError
from .units import round_up

FORMAT_NAME = "expertpack"
FORMAT_VERSION = 1
FORMAT_MINOR_VERSION = 1  # 1.1: layers[].crc32 (see the module docstring)
ALIGNMENT = 4096  # O_DIRECT contract: every block offset, stride and read length
MIN_ROLE_ALIGNMENT = 256  # format v1: every role's sub-offset inside its block is a multiple of this
ROLE_ALIGNMENT = ALIGNMENT  # what plan_layers uses: each role slice is an O_DIRECT-able range
DATA_START = ALIGNMENT  # one header page

PACK_FILE = "experts.pack"
MANIFEST_FILE = "manifest.json"
TRUNK_FILE = "trunk.gguf"
TRUNK_FINGERPRINT_KEY = "expertpack.fingerprint"
NON_FINGERPRINT_KEYS = ("fingerprint", "created_utc")

# magic, version, alignment, data_start, size_bytes, fingerprint (64 ascii hex digits)
HEADER = struct.Struct("<8sIIQQ64s")
MAGIC = b"EXPTPACK"


class ExpertKey(NamedTuple):
    layer: int
    expert: int


@dataclass(frozen=True, slots=True)
class RoleLayout:
    role: str  # "gate", "up", "gate_up", "down", "down.bias", ...
    tensor: str  # source tensor name
    ggml_type: str
    shape: tuple[int, ...]  # ggml ne of one expert's slice
    offset: int  # relative to the block start
    nbytes: int


@dataclass(frozen=True, slots=True)
class LayerLayout:
    layer: int
    offset: int  # absolute in experts.pack
    stride: int
    payload_bytes: int
    roles: tuple[RoleLayout, ...]
    sha256: tuple[str, ...] = ()  # one per expert; empty while a build has not hashed the layer
    crc32: tuple[int, ...] = ()  # one per expert (format 1.1); empty in a 1.0 pack

    def block_offset(self, expert: int) -> int:
        return self.offset + expert * self.stride


@dataclass(frozen=True, slots=True)
class ModelInfo:
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    moe_layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SourceFile:
    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class TrunkInfo:
    file: str
    size_bytes: int
    tensor_sha256: dict[str, str] = field(default_factory=dict)  # tensor name -> sha256 of its data


@dataclass(frozen=True, slots=True)
class PackHeader:
    version: int
    alignment: int
    data_start: int
    size_bytes: int
    fingerprint: str

    def encode(self) -> bytes:
        raw = HEADER.pack(MAGIC, self.version, self.alignment, self.data_start, self.size_bytes,
                          self.fingerprint.encode("ascii"))
        return raw.ljust(DATA_START, b"\0")

    @classmethod
    def expected_for(cls, manifest: "Manifest") -> "PackHeader":
        """The header a pack described by `manifest` must carry."""
        return cls(FORMAT_VERSION, ALIGNMENT, manifest.data_start, manifest.pack_size_bytes, manifest.fingerprint)

    @classmethod
    def decode(cls, raw: bytes, path: Path | str) -> "PackHeader":
        if len(raw) < HEADER.size:
            raise ManifestError(f"{path}: shorter than the {HEADER.size}-byte pack header")
        magic, version, alignment, data_start, size_bytes, fp = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ManifestError(f"{path}: not an expert pack, or its build never finished (magic {magic!r})")
        return cls(version, alignment, data_start, size_bytes, fp.decode("ascii", "replace"))


@dataclass(frozen=True)
class Manifest:
    fingerprint: str
    pack_size_bytes: int
    data_start: int
    source_files: tuple[SourceFile, ...]
    model: ModelInfo
    layers: tuple[LayerLayout, ...]
    trunk: TrunkInfo
    created_utc: str = ""
    minor_version: int = FORMAT_MINOR_VERSION
    raw: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # as loaded, for the check

    def fingerprint_matches(self) -> bool:
        """True when the manifest, every key as stored (ours or a tool's), is what was fingerprinted."""
        return fingerprint_of(self.raw if self.raw is not None else self.to_dict()) == self.fingerprint

    def layer(self, layer: int) -> LayerLayout:
        for entry in self.layers:
            if entry.layer == layer:
                return entry
        raise KeyError(f"layer {layer} has no routed experts; MoE layers are {list(self.model.moe_layers)}")

    def block_offset(self, key: ExpertKey) -> int:
        return self.layer(key.layer).block_offset(key.expert)

    @property
    def has_crc32(self) -> bool:
        """Whether every block has a crc32 (format 1.1), so that a reader can check each one it reads."""
        return bool(self.layers) and all(len(entry.crc32) == self.model.n_expert for entry in self.layers)

    @property
    def max_stride(self) -> int:
        return max(entry.stride for entry in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "minor_version": self.minor_version,
            "fingerprint": self.fingerprint,
            "created_utc": self.created_utc,
            "alignment": ALIGNMENT,
            "pack": {"file": PACK_FILE, "size_bytes": self.pack_size_bytes, "data_start": self.data_start},
            "trunk": {
                "file": self.trunk.file,
                "size_bytes": self.trunk.size_bytes,
                "tensor_sha256": dict(self.trunk.tensor_sha256),
            },
            "source": {"files": [{"name": f.name, "size_bytes": f.size_bytes, "sha256": f.sha256}
                                 for f in self.source_files]},
            "model": {
                "arch": self.model.arch,
                "n_layer": self.model.n_layer,
                "n_expert": self.model.n_expert,
                "n_expert_used": self.model.n_expert_used,
                "moe_layers": list(self.model.moe_layers),
            },
            "layers": [_layer_to_dict(entry) for entry in self.layers],
        }

    def compute_fingerprint(self) -> str:
        return fingerprint_of(self.to_dict())

    def with_fingerprint(self) -> "Manifest":
        return Manifest(self.compute_fingerprint(), self.pack_size_bytes, self.data_start, self.source_files,
                        self.model, self.layers, self.trunk, self.created_utc, self.minor_version)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, pack_dir: Path | str) -> "Manifest":
        path = Path(pack_dir) / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(f"{path}: no manifest; {pack_dir} is not a finished pack (run `expertpack build`)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, where: Path | str = "manifest") -> "Manifest":
        r = _Reader(where)
        r.check(isinstance(data, dict), "", "a JSON object")
        r.check(data.get("format") == FORMAT_NAME, "format", f"{FORMAT_NAME!r}")
        r.check(data.get("version") == FORMAT_VERSION, "version", f"{FORMAT_VERSION} (this expertpack reads v1)")
        r.check(data.get("alignment") == ALIGNMENT, "alignment", str(ALIGNMENT))
        pack = r.obj(data, "pack")
        trunk = r.obj(data, "trunk")
        model = r.obj(data, "model")
        source = r.obj(data, "source")
        tensor_sha = r.obj(trunk, "tensor_sha256", "trunk.")
        r.check(pack.get("file") == PACK_FILE, "pack.file", repr(PACK_FILE))  # fixed names: no paths
        r.check(trunk.get("file") == TRUNK_FILE, "trunk.file", repr(TRUNK_FILE))
        return cls(
            fingerprint=r.string(data, "fingerprint"),
            pack_size_bytes=r.integer(pack, "size_bytes", "pack."),
            data_start=r.integer(pack, "data_start", "pack."),
            source_files=tuple(
                SourceFile(r.string(f, "name", "source.files[]."), r.integer(f, "size_bytes", "source.files[]."),
                           r.string(f, "sha256", "source.files[]."))
                for f in r.array(source, "files", "source.")
            ),
            model=ModelInfo(
                arch=r.string(model, "arch", "model."),
                n_layer=r.integer(model, "n_layer", "model."),
                n_expert=r.integer(model, "n_expert", "model."),
                n_expert_used=r.integer(model, "n_expert_used", "model."),
                moe_layers=r.integers(model, "moe_layers", "model."),
            ),
            layers=tuple(_layer_from_dict(entry, r) for entry in r.array(data, "layers")),
            trunk=TrunkInfo(
                file=r.string(trunk, "file", "trunk."),
                size_bytes=r.integer(trunk, "size_bytes", "trunk."),
                tensor_sha256={str(k): str(v) for k, v in tensor_sha.items()},
            ),
            created_utc=str(data.get("created_utc", "")),
            minor_version=r.integer(data, "minor_version") if "minor_version" in data else 0,
            raw=data,
        )


def fingerprint_of(manifest: dict[str, Any]) -> str:
    canonical = {k: v for k, v in manifest.items() if k not in NON_FINGERPRINT_KEYS}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """What the planner needs of one per-expert tensor."""

    role: str
    tensor: str
    ggml_type: str
    shape: tuple[int, ...]
    nbytes: int


def plan_layers(roles_by_layer: dict[int, list[RoleSpec]], n_expert: int) -> tuple[tuple[LayerLayout, ...], int]:
    """Lays out the blocks of every MoE layer in layer order; returns the layers and the pack size.
    Roles keep the order given (the caller sorts them)."""
    layers: list[LayerLayout] = []
    cursor = DATA_START
    for layer in sorted(roles_by_layer):
        roles: list[RoleLayout] = []
        end = 0
        for spec in roles_by_layer[layer]:
            offset = round_up(end, ROLE_ALIGNMENT)
            roles.append(RoleLayout(spec.role, spec.tensor, spec.ggml_type, spec.shape, offset, spec.nbytes))
            end = offset + spec.nbytes
        stride = round_up(end, ALIGNMENT)
        layers.append(LayerLayout(layer, cursor, stride, end, tuple(roles)))
        cursor += n_expert * stride
    return tuple(layers), cursor


CRC32_HEX = re.compile(r"[0-9a-f]{8}")


def block_crc32(data: Any, value: int = 0) -> int:
    """The format's fast block checksum: zlib's CRC-32 of `data` (any buffer), continuing from
    `value`. C speed, and it releases the GIL on large buffers, so reader threads check in parallel."""
    return zlib.crc32(data, value)


def format_crc32(value: int) -> str:
    return f"{value:08x}"


class BlockDigest:
    """Both checksums of one block's payload, fed in order as its bytes pass: sha256 (verify) and
    crc32 (every read)."""

    __slots__ = ("_sha", "crc32")

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.crc32 = 0

    def update(self, data: Any) -> None:
        self._sha.update(data)
        self.crc32 = block_crc32(data, self.crc32)

    def sha256(self) -> str:
        return self._sha.hexdigest()


MAX_EXPERTS = 1 << 31  # the wire protocol's expert index is below this


def manifest_problems(manifest: Manifest) -> list[str]:
    """Every reason not to trust `manifest`: edited after the build, model counts out of range, a
    layout that breaks the contract. The one check every reader runs (expertd refuses to start on
    any, verify reports them and hashes only the blocks the manifest can describe)."""
    problems = []
    if not manifest.fingerprint_matches():
        problems.append("manifest.json was modified after the build (its content no longer matches its fingerprint)")
    problems.extend(model_problems(manifest.model))
    problems.extend(layout_problems(manifest))
    return problems


def model_problems(model: ModelInfo) -> list[str]:
    problems = []
    if not 1 <= model.n_expert <= MAX_EXPERTS:
        problems.append(f"model.n_expert {model.n_expert} is not in 1..{MAX_EXPERTS}")
    if not 1 <= model.n_expert_used <= model.n_expert:
        problems.append(f"model.n_expert_used {model.n_expert_used} is not in 1..n_expert ({model.n_expert})")
    outside = [l for l in model.moe_layers if l >= model.n_layer]
    if outside:
        problems.append(f"model.moe_layers {outside[:8]} are not below n_layer ({model.n_layer})")
    return problems


def layout_problems(manifest: Manifest) -> list[str]:
    """Every violation of the alignment and non-overlap contract; empty when the layout is sound.
    Part of manifest_problems; the layout alone bounds the work a reader does (each layer once,
    every block inside the pack's size, one hash per expert), so a reader checks it before reading
    a block. A layer listed more than once is said once, and the rest is checked on its first entry."""
    problems: list[str] = []
    if manifest.data_start % ALIGNMENT or manifest.data_start < HEADER.size:
        problems.append(f"data_start {manifest.data_start} is not a multiple of {ALIGNMENT} past the header")
    cursor = manifest.data_start
    n_expert = manifest.model.n_expert
    for what, layers in (("`layers`", [e.layer for e in manifest.layers]), ("model.moe_layers", manifest.model.moe_layers)):
        repeated = [(layer, n) for layer, n in Counter(layers).items() if n > 1]
        if repeated:
            shown = ", ".join(f"layer {layer} listed {n} times" for layer, n in repeated[:4])
            more = f" and {len(repeated) - 4} more layers" if len(repeated) > 4 else ""
            problems.append(f"{what} lists a layer more than once ({shown}{more}): each layer's blocks appear once")
    entries = list({e.layer: e for e in reversed(manifest.layers)}.values())  # the first entry of each layer
    if sorted(e.layer for e in manifest.layers) != sorted(manifest.model.moe_layers):
        problems.append("model.moe_layers does not list exactly the layers in `layers`")
    for entry in sorted(entries, key=lambda e: e.offset):
        where = f"layer {entry.layer}"
        if entry.offset % ALIGNMENT:
            problems.append(f"{where}: offset {entry.offset} is not a multiple of {ALIGNMENT}")
        if entry.stride % ALIGNMENT or entry.stride <= 0:
            problems.append(f"{where}: stride {entry.stride} is not a positive multiple of {ALIGNMENT}")
        if entry.payload_bytes > entry.stride:
            problems.append(f"{where}: payload {entry.payload_bytes} exceeds stride {entry.stride}")
        if entry.offset < cursor:
            problems.append(f"{where}: region starts at {entry.offset}, overlapping the previous one (ends {cursor})")
        cursor = entry.offset + n_expert * entry.stride
        if len(entry.sha256) != n_expert:
            problems.append(f"{where}: {len(entry.sha256)} block hashes for {n_expert} experts")
        if len(entry.crc32) not in (0, n_expert):
            problems.append(f"{where}: {len(entry.crc32)} block crc32s for {n_expert} experts")
        role_end = 0
        for role in sorted(entry.roles, key=lambda r: r.offset):
            if role.offset % MIN_ROLE_ALIGNMENT:
                problems.append(f"{where} role {role.role}: offset {role.offset} is not a multiple of {MIN_ROLE_ALIGNMENT}")
            if role.offset < role_end:
                problems.append(f"{where} role {role.role}: overlaps the previous role")
            role_end = role.offset + role.nbytes
        if role_end != entry.payload_bytes:
            problems.append(f"{where}: roles end at {role_end} but payload_bytes is {entry.payload_bytes}")
    if len({bool(entry.crc32) for entry in manifest.layers}) > 1:
        problems.append("some layers have block crc32s and others not")
    if cursor > manifest.pack_size_bytes:
        problems.append(f"the last layer ends at {cursor}, past the pack size {manifest.pack_size_bytes}")
    return problems


def _layer_to_dict(entry: LayerLayout) -> dict[str, Any]:
    return {
        "layer": entry.layer,
        "offset": entry.offset,
        "stride": entry.stride,
        "payload_bytes": entry.payload_bytes,
        "roles": [
            {"role": r.role, "tensor": r.tensor, "ggml_type": r.ggml_type, "shape": list(r.shape),
             "offset": r.offset, "nbytes": r.nbytes}
            for r in entry.roles
        ],
        "sha256": list(entry.sha256),
        **({"crc32": [format_crc32(c) for c in entry.crc32]} if entry.crc32 else {}),
    }


def _layer_from_dict(data: Any, r: "_Reader") -> LayerLayout:
    p = "layers[]."
    return LayerLayout(
        layer=r.integer(data, "layer", p),
        offset=r.integer(data, "offset", p),
        stride=r.integer(data, "stride", p),
        payload_bytes=r.integer(data, "payload_bytes", p),
        roles=tuple(
            RoleLayout(
                role=r.string(x, "role", p + "roles[]."),
                tensor=r.string(x, "tensor", p + "roles[]."),
                ggml_type=r.string(x, "ggml_type", p + "roles[]."),
                shape=r.integers(x, "shape", p + "roles[]."),
                offset=r.integer(x, "offset", p + "roles[]."),
                nbytes=r.integer(x, "nbytes", p + "roles[]."),
            )
            for x in r.array(data, "roles", p)
        ),
        sha256=tuple(str(h) for h in r.array(data, "sha256", p)),
        crc32=r.crc32s(data, "crc32", p) if isinstance(data, dict) and "crc32" in data else (),
    )


class _Reader:
    """Typed access to a parsed manifest that names the bad key in its error."""

    def __init__(self, where: Path | str) -> None:
        self.where = where

    def check(self, ok: bool, key: str, expected: str) -> None:
        if not ok:
            raise ManifestError(f"{self.where}: key {key or '<root>'} should be {expected}")

    def _get(self, obj: Any, key: str, prefix: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise ManifestError(f"{self.where}: missing key {prefix}{key}")
        return obj[key]

    def obj(self, obj: Any, key: str, prefix: str = "") -> dict[str, Any]:
        value = self._get(obj, key, prefix)
        self.check(isinstance(value, dict), prefix + key, "an object")
        return value

    def array(self, obj: Any, key: str, prefix: str = "") -> list[Any]:
        value = self._get(obj, key, prefix)
        self.check(isinstance(value, list), prefix + key, "an array")
        return value

    def string(self, obj: Any, key: str, prefix: str = "") -> str:
        value = self._get(obj, key, prefix)
        self.check(isinstance(value, str), prefix + key, "a string")
        return value

    def integer(self, obj: Any, key: str, prefix: str = "") -> int:
        value = self._get(obj, key, prefix)
        self.check(_is_count(value), prefix + key, "a non-negative integer")
        return value

    def crc32s(self, obj: Any, key: str, prefix: str = "") -> tuple[int, ...]:
        values = self.array(obj, key, prefix)
        self.check(all(isinstance(v, str) and CRC32_HEX.fullmatch(v) for v in values), prefix + key,
                   "a list of crc32s, 8 lowercase hex digits each")
        return tuple(int(v, 16) for v in values)

    def integers(self, obj: Any, key: str, prefix: str = "") -> tuple[int, ...]:
        values = self.array(obj, key, prefix)
        self.check(all(_is_count(v) for v in values), prefix + key, "a list of non-negative integers")
        return tuple(values)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

