import torch

from rollout.embedded_backend.request import Request, RequestStatus
from rollout.embedded_backend.scheduler import Scheduler
from rollout.sampling_params import SamplingParams
from spec import PositionUniforms, RequestAcceptance, SpecConfig


def _request(i, prompt_len=3, max_tokens=8):
    return Request(i, i, i, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   torch.Generator(), PositionUniforms(torch.Generator()), RequestAcceptance(), frozenset())


def _schedule(config=SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                           "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 8, 1]]})):
    return config.schedule.k_for_batch_size


def test_admission_is_bounded_by_max_num_seqs_and_in_order():
    scheduler = Scheduler(3, _schedule())
    requests = [_request(i) for i in range(5)]
    for r in requests:
        scheduler.add(r)
    plan = scheduler.plan()
    assert [r.req_id for r in plan.requests] == [0, 1, 2] and plan.new_requests == plan.requests
    assert plan.k_max == 1  # batch size 3 -> K = 1
    assert [r.status for r in requests] == [RequestStatus.RUNNING] * 3 + [RequestStatus.WAITING] * 2
    plan = scheduler.plan()
    assert plan.new_requests == [] and plan.batch_size == 3


def test_finished_requests_free_room_and_batch_size_drives_k():
    scheduler = Scheduler(3, _schedule())
    requests = [_request(i) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    scheduler.plan()
    scheduler.finish(requests[0])
    scheduler.finish(requests[1])
    plan = scheduler.plan()
    assert [r.req_id for r in plan.requests] == [2, 3] and [r.req_id for r in plan.new_requests] == [3]
    assert plan.k_max == 4  # batch size 2 -> K = 4
    scheduler.finish(requests[2])
    scheduler.finish(requests[3])
    assert not scheduler.has_unfinished and requests[3].status == RequestStatus.FINISHED


def test_room_for_drafts_respects_max_tokens_and_max_model_len():
    request = _request(0, prompt_len=3, max_tokens=8)
    assert request.room_for_drafts(max_model_len=100) == 7  # 8 tokens to go: 7 drafts + 1 bonus
    request.output_ids = [5] * 6
    assert request.room_for_drafts(max_model_len=100) == 1
    assert request.room_for_drafts(max_model_len=10) == 0  # 9 tokens held, 1 position left
