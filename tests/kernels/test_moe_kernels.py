"""All the experts a layer selected in two launches, per (token, slot) pair, against a float64 torch
reference of the same experts (gate/up/down from
dequantized blocks), for each activation, with and without biases and a fused gate_up; the results
do not depend on where the blocks sit, nor on which pairs a launch runs (a cache's waves)."""

from __future__ import annotations

from functools import partial
import math

import pytest
import torch
from gguf import GGMLQuantizationType as T

from expertpack.packtools.layout import LayerLayout, RoleLayout
from expertpack.packtools.quants import nbytes_of
from expertpack.worker.kernels.moe_tl import experts_per_pair
from expertpack.worker.nn.activation import Activation, ActKind
from expertpack.worker.weights.expert_roles import expert_roles
from expertpack.worker.weights.quant import dequantize

from ..helpers.quant import random_bytes

pytestmark = pytest.mark.slow  # the interpreter: about 15 s a case

D, F, N_EXPERT, K_TOP = 256, 256, 5, 2  # K-quant rows are whole superblocks
ACTS = [Activation(), Activation(limit=0.5), Activation(ActKind.SWIGLU_OAI, limit=0.7, alpha=1.702),
        Activation(ActKind.SITU, beta=2.0, linear_beta=3.0)]


def layout(gate_type: T, down_type: T, fused: bool, biases: bool) -> LayerLayout:
    roles, offset = [], 0
    specs = ([("gate_up", gate_type, (D, 2 * F))] if fused else [("gate", gate_type, (D, F)), ("up", gate_type, (D, F))])
    specs.append(("down", down_type, (F, D)))
    if biases:
        specs += [("gate.bias", T.F32, (F,)), ("up.bias", T.F32, (F,)), ("down.bias", T.F32, (D,))]
    for role, ggml_type, shape in specs:
        nbytes = nbytes_of(ggml_type, shape)
        roles.append(RoleLayout(role, f"blk.0.ffn_{role}", ggml_type.name, shape, offset, nbytes))
        offset = -(-(offset + nbytes) // 256) * 256
    return LayerLayout(0, 0, -(-offset // 4096) * 4096, offset, tuple(roles))


def pool_of(lay: LayerLayout, seed: int) -> torch.Tensor:
    pool = torch.zeros(N_EXPERT * lay.stride, dtype=torch.uint8)
    for e in range(N_EXPERT):
        for i, r in enumerate(lay.roles):
            raw = torch.from_numpy(random_bytes(T[r.ggml_type], tuple(r.shape), seed=seed + 10 * e + i, valid=True))
            pool[e * lay.stride + r.offset: e * lay.stride + r.offset + r.nbytes] = raw
    return pool


def reference(lay: LayerLayout, pool: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              act: Activation) -> torch.Tensor:
    out = torch.zeros(ids.numel(), D, dtype=torch.float64)
    for p, e in enumerate(ids.flatten().tolist()):
        m = {r.role: dequantize(pool[e * lay.stride + r.offset:][:r.nbytes], T[r.ggml_type], tuple(r.shape)).double()
             for r in lay.roles}
        xt = x[p // K_TOP].double()
        gate, up = (m["gate_up"] @ xt).chunk(2) if "gate_up" in m else (m["gate"] @ xt, m["up"] @ xt)
        if "gate.bias" in m:
            gate, up = gate + m["gate.bias"], up + m["up.bias"]
        y = m["down"] @ act(gate, up) + (m["down.bias"] if "down.bias" in m else 0)
        out[p] = w.flatten()[p] * y
    return out


def prompt_case(act: Activation, types: tuple[T, T], fused: bool, biases: bool, n_tokens: int, seeds: tuple[int, int],
                device: torch.device) -> tuple[LayerLayout, torch.Tensor, tuple, torch.Tensor]:
    """Random valid experts, tokens and routing: (the layout, ids [T, k], the kernels' arguments on
    `device`, the float64 reference)."""
    lay = layout(*types, fused, biases)
    pool = pool_of(lay, seed=seeds[0])
    g = torch.Generator().manual_seed(seeds[1])
    x = torch.randn(n_tokens, D, generator=g)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:K_TOP] for _ in range(n_tokens)])
    w = torch.rand(n_tokens, K_TOP, generator=g)
    args = (x.to(device), pool.to(device), (ids.flatten() * lay.stride).to(device), w.flatten().to(device),
            expert_roles(lay), act)
    return lay, ids, args, reference(lay, pool, x, ids, w, act)


CASES = [  # every activation once, every block layout once (the interpreter is slow: few, small cases)
    (ACTS[0], (T.Q4_K, T.Q6_K), False, False),
    (ACTS[1], (T.Q8_0, T.Q4_0), True, False),
    (ACTS[2], (T.MXFP4, T.MXFP4), False, True),
    (ACTS[3], (T.Q2_K, T.Q3_K), False, False),
]


# The i-quants through each launch shape's table pointer (test_linear_kernels checks every type's
# decoder exactly), gate/up and down of different types as the dynamic quants mix them.
IQ_PAIR_CASE = (ACTS[0], (T.IQ2_XXS, T.IQ1_S), False, False)
IQ4_PAIR_CASE = (ACTS[2], (T.IQ4_NL, T.IQ4_XS), False, True)  # the activations' launch adds the biases
IQ_TILE_CASE = (ACTS[0], (T.IQ3_S, T.IQ2_S), False, False)
IQ_DENSE_CASE = (ACTS[1], (T.IQ1_M, T.IQ4_XS), True, False)


@pytest.mark.parametrize("act,types,fused,biases", CASES + [IQ_PAIR_CASE, IQ4_PAIR_CASE],
                         ids=["swiglu-q4k-q6k", "clamped-q8-fused", "oai-mxfp4-biases", "situ-q2k-q3k",
                              "swiglu-iq2xxs-iq1s", "oai-iq4nl-iq4xs-biases"])
def test_experts_equal_the_reference(act: Activation, types: tuple[T, T], fused: bool, biases: bool,
                                                  device: torch.device) -> None:
    lay, ids, args, want = prompt_case(act, types, fused, biases, 4, (1, 3), device)  # each pair on its own
    full = experts_per_pair(*args)
    rel = ((full.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}"
    # A wave: only some pairs, the blocks moved elsewhere in another pool; those rows are the same bits.
    assert_a_wave_gives_the_same_bits(experts_per_pair, args, full, lay.stride,
                                      torch.arange(0, ids.numel(), 2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("act,types,fused,biases", [CASES[0], CASES[2], IQ_TILE_CASE],
                         ids=["swiglu-q4k-q6k", "oai-mxfp4-biases", "swiglu-iq3s-iq2s"])
def test_expert_tiles_equal_the_reference(act: Activation, types: tuple[T, T], fused: bool, biases: bool,
                                          device: torch.device) -> None:
    """A short prompt's pairs in tiles of one expert (several tiles for an expert with more pairs
    than a tile holds); a wave of any pairs gives them the whole step's bits."""
    from expertpack.worker.kernels.moe_tiles import G, experts_in_tiles

    lay = layout(*types, fused, biases)
    pool = pool_of(lay, seed=4)
    g = torch.Generator().manual_seed(5)
    n_tokens = 10
    x = torch.randn(n_tokens, D, generator=g)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:K_TOP] for _ in range(n_tokens)])
    assert torch.bincount(ids.flatten()).max() > G  # an expert needs two tiles
    w = torch.rand(n_tokens, K_TOP, generator=g)
    want = reference(lay, pool, x, ids, w, act)
    args = (x.to(device), pool.to(device), (ids.flatten() * lay.stride).to(device), w.flatten().to(device),
            expert_roles(lay), act)
    full = experts_in_tiles(*args)
    rel = ((full.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}"
    assert_a_wave_gives_the_same_bits(experts_in_tiles, args, full, lay.stride,
                                      torch.arange(1, ids.numel(), 3, dtype=torch.int32, device=device))



def test_q4_k_expert_tiles_equal_the_general_ones(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Q4_K experts in tiles take kernels of their own (moe_tiles' _q4_k kernels: the activation once
    a row, then down): over two superblocks of K and of F they give the reference, and the very bits
    of the general tile kernels whatever the pairs a tile (2 or 4); a wave gives the whole step's bits."""
    from expertpack.worker.kernels import moe_tiles

    module = __import__(__name__, fromlist=["D"])
    monkeypatch.setattr(module, "D", 512)
    monkeypatch.setattr(module, "F", 512)
    lay = layout(T.Q4_K, T.Q4_K, False, False)
    pool = pool_of(lay, seed=4)
    g = torch.Generator().manual_seed(5)
    n_tokens = 10
    x = torch.randn(n_tokens, 512, generator=g)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:K_TOP] for _ in range(n_tokens)])
    assert torch.bincount(ids.flatten()).max() > moe_tiles.G_Q4_K  # an expert needs two tiles
    w = torch.rand(n_tokens, K_TOP, generator=g)
    want = reference(lay, pool, x, ids, w, ACTS[3])
    args = (x.to(device), pool.to(device), (ids.flatten() * lay.stride).to(device), w.flatten().to(device),
            expert_roles(lay), ACTS[3])
    got = moe_tiles.experts_in_tiles(*args)
    rel = ((got.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}"
    assert_a_wave_gives_the_same_bits(moe_tiles.experts_in_tiles, args, got, lay.stride,
                                      torch.arange(1, ids.numel(), 3, dtype=torch.int32, device=device))
    monkeypatch.setattr(moe_tiles, "G_Q4_K", 2)
    assert torch.equal(moe_tiles.experts_in_tiles(*args), got)
    monkeypatch.setattr(moe_tiles, "integer_runs", lambda roles: False)  # the general kernels
    assert torch.equal(moe_tiles.experts_in_tiles(*args), got)

def assert_a_wave_gives_the_same_bits(run, args: tuple, full: torch.Tensor, stride: int, wave: torch.Tensor) -> None:
    """`run` over only the pairs `wave`, the blocks moved elsewhere in another pool (as a cache's
    slots): those rows are the whole step's bits (`full`: run(*args)), the others untouched."""
    x, pool, offsets, w, roles, act = args
    shift = 3 * stride
    moved = torch.cat([torch.zeros(shift, dtype=torch.uint8, device=pool.device), pool])
    part = run(x, moved, offsets + shift, w, roles, act, wave, out=torch.full_like(full, math.nan))
    assert torch.equal(part[wave.long()], full[wave.long()])
    others = torch.ones(full.shape[0], dtype=torch.bool, device=full.device)
    others[wave.long()] = False
    assert part[others].isnan().all()


def test_gate_up_split_over_k_equals_the_reference(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """A decode step splits gate/up's K across programs; the down launch sums the splits (and adds
    the biases) before the activation."""
    from expertpack.worker.kernels import moe_tl

    monkeypatch.setattr(__import__(__name__, fromlist=["D"]), "D", 512)  # two chunks of K
    monkeypatch.setattr(moe_tl, "gate_up_splits", lambda *shape: 2)
    act = ACTS[2]
    lay = layout(T.Q4_K, T.Q8_0, False, True)
    pool = pool_of(lay, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 512, generator=g)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:K_TOP] for _ in range(2)])
    w = torch.rand(2, K_TOP, generator=g)
    want = reference(lay, pool, x, ids, w, act)
    got = experts_per_pair(x.to(device), pool.to(device), (ids.flatten() * lay.stride).to(device),
                           w.flatten().to(device), expert_roles(lay), act).cpu().double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("act,types,fused,biases", [CASES[1], CASES[2], IQ_DENSE_CASE],
                         ids=["clamped-q8-fused", "oai-mxfp4-biases", "clamped-iq1m-fused-iq4xs"])
def test_dense_prefill_equals_the_reference(monkeypatch: pytest.MonkeyPatch, act: Activation, types: tuple[T, T],
                                            fused: bool, biases: bool, device: torch.device) -> None:
    """A prefill's experts dequantized once each and multiplied by all their tokens, in groups of
    experts (two here) and tiles of 16 pairs (several per expert here); one group of all gives the
    same bits, and a wave (the pairs of some experts, the blocks elsewhere) gives those pairs the
    very bits of the whole step."""
    from expertpack.worker.kernels import moe_dense

    monkeypatch.setattr(moe_dense, "GROUP_VALUES", 2 * (2 * F * D + D * F))
    monkeypatch.setattr(moe_dense, "GROUP_VALUES_FREE", 2 * (2 * F * D + D * F))  # on a GPU with memory free too
    monkeypatch.setattr(moe_dense, "BM", 16)
    lay, ids, args, want = prompt_case(act, types, fused, biases, 40, (7, 8), device)
    full = moe_dense.experts_dense(*args)
    rel = ((full.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}"
    wave = (ids.flatten() % 2 == 1).nonzero().flatten().to(torch.int32).to(device)  # the pairs of experts 1 and 3
    assert_a_wave_gives_the_same_bits(moe_dense.experts_dense, args, full, lay.stride, wave)
    for name in ("GROUP_VALUES", "GROUP_VALUES_FREE"):  # every expert in one group: the same bits
        monkeypatch.setattr(moe_dense, name, 1 << 28)
    assert torch.equal(moe_dense.experts_dense(*args), full)


@pytest.mark.parametrize("act,fused,d,f,mean", [(ACTS[0], False, 256, 256, 0.0), (ACTS[3], True, 256, 256, 0.0),
                                               (ACTS[0], False, 1280, 256, 4.0)],
                         ids=["swiglu", "situ-fused", "superblocks-offset"])
def test_integer_prefill_equals_the_reference(monkeypatch: pytest.MonkeyPatch, act: Activation, fused: bool, d: int,
                                              f: int, mean: float, device: torch.device) -> None:
    """Q4_K experts as float16 products of their integers (moe_integer): within float32's error of
    the float64 reference (as moe_dense), rows of several superblocks and of more than one pass of
    32 block sums included, activations away from zero too (where the integers' and the mins'
    terms cancel); in groups of two experts and tiles of 16 pairs; one group of all gives the same
    bits, and so does a wave of some experts' pairs, their blocks elsewhere."""
    from expertpack.worker.kernels import moe_dense, moe_integer

    module = __import__(__name__, fromlist=["D"])
    monkeypatch.setattr(module, "D", d)
    monkeypatch.setattr(module, "F", f)
    one = moe_integer.unpacked_bytes(expert_roles(layout(T.Q4_K, T.Q4_K, fused, False)))
    monkeypatch.setattr(moe_integer, "scratch_values", lambda dev: 2 * one // 4)
    monkeypatch.setattr(moe_integer, "BM", 16)
    monkeypatch.setattr(moe_dense, "BM", 16)
    lay, ids, args, want = prompt_case(act, (T.Q4_K, T.Q4_K), fused, False, 40, (9, 10), device)
    if mean:
        x = args[0].cpu() + mean
        args = (x.to(device), *args[1:])
        want = reference(lay, args[1].cpu(), x, ids, args[3].cpu().reshape(ids.shape), act)
    assert moe_integer.runs(args[4])
    full = moe_integer.experts_integer(*args)
    rel = ((full.cpu().double() - want).norm() / want.norm()).item()
    if rel >= 1e-6:  # moe_dense's error beside it says whether the reference or the integers are off
        dense_rel = ((moe_dense.experts_dense(*args).cpu().double() - want).norm() / want.norm()).item()
        raise AssertionError(f"relative error {rel:.2e} (moe_dense's {dense_rel:.2e})")
    wave = (ids.flatten() % 2 == 1).nonzero().flatten().to(torch.int32).to(device)
    assert_a_wave_gives_the_same_bits(moe_integer.experts_integer, args, full, lay.stride, wave)
    monkeypatch.setattr(moe_integer, "scratch_values", lambda dev: 1 << 28)
    assert torch.equal(moe_integer.experts_integer(*args), full)


@pytest.mark.parametrize("fused,d,f,mean", [(False, 512, 256, 0.0), (True, 256, 512, 4.0)], ids=["plain", "fused-offset"])
def test_integer_tiles_equal_the_reference(monkeypatch: pytest.MonkeyPatch, fused: bool, d: int, f: int, mean: float,
                                           device: torch.device) -> None:
    """A few pairs an expert (a short prompt, a batched decode step) in tiles of up to 16 pairs of
    one expert, its Q4_K blocks decoded on chip into the integers (moe_integer.experts_integer_tiles):
    within float32's error of the float64 reference, an expert of more pairs than a tile included;
    a wave of some experts' pairs, their blocks elsewhere, gives those pairs the same bits."""
    from expertpack.worker.kernels import moe_integer

    module = __import__(__name__, fromlist=["D"])
    monkeypatch.setattr(module, "D", d)
    monkeypatch.setattr(module, "F", f)
    lay, ids, args, want = prompt_case(ACTS[0], (T.Q4_K, T.Q4_K), fused, False, 40, (11, 12), device)
    assert torch.bincount(ids.flatten()).max() > moe_integer.BM_TILES  # an expert takes two tiles
    if mean:
        x = args[0].cpu() + mean
        args = (x.to(device), *args[1:])
        want = reference(lay, args[1].cpu(), x, ids, args[3].cpu().reshape(ids.shape), ACTS[0])
    got = moe_integer.experts_integer_tiles(*args)
    rel = ((got.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-6, f"relative error {rel:.2e}"
    wave = (ids.flatten() % 2 == 0).nonzero().flatten().to(torch.int32).to(device)
    assert_a_wave_gives_the_same_bits(moe_integer.experts_integer_tiles, args, got, lay.stride, wave)


def test_integer_rows_far_from_one_keep_their_scale(device: torch.device) -> None:
    """A row's power-of-two scale and its inverse are normal floats built from bits (a GPU division
    flushes a subnormal quotient to zero: a row of tiny values came out NaN), the parts and block
    sums in the scaled units; a row of zeros stays zeros."""
    from expertpack.worker.kernels import moe_integer

    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    x[0] *= 1e-36
    x[1] *= 1e30
    x[2] = 0
    x = x.to(device)
    parts = moe_integer._Parts(4, 512, x.device).split(x)
    assert torch.isfinite(parts.inv).all() and (parts.inv > 0).all()
    assert (parts.inv >= 2.0 ** -126).all() and (parts.inv <= 2.0 ** 126).all()
    back = (parts.hi.float() + parts.lo.float()) * parts.inv[:, None]
    rel = ((back.double() - x.double()).norm(dim=1) / x.double().norm(dim=1).clamp_min(1e-300))
    assert (rel[[1, 3]] < 1e-6).all(), rel
    assert rel[0] < 1e-3, rel  # 1e-36 lies under float32's normal range: its parts keep what it has
    assert torch.equal(back[2], x[2])
    sums = (parts.hi.float() + parts.lo.float()).view(4, 16, 32).sum(-1)
    assert torch.allclose(parts.sums, sums, rtol=1e-6, atol=0)


def test_dense_scratch_takes_all_experts_only_where_memory_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's dequantized experts in one group where the device has room (the products' tails
    once, not once per group), in bounded groups where the expert cache filled it, and in bounded
    groups while a CUDA graph is captured (its pool keeps what it allocates)."""
    from expertpack.worker.kernels import moe_dense

    gib = 1 << 30
    assert moe_dense.group_values(100 * gib) == moe_dense.GROUP_VALUES_FREE == gib  # 4 GiB of float32
    assert moe_dense.group_values(6 * gib) == 6 * gib // 8  # 3 GiB of float32: half of what is free
    assert moe_dense.group_values(gib) == moe_dense.GROUP_VALUES == gib // 4  # a full GPU: 1 GiB, as before
    assert moe_dense.scratch_values(torch.device("cpu")) == moe_dense.GROUP_VALUES
    # On a GPU (the CUDA calls stood in for): the driver's free bytes and torch's unused blocks count.
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (4 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: {"reserved_bytes.all.current": 5 * gib,
                                                                  "allocated_bytes.all.current": 3 * gib})
    assert moe_dense.scratch_values(torch.device("cuda")) == 6 * gib // 8
    capturing[0] = True
    assert moe_dense.scratch_values(torch.device("cuda")) == moe_dense.GROUP_VALUES


@pytest.mark.parametrize("act,types,fused,biases,wide,bn_wide",
                         [(ACTS[1], (T.MXFP4, T.MXFP4), True, False, False, 128), (*CASES[2], False, 128),
                          (*CASES[2], True, 128), (*CASES[2], True, 512)],
                         ids=["clamped-mxfp4-fused", "oai-mxfp4-biases", "oai-mxfp4-biases-wide",
                              "oai-mxfp4-biases-wide-partial-rows"])  # MXFP4 only
def test_grouped_prefill_equals_the_reference(monkeypatch: pytest.MonkeyPatch, act: Activation, types: tuple[T, T],
                                              fused: bool, biases: bool, wide: bool, bn_wide: int,
                                              device: torch.device) -> None:
    """A prefill's experts as grouped products with each block of weights decoded on chip, in tiles
    of 16 pairs of one expert (several per expert here), or of 64 (`wide`: the bf16x3 products) and
    BN_WIDE rows (512: rows past the matrices' end masked, as gpt-oss's 2,880 in 128s); a wave
    gives its pairs the whole step's bits."""
    from expertpack.worker.kernels import moe_grouped

    monkeypatch.setattr(moe_grouped, "WIDE_PAIRS", 1 if wide else 10**6)
    monkeypatch.setattr(moe_grouped, "BN_WIDE", bn_wide)  # 512: a tile of rows past the matrices' 256
    run = partial(moe_grouped.experts_grouped, n_expert=N_EXPERT)
    lay, ids, args, want = prompt_case(act, types, fused, biases, 40, (9, 10), device)
    full = run(*args)
    rel = ((full.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 1e-6, f"relative error {rel:.2e}"
    wave = (ids.flatten() % 2 == 1).nonzero().flatten().to(torch.int32).to(device)  # the pairs of experts 1 and 3
    assert_a_wave_gives_the_same_bits(run, args, full, lay.stride, wave)


@pytest.mark.parametrize("build", ["kernel", "ops"])
def test_expert_tiles_cover_each_experts_rows_in_tiles_of_one_expert(build: str, device: torch.device) -> None:
    """The device-built tile table, by the one-launch kernel and by torch operations: every sorted
    row in exactly one tile, a tile holding at most `rows` rows of a single expert, the experts'
    ranks and blocks in sorted order."""
    from expertpack.worker.kernels.expert_tiles import tile_table, tile_table_ops

    table_of = tile_table if build == "kernel" else tile_table_ops
    sorted_blocks = torch.tensor([0, 0, 0, 0, 0, 0, 4096, 8192, 8192, 8192, 8192, 12288], device=device)
    blocks, n, tiles = table_of(sorted_blocks, max_experts=6, rows=4)
    assert n.tolist() == [4]
    assert blocks[:4].tolist() == [0, 4096, 8192, 12288]
    used = [t for t in tiles.tolist() if t[2] > t[1]]
    assert used == [[0, 0, 4], [0, 4, 6], [1, 6, 7], [2, 7, 11], [3, 11, 12]]
    assert all(t == [0, 0, 0] for t in tiles.tolist()[len(used):])
    assert tiles.shape[0] == -(-12 // 4) + 6 and tiles.dtype == torch.int32


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_one_launch_tile_table_equals_the_torch_operations(rows: int, device: torch.device) -> None:
    """Random routings of a prompt (many experts of one or a few pairs, some of many): the kernel's
    blocks, expert count and tiles are the torch operations' (but for the sink entry, which the
    operations overwrite with some row's block)."""
    from expertpack.worker.kernels.expert_tiles import tile_table, tile_table_ops

    gen = torch.Generator().manual_seed(rows)
    for n_pairs, n_expert in ((1, 8), (37, 8), (256, 128), (4096, 128), (3000, 900)):
        ids = torch.randint(0, n_expert, (n_pairs,), generator=gen)
        ids[: n_pairs // 3] = ids[0]  # one expert of many pairs
        sorted_blocks = torch.sort(ids * 4096)[0].to(device)
        max_experts = min(n_pairs, n_expert)
        got, want = tile_table(sorted_blocks, max_experts, rows), tile_table_ops(sorted_blocks, max_experts, rows)
        assert torch.equal(got[0][:-1], want[0][:-1]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2], want[2]), (n_pairs, n_expert)


def test_the_layers_expert_count_bounds_the_tiles_of_a_cache_pool(device: torch.device) -> None:
    """A cache's pool holds every layer's slots: the layer's routed experts bound the launches."""
    from expertpack.worker.kernels.expert_tiles import block_extent, expert_tiles

    lay = layout(T.Q4_K, T.Q6_K, False, False)
    roles = expert_roles(lay)
    offsets = (torch.tensor([0, 1, 2, 1, 0, 2] * 20) * lay.stride).to(device)
    pool_bytes = 1000 * lay.stride  # room for 1,000 blocks
    loose = expert_tiles(offsets, None, 2, pool_bytes, roles, rows=16)
    tight = expert_tiles(offsets, None, 2, pool_bytes, roles, rows=16, n_expert=N_EXPERT)
    assert loose.max_experts == min(120, pool_bytes // block_extent(roles)) == 120
    assert tight.max_experts == N_EXPERT and tight.table.shape[0] == -(-120 // 16) + N_EXPERT
    assert tight.n_experts.tolist() == [3] and torch.equal(tight.order, loose.order)


def test_i_quant_experts_never_take_the_tiles_path() -> None:
    """A prompt whose experts share a few pairs each runs them in tiles, unless a matrix is an
    i-quant: moe_tiles decodes those through the [BN, 256] values, moe_tl through iq_dot (3.3x
    faster at a 32-token prompt on the H200); from DENSE_MIN_PAIRS_PER_EXPERT on, both go dense."""
    from expertpack.worker.nn.moe import DENSE_MIN_PAIRS_PER_EXPERT, fused_path
    from expertpack.worker.nn.triton_ops import TritonOps

    few = torch.arange(2 * N_EXPERT).reshape(-1, 1) % N_EXPERT  # 2 pairs an expert
    many = torch.arange(DENSE_MIN_PAIRS_PER_EXPERT * N_EXPERT).reshape(-1, 1) % N_EXPERT
    for types, tiled in (((T.Q4_K, T.Q6_K), True), ((T.IQ2_XXS, T.IQ1_S), False), ((T.Q4_K, T.IQ4_XS), False)):
        roles = expert_roles(layout(*types, False, False))
        assert TritonOps.experts_tiled(roles) == tiled
        assert fused_path(few, N_EXPERT, False, TritonOps.experts_tiled(roles)) == ("tiles" if tiled else "per_pair")
        assert fused_path(many, N_EXPERT, False, TritonOps.experts_tiled(roles)) == "dense"


def test_a_long_prompts_q4_k_experts_take_the_integer_paths() -> None:
    """Experts whose three matrices are Q4_K and have no biases run in moe_integer's tiles from
    INTEGER_TILES_MIN_PAIRS_PER_EXPERT pairs an expert and unpacked from INTEGER_MIN_PAIRS_PER_EXPERT;
    another type or a bias keeps them dense; a few pairs an expert stay in tiles, and for them from
    one pair an expert (a batched decode step; moe_tiles' Q4_K kernels), where others run per pair."""
    from expertpack.worker.kernels import moe_integer
    from expertpack.worker.nn.moe import (DENSE_MIN_PAIRS_PER_EXPERT, INTEGER_MIN_PAIRS_PER_EXPERT,
                                          INTEGER_TILES_MIN_PAIRS_PER_EXPERT, fused_path)
    from expertpack.worker.nn.triton_ops import TritonOps

    def pairs(per_expert: int) -> torch.Tensor:
        return torch.arange(per_expert * N_EXPERT).reshape(-1, 1) % N_EXPERT

    assert 2 < INTEGER_TILES_MIN_PAIRS_PER_EXPERT < INTEGER_MIN_PAIRS_PER_EXPERT
    between = pairs(max(INTEGER_TILES_MIN_PAIRS_PER_EXPERT, DENSE_MIN_PAIRS_PER_EXPERT))
    for types, biases, integer in (((T.Q4_K, T.Q4_K), False, True), ((T.Q4_K, T.Q6_K), False, False),
                                   ((T.Q4_K, T.Q4_K), True, False)):
        roles = expert_roles(layout(*types, False, biases))
        assert TritonOps.experts_integer(roles) == moe_integer.runs(roles) == integer
        assert fused_path(pairs(2), N_EXPERT, False, True, integer) == "tiles"
        assert fused_path(pairs(1), N_EXPERT, False, True, integer) == ("tiles" if integer else "per_pair")
        assert fused_path(pairs(1)[:1], N_EXPERT, False, True, integer) == "per_pair"  # one token: split over K
        assert fused_path(between, N_EXPERT, False, True, integer) == ("integer_tiles" if integer else "dense")
        assert fused_path(pairs(INTEGER_MIN_PAIRS_PER_EXPERT), N_EXPERT, False, True, integer) == (
            "integer" if integer else "dense")
