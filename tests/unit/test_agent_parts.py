"""The parts of a multi-turn rollout on their own: tool calls parsed by vLLM's parsers, tools and their faults,
environments (a class, a real HTTP server that fails and recovers or stays down), the counters, the trainer's
loss masks and the samples a rollout hands the trainer."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rlhf_testing.tiny_chat import build_chat_tokenizer

from rlhf_api.environment import Environment
from rlhf_runtime.agent.calls import Call, CallParser, check_parser
from rlhf_runtime.agent.endpoints import Endpoints, resolve
from rlhf_runtime.agent.environments import (
    EnvironmentFault,
    Environments,
    EnvironmentUnreachable,
    HttpEnvironment,
    Outage,
    Step,
    ToolsOnly,
    as_step,
    observation_messages,
)
from rlhf_runtime.agent.metrics import Counters, EngineLoad, quantile
from rlhf_runtime.agent.tools import Tools

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def env_spec(**over: Any) -> Environment:
    tools = [{"name": "double", "function": "tests.unit.test_agent_parts:double", "parameters": SCHEMA},
             {"name": "boom", "function": "tests.unit.test_agent_parts:boom", "parameters": SCHEMA},
             {"name": "slow", "function": "tests.unit.test_agent_parts:slow", "parameters": SCHEMA},
             {"name": "big", "function": "tests.unit.test_agent_parts:big", "parameters": SCHEMA},
             {"name": "binary", "function": "tests.unit.test_agent_parts:binary", "parameters": SCHEMA}]
    return Environment.model_validate({"tools": tools, "python": {"timeoutSeconds": 0.5, "maxOutputBytes": 256},
                                       **over})


def double(x: int) -> int:
    return 2 * x


def boom(x: int) -> str:
    raise RuntimeError(f"boom {x}")


async def slow(x: int) -> str:
    await asyncio.sleep(30)
    return "late"


def binary(x: int) -> bytes:
    return b"ok\xff"


def big(x: int) -> bytes:
    return b"\xff\xfe" + b"y" * 5000


# ------------------------------------------------------------------------------------------------ calls
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = {}
    for t in ("chatml", "llama3"):
        path = tmp_path_factory.mktemp(t)
        build_chat_tokenizer(path, t)
        out[t] = AutoTokenizer.from_pretrained(str(path))
    return out


TOOLS = [{"type": "function", "function": {"name": "double", "description": "", "parameters": SCHEMA}}]


def test_hermes_calls_and_malformed_ones(tokenizers: dict[str, Any]) -> None:
    p = CallParser(tokenizers["chatml"], "hermes", TOOLS)
    ok = p.parse('sure <tool_call>{"name": "double", "arguments": {"x": 2}}</tool_call>')
    assert (ok.content.strip(), [(c.name, c.arguments) for c in ok.calls], ok.error) == ("sure", [("double", {"x": 2})],
                                                                                         None)
    bad = p.parse('<tool_call>{"name": "double", "arguments": {"x": </tool_call>')
    assert bad.calls == [] and "malformed tool call" in (bad.error or "")
    plain = p.parse("no call here")
    assert (plain.content, plain.calls, plain.error) == ("no call here", [], None)
    args = p.parse('<tool_call>{"name": "double", "arguments": [1, 2]}</tool_call>')
    assert args.calls == [] and "not a JSON object" in (args.error or "")


def test_llama3_json_calls(tokenizers: dict[str, Any]) -> None:
    p = CallParser(tokenizers["llama3"], "llama3_json", TOOLS)
    ok = p.parse('{"name": "double", "parameters": {"x": 3}}')
    assert [(c.name, c.arguments) for c in ok.calls] == [("double", {"x": 3})]


def test_unknown_parser_is_refused_with_the_choices(tmp_path: Path) -> None:
    from rlhf_testing.tiny import build_tokenizer
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="not a tool-call parser of this vLLM .*hermes"):
        check_parser("nosuch")
    build_tokenizer(tmp_path)  # no chat tokens at all
    with pytest.raises(ValueError, match="toolParser 'llama3_json' cannot parse"):
        CallParser(AutoTokenizer.from_pretrained(str(tmp_path)), "llama3_json", TOOLS)


# ------------------------------------------------------------------------------------------------ tools
def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_tools_answer_and_every_fault_is_an_outcome() -> None:
    tools = Tools(env_spec())
    assert [t["function"]["name"] for t in tools.schemas()] == ["double", "boom", "slow", "big", "binary"]
    ok = run(tools.call(Call("double", {"x": 21})))
    assert (ok.text, ok.error) == ("42", None)
    cases = {"unknown_tool": Call("nope", {}), "bad_arguments": Call("double", {"x": "a"}),
             "exception": Call("boom", {"x": 1}), "timeout": Call("slow", {"x": 1}),
             "output_truncated": Call("big", {"x": 1})}
    for kind, call in cases.items():
        out = run(tools.call(call))
        assert out.error == kind, (kind, out)
        assert out.text
    big_out = run(tools.call(Call("big", {"x": 1})))
    assert len(big_out.text.encode()) < 400 and "bytes cut" in big_out.text and "\ufffd" in big_out.text
    bad_utf8 = run(tools.call(Call("binary", {"x": 1})))
    assert (bad_utf8.error, bad_utf8.text) == ("invalid_utf8", "ok\ufffd")
    assert run(tools.call(Call("slow", {"x": 1}))).seconds < 5


def test_tool_specs_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot import tool function 'tests.unit.nosuch:f' "
                                         r"\(spec.environment.tools\[0\].function\)"):
        Tools(Environment.model_validate({"tools": [{"name": "f", "function": "tests.unit.nosuch:f",
                                                     "parameters": SCHEMA}]}))
    with pytest.raises(ValueError, match="must be a JSON schema of type object"):
        Tools(Environment.model_validate({"tools": [{"name": "f", "function": "tests.unit.test_agent_parts:double",
                                                     "parameters": {"type": "array"}}]}))
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        Tools(Environment.model_validate({"tools": [{"name": "f", "function": "tests.unit.test_agent_parts:double",
                                                     "parameters": {"type": "object", "required": 3}}]}))


def test_the_python_tool_runs_isolated_and_a_hang_times_out() -> None:
    tools = Tools(Environment.model_validate({"tools": [{"name": "python", "builtin": "python", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}],
        "python": {"timeoutSeconds": 2}}))
    ok = run(tools.call(Call("python", {"code": "print(6*7)"})))
    assert (ok.text.strip(), ok.error) == ("42", None)
    hang = run(tools.call(Call("python", {"code": "while True: pass"})))
    assert hang.error == "timeout" and hang.seconds < 10
    crash = run(tools.call(Call("python", {"code": "raise ValueError('x')"})))
    assert crash.error == "exception" and "ValueError" in crash.text
    # bytes that are not UTF-8: the model reads replacement characters, the step counts a fault
    binary = run(tools.call(Call("python", {"code": "import sys; sys.stdout.buffer.write(b'ok\\xff\\n')"})))
    assert (binary.error, binary.text) == ("invalid_utf8", "ok\ufffd\n")
    counters = Counters()
    for out in (ok, binary):
        counters.tool(out.seconds, out.error, out.text)
    summary = counters.summary([])
    assert (summary["tool_errors"], summary["fault_share"]) == ({"invalid_utf8": 1}, 0.5)


# ------------------------------------------------------------------------------------------ environments
class CountingEnv:
    """An environment class of the protocol: done after two steps, reward 1 per step; fails on 'crash'."""

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        self.n = 0
        return [{"role": "user", "content": f"start {sample['prompt']}"}]

    async def step(self, message: dict[str, Any]) -> dict[str, Any]:
        if "crash" in message["content"]:
            raise KeyError("crash")
        self.n += 1
        return {"observations": [{"role": "user", "content": f"step {self.n}"}], "reward": 1.0, "done": self.n >= 2}


def test_class_environment_protocol_and_its_faults() -> None:
    envs = Environments(Environment.model_validate({"className": "tests.unit.test_agent_parts:CountingEnv"}))
    env = envs.make("e1")
    assert run(env.reset({"prompt": "p"})) == [{"role": "user", "content": "start p"}]
    s1 = run(env.step({"role": "assistant", "content": "a"}))
    s2 = run(env.step({"role": "assistant", "content": "b"}))
    assert (s1.reward, s1.done, s2.done) == (1.0, False, True)
    with pytest.raises(EnvironmentFault, match="step raised KeyError"):
        run(env.step({"role": "assistant", "content": "crash"}))
    with pytest.raises(ValueError, match="not a class with a step method"):
        Environments(Environment.model_validate({"className": "tests.unit.test_agent_parts:double"}))


def test_tools_only_ends_when_a_turn_has_no_results() -> None:
    env = ToolsOnly()
    assert run(env.step({"tool_results": [{"role": "tool", "content": "1"}]})).done is False
    assert run(env.step({"tool_results": []})).done is True


def test_observations_and_steps_of_any_shape() -> None:
    assert observation_messages({"text": "hi"}) == [{"role": "user", "content": "hi"}]
    assert observation_messages({"messages": [{"role": "tool", "content": 3}]}) == [{"role": "tool", "content": "3"}]
    assert observation_messages({"board": [1, 2]}) == [{"role": "user", "content": '{"board": [1, 2]}'}]
    assert as_step({"observation": "x", "reward": 2, "done": True}) == Step([{"role": "user", "content": "x"}],
                                                                            2.0, True)
    with pytest.raises(EnvironmentFault, match="reward of type str"):
        as_step({"reward": "high"})
    with pytest.raises(EnvironmentFault, match="not a Step or a dict"):
        as_step(3)


class Server:
    """A real HTTP environment server (OpenEnv's shape) whose answers the test controls: ``fail`` 5xx answers
    before it answers again. It keeps its episodes: a step of an episode it did not start is answered 404. Every
    request is in ``seen`` as (path, episode, Host header)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.fail = 0
        self.ready = False
        self.episodes: dict[str, int] = {}
        self.seen: list[tuple[str, str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if outer.ready and self.path == "/health" else 503)
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.fail > 0:
                    outer.fail -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                ep = body["episode_id"]
                outer.seen.append((self.path, ep, self.headers["Host"]))
                if self.path == "/reset":
                    outer.episodes[ep] = 0
                    out = {"observation": {"text": body["sample"]["prompt"]}, "reward": None, "done": False}
                elif ep not in outer.episodes:
                    self.send_response(404)
                    self.end_headers()
                    return
                else:
                    outer.episodes[ep] += 1
                    out = {"observation": {"text": f"ok {outer.episodes[ep]}"}, "reward": 0.5, "done": False}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_http_environment_episodes_and_a_short_outage(server: Server) -> None:
    envs = Environments(Environment.model_validate({"http": {"url": server.url, "unreachableSeconds": 30}}))
    a, b = envs.make("a"), envs.make("b")
    assert run(a.reset({"prompt": "pa"})) == [{"role": "user", "content": "pa"}]
    run(b.reset({"prompt": "pb"}))
    server.fail = 2  # two 503s: retried, then answered
    s = run(a.step({"role": "assistant", "content": "x"}))
    assert (s.observations, s.reward) == ([{"role": "user", "content": "ok 1"}], 0.5)
    assert server.episodes == {"a": 1, "b": 0}


def test_waiting_for_the_server_to_be_ready(server: Server) -> None:
    envs = Environments(Environment.model_validate({"http": {"url": server.url, "unreachableSeconds": 0.5}}))
    with pytest.raises(EnvironmentUnreachable, match=r"/health was not ready within .*0.5 \(HTTPError: Service Unavailable"):
        envs.wait_ready()
    server.ready = True
    envs.wait_ready()


def test_the_test_environment_server_answers_the_runtimes_client() -> None:
    """``rlhf_testing.env_server`` (what the pods tier runs as a job's environment server pods) speaks the shape
    the runtime's client expects: episodes side by side, tool results back, a final answer scored and done."""
    from rlhf_testing.env_server import serve

    httpd = serve(0, "127.0.0.1")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        envs = Environments(Environment.model_validate({"http": {"url": f"http://127.0.0.1:{httpd.server_port}"}}))
        envs.wait_ready()
        a, b = envs.make("a"), envs.make("b")
        first = run(a.reset({"prompt": "6*7?", "answer": "42", "messages": None}))
        assert len(first) == 1 and first[0]["content"].endswith("] 6*7?"), first
        run(b.reset({"prompt": "2+2?", "answer": "4", "messages": None}))
        tool = {"role": "tool", "content": "42"}
        assert run(a.step({"role": "assistant", "content": "", "tool_results": [tool]})) == Step([tool], None, False)
        host = [{"role": "user", "content": first[0]["content"].partition(" ")[0]}]  # the server's "[host]"
        assert run(a.step({"role": "assistant", "content": "it is 42"})) == Step(host, 1.0, True)
        assert run(b.step({"role": "assistant", "content": "5"})) == Step(host, 0.0, True)
        with pytest.raises(EnvironmentFault, match="answered HTTP 404"):  # the episode ended
            run(a.step({"role": "assistant", "content": "42"}))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_http_environment_down_past_its_deadline_fails_the_run(server: Server) -> None:
    url = server.url
    server.close()  # nothing listens there now
    env = HttpEnvironment(url, 1.0, Outage(0.5), "a")
    t0 = time.monotonic()
    with pytest.raises(EnvironmentUnreachable, match=f"unreachableSeconds 0.5.*{url}/reset"):
        run(env.reset({"prompt": "p"}))
    assert time.monotonic() - t0 < 10


# ------------------------------------------------------------------ episodes pinned to one server address
NAME = "envjob-env.ns.svc"  # the operator's server: a headless Service's name, its pods' addresses


@pytest.fixture
def two_servers() -> Iterator[list[Server]]:
    """Two servers on one port, at two addresses (as the pods of one headless Service are)."""
    a = Server("127.0.0.1")
    b = Server("127.0.0.2", a.port)
    yield [a, b]
    a.close()
    b.close()


class Listed:
    """A resolver the test controls: the name's addresses are ``addrs``; every call counted."""

    def __init__(self, port: int, addrs: list[str]) -> None:
        self.port, self.addrs, self.calls = port, addrs, 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return list(self.addrs) if (host, port) == (NAME, self.port) else []


def server_envs(port: int, resolver: Listed) -> Environments:
    spec = Environment.model_validate({"http": {"server": {"image": "envs/x:1", "port": port},
                                                "unreachableSeconds": 30}})
    return Environments(spec, f"http://{NAME}:{port}", resolver)


def episodes_of(server: Server) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path, ep, _ in server.seen:
        out.setdefault(ep, []).append(path)
    return out


def test_every_request_of_an_episode_reaches_the_one_server_it_started_on(two_servers: list[Server]) -> None:
    a, b = two_servers
    envs = server_envs(a.port, Listed(a.port, ["127.0.0.1", "127.0.0.2"]))

    async def episode(i: int) -> list[str]:
        env = envs.make(f"e{i}")
        out = [(await env.reset({"prompt": f"p{i}"}))[0]["content"]]
        for _ in range(3):
            out.append((await env.step({"role": "assistant", "content": "x"})).observations[0]["content"])
        await env.close()
        return out

    async def episodes() -> list[list[str]]:
        return await asyncio.gather(*(episode(i) for i in range(8)))

    got = run(episodes())
    assert got == [[f"p{i}", "ok 1", "ok 2", "ok 3"] for i in range(8)]  # no step answered 404
    on_a, on_b = episodes_of(a), episodes_of(b)
    assert set(on_a) | set(on_b) == {f"e{i}" for i in range(8)} and not set(on_a) & set(on_b)
    assert all(paths == ["/reset", "/step", "/step", "/step"] for paths in [*on_a.values(), *on_b.values()])
    assert (len(on_a), len(on_b)) == (4, 4)  # spread over both
    assert {host for _, _, host in a.seen + b.seen} == {f"{NAME}:{a.port}"}  # named as the server
    assert envs.endpoints is not None and envs.endpoints.load == {}  # every pin released


def test_a_server_that_goes_away_is_the_fault_of_its_episodes_only(two_servers: list[Server]) -> None:
    a, b = two_servers
    listed = Listed(a.port, ["127.0.0.1", "127.0.0.2"])
    envs = server_envs(a.port, listed)
    started = [envs.make(f"e{i}") for i in range(4)]
    for env in started:
        run(env.reset({"prompt": "p"}))
    assert (len(episodes_of(a)), len(episodes_of(b))) == (2, 2)
    b.close()  # its pod is gone; the name still lists it for a while (DNS)
    fresh = [envs.make(f"n{i}") for i in range(3)]
    for env in fresh:  # a reset refused by the gone address is retried on the other
        assert run(env.reset({"prompt": "q"})) == [{"role": "user", "content": "q"}]
    assert {f"n{i}" for i in range(3)} <= set(episodes_of(a))
    listed.addrs = ["127.0.0.1"]  # ... until the name no longer lists it
    calls = listed.calls
    for env in started:
        if env.episode in episodes_of(a):
            assert run(env.step({"role": "assistant", "content": "x"})).observations[0]["content"] == "ok 1"
        else:
            t0 = time.monotonic()
            with pytest.raises(EnvironmentFault, match=rf"127\.0\.0\.2, which held episode {env.episode}, is no "
                                                       rf"longer an address of {NAME} \(its pod is gone\)"):
                run(env.step({"role": "assistant", "content": "x"}))
            assert time.monotonic() - t0 < 5  # at once, not after the retries of a short outage
    assert listed.calls > calls  # the failure resolved the name again
    later = envs.make("later")
    run(later.reset({"prompt": "r"}))
    assert "later" in episodes_of(a) and envs.outage.since is None  # the other server answers: no outage


def test_which_urls_are_pinned() -> None:
    def endpoints(url: str, addrs: list[str], pin_single: bool = False) -> Endpoints:
        e = Endpoints(url, pin_single, lambda host, port: list(addrs))
        e.refresh()
        return e

    two = ["10.0.0.1", "10.0.0.2"]
    assert endpoints("http://env.example:8000", ["10.0.0.1"]).pin() is None  # a user's URL of one address: as is
    assert endpoints("http://env.example:8000", []).pin() is None  # not resolvable
    assert endpoints("http://env.example:8000", ["10.0.0.1"], pin_single=True).pin() == "10.0.0.1"  # the operator's
    assert endpoints("https://env.example", two).pin() is None  # TLS needs the name
    assert endpoints("http://10.0.0.9:8000", two).pin() is None  # an address already
    e = endpoints("http://env.example:8000/api/", two)
    picks = [e.pin() for _ in range(4)]
    assert picks == ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2"] and e.load == {"10.0.0.1": 2, "10.0.0.2": 2}
    e.release("10.0.0.2")
    assert e.pin() == "10.0.0.2"  # the least loaded
    assert (e.url_of("10.0.0.2"), e.url_of(None)) == ("http://10.0.0.2:8000/api", "http://env.example:8000/api")
    assert endpoints("http://env.example", ["fd00::1", "fd00::2"]).url_of("fd00::1") == "http://[fd00::1]:80"
    assert resolve("127.0.0.1", 80) == ["127.0.0.1"]


# --------------------------------------------------------------------------------- counters, trainer masks
def test_counters_and_engine_load() -> None:
    c = Counters()
    c.trajectory(2, "done")
    c.trajectory(5, "budget")
    c.tool(0.1, None, "")
    c.tool(0.2, "timeout", "late")
    c.error("malformed_call", "bad")
    s = c.summary([0.9, 0.8])
    assert (s["turns_mean"], s["turns_max"], s["truncated_share"], s["engine_busy_share"]) == (3.5, 5, 0.5, 0.8)
    assert s["tool_errors"] == {"timeout": 1, "malformed_call": 1} and s["fault_share"] == pytest.approx(2 / 3)
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([], 0.5) is None
    load = EngineLoad(2)
    load.start(load.pick())
    assert load.pick() == 1
    load.end(0)
    load.finish()
    assert 0.0 <= load.shares()[0] <= 1.0 and load.shares()[1] == 0.0


def test_loss_masks_decide_what_the_trainer_trains_on() -> None:
    import torch

    from rlhf_runtime.roles.batches import pack

    prompts, completions = [[1, 2], [3]], [[4, 5, 6, 7], [8, 9]]
    plain = pack(prompts, completions, [0, 1], torch.device("cpu"))
    masked = pack(prompts, completions, [0, 1], torch.device("cpu"), [[1, 0, 0, 1], [1, 1]])
    assert plain.tokens == 6 and masked.tokens == 4
    assert masked.mask[0].tolist() == [0, 0, 1, 0, 0, 1, 0, 1, 1]
    assert torch.equal(masked.ids, plain.ids) and torch.equal(masked.where, plain.where)
    with pytest.raises(ValueError, match="loss mask of 3 for 4 completion tokens"):
        pack(prompts, completions, [0], torch.device("cpu"), [[1, 1, 1], [1, 1]])


def test_trajectories_become_samples_with_masks_rewards_and_zeroes(tmp_path: Path) -> None:
    from rlhf_runtime.agent.chat import Trajectory
    from rlhf_runtime.agent.rollout import Result
    from rlhf_runtime.controller.agent_experience import to_samples

    t1 = Trajectory([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, 0.0, -0.2])
    t2 = Trajectory([1], [6], [1], [-0.3])
    out = to_samples([Result("s1", t1, 1.5, False, "a"), Result("s2", t2, None, True, "b")])
    assert out.seqs() == {"prompts": [[1, 2], [1]], "completions": [[3, 4, 5], [6]],
                          "loss_masks": [[1, 0, 1], [1]]}
    assert (out.env_rewards, out.zeroed, out.tokens, out.items) == ([1.5, None], [False, True], 3,
                                                                    [("s1", "a"), ("s2", "b")])
    assert out.logprobs == [[-0.1, 0.0, -0.2], [-0.3]]
