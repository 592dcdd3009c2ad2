"""`expertpack build`: GGUF (one file or a split set) -> experts.pack + manifest.json + trunk.gguf.

Order of work, each step safe to kill at any point:
1. plan from the source header; refuse a finished pack unless forced; check free disk;
2. create experts.pack.partial and trunk.gguf.partial at full size (fallocate: no ENOSPC later),
   trunk header first with a placeholder fingerprint; record a checkpoint;
3. one sequential pass over every shard (source_pass), hashing the source as it goes; a layer's
   blocks get their sha256 and crc32 as their bytes stream past, or (a layer begun before a resume)
   are read back and hashed as soon as all its roles are written; every
   `checkpoint_every_s` the outputs are fdatasync'ed and the position recorded;
4. finalize: manifest and fingerprint, pack header page, fingerprint patched into the trunk,
   fsync, rename the partials, manifest.json last. Only then does the directory look complete.
A rerun of the same command resumes from the last checkpoint when the plan is unchanged."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import signal
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType

from tqdm import tqdm

from . import gguf_stream
from .build_plan import BuildPlan, plan_build
from .build_state import BuildState, load_state, remove_state, save_state
from .errors import BuildLockedError, DiskSpaceError, ExpertpackError, OutputExistsError
from .gguf_source import SPLIT_NAME, GGUFSource
from .gguf_stream import string_field
from .hashing import BlockHasher
from .layout import (
    DATA_START, FORMAT_VERSION, ALIGNMENT, MANIFEST_FILE, PACK_FILE, TRUNK_FILE, TRUNK_FINGERPRINT_KEY,
    BlockDigest, ExpertKey, LayerLayout, Manifest, ModelInfo, PackHeader, SourceFile, TrunkInfo,
)
from .source_pass import ExpertSegment, OutputFds, Segment, TrunkSegment, copy_shard, hash_prefix, open_direct
from .units import GIB, human_bytes
from .verify import digest_range

log = logging.getLogger("expertpack.build")

PARTIAL = ".partial"
OUTPUT_NAMES = (PACK_FILE, TRUNK_FILE, MANIFEST_FILE)


class BuildInterrupted(ExpertpackError):
    """SIGTERM or Ctrl-C: progress was checkpointed; the same command resumes."""


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    safety_margin_bytes: int = 1 * GIB
    checkpoint_every_s: float = 30.0
    hash_threads: int = os.cpu_count() or 2
    progress: bool = True


def default_output(src: Path) -> Path:
    """model.Q4_K_M.gguf -> model.Q4_K_M.expertpack; a split set drops its -00001-of-000NN."""
    stem = src.name.removesuffix(".gguf")
    match = SPLIT_NAME.match(src.name)
    if match:
        stem = match["prefix"]
    return src.with_name(stem + ".expertpack")


def build_pack(src: Path | GGUFSource, out: Path, options: BuildOptions = BuildOptions()) -> Manifest:
    """Builds the pack of `src` (a GGUF path, or a described source such as synth's) into `out`."""
    plan = plan_build(src)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with _lock(out), _Interrupts() as interrupts:
            return _Builder(plan, out, options, interrupts).run()
    except DiskSpaceError:
        if created and not any(out.iterdir()):
            out.rmdir()  # the build made it and put nothing in it
        raise


class _Builder:
    def __init__(self, plan: BuildPlan, out: Path, options: BuildOptions, interrupts: "_Interrupts") -> None:
        self.plan = plan
        self.interrupts = interrupts
        self.out = out
        self.options = options
        self.plan_id = plan.plan_id()
        self.layers = {l.layer: l for l in plan.layers}
        self.n_expert = plan.classification.n_expert
        self._lock = threading.Lock()
        self._block_sha: dict[int, list[str | None]] = {}
        self._block_crc: dict[int, list[int | None]] = {}

    # ---- paths -------------------------------------------------------------------------------
    def path(self, name: str, partial: bool = False) -> Path:
        return self.out / (name + PARTIAL if partial else name)

    # ---- top level ---------------------------------------------------------------------------
    def run(self) -> Manifest:
        for key in self.plan.dropped_keys:
            log.warning("metadata key %s is an empty array, which gguf-py cannot write; trunk.gguf omits it", key)
        state = self._resume_or_start()
        if state.finished_copy and all(self._layer_hashed(l) for l in self.layers):
            return self._finalize(state)
        pack_fd, direct = open_direct(self.path(PACK_FILE, True), os.O_RDWR)
        trunk_fd = os.open(self.path(TRUNK_FILE, True), os.O_RDWR)
        readback_fd = os.open(self.path(PACK_FILE, True), os.O_RDONLY)  # buffered: any-size reads
        try:
            self._copy(state, OutputFds(pack_fd, trunk_fd, direct), readback_fd)
        finally:
            os.close(pack_fd)
            os.close(trunk_fd)
            os.close(readback_fd)
        return self._finalize(state)

    # ---- start / resume ----------------------------------------------------------------------
    def _resume_or_start(self) -> BuildState:
        state = load_state(self.out)
        if state is not None and state.plan_id == self.plan_id and self._partials_intact(state):
            if not self.options.force:
                done = state.done_bytes(self.plan.source.shards)
                log.info("resuming the interrupted build at %s of %s", human_bytes(done),
                         human_bytes(self.plan.source.size_bytes))
                for layer, hashes in state.layer_sha256.items():
                    if layer in state.layer_crc32:  # else hashed again, for its crc32s
                        self._block_sha[layer] = list(hashes)
                        self._block_crc[layer] = list(state.layer_crc32[layer])
                return state
        elif state is not None:
            log.info("the source or the build plan changed since the interrupted build; starting over")
        self._refuse_or_clear_existing(state is not None)
        return self._start()

    def _partials_intact(self, state: BuildState) -> bool:
        pack, trunk = self.path(PACK_FILE, True), self.path(TRUNK_FILE, True)
        if state.finished_copy and not pack.exists() and self.path(PACK_FILE).exists():
            return True  # killed during the final renames
        return pack.is_file() and trunk.is_file() and pack.stat().st_size == self.plan.pack_size_bytes \
            and trunk.stat().st_size == state.trunk_size_bytes

    def _refuse_or_clear_existing(self, had_state: bool) -> None:
        existing = [n for n in OUTPUT_NAMES if self.path(n).exists()]
        if existing and not self.options.force and not had_state:
            raise OutputExistsError(
                f"{self.out} already holds {', '.join(existing)}; pass --force to replace it, or choose another "
                "output directory"
            )
        # The manifest goes first, so a half-removed pack never looks complete.
        for name in (MANIFEST_FILE, PACK_FILE, TRUNK_FILE):
            for p in (self.path(name), self.path(name, True)):
                p.unlink(missing_ok=True)
        remove_state(self.out)

    def _start(self) -> BuildState:
        plan = self.plan
        nonce = hashlib.sha256(os.urandom(32)).hexdigest()
        placeholder = ("pending" + nonce)[:64]
        trunk_path = self.path(TRUNK_FILE, True)
        pack_path = self.path(PACK_FILE, True)
        try:
            layout = gguf_stream.write_header(
                trunk_path,
                plan.source.arch,
                [*plan.trunk_metadata, string_field(TRUNK_FINGERPRINT_KEY, placeholder)],
                plan.trunk_tensors,
            )
            self._check_disk(plan.pack_size_bytes + layout.size_bytes - trunk_path.stat().st_size)
            _allocate(trunk_path, layout.size_bytes)
            pack_path.unlink(missing_ok=True)
            _allocate(pack_path, plan.pack_size_bytes)
            _fsync_dir(self.out)
        except BaseException:
            # No checkpoint refers to them yet: a refused or interrupted start leaves nothing behind.
            trunk_path.unlink(missing_ok=True)
            pack_path.unlink(missing_ok=True)
            raise
        state = BuildState(
            plan_id=self.plan_id,
            placeholder=placeholder,
            trunk_size_bytes=layout.size_bytes,
            trunk_offsets=layout.offsets,
        )
        save_state(self.out, state)
        log.info("building %s: %d MoE layers x %d experts, pack %s, trunk %s", self.out,
                 len(plan.layers), self.n_expert, human_bytes(plan.pack_size_bytes), human_bytes(layout.size_bytes))
        return state

    def _check_disk(self, needed: int) -> None:
        st = os.statvfs(self.out)
        free = st.f_bavail * st.f_frsize
        margin = self.options.safety_margin_bytes
        if free < needed + margin:
            raise DiskSpaceError(
                f"not enough free space in {self.out}: need {human_bytes(needed)} for the pack and trunk plus "
                f"{human_bytes(margin)} safety margin, but only {human_bytes(free)} is free "
                "(free some space, choose an output directory on another disk, or lower --safety-margin-gib)"
            )

    # ---- the copy ----------------------------------------------------------------------------
    def _segments(self, state: BuildState) -> list[list[Segment]]:
        per_shard: list[list[Segment]] = [[] for _ in self.plan.source.shards]
        for t in self.plan.classification.trunk:
            per_shard[t.shard].append(TrunkSegment(t.offset, t.nbytes, t.name, state.trunk_offsets[t.name]))
        for e in self.plan.classification.experts:
            layer = self.layers[e.layer]
            index = next(i for i, r in enumerate(layer.roles) if r.role == e.role)
            role = layer.roles[index]
            previous_end = layer.roles[index - 1].offset + layer.roles[index - 1].nbytes if index else 0
            per_shard[e.source.shard].append(ExpertSegment(
                e.source.offset, e.source.nbytes, e.source.name, e.layer, layer.offset, layer.stride,
                role.offset, e.bytes_per_expert, role.offset - previous_end))
        for segs in per_shard:
            segs.sort(key=lambda s: s.offset)
        return per_shard

    def _copy(self, state: BuildState, fds: OutputFds, readback_fd: int) -> None:
        shards = self.plan.source.shards
        per_shard = self._segments(state)
        roles_left = {l: len(layer.roles) for l, layer in self.layers.items()}
        for shard_index, segs in enumerate(per_shard):
            for seg in segs:
                if isinstance(seg, ExpertSegment) and state.segment_done(shard_index, seg.offset + seg.nbytes):
                    roles_left[seg.layer] -= 1
        # Layers streamed from their first role hash as they stream; the others (begun before a
        # resume) are read back and hashed once complete.
        streamed = {l: [BlockDigest() for _ in range(self.n_expert)]
                    for l, left in roles_left.items() if left == len(self.layers[l].roles)}

        def on_bytes(n: int) -> None:
            copy_bar.update(n)
            self.interrupts.raise_if_requested()  # only here, between chunks: state stays consistent

        copy_bar = tqdm(total=self.plan.source.size_bytes, initial=state.done_bytes(shards), unit="B",
                        unit_scale=True, unit_divisor=1024, desc="copy", disable=not self.options.progress,
                        mininterval=0.5, dynamic_ncols=True)
        hash_bar = tqdm(total=len(self.layers) * self.n_expert, unit="block", desc="hash",
                        disable=not self.options.progress, mininterval=0.5, dynamic_ncols=True)
        hash_bar.update(sum(1 for hs in self._block_sha.values() for h in hs if h))

        def on_hashed(key: ExpertKey, digest: BlockDigest) -> None:
            with self._lock:
                self._block_sha.setdefault(key.layer, [None] * self.n_expert)[key.expert] = digest.sha256()
                self._block_crc.setdefault(key.layer, [None] * self.n_expert)[key.expert] = digest.crc32
            hash_bar.update(1)

        del state.source_sha256[state.shard:]  # a digest recorded past the checkpoint is redone
        last_done = (state.shard, state.position)
        hasher = _BlockDigester(readback_fd, self.options.hash_threads, on_hashed)
        try:
            for layer_id, left in roles_left.items():
                if left == 0 and not self._layer_hashed(layer_id):
                    hasher.submit_layer(self.layers[layer_id], self.n_expert)
            last_checkpoint = time.monotonic()
            for shard_index in range(state.shard, len(shards)):
                shard = shards[shard_index]
                start = state.position if shard_index == state.shard else 0
                digest = hashlib.sha256()
                if start:
                    with tqdm(total=start, unit="B", unit_scale=True, unit_divisor=1024,
                              desc="re-reading for the source digest", disable=not self.options.progress,
                              leave=False) as bar:
                        with closing(self.plan.source.open_shard(shard_index)) as reader:
                            hash_prefix(reader, start, digest, bar.update)

                def on_segment_done(seg: Segment, sha: str | None) -> None:
                    nonlocal last_checkpoint, last_done
                    last_done = (shard_index, seg.offset + seg.nbytes)
                    if isinstance(seg, TrunkSegment):
                        state.trunk_sha256[seg.name] = sha
                    else:
                        roles_left[seg.layer] -= 1
                        if roles_left[seg.layer] == 0 and seg.layer in streamed:
                            hashes = streamed.pop(seg.layer)
                            for expert, h in enumerate(hashes):
                                on_hashed(ExpertKey(seg.layer, expert), h)
                        elif roles_left[seg.layer] == 0:
                            hasher.submit_layer(self.layers[seg.layer], self.n_expert)
                    if time.monotonic() - last_checkpoint >= self.options.checkpoint_every_s:
                        self._checkpoint(state, fds, shard_index, seg.offset + seg.nbytes)
                        last_checkpoint = time.monotonic()

                with closing(self.plan.source.open_shard(shard_index)) as reader:
                    copy_shard(reader, shard.size_bytes, start, per_shard[shard_index], fds, digest, streamed,
                               on_bytes, on_segment_done)
                state.source_sha256.append(digest.hexdigest())
                last_done = (shard_index + 1, 0)
                self._checkpoint(state, fds, *last_done)
            hasher.wait()
            state.finished_copy = True
            self._checkpoint(state, fds, len(shards), 0)
        except BuildInterrupted:
            self._checkpoint(state, fds, *last_done)
            log.warning("interrupted: progress is saved; run the same command again to resume")
            raise
        finally:
            hasher.close()
            copy_bar.close()
            hash_bar.close()

    def _layer_hashed(self, layer: int) -> bool:
        hashes, crcs = self._block_sha.get(layer), self._block_crc.get(layer)
        return hashes is not None and all(hashes) and crcs is not None and all(c is not None for c in crcs)

    def _checkpoint(self, state: BuildState, fds: OutputFds, shard: int, position: int) -> None:
        os.fdatasync(fds.pack)
        os.fdatasync(fds.trunk)
        with self._lock:
            hashed = [l for l in self._block_sha if self._layer_hashed(l)]
            state.layer_sha256 = {l: list(self._block_sha[l]) for l in hashed}
            state.layer_crc32 = {l: list(self._block_crc[l]) for l in hashed}
        state.shard = shard
        state.position = position
        save_state(self.out, state)

    # ---- finalize ----------------------------------------------------------------------------
    def _finalize(self, state: BuildState) -> Manifest:
        plan = self.plan
        cls = plan.classification
        layers = tuple(
            LayerLayout(l.layer, l.offset, l.stride, l.payload_bytes, l.roles, tuple(state.layer_sha256[l.layer]),
                        tuple(state.layer_crc32[l.layer]))
            for l in plan.layers
        )
        manifest = Manifest(
            fingerprint="",
            pack_size_bytes=plan.pack_size_bytes,
            data_start=DATA_START,
            source_files=tuple(SourceFile(s.path.name, s.size_bytes, sha)
                               for s, sha in zip(plan.source.shards, state.source_sha256)),
            model=ModelInfo(cls.arch, cls.n_layer, cls.n_expert, cls.n_expert_used, cls.moe_layers),
            layers=layers,
            trunk=TrunkInfo(TRUNK_FILE, state.trunk_size_bytes,
                            {t.name: state.trunk_sha256[t.name] for t in plan.trunk_tensors}),
            created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        ).with_fingerprint()

        pack_partial, trunk_partial = self.path(PACK_FILE, True), self.path(TRUNK_FILE, True)
        if pack_partial.exists():
            header = PackHeader(FORMAT_VERSION, ALIGNMENT, DATA_START, plan.pack_size_bytes, manifest.fingerprint)
            _write_at(pack_partial, header.encode(), 0)
        if trunk_partial.exists():
            _patch_placeholder(trunk_partial, state.placeholder, manifest.fingerprint)
        manifest_partial = self.path(MANIFEST_FILE, True)
        manifest.write(manifest_partial)
        _fsync_file(manifest_partial)
        for name in (PACK_FILE, TRUNK_FILE, MANIFEST_FILE):
            if self.path(name, True).exists():
                os.replace(self.path(name, True), self.path(name))
            _fsync_dir(self.out)
        remove_state(self.out)
        log.info("built %s: fingerprint %s", self.out, manifest.fingerprint[:16])
        return manifest


# ---- small helpers -------------------------------------------------------------------------------
class _BlockDigester(BlockHasher):
    """BlockHasher giving both of a block's checksums (a BlockDigest) instead of its sha256 alone."""

    def _hash_one(self, layer: LayerLayout, expert: int) -> None:
        digest = digest_range(self._fd, layer.block_offset(expert), layer.payload_bytes)
        self._on_done(ExpertKey(layer.layer, expert), digest)  # type: ignore[arg-type]


def _allocate(path: Path, size: int) -> None:
    """Reserves the blocks now so a full disk fails here, not mid-copy; unwritten ranges read as 0."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (28,):  # ENOSPC
                raise DiskSpaceError(f"{path}: the disk filled while reserving {human_bytes(size)}") from exc
            os.ftruncate(fd, size)  # a filesystem without fallocate: sparse file, same contents
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_at(path: Path, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _patch_placeholder(path: Path, placeholder: str, fingerprint: str) -> None:
    """Replaces the 64-character placeholder written into trunk.gguf's metadata by the fingerprint
    (same length, so no offset moves). A trunk already patched is left alone."""
    needle = placeholder.encode("ascii")
    with open(path, "rb") as f:
        head = f.read(64 << 20)
    at = head.find(needle)
    if at < 0:
        if head.find(fingerprint.encode("ascii")) >= 0:
            return
        raise ExpertpackError(f"{path}: the fingerprint placeholder is gone; delete the output and rebuild")
    _write_at(path, fingerprint.encode("ascii"), at)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_fsync_dir = _fsync_file  # a directory's entries are synced through an fd of the directory


class _lock:
    """An exclusive flock on the output directory itself for the length of a build (no lock file,
    so nothing can be unlinked from under a waiting build)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise BuildLockedError(f"another expertpack build is writing into {self.out}") from None

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


class _Interrupts:
    """SIGTERM and SIGINT only set a flag; the copy checks it between chunks and stops there with
    BuildInterrupted, after a checkpoint, so a rerun resumes."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signal.Signals(signum).name

    def raise_if_requested(self) -> None:
        if self.requested is not None:
            raise BuildInterrupted(f"stopped by {self.requested}; rerun the same command to resume")

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

