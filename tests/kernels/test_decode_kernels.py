"""The decode step's small fused kernels against the torch formulas they replace: attention over a
KV buffer reserved ahead (GQA, a sliding window, sinks, keys past the query's position never
read), the softmax routers (top-k with k not a power of two), the residual add before RMSNorm and
the routed experts' lookup in the expert cache's device table."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.kernels.attention_tl import decode_attention
from expertpack.worker.kernels.pointwise_tl import add_rms_norm
from expertpack.worker.kernels.routing_tl import expert_ahead, expert_lookup, softmax_topk, sqrtsoftplus_route
from expertpack.worker.nn import layers, routing
from expertpack.worker.nn.ops import AheadSlots, TorchOps


@pytest.mark.parametrize("heads,kv_heads,d,dv", [(8, 2, 64, 64), (4, 4, 48, 32)])
@pytest.mark.parametrize("window,sinks", [(None, False), (5, True), (None, True)])
@pytest.mark.parametrize("capacity", [400, 1100])  # one launch; several splits and a merge
def test_decode_attention(heads: int, kv_heads: int, d: int, dv: int, window: int | None, sinks: bool, capacity: int,
                          device: torch.device) -> None:
    g = torch.Generator().manual_seed(heads * d + (window or 0))  # most keys lie past the queries' positions
    positions = torch.tensor([0, 7, 300])
    q = torch.randn(3, heads, d, generator=g)
    k = torch.randn(capacity, kv_heads, d, generator=g)
    v = torch.randn(capacity, kv_heads, dv, generator=g)
    s = torch.randn(heads, generator=g) if sinks else None
    want = layers.attention(q, k, v, positions, d ** -0.5, window=window, sinks=s)  # the torch path
    k_dev = k.clone()
    k_dev[301:] = float("nan")  # never read: beyond every query's position
    got = decode_attention(q.to(device), k_dev.to(device), v.to(device), positions.to(device), d ** -0.5,
                           window, None if s is None else s.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts,k", [(64, 8), (60, 6), (32, 4)])
@pytest.mark.parametrize("softmax_first,normalize", [(True, True), (True, False), (False, False)])
def test_softmax_routers(experts: int, k: int, softmax_first: bool, normalize: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(5, experts, generator=g) * 2
    if softmax_first:
        want_ids, want_w = routing.softmax_topk(logits, k, normalize)
    else:
        want_ids, want_w = routing.topk_softmax(logits, k)
    ids, w = softmax_topk(logits.to(device), k, normalize, softmax_first)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-7)
    # split-K partial sums of the router, added by the kernel in order
    parts = torch.stack([logits * 0.25, logits * 0.5, logits * 0.25], dim=1)
    ids, w = softmax_topk(parts.to(device), k, normalize, softmax_first)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("experts,k", [(256, 6), (60, 3)])
def test_sqrtsoftplus_routers(experts: int, k: int, device: torch.device) -> None:
    """DeepSeek-V4's routers in one launch: top k by score + bias, and hashed by token id, against
    routing.py's torch formulas; logits past softplus's threshold (20) and far below 0 among them."""
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(5, experts, generator=g) * 4
    logits[0, :3] = torch.tensor([25.0, -30.0, 20.5])
    bias = torch.randn(experts, generator=g) * 0.1
    want_ids, want_w = routing.sqrtsoftplus_topk(logits, bias, k, 1.5)
    ids, w = sqrtsoftplus_route(logits.to(device), k, 1.5, bias=bias.to(device))
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-7)
    table = torch.randint(0, experts, (50, k), generator=g, dtype=torch.int32)
    tokens = torch.tensor([3, 49, 0, 3, 17])
    want_ids, want_w = routing.sqrtsoftplus_hashed(logits, table, tokens, 1.5)
    ids, w = sqrtsoftplus_route(logits.to(device), k, 1.5, table=table.to(device), tokens=tokens.to(device))
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("parts", [0, 1, 8])
def test_add_rms_norm(parts: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(parts)
    x = torch.randn(3, 2880, generator=g)
    delta = torch.randn(3, parts, 2880, generator=g) if parts else torch.randn(3, 2880, generator=g)
    w = torch.randn(2880, generator=g)
    total = x + (delta.sum(dim=1) if parts else delta)
    got_total, got = add_rms_norm(x.to(device), delta.to(device), w.to(device), 1e-6)
    torch.testing.assert_close(got_total.cpu(), total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.cpu(), layers.rms_norm(total, w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style,rot,norms,parts", [(layers.RopeStyle.NEOX, 64, True, 1), (layers.RopeStyle.NORM, 32, False, 3)])
def test_qkv_rope_store(style: layers.RopeStyle, rot: int, norms: bool, parts: int, device: torch.device) -> None:
    from expertpack.worker.kernels.pointwise_tl import qkv_rope_store

    heads, kv_heads, d, t = 4, 2, 64, 3
    g = torch.Generator().manual_seed(rot)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    q_norm, k_norm = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if norms else (None, None)
    r = layers.Rope(rot, 10000.0, style)
    positions = torch.tensor([5, 9, 2])
    cos, sin = r.cos_sin(positions, torch.device("cpu"))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    if norms:
        q, k = layers.rms_norm(q, q_norm, 1e-6), layers.rms_norm(k, k_norm, 1e-6)
    want_q, want_k = r.apply(q, cos, sin), r.apply(k, cos, sin)
    keys = torch.zeros(16, kv_heads, d, device=device)
    values = torch.zeros(16, kv_heads, d, device=device)
    split = torch.stack([qkv / parts] * parts, dim=1) if parts > 1 else qkv  # [T, S, C]: partial sums
    got_q = qkv_rope_store(split.to(device), heads, kv_heads, None if q_norm is None else q_norm.to(device),
                           None if k_norm is None else k_norm.to(device), 1e-6, cos.to(device), sin.to(device), rot,
                           style is layers.RopeStyle.NEOX, keys, values, positions.to(device))
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys.cpu()[positions], want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values.cpu()[positions], v, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[positions] = False
    assert not keys.cpu()[untouched].any() and not values.cpu()[untouched].any()


def test_matvec_parts_add_up_to_the_product(device: torch.device) -> None:
    from gguf import GGMLQuantizationType as T

    from expertpack.worker.kernels.linear_tl import matvec, matvec_parts
    from expertpack.worker.weights.quant import dequantize

    from ..helpers.quant import random_bytes

    raw = torch.from_numpy(random_bytes(T.Q8_0, (2048, 64), seed=4, valid=True))
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(4))
    parts = matvec_parts(x.to(device), raw.to(device), int(T.Q8_0), 2048, 64)
    assert parts.shape[0] == 2 and parts.shape[1] > 1  # a short wide matrix is split
    want = x.double() @ dequantize(raw, T.Q8_0, (2048, 64)).double().T
    torch.testing.assert_close(parts.sum(1).double().cpu(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(matvec(x.to(device), raw.to(device), int(T.Q8_0), 2048, 64), parts.sum(1))  # same device, same sum


def test_a_matrix_per_head_in_one_launch(device: torch.device) -> None:
    """MLA's absorbed projections: x [T, H, K] against H matrices [R, K] stored head-major."""
    from gguf import GGMLQuantizationType as T

    from expertpack.worker.kernels.linear_tl import matvec_heads
    from expertpack.worker.weights.quant import dequantize

    from ..helpers.quant import random_bytes

    heads, rows, k = 3, 40, 256
    raw = torch.from_numpy(random_bytes(T.Q4_K, (k, rows, heads), seed=9, valid=True))
    x = torch.randn(2, heads, k, generator=torch.Generator().manual_seed(9))
    want = torch.einsum("thk,hrk->thr", x.double(), dequantize(raw, T.Q4_K, (k, rows, heads)).double())
    got = matvec_heads(x.to(device), raw.to(device), int(T.Q4_K), k, rows).cpu()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("capacity,d", [(70, 40), (1100, 40), (70, 520)])  # one launch; splits and a merge; wide
def test_decode_attention_over_the_keys_a_mask_shows(capacity: int, d: int, device: torch.device) -> None:
    """DeepSeek-V4's keys (a ring of raw entries, the token's own, compressed entries) in no
    position order: a mask says which each query sees, blocks of only hidden keys among them (the
    entries of windows not complete yet), with a sink logit per head; against the torch formula of
    compressed_attention._attend."""
    g = torch.Generator().manual_seed(capacity + d)
    heads = 4
    q = torch.randn(2, heads, d, generator=g)
    keys = torch.randn(capacity, d, generator=g)
    visible = torch.rand(2, capacity, generator=g) < 0.3
    visible[:, 40:] = False  # whole blocks hidden
    visible[1, 64:66] = True
    sinks = torch.randn(heads, generator=g)
    scores = torch.einsum("thd,sd->hts", q, keys) * d ** -0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(torch.cat([scores, sinks.reshape(heads, 1, 1).expand(heads, 2, 1)], dim=-1), dim=-1)[..., :-1]
    want = torch.einsum("hts,sd->thd", probs, keys)
    keys[~visible.any(dim=0)] = float("nan")  # a hidden key weighs nothing, whatever it holds
    got = decode_attention(q.to(device), keys[:, None].to(device), keys[:, None].to(device),
                           None, d ** -0.5, sinks=sinks.to(device),
                           visible=visible.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,k", [(1, 8), (3, 6)])
def test_expert_lookup_records_ids_and_offsets_and_gathers_kept_blocks(t: int, k: int, device: torch.device) -> None:
    """engine.TableDecode's lookup: each pair's offset from the table row (-1 absent, in the
    resident slots, or a kept block's address in host memory), recorded with its id; ids outside
    the row (routing on NaN, past an absent expert) clamped into it; kept blocks copied into the
    pairs' transit slots after the resident ones, whose offsets the kernels get; absent ones read
    as 0. The kernel (its pool on the device, the kept blocks in pinned host memory) against
    TorchOps' formula on the CPU."""
    slot, nbytes, n_resident = 4096, 3000, 40
    g = torch.Generator().manual_seed(t * k)
    where = torch.randint(0, n_resident, (64,), generator=g) * slot  # resident slot offsets
    kind = torch.randint(0, 3, (64,), generator=g)  # 0 resident, 1 absent, 2 kept (in tier slot e % 16)
    ids = torch.randint(0, 64, (t, k), generator=g)
    ids[0, 0], ids[-1, -1] = -5, 1000
    tier_bytes = torch.randint(0, 256, (16 * slot,), dtype=torch.uint8, generator=g)
    pool_bytes = torch.randint(0, 256, ((n_resident + t * k) * slot,), dtype=torch.uint8, generator=g)
    results = []
    for on in (torch.device("cpu"), device):
        tier = tier_bytes.pin_memory() if on.type == "cuda" else tier_bytes.clone()
        pool = pool_bytes.to(on, copy=True)
        kept_at = tier.data_ptr() - pool.data_ptr() + (torch.arange(64) % 16) * slot
        row = torch.where(kind == 0, where, torch.where(kind == 1, -1, kept_at))
        rec = torch.zeros(2, t * k, dtype=torch.int64, device=on)
        args = (rec[0], rec[1], pool, n_resident * slot, slot, nbytes)
        if not results:
            got = TorchOps(on).expert_lookup(ids, row, *args)
        else:
            got = expert_lookup(ids.to(on), row.to(on), *args)
        if on.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(rec[1].cpu(), row[rec[0].cpu()])
        results.append((got.cpu(), rec[0].cpu(), pool.cpu()))
    (want, want_ids, want_pool), (got, got_ids, got_pool) = results
    assert torch.equal(got, want) and torch.equal(got_ids, want_ids) and torch.equal(got_pool, want_pool)
    assert want_ids[0] == 0 and want_ids[-1] == 63
    pairs = kind[want_ids]
    assert (pairs == 2).any() and (pairs == 1).any()
    for p, e in enumerate(want_ids.tolist()):
        if kind[e] == 0:
            assert want[p] == where[e]
        elif kind[e] == 1:
            assert want[p] == 0
        else:
            assert want[p] == (n_resident + p) * slot
            assert torch.equal(want_pool[want[p]:want[p] + nbytes], tier_bytes[(e % 16) * slot:][:nbytes])


@pytest.mark.parametrize("most", [8, 3, 0])
def test_blocks_copied_ahead_are_read_from_their_ahead_slots(device: torch.device, most: int) -> None:
    """engine.TableDecode's copies ahead: expert_ahead copies the guessed experts' kept blocks
    (not resident or absent ones), the first `most` of them in the guess's order, into their ahead
    slots; the next lookup reads a kept pair whose expert's block was copied ahead from its ahead
    slot and copies only the other kept pairs into their transit slots, and counts kept pairs,
    those read ahead and blocks copied ahead. The kernels against TorchOps' formula, and each
    pair's bytes against the tier's."""
    slot, nbytes, n_resident, k = 4096, 3000, 40, 8
    g = torch.Generator().manual_seed(11)
    where = torch.randint(0, n_resident, (64,), generator=g) * slot
    kind = torch.arange(64) % 3  # 0 resident, 1 absent, 2 kept (in tier slot e % 16)
    ids = torch.tensor([[2, 5, 8, 11, 0, 3, 14, 1]])  # kept: 2, 5, 8, 11, 14
    guess = torch.tensor([5, 11, 17, 6, 20, 2, 4, 9])  # kept and right: 5, 11, 2; kept, wrong: 17, 20; others not kept
    copied = [5, 11, 17, 20, 2][:most]  # the kept guesses in order, as many as copied ahead
    right = [e for e in copied if e in ids[0].tolist()]
    tier_bytes = torch.randint(0, 256, (16 * slot,), dtype=torch.uint8, generator=g)
    pool_bytes = torch.randint(0, 256, ((n_resident + 3 * k) * slot,), dtype=torch.uint8, generator=g)
    base = (n_resident + k) * slot
    results = []
    for on in (torch.device("cpu"), device):
        tier = tier_bytes.pin_memory() if on.type == "cuda" else tier_bytes.clone()
        pool = pool_bytes.to(on, copy=True)
        kept_at = tier.data_ptr() - pool.data_ptr() + (torch.arange(64) % 16) * slot
        row = torch.where(kind == 0, where, torch.where(kind == 1, -1, kept_at)).to(on)
        ahead = AheadSlots(guess.to(on), base, torch.tensor([1, 0, 0], dtype=torch.int64, device=on), most)
        rec = torch.zeros(2, k, dtype=torch.int64, device=on)
        args = (rec[0], rec[1], pool, n_resident * slot, slot, nbytes)
        if not results:
            ops = TorchOps(on)
            ops.expert_ahead(row, ahead, pool, n_resident * slot, slot, nbytes)
            got = ops.expert_lookup(ids, row, *args, ahead=ahead)
        else:
            expert_ahead(row, ahead, pool, n_resident * slot, slot, nbytes)
            got = expert_lookup(ids.to(on), row, *args, ahead=ahead)
        if on.type == "cuda":
            torch.cuda.synchronize()
        results.append((got.cpu(), ahead.counts.cpu(), pool.cpu()))
    (want, want_counts, want_pool), (got, got_counts, got_pool) = results
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool) and torch.equal(got_counts, want_counts)
    assert want_counts.tolist() == [1 + 5, len(right), len(copied)]  # added to what was there
    for g_, e in enumerate(guess.tolist()):  # the copied guesses in their ahead slots, the others not written
        at = base + g_ * slot
        if e in copied:
            assert torch.equal(want_pool[at:at + nbytes], tier_bytes[(e % 16) * slot:][:nbytes])
        else:
            assert torch.equal(want_pool[at:at + slot], pool_bytes[at:at + slot])
    for p, e in enumerate(ids[0].tolist()):
        transit = (n_resident + p) * slot
        if e in right:
            assert want[p] == base + guess.tolist().index(e) * slot
            assert torch.equal(want_pool[transit:transit + slot], pool_bytes[transit:transit + slot])  # not copied again
        elif kind[e] == 2:
            assert want[p] == transit
            assert torch.equal(want_pool[transit:transit + nbytes], tier_bytes[(e % 16) * slot:][:nbytes])
        else:
            assert want[p] == (where[e] if kind[e] == 0 else 0)
