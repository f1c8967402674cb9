"""The prompt cache: longest-prefix reuse over many entries, views that never change an
entry, the byte-capped LRU, spills to the SSD tier and restores from it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.cache import kv_layout, prefix_cache
from mlxd.engine.cache.kv_layout import view
from mlxd.engine.cache.prefix_cache import PrefixCache
from mlxd.engine.cache.ssd_tier import SsdTier, common_prefix
from tests.support import wait_for

BIG = 1 << 30


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load(str(tiny_model))[0]


def filled(model: Any, tokens: list[int], cache: list[Any] | None = None) -> list[Any]:
    """A fresh cache after running `tokens` through the model (as a lane leaves it)."""
    cache = cache if cache is not None else list(make_prompt_cache(model))
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def last_logits(model: Any, tokens: list[int], cache: list[Any] | None = None) -> mx.array:
    cache = cache if cache is not None else list(make_prompt_cache(model))
    out = model(mx.array(tokens)[None], cache=cache)[:, -1]
    mx.eval(out)
    return out


def seq(start: int, n: int) -> list[int]:
    return [(start + i) % 300 + 3 for i in range(n)]


def test_common_prefix() -> None:
    import numpy as np

    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert common_prefix(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert common_prefix(a, np.array([1, 2], dtype=np.int32)) == 2
    assert common_prefix(a, np.array([], dtype=np.int32)) == 0
    assert common_prefix(a, np.array([7], dtype=np.int32)) == 0
    assert common_prefix(a, a) == 4


def test_the_entry_sharing_the_longest_prefix_serves(model: Any) -> None:
    pc = PrefixCache(BIG)
    system = seq(0, 20)
    a, b = system + seq(100, 10), system + seq(200, 10)
    pc.store(filled(model, a), a)
    pc.store(filled(model, b), b)
    pc.store(filled(model, seq(50, 15)), seq(50, 15))
    query = system + seq(200, 6) + seq(7, 5)  # 26 tokens in common with b, 20 with a
    kv, cached = pc.fetch(query)
    assert cached == 26 and kv is not None and kv[0].offset == 26
    warm = last_logits(model, query[cached:], kv)
    assert mx.allclose(warm, last_logits(model, query), atol=1e-4).item()
    assert pc.stats.ram_hits == 1 and pc.stats.tokens_reused == 26


def test_two_clients_alternating_both_hit_every_turn(model: Any) -> None:
    pc = PrefixCache(BIG)
    one, two = seq(0, 40), seq(150, 40)
    history = {"one": one, "two": two}
    for turn in range(4):
        for name in ("one", "two"):
            prompt = history[name] + seq(turn * 7 + 1, 3)
            kv, cached = pc.fetch(prompt)
            if turn == 0:
                assert cached == 0 and kv is None
                kv = list(make_prompt_cache(model))
            else:
                assert cached == len(history[name]), (turn, name, cached)
            full = prompt + seq(9, 4)  # the reply
            model(mx.array(full[cached:])[None], cache=kv)
            pc.store(kv, full)
            history[name] = full
    assert pc.stats.misses == 2 and pc.stats.ram_hits == 6


def test_a_served_view_never_changes_the_entry(model: Any) -> None:
    pc = PrefixCache(BIG)
    tokens = seq(0, 30)
    pc.store(filled(model, tokens), tokens)
    kv, cached = pc.fetch(tokens[:20] + seq(90, 10))
    assert cached == 20
    assert kv is not None
    model(mx.array(seq(90, 10))[None], cache=kv)  # the lane appends its own tokens
    mx.eval([c.state for c in kv])
    again, cached = pc.fetch([*tokens, 5])
    assert cached == 30
    assert mx.allclose(last_logits(model, [5], again), last_logits(model, [*tokens, 5]), atol=1e-4).item()


def test_at_least_one_prompt_token_is_left_to_run(model: Any) -> None:
    pc = PrefixCache(BIG)
    tokens = seq(0, 12)
    pc.store(filled(model, tokens), tokens)
    _, cached = pc.fetch(tokens)
    assert cached == 11


def test_a_prefix_below_the_wanted_share_is_a_miss_and_stays(model: Any) -> None:
    pc = PrefixCache(BIG)
    tokens = seq(0, 10)
    pc.store(filled(model, tokens), tokens)
    kv, cached = pc.fetch(tokens[:4] + seq(100, 20), min_share=0.5)
    assert (kv, cached) == (None, 0)
    assert pc.fetch(tokens[:4] + seq(100, 2), min_share=0.5)[1] == 4


def test_store_refuses_a_cache_claiming_more_than_its_tokens(model: Any) -> None:
    pc = PrefixCache(BIG)
    pc.store(filled(model, seq(0, 5)), seq(0, 3))
    assert pc.fetch(seq(0, 5))[1] == 0


def test_entries_a_longer_one_covers_are_dropped(model: Any) -> None:
    pc = PrefixCache(BIG)
    short, long = seq(0, 10), seq(0, 25)
    pc.store(filled(model, short), short)
    pc.store(filled(model, long), long)
    assert pc.snapshot().ram.entries == 1
    assert pc.fetch([*short, 9])[1] == 10  # served by the longer one, cut


def test_the_byte_cap_evicts_the_least_recently_used(model: Any) -> None:
    per_entry = sum(c.nbytes for c in view(filled(model, seq(0, 16)), 16))
    pc = PrefixCache(2 * per_entry)
    a, b, c = seq(0, 16), seq(100, 16), seq(200, 16)
    pc.store(filled(model, a), a)
    pc.store(filled(model, b), b)
    assert pc.fetch([*a, 1])[1] == 16  # a is now the recently used one
    pc.store(filled(model, c), c)
    assert pc.snapshot().ram.entries == 2
    assert pc.snapshot().ram.bytes <= 2 * per_entry
    assert pc.fetch([*b, 1])[1] == 0  # evicted (no SSD tier: gone)
    assert pc.fetch([*a, 1])[1] == 16 and pc.fetch([*c, 1])[1] == 16
    assert pc.stats.ram_evicted == 1 and pc.stats.evicted_unwritten == 1


def test_a_cache_that_cannot_be_cut_serves_only_prompts_containing_it(model: Any) -> None:
    pc = PrefixCache(BIG)
    tokens = seq(0, 12)
    rotating = filled(model, tokens, [RotatingKVCache(max_size=4) for _ in model.layers])  # wrapped: not trimmable
    assert not rotating[0].is_trimmable()
    pc.store(rotating, tokens)
    assert pc.fetch(tokens[:8] + seq(50, 3))[1] == 0
    kv, cached = pc.fetch(tokens + seq(50, 3))
    assert cached == 12 and kv is not None


def tier(tmp_path: Path) -> SsdTier:
    return SsdTier(tmp_path / "kv", BIG)


def test_write_behind_and_flush_put_entries_on_ssd_and_a_new_cache_restores_them(model: Any, tmp_path: Path) -> None:
    idle = threading.Event()
    idle.set()
    pc = PrefixCache(BIG, tier(tmp_path), idle)
    a, b = seq(0, 40), seq(100, 40)
    pc.store(filled(model, a), a)
    pc.store(filled(model, b), b)
    assert pc.write_behind() == "queued"  # the newest first, one at a time
    assert pc.write_behind() in ("busy", "none")  # "busy" while the writer holds it
    assert wait_for(lambda: pc.writes_pending == 0, 10)
    report = pc.flush(10)
    assert report.complete and report.entries == 1 and report.bytes > 0
    assert pc.write_behind() == "none"  # nothing left to write
    assert pc.flush(10).entries == 0
    pc.close()

    restarted = PrefixCache(BIG, tier(tmp_path), idle)  # a new engine on the same dir
    assert len(restarted.ssd or []) == 2
    query = a[:30] + seq(7, 5)
    kv, cached = restarted.fetch(query)
    assert cached == 30 and restarted.stats.ssd_hits == 1
    assert mx.allclose(last_logits(model, query[cached:], kv), last_logits(model, query), atol=1e-4).item()
    assert restarted.fetch(query)[1] == 30 and restarted.stats.ram_hits == 1  # now in RAM too
    restarted.close()


def test_eviction_spills_to_ssd_and_the_entry_comes_back_from_there(model: Any, tmp_path: Path) -> None:
    per_entry = sum(c.nbytes for c in view(filled(model, seq(0, 16)), 16))
    busy = threading.Event()  # never idle: only the eviction's urgent write runs
    pc = PrefixCache(4 * per_entry, tier(tmp_path), busy)
    entries = [seq(i * 40, 16) for i in range(6)]
    for tokens in entries:
        pc.store(filled(model, tokens), tokens)
    assert wait_for(lambda: pc.writes_pending == 0, 10)
    assert pc.snapshot().ram.entries == 4
    assert pc.ssd is not None and len(pc.ssd) == 2  # the two evicted ones, written while busy
    kv, cached = pc.fetch(entries[0] + [1])
    assert cached == 16 and pc.stats.ssd_hits == 1
    assert mx.allclose(last_logits(model, [1], kv), last_logits(model, entries[0] + [1]), atol=1e-4).item()
    pc.close()


def written(pc: PrefixCache) -> bool:
    """Hand the writer the checkpoints taken (as a lane's next step does) and wait for the writes."""
    pc.send_checkpoints()
    return bool(wait_for(lambda: pc.writes_pending == 0, 10))


def test_a_checkpoint_goes_to_ssd_at_the_next_hand_over_while_busy_and_never_to_ram(model: Any,
                                                                                   tmp_path: Path) -> None:
    busy = threading.Event()  # never idle: a checkpoint is written all the same
    pc = PrefixCache(BIG, tier(tmp_path), busy)
    tokens = seq(0, 40)
    kv = filled(model, tokens)
    assert pc.checkpoint(kv, [*tokens, 7])  # the row's history runs one past its KV
    assert pc.writes_pending == 1 and pc.ssd is not None and len(pc.ssd) == 0  # its copy queued, not handed over
    kv2 = filled(model, seq(40, 8), kv)  # the row goes on writing into its own cache
    assert written(pc)
    (entry,) = pc.ssd.entries()
    assert entry.tokens.tolist() == tokens  # what the KV held when it was taken, not what came after
    assert pc.snapshot().ram.entries == 0 and pc.stats.checkpoints == 1
    longer = tokens + seq(40, 8)
    assert pc.checkpoint(kv2, [*longer, 9])
    assert written(pc)
    assert [e.tokens.tolist() for e in pc.ssd.entries()] == [longer]  # the newer one replaced it
    restarted = PrefixCache(BIG, tier(tmp_path), busy)
    query = longer + seq(7, 3)
    got, cached = restarted.fetch(query)
    assert cached == 48 and restarted.stats.ssd_hits == 1
    assert mx.allclose(last_logits(model, query[cached:], got), last_logits(model, query), atol=1e-4).item()
    pc.close()
    restarted.close()


@pytest.mark.parametrize("group", [False, True], ids=["one-array-a-tensor", "blocks"])
def test_a_bfloat16_checkpoint_is_written_from_its_staged_copy_and_restores_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: bool) -> None:
    """A checkpoint stages its copy as the file holds it (bfloat16 as its bits) behind the step
    under way, and the hand-over only takes the bytes (kv_layout.py): the file restores to the
    same arrays, whatever the row wrote after."""
    monkeypatch.setattr(kv_layout, "GROUP", group)
    kv = []
    for i in range(2):
        c = KVCache()
        k1, k2 = mx.random.split(mx.random.key(i))
        c.update_and_fetch(mx.random.normal((1, 2, 24, 64), key=k1).astype(mx.bfloat16),
                           mx.random.normal((1, 2, 24, 64), key=k2).astype(mx.bfloat16))
        kv.append(c)
    want = [(mx.array(c.keys[..., :24, :]), mx.array(c.values[..., :24, :])) for c in kv]
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    taken = pc.checkpoint(kv, seq(0, 24))
    assert taken is not None and taken.staged is not None and taken.kv == []  # the copy alone, not the row's buffers
    for c in kv:  # the row goes on: its next tokens land after the copied ones
        c.update_and_fetch(mx.ones((1, 2, 4, 64), dtype=mx.bfloat16), mx.ones((1, 2, 4, 64), dtype=mx.bfloat16))
    assert written(pc) and taken.staged is None and taken.on_ssd
    got, cached = PrefixCache(BIG, tier(tmp_path), threading.Event()).fetch([*seq(0, 24), 5])
    assert cached == 24 and got is not None
    for c, (keys, values) in zip(got, want, strict=True):
        assert c.keys.dtype == mx.bfloat16
        assert mx.array_equal(c.keys, keys).item() and mx.array_equal(c.values, values).item()
    pc.close()


def test_paced_checkpoint_copies_reach_the_writer_over_turns_and_a_drain_takes_the_rest(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With READ_A_TURN (CUDA: a read to the host holds the GPU thread), each turn reads at most
    that many bytes of the copies' blocks; a checkpoint goes to the writer once all its blocks
    are read, and restores as if read at once. A drain (flush) reads what is left, budget or not."""
    monkeypatch.setattr(kv_layout, "GROUP", True)
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    first, second = seq(0, 40), seq(100, 40)
    one = pc.checkpoint(filled(model, first), first)
    assert one is not None and one.staged is not None
    blocks = one.staged.blocks
    monkeypatch.setattr(kv_layout, "BLOCK_BYTES", max(b.nbytes for b in blocks) // 2)  # the next: more blocks
    two = pc.checkpoint(filled(model, second), second)
    assert two is not None and two.staged is not None and len(two.staged.blocks) > len(blocks)
    monkeypatch.setattr(prefix_cache, "READ_A_TURN", 1)  # one block a turn
    for turn in range(1, len(blocks)):
        pc.send_checkpoints()
        assert one.staged is not None and len(one.read) == turn and not two.read
    pc.send_checkpoints()  # its last block: the first checkpoint goes to the writer
    assert one.staged is None and one.read == [] and not two.read
    pc.send_checkpoints()
    assert two.staged is not None and len(two.read) == 1
    pc.flush(10)  # a drain: the rest at once
    assert two.staged is None and pc.writes_pending == 0 and one.on_ssd and two.on_ssd
    for tokens in (first, second):
        got, cached = PrefixCache(BIG, tier(tmp_path), threading.Event()).fetch([*tokens, 5])
        assert cached == 40 and got is not None
        assert mx.allclose(last_logits(model, [5], got), last_logits(model, [*tokens, 5]), atol=1e-4).item()
    pc.close()


def test_later_checkpoints_write_only_what_follows_the_whole_one_and_restore_joined(model: Any,
                                                                                    tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    tokens = seq(0, 40)
    kv = filled(model, tokens)
    whole = pc.checkpoint(kv, tokens)
    assert whole is not None and whole.base is None
    longer = tokens + seq(40, 8)
    kv = filled(model, seq(40, 8), kv)
    delta = pc.checkpoint(kv, longer, whole)
    assert delta is not None and delta.base == (whole.name, 40)
    assert delta.nbytes * 4 < whole.nbytes  # 8 tokens' KV, not 48
    assert written(pc)
    assert pc.ssd is not None
    by_length = sorted(pc.ssd.entries(), key=lambda e: len(e.tokens))
    assert [len(e.tokens) for e in by_length] == [40, 48]  # the base stays: the delta needs it
    assert (by_length[1].base, by_length[1].start) == (whole.name, 40)
    restarted = PrefixCache(BIG, tier(tmp_path), threading.Event())
    query = longer + seq(7, 3)
    got, cached = restarted.fetch(query)
    assert cached == 48 and restarted.stats.ssd_hits == 1
    assert mx.allclose(last_logits(model, query[cached:], got), last_logits(model, query), atol=1e-4).item()
    assert restarted.ssd is not None
    restarted.ssd.remove(whole.name)  # a base that goes takes its deltas with it
    assert len(restarted.ssd) == 0
    pc.close()
    restarted.close()


def checkpoint_chain(pc: PrefixCache, model: Any, deltas: int) -> tuple[list[Any], list[int]]:
    """A 40-token row's checkpoints as it grows 8 tokens at a time: a whole file, then `deltas`
    delta files, each on the one before; and the row's tokens."""
    tokens = seq(0, 40)
    kv = filled(model, tokens)
    links = [pc.checkpoint(kv, tokens)]
    for step in range(deltas):
        new = seq(40 + 8 * step, 8)
        kv = filled(model, new, kv)
        tokens = tokens + new
        links.append(pc.checkpoint(kv, tokens, links[-1]))
    return links, tokens


def test_a_chain_of_deltas_writes_each_token_once_and_restores_joined(model: Any, tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    links, tokens = checkpoint_chain(pc, model, 3)
    assert all(e is not None for e in links)
    assert [e.base for e in links[1:]] == [(links[0].name, 40), (links[1].name, 48), (links[2].name, 56)]
    assert all(e.nbytes * 4 < links[0].nbytes for e in links[1:])  # 8 tokens' KV each
    assert written(pc) and pc.ssd is not None
    assert sorted(len(e.tokens) for e in pc.ssd.entries()) == [40, 48, 56, 64]  # every link stays
    newest = pc.ssd.get(links[-1].name)
    assert newest is not None and [len(e.tokens) for e in pc.ssd.chain(newest) or []] == [40, 48, 56, 64]
    assert pc.ssd.chain_size(newest) == sum(e.size for e in pc.ssd.entries())
    restarted = PrefixCache(BIG, tier(tmp_path), threading.Event())
    query = tokens + seq(7, 3)
    got, cached = restarted.fetch(query)
    assert cached == 64 and restarted.stats.ssd_hits == 1 and got is not None and got[0].offset == 64
    assert mx.allclose(last_logits(model, query[cached:], got), last_logits(model, query), atol=1e-4).item()
    assert restarted.ssd is not None
    restarted.ssd.remove(links[1].name)  # a link that goes takes the links on it with it
    assert sorted(len(e.tokens) for e in restarted.ssd.entries()) == [40]
    pc.close()
    restarted.close()


def test_a_scan_drops_a_chain_whose_middle_link_is_gone(model: Any, tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    links, tokens = checkpoint_chain(pc, model, 2)
    assert written(pc) and pc.ssd is not None and len(pc.ssd) == 3
    assert links[1] is not None
    (pc.ssd.dir / links[1].name).unlink()  # a crash, say: the newest link would serve nothing
    rescanned = tier(tmp_path)
    assert sorted(len(e.tokens) for e in rescanned.entries()) == [40]
    restarted = PrefixCache(BIG, rescanned, threading.Event())
    _, cached = restarted.fetch([*tokens, 5])
    assert cached == 40  # the whole file still serves
    pc.close()
    restarted.close()


def test_a_delta_whose_base_is_not_on_disk_is_not_written_and_a_scan_drops_orphans(model: Any,
                                                                                   tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    tokens = seq(0, 40)
    kv = filled(model, tokens)
    lost = pc.checkpoint(filled(model, tokens[:32]), tokens[:32])
    assert lost is not None
    pc._copying.clear()  # as if its write failed: it never reaches the disk
    lost.write_failed = True  # (what the writer's callback says then)
    delta = pc.checkpoint(kv, tokens, lost)
    assert delta is not None and delta.base == (lost.name, 32)
    assert written(pc)
    assert delta.write_failed and pc.ssd is not None and len(pc.ssd) == 0  # it would serve nothing
    whole = pc.checkpoint(filled(model, tokens[:32]), tokens[:32])
    assert written(pc)
    assert pc.checkpoint(kv, tokens, whole) is not None
    assert written(pc) and len(pc.ssd) == 2
    assert whole is not None
    (pc.ssd.dir / whole.name).unlink()  # a crash, say, between the two: the next scan drops the delta
    rescanned = tier(tmp_path)
    assert len(rescanned) == 0 and not list(rescanned.dir.glob("*.safetensors"))
    pc.close()


def next_turn(pc: PrefixCache, model: Any, prompt: list[int]) -> tuple[list[Any], int]:
    """A row of `prompt` as a lane runs it: its cached prefix fetched, the rest run on it."""
    got, cached = pc.fetch(prompt)
    kv = got if got is not None else list(make_prompt_cache(model))
    return filled(model, prompt[cached:], kv), cached


@pytest.mark.parametrize("served", ["written entry", "checkpoint"])
def test_a_first_checkpoint_stands_on_the_ssd_file_its_prompt_came_from(model: Any, tmp_path: Path,
                                                                        served: str) -> None:
    """An agent's next turn: its prompt's first tokens came from the prompt cache, from an entry
    on SSD (the reply before, written) or holding a checkpoint on SSD of most of them (the RAM
    entry of the reply before, whose checkpoint ended a few tokens short); the turn's first
    checkpoint writes only what follows that file, and a new engine restores it joined."""
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    turn1 = seq(0, 40)
    if served == "written entry":
        pc.store(filled(model, turn1), turn1)
        assert pc.flush(10).complete
        base_tokens = 40
    else:  # the reply's checkpoint holds its first 36 tokens; its RAM entry, all 40, is not on SSD
        first = pc.checkpoint(filled(model, turn1[:36]), turn1[:36])
        assert first is not None and written(pc)
        pc.store(filled(model, turn1), turn1)
        base_tokens = 36
    turn2 = turn1 + seq(200, 12)
    kv, cached = next_turn(pc, model, turn2)
    assert cached == 40
    whole_bytes = sum(c.nbytes for c in view(kv, len(turn2)))
    taken = pc.checkpoint(kv, turn2, cached=cached)
    assert taken is not None and taken.base is not None and taken.base[1] == base_tokens
    assert taken.nbytes * 3 < whole_bytes  # the turn's new tokens (and the few its base lacks), not 52
    assert written(pc) and taken.on_ssd and pc.ssd is not None
    restarted = PrefixCache(BIG, tier(tmp_path), threading.Event())
    query = [*turn2, 9]
    got, hit = restarted.fetch(query)
    assert hit == len(turn2) and restarted.stats.ssd_hits == 1
    assert mx.allclose(last_logits(model, query[hit:], got), last_logits(model, query), atol=1e-4).item()
    pc.close()
    restarted.close()


def test_a_first_checkpoint_is_whole_where_no_file_holds_enough_of_its_prompt(model: Any, tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    long = seq(0, 40)
    pc.store(filled(model, long), long)
    assert pc.flush(10).complete
    prompt = long[:12] + seq(100, 30)  # 12 tokens served by a 40-token file: more than twice what it serves
    kv, cached = next_turn(pc, model, prompt)
    assert cached == 12
    taken = pc.checkpoint(kv, prompt, cached=cached)
    assert taken is not None and taken.base is None
    unwritten = seq(150, 40)  # served by a RAM entry that is not on SSD: nothing to stand on
    pc.store(filled(model, unwritten), unwritten)
    prompt = unwritten + seq(5, 6)
    kv, cached = next_turn(pc, model, prompt)
    assert cached == 40
    taken = pc.checkpoint(kv, prompt, cached=cached)
    assert taken is not None and taken.base is None
    assert written(pc)
    pc.close()


def test_rows_checkpointing_the_same_tokens_share_one_file(model: Any, tmp_path: Path) -> None:
    pc = PrefixCache(BIG, tier(tmp_path), threading.Event())
    prompt = seq(0, 32)
    first = pc.checkpoint(filled(model, prompt), prompt)  # one choice of a request ...
    again = pc.checkpoint(filled(model, prompt), prompt)  # ... and another, the same prompt
    assert first is not None and again is first and pc.stats.checkpoints == 1
    assert written(pc)
    assert pc.ssd is not None and len(pc.ssd) == 1
    assert pc.checkpoint(filled(model, prompt), prompt) is first  # written: still the one
    pc.ssd.remove(first.name)  # gone (evicted, say): the next row writes it again
    anew = pc.checkpoint(filled(model, prompt), prompt)
    assert anew is not None and anew is not first and pc.stats.checkpoints == 2
    assert written(pc) and len(pc.ssd) == 1
    pc.close()


def test_a_checkpoint_the_writer_is_too_far_behind_for_is_skipped(model: Any, tmp_path: Path) -> None:
    rows = [seq(100 * i, 40) for i in range(3)]
    kvs = [filled(model, tokens) for tokens in rows]
    size = sum(c.nbytes for c in view(kvs[0], 40))
    pc = PrefixCache(4 * size, tier(tmp_path), threading.Event())  # half the cap: room for two copies waiting
    assert pc.checkpoint(kvs[0], rows[0])
    assert pc.checkpoint(kvs[1], rows[1])  # another row's, while the first still waits
    assert not pc.checkpoint(kvs[2], rows[2])  # past half the cap: skipped, not waited for
    assert (pc.stats.checkpoints, pc.stats.checkpoints_skipped) == (2, 1)
    assert written(pc)
    assert pc.ssd is not None and len(pc.ssd) == 2
    no_tier = PrefixCache(BIG)
    assert not no_tier.checkpoint(kvs[2], rows[2])  # nowhere to write it
    pc.close()


def test_quantized_kv_round_trips_through_ssd(tmp_path: Path) -> None:
    idle = threading.Event()
    idle.set()
    pc = PrefixCache(BIG, tier(tmp_path), idle)
    tokens = seq(0, 64)
    kv = []
    for _ in range(3):  # head size 64 (the tiny model's 16 is below every quantization group size)
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, 64, 64)), mx.random.normal((1, 2, 64, 64)))
        kv.append(c.to_quantized(group_size=32, bits=4))
    pc.store(kv, tokens)
    assert pc.flush(10).entries == 1
    pc.close()
    restarted = PrefixCache(BIG, tier(tmp_path), idle)
    back, cached = restarted.fetch([*tokens, 3])
    assert cached == 64 and back is not None
    assert type(back[0]).__name__ == "QuantizedKVCache" and (back[0].bits, back[0].group_size) == (4, 32)
    for got, want in zip(back, kv, strict=True):
        for x, y in zip(got.keys, want.keys, strict=True):
            assert mx.array_equal(x, y[..., :64, :]).item()
    restarted.close()


def test_a_corrupt_file_is_a_miss_and_is_quarantined(model: Any, tmp_path: Path) -> None:
    idle = threading.Event()
    idle.set()
    pc = PrefixCache(BIG, tier(tmp_path), idle)
    tokens = seq(0, 50)
    pc.store(filled(model, tokens), tokens)
    assert pc.flush(10).entries == 1
    pc.close()
    (path,) = (tmp_path / "kv").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # one bit in the KV data
    path.write_bytes(bytes(data))
    restarted = PrefixCache(BIG, tier(tmp_path), idle)
    assert restarted.fetch([*tokens, 1]) == (None, 0)
    assert restarted.stats.misses == 1
    assert restarted.ssd is not None and restarted.ssd.stats.quarantined == 1 and len(restarted.ssd) == 0
    assert len(list((tmp_path / "kv" / "quarantine").iterdir())) == 1
    restarted.close()


def test_a_file_is_restored_only_where_that_costs_less_than_prefilling_what_it_serves(model: Any,
                                                                                      tmp_path: Path) -> None:
    """Restore's cost per byte as measured, against prefill's per token as the engine measured it
    (None: not yet): a long file restored whole to serve a short prefix it shares is a loss."""
    a, b = seq(0, 40), seq(100, 40)
    with_files = PrefixCache(BIG, tier(tmp_path), threading.Event())
    for tokens in (a, b):
        assert with_files.checkpoint(filled(model, tokens), tokens) is not None  # to SSD only
    assert written(with_files)
    with_files.close()
    per_token: list[float | None] = [None]
    restarted = PrefixCache(BIG, tier(tmp_path), threading.Event(), prefill_cost=lambda: per_token[0])
    assert restarted.fetch([*a[:4], 7])[1] == 4  # nothing measured yet: any prefix is restored
    assert restarted.ssd is not None
    s, size = restarted.ssd.stats, restarted.ssd.entries()[0].size
    assert s.restores == 1
    per_token[0] = size * s.restore_s / s.restored_bytes / 20  # restoring a file costs what prefilling 20 tokens does
    assert restarted.fetch([*b[:4], 7]) == (None, 0)  # 4 tokens: cheaper to prefill them
    assert s.restores == 1 and restarted.stats.misses == 1
    assert restarted.longest([*b[:4], 7]) == 0  # the batch lane's plans see the same
    kv, cached = restarted.fetch([*b, 7])  # 40 of them: it pays
    assert cached == 40 and kv is not None and s.restores == 2
    per_token[0] = 1e-12
    assert restarted.fetch([*a, 7])[1] == 40  # in RAM now: no restore to pay for
    restarted.close()


def test_no_ram_tier_keeps_nothing(model: Any) -> None:
    pc = PrefixCache(0)
    pc.store(filled(model, seq(0, 10)), seq(0, 10))
    assert pc.fetch([*seq(0, 10), 1]) == (None, 0)


def test_a_failed_write_is_not_retried_by_write_behind_but_by_a_drain(model: Any, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxd.engine.cache import kv_files

    idle = threading.Event()
    idle.set()
    pc = PrefixCache(BIG, tier(tmp_path), idle)
    real = kv_files.write_file

    def full(*args: Any, **kw: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_files, "write_file", full)
    tokens = seq(0, 20)
    pc.store(filled(model, tokens), tokens)
    assert pc.write_behind() == "queued"
    assert wait_for(lambda: pc.writes_pending == 0, 10)
    assert pc.write_behind() == "none"  # not again and again (the idle loop would spin)
    assert pc.ssd is not None and pc.ssd.stats.write_errors == 1
    report = pc.flush(10)  # a drain tries again, and says it did not get it all written
    assert report.complete is False and report.errors == 1
    monkeypatch.setattr(kv_files, "write_file", real)
    report = pc.flush(10)
    assert report.complete is True and report.entries == 1
    pc.close()


def test_an_entry_larger_than_ram_goes_to_ssd_and_serves_from_there_without_filling_ram(
    model: Any, tmp_path: Path,
) -> None:
    small, big = seq(0, 8), seq(100, 64)
    per_small = sum(c.nbytes for c in view(filled(model, small), 8))
    idle = threading.Event()
    idle.set()
    pc = PrefixCache(2 * per_small, tier(tmp_path), idle)
    pc.store(filled(model, small), small)
    pc.store(filled(model, big), big)  # 8x the small one: over the cap
    assert wait_for(lambda: pc.writes_pending == 0, 10)
    assert pc.snapshot().ram.entries == 1 and pc.ssd is not None and len(pc.ssd) == 1
    kv, cached = pc.fetch([*big, 1])
    assert cached == 64 and kv is not None and pc.stats.ssd_hits == 1
    assert pc.snapshot().ram.entries == 1  # served, not kept: the small one stays
    assert pc.fetch([*small, 1])[1] == 8
    pc.close()


def test_a_stored_entry_does_not_keep_its_lanes_longer_buffer(model: Any) -> None:
    pc = PrefixCache(BIG)
    tokens = seq(0, 260)  # a KVCache grows in steps of 256: its buffer holds 512
    kv = filled(model, tokens)
    assert kv[0].keys.shape[2] == 512
    pc.store(kv, tokens)
    (entry,) = pc._entries.values()
    assert entry.kv[0].keys.shape[2] == 260 and entry.nbytes == sum(c.nbytes for c in entry.kv)


def test_a_cache_that_cannot_be_cut_keeps_its_prefix_files_on_ssd(model: Any, tmp_path: Path) -> None:
    idle = threading.Event()
    idle.set()
    pc = PrefixCache(BIG, tier(tmp_path), idle)
    system = seq(0, 6)
    longer = [*system, *seq(50, 8)]
    for tokens in (system, longer):
        pc.store(filled(model, tokens, [RotatingKVCache(max_size=4) for _ in model.layers]), tokens)
    assert pc.flush(10).entries == 2
    pc.close()
    restarted = PrefixCache(BIG, tier(tmp_path), idle)
    assert restarted.ssd is not None and len(restarted.ssd) == 2  # the longer one does not serve the shorter
    assert not all(d.trimmable for d in restarted.ssd.entries())
    kv, cached = restarted.fetch([*system, 99, 98])
    assert cached == 6 and kv is not None  # the exact prefix entry, not the longer one
    restarted.close()


def test_a_flush_answer_to_an_asker_who_gave_up_is_dropped() -> None:
    import concurrent.futures

    from mlxd.engine.gpu.gateway import answer

    gave_up: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    gave_up.cancel()
    answer(gave_up, {"entries": 1})  # must not raise on the GPU thread
    waiting: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    answer(waiting, {"entries": 2})
    assert waiting.result(0) == {"entries": 2}
