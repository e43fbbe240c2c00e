"""``sf.data.loader`` with ``num_workers=2`` under real torchrun (#25 item 3).

Two processes launched by ``torchrun --nproc-per-node 2`` on CPU each read their block of
every global batch of a token file through two DataLoader workers; together they read
exactly the one-process loader's batches (each sample once per epoch, in the same global
order), and the position saved after some batches resumes the rest.
"""

from __future__ import annotations

import textwrap

import torch

import shardfn as sf
from tests.test_distributed_launch import REPO, _torchrun

SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import shardfn as sf

sf.distributed.initialize()
rank = dist.get_rank()
mesh = sf.Mesh({{"dp": dist.get_world_size()}})
data = sf.data.TokenFile({path!r}, 4)
loader = sf.data.loader(data, mesh, global_batch=4, seed=3, num_workers=2,
                        multiprocessing_context="fork")
batches = [x for x, _ in loader]
resumed = sf.data.loader(data, mesh, global_batch=4, seed=3, num_workers=2,
                         multiprocessing_context="fork")
it = iter(resumed)
next(it)
state = resumed.state
again = sf.data.loader(data, mesh, global_batch=4, seed=3, state=state)
rest = [x for x, _ in again]
torch.save({{"batches": batches, "rest": rest}}, {out!r} + f"/rank{{rank}}.pt")
sf.distributed.shutdown()
"""


def test_workers_under_torchrun_read_the_one_process_order(tmp_path):
    path = str(tmp_path / "tokens.uint16")
    sf.data.write_tokens(path, torch.arange(200) % 97)
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO), path=path,
                                                    out=str(tmp_path))))
    result = _torchrun(script)
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = [x for x, _ in sf.data.loader(sf.data.TokenFile(path, 4), None, global_batch=4,
                                         seed=3)]
    assert len(want) == len(ranks[0]["batches"]) == len(ranks[1]["batches"]) > 2
    for step, full in enumerate(want):
        got = torch.cat([ranks[0]["batches"][step], ranks[1]["batches"][step]])
        assert torch.equal(got, full), step
        if step >= 1:
            got = torch.cat([ranks[0]["rest"][step - 1], ranks[1]["rest"][step - 1]])
            assert torch.equal(got, full), step
