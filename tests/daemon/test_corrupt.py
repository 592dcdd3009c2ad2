"""Corrupt bytes never reach a client: with one byte of one block flipped on disk, expertd FAILs that
key CORRUPT (counted, named by layer and expert in the log, health degraded) and serves every other
key byte-exact; a pack built before format 1.1 (no crc32s) is still served, unchecked and said so."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from expertpack.client import ExpertClient, FetchFailed
from expertpack.client import protocol as p
from expertpack.client.expertctl import EXIT_DEGRADED, EXIT_OK, health
from expertpack.packtools.layout import (
    MANIFEST_FILE, PACK_FILE, ExpertKey, Manifest, PackHeader, block_crc32, fingerprint_of,
)

from expertpack.daemon.reader import split_ranges

from ..conftest import BIN, start_daemon
from ..helpers.expertd import all_keys, flip_byte

BAD = ExpertKey(1, 5)


def as_built_before_crc32(pack: Path) -> None:
    """Makes `pack` what a format 1.0 build wrote: no minor_version, no crc32s, and the fingerprint
    of that manifest in manifest.json and in the pack's header."""
    data = json.loads((pack / MANIFEST_FILE).read_text())
    del data["minor_version"]
    for layer in data["layers"]:
        del layer["crc32"]
    data["fingerprint"] = fingerprint_of(data)
    (pack / MANIFEST_FILE).write_text(json.dumps(data))
    header = PackHeader.expected_for(Manifest.load(pack))
    with open(pack / PACK_FILE, "r+b") as f:
        f.write(header.encode())


def test_the_build_records_each_blocks_crc32(tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    assert m.minor_version == 1 and m.has_crc32
    with open(tiny_pack / PACK_FILE, "rb") as f:
        for key in all_keys(m):
            layer = m.layer(key.layer)
            f.seek(layer.block_offset(key.expert))
            assert block_crc32(f.read(layer.payload_bytes)) == layer.crc32[key.expert], key


def test_a_flipped_byte_fails_that_key_corrupt_and_only_that_key(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    m = Manifest.load(pack)
    flip_byte(pack, BAD)
    d = start_daemon(pack, tmp_path, "--stage-slots", "16", "--client-slots", "4")
    d.wait_for("READY=1")
    try:
        with ExpertClient(d.endpoint) as client:
            with pytest.raises(FetchFailed) as caught:
                list(client.fetch([BAD]))
            assert caught.value.code is p.FailCode.CORRUPT and caught.value.key == BAD
            assert "layer 1 expert 5" in str(caught.value) and "crc32" in str(caught.value)
            good = [k for k in all_keys(m) if k != BAD]
            served = []
            for expert in client.fetch(good):  # after the corrupt one: the daemon serves on
                layer = m.layer(expert.key.layer)
                assert hashlib.sha256(expert.data).hexdigest() == layer.sha256[expert.key.expert], expert.key
                served.append(expert.key)
                expert.release()
            assert sorted(served) == good
            with pytest.raises(FetchFailed) as again:  # never from a cache of any kind: read and checked again
                list(client.fetch([BAD]))
            assert again.value.code is p.FailCode.CORRUPT
            stats = client.stats()
        c = stats["counters"]
        assert c["corrupt_blocks"] == 2 and c["io_errors"] == 0 and c["failed"] == 2
        assert c["checked_blocks"] == len(good) + 2 and c["ready"] == len(good)
        assert stats["slots"]["reading"] == 0 and stats["slots"]["leased"] == 0
        code, line = health(stats)
        assert code == EXIT_DEGRADED and "crc32" in line
        ctl = subprocess.run([str(BIN / "expertctl"), "stats", "--endpoint", d.endpoint], capture_output=True, text=True)
        assert ctl.returncode == 0 and "corrupt_blocks 2" in ctl.stdout, ctl
        ctl = subprocess.run([str(BIN / "expertctl"), "health", "--endpoint", d.endpoint], capture_output=True, text=True)
        assert ctl.returncode == EXIT_DEGRADED and "failed their crc32 check" in ctl.stdout, ctl
    finally:
        code, log = d.stop()
    assert code == 0, log
    assert "corrupt block: layer 1 expert 5" in log and log.count("corrupt block:") == 2


def test_a_flipped_byte_in_any_piece_of_a_block_fails_it(tiny_pack: Path, tmp_path: Path) -> None:
    """Each reader thread checksums the piece it read and the daemon joins the pieces' crc32s: a
    flip in the first byte of the first piece, inside each later piece, or in the last byte of the
    last (a shorter one) fails that block, through the staging and through the RAM tier."""
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    m = Manifest.load(pack)
    payload = m.layer(0).payload_bytes
    pieces = split_ranges(m.layer(0).stride, 4)
    assert len(pieces) == 4 and len({n for _, n in pieces}) == 2  # the test's point: several pieces, two lengths
    flips = {ExpertKey(0, 0): 0, ExpertKey(0, 9): pieces[1][0] + 1, ExpertKey(2, 3): pieces[2][0] + 4095,
             ExpertKey(3, 15): payload - 1}
    for key, at in flips.items():
        flip_byte(pack, key, at)
    for tier in ("0", "1"):
        (tmp_path / f"tier{tier}").mkdir()
        d = start_daemon(pack, tmp_path / f"tier{tier}", "--stage-slots", "16", "--client-slots", "4",
                         "--ram-cache-gib", tier)
        d.wait_for("READY=1")
        try:
            with ExpertClient(d.endpoint) as client:
                for key in flips:
                    with pytest.raises(FetchFailed) as caught:
                        list(client.fetch([key]))
                    assert caught.value.code is p.FailCode.CORRUPT and caught.value.key == key
                good = [k for k in all_keys(m) if k not in flips]
                for expert in client.fetch(good):
                    layer = m.layer(expert.key.layer)
                    assert hashlib.sha256(expert.data).hexdigest() == layer.sha256[expert.key.expert], expert.key
                    expert.release()
                c = client.stats()["counters"]
            assert c["corrupt_blocks"] == len(flips) and c["ready"] == len(good)
            assert c["checked_blocks"] == len(all_keys(m)) and c["checked_bytes"] == len(all_keys(m)) * payload
        finally:
            code, log = d.stop()
        assert code == 0, log


def test_a_pack_built_before_crc32s_still_serves(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    as_built_before_crc32(pack)
    m = Manifest.load(pack)
    assert m.minor_version == 0 and not m.has_crc32
    d = start_daemon(pack, tmp_path, "--stage-slots", "16", "--client-slots", "4")
    d.wait_for("READY=1")
    try:
        with ExpertClient(d.endpoint) as client:
            assert client.fingerprint == m.fingerprint
            for expert in client.fetch(all_keys(m)):
                assert hashlib.sha256(expert.data).hexdigest() == m.layer(expert.key.layer).sha256[expert.key.expert]
                expert.release()
            stats = client.stats()
        c = stats["counters"]
        assert c["ready"] == len(all_keys(m)) and c["checked_blocks"] == 0 and c["corrupt_blocks"] == 0
        assert health(stats)[0] == EXIT_OK
    finally:
        code, log = d.stop()
    assert code == 0, log
    assert "built before pack format 1.1" in log
