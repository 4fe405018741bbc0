"""What the connector reads of a vLLM request (``views.request_view``), on stand-in requests."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from vllm_testlib import MiniEngine

from kvplane.integrations.vllm import views
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest
from kvplane.integrations.vllm.views import lora_identity, request_view

PROMPT = list(range(1, 22))  # 21 tokens: blocks of 4, chunks of 2 blocks -> 2 chunks


def vllm_request(req_id: str = "q", **more: object) -> SimpleNamespace:
    """The attributes of a vLLM ``Request`` that the connector reads."""
    fields: dict[str, object] = {
        "request_id": req_id,
        "all_token_ids": PROMPT,
        "prompt_token_ids": PROMPT,
        "mm_features": [],
        "lora_request": None,
        "cache_salt": None,
        "skip_reading_prefix_cache": False,
        **more,
    }
    return SimpleNamespace(**fields)


def test_a_request_that_skips_reading_the_prefix_cache_is_not_readable() -> None:
    assert request_view(vllm_request()).readable
    view = request_view(vllm_request(skip_reading_prefix_cache=True))
    assert view.eligible and not view.readable
    assert request_view(vllm_request(mm_features=["image"])).eligible is False


def test_an_unreadable_request_matches_nothing_but_is_stored() -> None:
    eng = MiniEngine({"blocks_per_chunk": 2, "host_slots": 8})
    eng.run(PROMPT)
    eng.settle()
    skip = RequestView("lp", PROMPT, readable=False)
    assert eng.sched.matched_tokens(skip, 0) == 0  # the prefix is cached, but not for it
    assert eng.sched.matched_tokens(RequestView("n", PROMPT), 0) == 16

    other = [*range(100, 121)]
    skip = RequestView("lp2", other, readable=False)
    assert eng.sched.matched_tokens(skip, 0) == 0
    blocks, eng.free = eng.free[:6], eng.free[6:]
    eng.sched.allocated(skip, blocks, 0)
    meta = eng.step([ScheduledRequest(skip, len(other), blocks)])
    assert [len(op.keys) for op in meta.stores] == [2]  # its KV is still stored
    eng.finish_step(meta)
    eng.worker.drain()
    eng.idle_step()
    eng.sched.finished("lp2")  # its gather is done: nothing fenced
    assert eng.sched.fenced_blocks == []
    eng.free.extend(blocks)
    assert eng.sched.matched_tokens(RequestView("n2", other), 0) == 16
    eng.close()


def _lora(name: str, int_id: int, path: Path) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


def test_lora_keys_name_the_adapter_id_and_files(tmp_path: Path) -> None:
    v1 = tmp_path / "sql-v1"
    v1.mkdir()
    (v1 / "adapter_model.safetensors").write_bytes(b"v1" * 64)
    (v1 / "adapter_config.json").write_text("{}")
    v2 = tmp_path / "sql-v2"
    v2.mkdir()
    (v2 / "adapter_model.safetensors").write_bytes(b"v2" * 999)
    (v2 / "adapter_config.json").write_text("{}")
    base = request_view(vllm_request(lora_request=_lora("sql", 1, v1))).extra_keys
    assert base[:3] == ("lora", "sql", 1)
    assert request_view(vllm_request(lora_request=_lora("sql", 1, v1))).extra_keys == base
    for other in (_lora("sql", 7, v1), _lora("sql", 1, v2), _lora("sql2", 1, v1)):
        assert request_view(vllm_request(lora_request=other)).extra_keys != base
    assert request_view(vllm_request()).extra_keys == ()


def test_an_adapter_retrained_in_place_stamps_anew_in_a_new_process(tmp_path: Path) -> None:
    adapter = tmp_path / "sql"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"old" * 64)
    before = lora_identity(_lora("sql", 3, adapter))
    weights.write_bytes(b"new weights" * 64)
    os.utime(weights, ns=(1, 1))
    views._adapter.cache_clear()  # a restarted engine: nothing memoised
    after = lora_identity(_lora("sql", 3, adapter))
    assert before is not None and after is not None
    assert (before.name, before.int_id) == (after.name, after.int_id)
    assert before.stamp != after.stamp
