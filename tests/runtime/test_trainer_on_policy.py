"""One optimiser pass per batch without old log-probabilities: the trainer takes the loss pass's own (detached)
instead of a separate forward pass. The update must equal the one made with the old log-probabilities computed
beforehand (``Trainer.logprobs``, the path for several passes); with two passes the separate forward still runs.
Two real ``Trainer`` objects on the tiny model, in a subprocess (keeps torch out of pytest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.runtime.conftest import job_config, write_config

SCRIPT = r"""
import json, sys
import torch
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_runtime.roles import policy as trainer_mod

forwards = {"n": 0}
real = trainer_mod.token_logprobs
def counted(*a, **k):
    forwards["n"] += 1
    return real(*a, **k)
trainer_mod.token_logprobs = counted

def params(t):
    return {k: v.detach().clone() for k, v in t.model.named_parameters()}

results = []
for path in sys.argv[1:]:  # one job config each: the same batch, two Trainers per config
    cfg = open(path).read()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in (3, 5, 4, 6)]
    completions = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in (7, 2, 5, 4)]
    batch = {"prompts": prompts, "completions": completions, "advantages": [1.0, -0.5, 0.25, -1.0]}
    short, full = Trainer(TrainerOptions.from_config(cfg)), Trainer(TrainerOptions.from_config(cfg))
    before = params(short)
    forwards["n"] = 0
    short.train(batch)
    short_forwards = forwards["n"]
    old = full.logprobs(batch)["logp"]
    full.train({**batch, "old_logprobs": old})
    a, b = params(short), params(full)
    results.append({
        "short_forwards": short_forwards,
        "max_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        "moved": max(float((a[k] - before[k]).abs().max()) for k in a),
    })
print(json.dumps(results))
"""


def test_one_pass_uses_the_loss_pass_log_probabilities_and_several_passes_still_compute_them(
    tiny_model: Path, tmp_path: Path
) -> None:
    """One process, two configs (the Trainers' start-up paid once): ``epochsPerStep`` 1, then 2."""
    configs = [write_config(tmp_path / f"job{epochs}.json",
                            job_config(tiny_model, algorithm={"learningRate": 1e-2, "epochsPerStep": epochs,
                                                              "klCoef": 0.0}))
               for epochs in (1, 2)]
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, configs)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = json.loads(out.stdout.strip().splitlines()[-1])
    assert one["moved"] > 1e-4, one  # the step changed the weights
    assert one["max_diff"] < 1e-6, one  # ... exactly as with the old log-probabilities given
    assert one["short_forwards"] == 1, one  # one micro-batch: only the loss pass's forward
    assert two["moved"] > 1e-4, two
    assert two["max_diff"] < 1e-6, two
    assert two["short_forwards"] == 3, two  # the old log-probabilities' pass, then one per optimiser pass
