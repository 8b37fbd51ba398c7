"""What crosses from the engine process to the HTTP process: each step's additions, from which the HTTP process
rebuilds every output exactly as the engine made it."""
from __future__ import annotations

import multiprocessing
import pickle
import signal
from collections import Counter
from dataclasses import replace

from kvserve.sampling_params import SamplingParams
from kvserve.server.engine_core import EngineCore, from_wire, to_wire

REQUESTS = {"plain": SamplingParams(temperature=0, max_tokens=24),
            "n2": SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, logprobs=2),
            "stopped": SamplingParams(temperature=0, max_tokens=40, stop=["\n"], prompt_logprobs=1)}


def add_requests(engine) -> dict:
    for request_id, params in REQUESTS.items():
        engine.add_request("The three primary colors are", params, request_id=request_id)
    return REQUESTS


def test_outputs_rebuilt_from_what_each_step_added_equal_the_engines(smollm2):
    engine = smollm2.engine
    requests = add_requests(engine)
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


class Sent(list):
    """Stands in for the events pipe: what the engine core sends, each message pickled as the pipe would."""

    def send(self, message: tuple) -> None:
        self.append(pickle.loads(pickle.dumps(message)))


def test_a_stream_interval_sends_each_requests_steps_merged_and_they_rebuild_its_outputs(smollm2):
    """Interval 4: a request's first output goes alone, then one per 4 steps, and the last as soon as it is made;
    rebuilt, they end in the outputs the engine made step by step (text, token ids, logprobs, metrics)."""
    engine, sent = smollm2.engine, Sent()
    core = EngineCore(engine, multiprocessing.Pipe(duplex=False)[0], sent, max_waiting=8, stream_interval=4)
    add_requests(engine)
    finals, made = {}, Counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        made.update(out.request_id for out in outputs)
        finals.update((out.request_id, out) for out in outputs if out.finished)
        core._send_step(outputs)
    last, held = {}, {}
    for kind, wired, _, _ in sent:
        assert kind == "step"
        for item in wired:
            held.setdefault(item[0], []).append(item[4])
            last[item[0]] = from_wire(item, last.get(item[0]))
    for request_id, out in finals.items():  # the last message's new text and ids are those of the steps it merged
        assert replace(last[request_id], outputs=[replace(c, new_text=e.new_text, new_token_ids=e.new_token_ids)
                                                  for c, e in zip(last[request_id].outputs, out.outputs)]) == out
    assert last.keys() == finals.keys() and not core._held
    for request_id, steps in held.items():
        assert sum(steps) == made[request_id] > 12
        assert steps[0] == 1 and set(steps[1:-1]) == {4} and 1 <= steps[-1] <= 4, steps


def test_the_engine_core_returns_quietly_when_the_http_process_is_gone(smollm2):
    """The HTTP process ends mid-stream (a server stopped under load): the engine core's next send finds the events
    pipe closed, and its loop returns instead of dying with a BrokenPipeError traceback."""
    engine = smollm2.engine
    (commands_in, commands_out), (events_in, events_out) = multiprocessing.Pipe(duplex=False), multiprocessing.Pipe(duplex=False)
    core = EngineCore(engine, commands_in, events_out, max_waiting=8)  # commands_out held open: no command, no EOF
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), request_id="orphaned")
    events_in.close()
    try:
        core.run()
        assert engine.has_unfinished_requests()  # it stopped at the first send, after one step
    finally:
        commands_out.close()
        engine.abort_request("orphaned")
    assert not engine.has_unfinished_requests()


def test_an_engine_whose_http_process_left_while_it_loaded_exits_quietly(tiny_model_dir):
    """The server stopped during the engine's start (a kernel build, a model load): the engine then died on a
    BrokenPipeError's traceback when it said it was ready."""
    from kvserve.config import EngineConfig
    from kvserve.server.engine_core import main

    commands, _ = multiprocessing.Pipe()
    gone, events = multiprocessing.Pipe()
    gone.close()
    handler = signal.getsignal(signal.SIGINT)  # main ignores Ctrl-C, as an engine process does
    try:
        main(EngineConfig(model=str(tiny_model_dir), num_blocks=8), commands, events, 4, 1, None, None)  # returns, no error
    finally:
        signal.signal(signal.SIGINT, handler)
