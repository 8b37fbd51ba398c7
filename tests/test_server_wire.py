"""What crosses from the engine process to the HTTP process: each step's additions, from which the HTTP process
rebuilds every output exactly as the engine made it."""
from __future__ import annotations

import pickle
from dataclasses import replace

from kvserve.sampling_params import SamplingParams
from kvserve.server.engine_core import from_wire, to_wire


def test_outputs_rebuilt_from_what_each_step_added_equal_the_engines(smollm2):
    engine = smollm2.engine
    requests = {"plain": SamplingParams(temperature=0, max_tokens=24),
                "n2": SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, logprobs=2),
                "stopped": SamplingParams(temperature=0, max_tokens=40, stop=["\n"], prompt_logprobs=1)}
    for request_id, params in requests.items():
        engine.add_request("The three primary colors are", params, request_id=request_id)
    last, seen, steps, sizes = {}, set(), 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out.request_id not in seen
            message = pickle.dumps(to_wire(out, first))
            sizes.append(len(message))
            seen.add(out.request_id)
            rebuilt = from_wire(pickle.loads(message), last.get(out.request_id))
            if first or out.finished:  # the metrics cross then; in between they are the first output's (TTFT, queue time)
                assert rebuilt == out
            else:
                assert replace(rebuilt, metrics=out.metrics) == out and rebuilt.metrics is last[out.request_id].metrics
            last[out.request_id] = rebuilt
        steps += 1
    assert {r: o.finished for r, o in last.items()} == dict.fromkeys(requests, True) and steps > 20
    assert last["stopped"].outputs[0].finish_reason == "stop" and last["n2"].outputs[1].logprobs
    assert max(sizes[len(requests):-len(requests)]) < 1500  # a step's message does not grow with the output
