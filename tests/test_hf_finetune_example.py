"""examples/hf_finetune.py end to end, as a user runs it, against the HF module on one process.

The script runs as a subprocess on local worlds (FSDP x TP on 4 ranks for 4 AdamW steps,
a checkpoint after 2, a new world of 2 ranks that resumes with plain FSDP, the export,
``from_pretrained`` and ``generate()``) and must pass its own checks. Then, in this
process, the same 4 steps of ``torch.optim.AdamW`` on the HF module with the whole batch
give the losses of both phases and the exported weights: the whole path (two layouts, two
world sizes, a reshard through the checkpoint, a save_pretrained) is one-process training
to float32 round-off. The script's command-line checks run in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "hf_finetune.py"
STEPS = 4
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _example():
    spec = importlib.util.spec_from_file_location("shardfn_hf_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, str, str]:
    """The script's run on local worlds: (summary.json, the output directory, stdout,
    stderr)."""
    out = tmp_path_factory.mktemp("hf_finetune")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out",
                             str(out)], cwd=out, env=env, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((out / "summary.json").read_text()), out, result.stdout, result.stderr


def _one_process_reference(example, out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps of torch.optim.AdamW on the HF module, whole batch (the script's
    hyperparameters: lr 3e-3, eps 1e-6, weight decay 0.01), on the global batches of a
    one-process loader over the script's token file (read from the start, no resume)."""
    llama = example.build_llama().train()
    opt = torch.optim.AdamW(llama.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.01)
    losses = []
    for _, (ids, _) in zip(range(STEPS), example.batches(example.make_loader(str(out), None)),
                           strict=False):
        opt.zero_grad()
        loss = llama(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in llama.named_parameters()}


def test_script_passes_its_checks_and_trains_like_one_process(run):
    summary, out, stdout, stderr = run
    assert summary["failures"] == [], summary["failures"]
    assert summary["finetune_mesh"] == {"dp": 2, "tp": 2} and summary["resume_ranks"] == 2
    assert summary["checkpoint_step"] == STEPS // 2
    assert summary["loaded_equals_saved"] is True
    assert summary["resumed_vs_stayed_max_rel_diff"] < 1e-5
    assert summary["loading_info"] == {}
    assert summary["export_logits_max_abs_diff"] <= 1e-5
    assert summary["generate_equals_greedy"] is True
    assert summary["sample"].startswith("shardfn is") and 10 < len(summary["sample"]) <= 34
    losses = summary["losses"]
    assert len(losses["finetune"]) == len(losses["resumed"]) == STEPS // 2
    assert losses["finetune"][-1] < losses["finetune"][0]
    assert losses["resumed"][-1] < losses["resumed"][0] < losses["finetune"][-1]
    assert "loaded weights equal the saved ones: OK" in stdout, stdout
    # output to a pipe: progress as lines on rank 0, no tqdm redraws (from_pretrained's
    # included), each rank's own line tagged with its mesh coordinates
    assert "\r" not in stdout + stderr and max(map(len, stdout.splitlines())) <= 500
    assert stdout.count("  finetune (steps 1-2): step 2/2 (100%)  loss ") == 1, stdout
    assert stdout.count("  resume (steps 3-4): step 2/2 (100%)  loss ") == 1, stdout
    for rank in (0, 1):
        assert stdout.count(f"[dp={rank}] loaded ") == 1, stdout

    assert summary["data_position"]["resumed"] == summary["data_position"]["stayed"]
    example = _example()
    corpus = np.fromfile(out / "corpus.uint16", dtype="<u2")        # written once, uint16
    assert torch.equal(torch.from_numpy(corpus.astype("int64")), example.encode(example.CORPUS))
    want_losses, want_params = _one_process_reference(example, out)
    got_losses = losses["finetune"] + losses["resumed"]
    assert got_losses == pytest.approx(want_losses, rel=1e-5), (got_losses, want_losses)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    got_params = dict(exported.named_parameters())
    assert got_params.keys() == want_params.keys()
    for name, want in want_params.items():
        torch.testing.assert_close(got_params[name].detach(), want, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(want_params["lm_head.weight"],
                           _example().build_llama().lm_head.weight)   # it did train


@pytest.mark.parametrize(("argv", "message"), [
    (["--dp", "3", "--tp", "2", "--ranks", "4"], "--dp 3 x --tp 2 must equal the fine-tune's "
                                                 "world size 4"),
    (["--resume-ranks", "3"], "--resume-ranks 3 must divide the batch of 8 sequences"),
    (["--steps", "1"], "--steps 1: at least 2"),
])
def test_command_line_errors(argv, message, tmp_path):
    example = _example()
    with pytest.raises(SystemExit, match=message):
        example.make_job(example.parse_args([*argv, "--out", str(tmp_path)]), None)


def test_torchrun_resume_on_fewer_ranks_needs_a_second_launch(tmp_path):
    example = _example()
    args = example.parse_args(["--resume-ranks", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="every rank of the world, so resuming on fewer "
                                         "ranks is a second launch"):
        example.make_job(args, 4)
    job = example.make_job(example.parse_args(["--out", str(tmp_path)]), 4)
    assert (job.dp, job.tp, job.resume_ranks) == (2, 2, 4)   # torchrun 4: resume on all 4
    with pytest.raises(SystemExit, match="no .*finetune.pt; run --phase finetune"):
        example.make_job(example.parse_args(["--phase", "resume", "--out", str(tmp_path)]), 2)
