"""Reward sources besides rules: an HTTP endpoint (against a real local server), a reward model (a tiny one built
here, whose score means something), and how sources are combined and normalized."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.models import Reward, RewardEndpoint, RewardModel
from rlhf_runtime.algo.rewards import RewardError, combine, endpoint_rewards, make_reward, normalize

# ------------------------------------------------------------------------------------------ endpoint
Reply = tuple[int, object]  # (HTTP status, JSON body or raw bytes)


class RewardServer:
    """A real HTTP server on 127.0.0.1; ``answer(body, request_number) -> (status, body)`` decides each reply and
    every request body is kept. ``gate`` is released at teardown, so a handler blocked on it ends."""

    def __init__(self, answer: Callable[[dict[str, Any], int], Reply]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.lock, self.gate = threading.Lock(), threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    number = len(server.bodies)
                status, reply = answer(body, number)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout test)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_port}/reward"

    def close(self) -> None:
        self.gate.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[dict[str, Any], int], Reply]], RewardServer]]:
    servers: list[RewardServer] = []

    def start(answer: Callable[[dict[str, Any], int], Reply]) -> RewardServer:
        servers.append(RewardServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def by_length(body: dict[str, Any], _: int) -> Reply:
    return 200, {"rewards": [len(c) + (1 if a else 0) for c, a in zip(body["completions"], body["answers"])]}


def test_endpoint_batches_and_keeps_order(serve) -> None:
    srv = serve(by_length)
    completions = ["x" * i for i in range(7)]
    got = endpoint_rewards(RewardEndpoint(url=srv.url, batch_size=3), ["p"] * 7, completions,
                           [None, "a", None, None, None, None, "b"])
    assert got == [0.0, 2.0, 2.0, 3.0, 4.0, 5.0, 7.0]
    assert len(srv.bodies) == math.ceil(7 / 3)
    assert [len(b["completions"]) for b in srv.bodies] == [3, 3, 1]
    assert srv.bodies[0] == {"prompts": ["p"] * 3, "completions": ["", "x", "xx"], "answers": [None, "a", None]}
    assert endpoint_rewards(RewardEndpoint(url=srv.url), ["p", "q"], ["ab", "c"], None) == [2.0, 1.0]
    assert srv.bodies[-1]["answers"] == [None, None]


def test_endpoint_retries_5xx_then_succeeds(serve) -> None:
    srv = serve(lambda body, n: (503, {"error": "warming up"}) if n <= 2 else by_length(body, n))
    assert endpoint_rewards(RewardEndpoint(url=srv.url, retries=2), ["p"], ["abc"], None) == [3.0]
    assert len(srv.bodies) == 3


def test_endpoint_retries_exhausted(serve) -> None:
    srv = serve(lambda body, n: (429, {"error": "slow down"}) if n == 1 else (500, b"internal boom"))
    with pytest.raises(RewardError) as e:
        endpoint_rewards(RewardEndpoint(url=srv.url, retries=2), ["p"], ["abc"], None)
    msg = str(e.value)
    assert f"spec.reward.endpoint.url {srv.url}" in msg and "failed after 3 attempts" in msg, msg
    assert "HTTP 500" in msg and "internal boom" in msg, msg
    assert len(srv.bodies) == 3


def test_endpoint_4xx_fails_at_once(serve) -> None:
    srv = serve(lambda body, n: (400, {"error": "prompts missing"}))
    with pytest.raises(RewardError, match=r"HTTP 400.*prompts missing.*not retried.*attempt 1 of 4") as e:
        endpoint_rewards(RewardEndpoint(url=srv.url, retries=3), ["p"], ["abc"], None)
    assert srv.url in str(e.value)
    assert len(srv.bodies) == 1


@pytest.mark.parametrize(("reply", "match"), [
    ({"rewards": [1.0]}, "answered 1 rewards for 2 completions"),
    ({"rewards": [1.0, "high"]}, "reward 1 = '\"high\"'"),
    ({"rewards": [1.0, True]}, "reward 1 = 'true'"),
    ({"rewards": [1.0, None]}, "reward 1 = 'null'"),
    (b'{"rewards": [1.0, NaN]}', "reward 1 = 'NaN'"),
    ({"scores": [1.0, 2.0]}, r'must answer \{"rewards"'),
    (b"<html>oops</html>", "not JSON"),
])
def test_endpoint_bad_answers(serve, reply: object, match: str) -> None:
    srv = serve(lambda body, n: (200, reply))
    with pytest.raises(RewardError, match=match) as e:
        endpoint_rewards(RewardEndpoint(url=srv.url, retries=3), ["p", "q"], ["a", "b"], None)
    assert srv.url in str(e.value) and "attempt 1 of 4" in str(e.value)
    assert len(srv.bodies) == 1  # a wrong answer is not retried


def test_endpoint_timeout_is_retried_then_fails(serve) -> None:
    srv: RewardServer

    def blocked(body: dict[str, Any], n: int) -> Reply:
        srv.gate.wait(30)  # released at teardown; 30 s only bounds a broken test
        return by_length(body, n)

    srv = serve(blocked)
    with pytest.raises(RewardError, match=r"failed after 2 attempts.*no answer within timeoutSeconds 0.3") as e:
        endpoint_rewards(RewardEndpoint(url=srv.url, retries=1, timeout_seconds=0.3), ["p"], ["a"], None)
    assert srv.url in str(e.value)
    assert len(srv.bodies) == 2


def test_endpoint_connection_refused(serve) -> None:
    srv = serve(by_length)
    url = srv.url
    srv.close()  # nothing listens on the port any more
    with pytest.raises(RewardError, match=r"failed after 1 attempt \(retries 0\); last error: cannot connect"):
        endpoint_rewards(RewardEndpoint(url=url, retries=0), ["p"], ["a"], None)


# ------------------------------------------------------------------------------- combine, normalize
def test_combine() -> None:
    parts = {"rule": [1.0, 0.0, 1.0], "model": [0.5, -1.0, 2.0], "endpoint": [10.0, 20.0, 30.0]}
    got = combine(parts, {"rule": 2.0, "model": -1.0, "endpoint": 0.1})
    assert got == pytest.approx([2 - 0.5 + 1, 0 + 1 + 2, 2 - 2 + 3])
    assert combine({"model": [3.0]}, {"model": 1.0, "rule": 5.0}) == [3.0]
    with pytest.raises(RewardError, match="different numbers of samples"):
        combine({"rule": [1.0], "model": [1.0, 2.0]}, {"rule": 1.0, "model": 1.0})
    with pytest.raises(RewardError, match="no weight for reward source"):
        combine({"rule": [1.0]}, {"model": 1.0})


def test_normalize() -> None:
    assert normalize([1.0, 3.0], "none") == [1.0, 3.0]
    # mean 2, population std 1
    assert normalize([1.0, 3.0], "batch") == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)])
    got = normalize([0.0, 0.0, 3.0], "batch")  # mean 1, std sqrt(2)
    assert got == pytest.approx([-1 / (2 ** 0.5 + 1e-6)] * 2 + [2 / (2 ** 0.5 + 1e-6)])
    assert normalize([0.7] * 4, "batch") == [0.0] * 4
    assert normalize([], "batch") == []
    with pytest.raises(RewardError, match="unknown spec.reward.normalize"):
        normalize([1.0], "zscore")


def test_make_reward_without_rule_or_function() -> None:
    assert make_reward(Reward(endpoint=RewardEndpoint(url="http://x/reward"))) is None
    assert make_reward(Reward(model=RewardModel(name="/m"))) is None
    assert make_reward(Reward(rule="contains", target="7", model=RewardModel(name="/m")))("p", "7", None) == 1.0
    with pytest.raises(RewardError, match="needs a source"):
        make_reward(Reward())
    with pytest.raises(RewardError, match="rule or function, not both"):
        make_reward(Reward(rule="contains", target="7", function="m:f"))
    assert Reward(rule="contains", endpoint=RewardEndpoint(url="http://x")).sources() == ["rule", "endpoint"]


# -------------------------------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory):
    from rlhf_testing.tiny import build_tiny_reward_model

    from rlhf_runtime.roles.reward import RewardScorer

    path = build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model", target="a")
    return RewardScorer(str(path), None, "float32", batch_size=3, device="cpu")


def test_tiny_reward_model_scores_the_share_of_target(scorer) -> None:
    aaaa, abab, bbbb = scorer.score(["prompt"] * 3, ["aaaa", "abab", "bbbb"])
    assert aaaa > abab > bbbb
    assert aaaa == pytest.approx(0.4, abs=0.01) and bbbb == pytest.approx(0.0, abs=1e-6)  # 'prompt' has no 'a'
    ladder = scorer.score(["prompt"] * 9, ["a" * k + "b" * (8 - k) for k in range(9)])
    assert all(lo < hi for lo, hi in itertools.pairwise(ladder)), ladder
    assert ladder == pytest.approx([k / 14 for k in range(9)], abs=0.01)  # ~ the fraction of the 14 characters
    assert scorer.info()["device"] == "cpu" and scorer.info()["parameters"] > 0


def test_reward_model_batches_and_padding_do_not_change_scores(scorer) -> None:
    prompts = ["prompt", "q", "hello world", "a", "xyz", "2+2=", "say"]
    completions = ["aaab", "a", "", "bbbbbbbbbbbb", "ab", "4", "aaaaaaaaaaaaaaaaaaaa"]
    batched = scorer.score(prompts, completions)  # batch_size 3 < 7 samples, padded to unequal lengths
    alone = [scorer.score([p], [c])[0] for p, c in zip(prompts, completions)]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert scorer.score([], []) == []


def test_reward_model_errors(tmp_path: Path) -> None:
    from rlhf_testing.tiny import build_tiny_reward_model

    from rlhf_runtime.roles.reward import RewardScorer

    two = build_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"spec.reward.model.name .*two.* has num_labels 2"):
        RewardScorer(str(two), None, "float32", batch_size=4)
    with pytest.raises(FileNotFoundError, match=r"spec.reward.model.name .*nowhere does not exist"):
        RewardScorer(str(tmp_path / "nowhere"), None, "float32", batch_size=4)
    corrupt = build_tiny_reward_model(tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")  # a truncated download, say
    with pytest.raises(ValueError, match=r"cannot load the reward model spec.reward.model.name .*corrupt.* as a "
                       r"sequence-classification model: .*header"):
        RewardScorer(str(corrupt), None, "float32", batch_size=4)
