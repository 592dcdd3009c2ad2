"""`expertpack verify OUT`: proves a pack is whole. Checks the manifest against its own fingerprint,
the layout contract (alignment, strides, non-overlap, each layer once), the pack's size and header,
the trunk's fingerprint key and tensor hashes, and re-hashes every expert block in parallel (sha256,
and the crc32 expertd checks on every read where the pack has them, format 1.1). A manifest whose
layout or model counts break the contract cannot say which bytes to read: that is reported and no
block is read (its blocks could repeat, overlap or lie anywhere). Reports every problem it finds,
each damaged block by (layer, expert); it never modifies the pack."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader
from tqdm import tqdm

from .errors import ManifestError
from .hashing import hash_range, read_range
from .layout import (
    DATA_START, PACK_FILE, TRUNK_FINGERPRINT_KEY, BlockDigest, ExpertKey, Manifest, PackHeader, format_crc32,
    layout_problems, manifest_problems, model_problems,
)


@dataclass(frozen=True, slots=True)
class DamagedBlock:
    key: ExpertKey
    expected: str
    found: str


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    damaged: list[DamagedBlock] = field(default_factory=list)
    blocks_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.damaged


def verify_pack(pack_dir: Path, threads: int | None = None, progress: bool = True) -> VerifyReport:
    """Raises ManifestError only when there is no readable manifest to check against."""
    manifest = Manifest.load(pack_dir)
    report = VerifyReport()
    report.problems.extend(manifest_problems(manifest))
    pack_path = pack_dir / PACK_FILE
    if not pack_path.is_file():
        report.problems.append(f"{pack_path} is missing")
        return report
    size = pack_path.stat().st_size
    if size != manifest.pack_size_bytes:
        report.problems.append(f"{pack_path} is {size} bytes, the manifest says {manifest.pack_size_bytes}")
    report.problems.extend(_header_problems(pack_path, manifest))
    report.problems.extend(_trunk_problems(pack_dir, manifest))
    if model_problems(manifest.model) or layout_problems(manifest):
        report.problems.append(f"expert blocks not hashed: the layout of {pack_dir / 'manifest.json'} breaks the "
                               "contract (above), so it cannot say which bytes to read; restore the manifest or "
                               "rebuild the pack")
        return report
    _check_blocks(pack_path, manifest, report, threads or os.cpu_count() or 2, progress)
    return report


def _header_problems(pack_path: Path, manifest: Manifest) -> list[str]:
    with open(pack_path, "rb") as f:
        raw = f.read(DATA_START)
    try:
        header = PackHeader.decode(raw, pack_path)
    except ManifestError as exc:
        return [str(exc)]
    expected = PackHeader.expected_for(manifest)
    if header != expected:
        return [f"{pack_path}: header {header} does not match the manifest (expected {expected})"]
    return []


def _trunk_problems(pack_dir: Path, manifest: Manifest) -> list[str]:
    path = pack_dir / manifest.trunk.file
    if not path.is_file():
        return [f"{path} is missing"]
    if path.stat().st_size != manifest.trunk.size_bytes:
        return [f"{path} is {path.stat().st_size} bytes, the manifest says {manifest.trunk.size_bytes}"]
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        return [f"{path}: unreadable GGUF ({exc})"]
    problems = []
    field_ = reader.get_field(TRUNK_FINGERPRINT_KEY)
    found = field_.contents() if field_ is not None else None
    if found != manifest.fingerprint:
        problems.append(f"{path}: {TRUNK_FINGERPRINT_KEY} is {found!r}, this pack's fingerprint is {manifest.fingerprint}")
    tensors = {t.name: t for t in reader.tensors}
    if set(tensors) != set(manifest.trunk.tensor_sha256):
        problems.append(f"{path}: tensor set differs from the manifest's trunk tensors")
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, expected in manifest.trunk.tensor_sha256.items():
            t = tensors.get(name)
            if t is None:
                continue
            try:
                if hash_range(fd, int(t.data_offset), int(t.n_bytes)) != expected:
                    problems.append(f"{path}: trunk tensor {name} is damaged (sha256 mismatch)")
            except OSError as exc:
                problems.append(f"{path}: trunk tensor {name} cannot be read ({exc})")
    finally:
        os.close(fd)
    return problems


def _check_blocks(pack_path: Path, manifest: Manifest, report: VerifyReport, threads: int, progress: bool) -> None:
    size = pack_path.stat().st_size
    # Only blocks the manifest holds a hash for: an edited n_expert cannot make this loop unbounded.
    jobs = [(layer, e) for layer in manifest.layers for e in range(min(manifest.model.n_expert, len(layer.sha256)))]
    total = sum(layer.payload_bytes for layer, _ in jobs)
    fd = os.open(pack_path, os.O_RDONLY)

    def check(job: tuple) -> tuple[ExpertKey, str, str, int, str | None]:
        layer, e = job
        offset = layer.block_offset(e)
        key = ExpertKey(layer.layer, e)
        if offset + layer.payload_bytes > size:
            return key, layer.sha256[e], "<beyond end of file>", layer.payload_bytes, None
        crc_problem = None
        try:
            digest = digest_range(fd, offset, layer.payload_bytes)
            found = digest.sha256()
            if found == layer.sha256[e] and e < len(layer.crc32) and digest.crc32 != layer.crc32[e]:
                crc_problem = (f"layer {layer.layer} expert {e}: its bytes match their sha256 but have crc32 "
                               f"{format_crc32(digest.crc32)}, the manifest says {format_crc32(layer.crc32[e])}: "
                               "the build recorded a wrong crc32 and expertd will refuse this block (rebuild)")
        except OSError as exc:  # a bad sector is damage to report, not a crash
            found = f"<read error: {exc}>"
        return key, layer.sha256[e], found, layer.payload_bytes, crc_problem

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool, tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", disable=not progress,
            mininterval=0.5, dynamic_ncols=True,
        ) as bar:
            for key, expected, found, nbytes, crc_problem in pool.map(check, jobs):
                report.blocks_checked += 1
                report.bytes_checked += nbytes
                bar.update(nbytes)
                if expected != found:
                    report.damaged.append(DamagedBlock(key, expected, found))
                if crc_problem is not None:
                    report.problems.append(crc_problem)
    finally:
        os.close(fd)


def digest_range(fd: int, offset: int, nbytes: int) -> BlockDigest:
    """sha256 and crc32 of bytes [offset, offset + nbytes) in one read; a short read is an error."""
    digest = BlockDigest()
    read_range(fd, offset, nbytes, digest)
    return digest

