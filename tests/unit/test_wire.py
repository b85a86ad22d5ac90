"""The shard protocol's records to its messages and back (router/transport/wire.py): what the core hands the shard
client reaches the shards field for field, and a step's answer reaches the core whole."""

from __future__ import annotations

from conveyor.router.pipeline.request import Parameters
from conveyor.router.transport import wire
from conveyor.router.transport.records import Batch, CachedBatch, NewRequest, RequestUpdate
from conveyor.v1 import shard_pb2 as pb


def tokens_pb(*ids: int) -> pb.Tokens:
    return pb.Tokens(ids=ids, logprobs=[-1.0] * len(ids), texts=[str(i) for i in ids], is_special=[False] * len(ids))


def test_a_steps_answer_reaches_the_core_whole_with_the_slowest_ranks_timings() -> None:
    finished = pb.GeneratedText(text="ab", generated_tokens=2, finish_reason=pb.FINISH_REASON_STOP_SEQUENCE, seed=5)
    rank_0 = pb.DecodeResponse(
        generations=[
            pb.Generation(request_id=1, tokens=tokens_pb(7)),
            pb.Generation(
                request_id=2, tokens=tokens_pb(8, 9), prefill_tokens=tokens_pb(3), top_tokens=[tokens_pb(4)], drafted=2
            ),
            pb.Generation(request_id=3, tokens=tokens_pb(6), finished=finished),
        ],
        batch=pb.CachedBatch(id=4, request_ids=[1, 2], size=2),
        timings=pb.Timings(total_ns=10),
    )
    rank_1 = pb.DecodeResponse(timings=pb.Timings(total_ns=20, mask_ns=3, disk_bytes=0))
    result = wire.step_result([rank_0, rank_1])
    plain, drafted, ended = result.generations
    assert (plain.request_id, list(plain.tokens.ids), plain.finished, plain.drafted) == (1, [7], None, 0)
    assert list(plain.prefill_tokens.ids) == [] and plain.top_tokens == []
    assert list(drafted.tokens.texts) == ["8", "9"] and drafted.drafted == 2
    assert list(drafted.prefill_tokens.ids) == [3] and [list(t.ids) for t in drafted.top_tokens] == [[4]]
    assert (ended.finished.finish_reason, ended.finished.seed, ended.finished.text) == ("stop_sequence", 5, "ab")
    assert result.batch == CachedBatch(id=4, request_ids=[1, 2], size=2)
    assert (result.timings.total_ns, result.timings.mask_ns, result.timings.disk_bytes) == (20, 3, 0)  # rank 1's
    alone = wire.step_result([rank_0])
    assert alone.timings.disk_bytes is None  # not looked at: unset, not 0
    greedy = pb.GeneratedText(finish_reason=pb.FINISH_REASON_LENGTH)
    assert wire.generation(pb.Generation(tokens=tokens_pb(1), finished=greedy)).finished.seed is None
    assert wire.step_result([pb.PrefillResponse()]).batch is None  # every request finished


def test_a_joining_request_and_an_update_reach_the_shards_field_for_field() -> None:
    parameters = Parameters(max_new_tokens=5, stop=("x",), ignore_eos=True, top_n_tokens=2, adapter="qv")
    joining = NewRequest(7, [1, 2, 3], parameters, 1, True, [4, 5], 2, 1, "scope")
    message = wire.batch_pb(Batch(id=3, requests=[joining]))
    assert (message.id, message.size) == (3, 1)
    request = message.requests[0]
    assert (request.id, list(request.input_ids), request.resumed_tokens, request.prefill_logprobs) == (
        7,
        [1, 2, 3],
        1,
        True,
    )
    assert (list(request.blocks), request.cache_len, request.chunk_len, request.cache_scope) == ([4, 5], 2, 1, "scope")
    assert (request.top_n_tokens, request.adapter, request.grammar) == (2, "qv", "")
    stopping = request.stopping_parameters
    assert (stopping.max_new_tokens, list(stopping.stop_sequences), stopping.ignore_eos_token) == (5, ["x"], True)
    whole = wire.request_pb(NewRequest(0, [1], Parameters()))
    assert not whole.HasField("chunk_len")  # None: the whole prompt
    assert wire.request_pb(NewRequest(0, [1], Parameters(), chunk_len=0)).HasField("chunk_len")
    (update,) = wire.updates_pb([RequestUpdate(request_id=7, new_blocks=[9], chunk_len=4, speculate=2)])
    assert (update.request_id, list(update.new_blocks), update.chunk_len, update.speculate) == (7, [9], 4, 2)
