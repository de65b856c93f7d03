"""Unit tests for inference.sequence, inference.sampling_params and inference.config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from inference.config import EngineConfig
from inference.sampling_params import MAX_STOP_STRINGS, InvalidParameterError, SamplingParams
from inference.sequence import FinishReason, Sequence, SequenceStatus


def make_seq(prompt: list[int], **kwargs: Any) -> Sequence:
    return Sequence(0, prompt, SamplingParams(), arrival_time=0.0, **kwargs)


# ---- Sequence --------------------------------------------------------------------------------------


def test_sequence_rejects_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt"):
        make_seq([])


def test_new_sequence_starts_waiting_with_its_prompt_and_nothing_computed() -> None:
    seq = make_seq([5, 6, 7])

    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert seq.token_ids == [5, 6, 7]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.output_token_ids == []
    assert seq.num_uncomputed_tokens == 3


def test_appended_tokens_are_output_and_leave_the_prompt_untouched() -> None:
    prompt = [5, 6, 7]
    seq = make_seq(prompt)

    seq.append_token(8)
    seq.append_token(9)

    assert seq.prompt_token_ids == [5, 6, 7] and prompt == [5, 6, 7]
    assert seq.output_token_ids == [8, 9]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (5, 3, 2)


@pytest.mark.parametrize(("num_computed", "prefilling"), [(0, True), (3, True), (4, False), (5, False)])
def test_is_prefilling_while_more_than_the_last_token_is_uncomputed(num_computed: int,
                                                                     prefilling: bool) -> None:
    seq = make_seq([1, 2, 3, 4, 5], num_computed_tokens=num_computed)

    assert seq.num_uncomputed_tokens == 5 - num_computed
    assert seq.is_prefilling is prefilling


def test_sort_key_orders_by_priority_then_arrival_then_id() -> None:
    params = SamplingParams()
    seqs = [Sequence(3, [1], params, arrival_time=1.0, priority=0),
            Sequence(1, [1], params, arrival_time=0.0, priority=1),
            Sequence(2, [1], params, arrival_time=1.0, priority=0),
            Sequence(0, [1], params, arrival_time=5.0, priority=-1)]

    assert [s.seq_id for s in sorted(seqs, key=Sequence.sort_key)] == [0, 2, 3, 1]


def test_reset_for_recompute_keeps_tokens_and_forgets_cache_state() -> None:
    seq = make_seq([1, 2, 3, 4, 5], num_computed_tokens=5, num_cached_tokens=4)
    seq.block_table, seq.block_hashes, seq.status = [3, 7], [11], SequenceStatus.RUNNING
    seq.append_token(9)

    seq.reset_for_recompute()

    assert seq.token_ids == [1, 2, 3, 4, 5, 9]
    assert seq.output_token_ids == [9]
    assert (seq.num_computed_tokens, seq.num_cached_tokens) == (0, 0)
    assert seq.block_table == [] and seq.block_hashes == []
    assert seq.status is SequenceStatus.WAITING
    assert seq.num_preemptions == 1
    assert seq.num_uncomputed_tokens == 6


def test_finished_status_makes_is_finished_true() -> None:
    seq = make_seq([1])
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.STOP

    assert seq.is_finished


# ---- SamplingParams --------------------------------------------------------------------------------


def test_default_sampling_params_are_valid_and_not_greedy() -> None:
    params = SamplingParams()

    assert params.max_tokens >= 1
    assert not params.is_greedy


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 1},
    {"temperature": 0.0}, {"temperature": 100.0},
    {"top_p": 1e-9}, {"top_p": 1.0},
    {"top_k": 0}, {"top_k": 50},
    {"seed": 0}, {"seed": 2**63 - 1},
    {"stop": ("\n", "END")}, {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))},
    {"max_tokens": 5, "min_tokens": 5}, {"min_tokens": 0},
])
def test_sampling_params_accept_boundary_values(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)

    assert all(getattr(params, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0), ("top_p", math.nan),
    ("top_k", -1), ("top_k", 2.5),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5),
    ("stop", ("",)), ("stop", ("ok", 3)), ("stop", "END"),
    ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
    ("min_tokens", -1), ("min_tokens", 17),  # default max_tokens is 16
])
def test_each_invalid_sampling_param_raises_an_error_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})

    assert isinstance(info.value, ValueError)
    assert info.value.param == field
    assert str(info.value).startswith(f"{field}: ")


def test_sampling_params_are_immutable() -> None:
    params = SamplingParams()

    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]


# ---- EngineConfig ----------------------------------------------------------------------------------


def test_default_engine_config_is_valid() -> None:
    config = EngineConfig()

    assert config.block_size > 0 and config.max_num_batched_tokens >= config.block_size


@pytest.mark.parametrize(("field", "value"), [
    ("max_num_seqs", 0), ("max_num_seqs", 1.5),
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", -8),
    ("block_size", 0),
    ("kv_cache_memory_bytes", 0),
    ("num_kv_blocks", -1),
    ("max_model_len", -1),
    ("kv_cache_dtype", "fp8"),
    ("dtype", "float64"),
    ("num_threads", -1),
    ("decode_graphs_max_context", 0),
])
def test_each_invalid_engine_config_field_raises_a_value_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})

    assert str(info.value).startswith(f"{field}: ")


def test_budget_below_block_size_is_rejected_only_without_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(block_size=16, max_num_batched_tokens=8, enable_chunked_prefill=False)

    assert EngineConfig(block_size=16, max_num_batched_tokens=8).max_num_batched_tokens == 8


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_dtype": "int8"}, {"dtype": "bfloat16"}, {"num_kv_blocks": 64}, {"max_model_len": 2048},
])
def test_engine_config_accepts_documented_choices(kwargs: dict[str, Any]) -> None:
    config = EngineConfig(**kwargs)

    assert all(getattr(config, k) == v for k, v in kwargs.items())
