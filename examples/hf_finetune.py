"""Fine-tune a small Hugging Face Llama with shardfn: FSDP x TP, resume on fewer ranks, export.

Three phases (``--phase all`` runs them in turn; docs/huggingface.md walks through them):

1. **finetune**, on ``dp x tp`` ranks: a tiny Llama built from its config (GQA: 8 heads,
   4 key/value heads; random init, standing in for ``from_pretrained``) trains on a
   character corpus (written once as a token file, ``DIR/corpus.uint16``, and read by
   ``sf.data.loader``: each dp rank its block of every global batch, both tp ranks of a
   dp index the same block) with FSDP x TP, ``sf.shard_params(sf.tensor_split(fm, mesh, "tp",
   plan), mesh, "dp")``: the model's own TP plan with a vocab-parallel head and
   ``sf.vocab_parallel_causal_lm_loss``. After ``--steps // 2`` AdamW steps every rank
   writes its shards to a checkpoint (``sf.checkpoint.save``: the trainable leaves, the
   AdamW state, the step, the loader's position); the run then goes on to ``--steps``,
   only to be compared with.
2. **resume**, on ``--resume-ranks`` ranks (a new job): plain FSDP (ZeRO-3,
   ``sf.shard_params(sf.functional(hf), mesh, "dp")``) loads the checkpoint, every leaf
   and AdamW moment resharded, and trains to ``--steps`` with HF's own loss (``labels=``),
   its loader continuing the data order from the saved position on the new dp size.
3. **export**: ``sf.checkpoint.save_pretrained`` writes the ZeRO-3 leaves as a Hugging
   Face directory; ``AutoModelForCausalLM.from_pretrained`` loads it; ``generate()``
   continues a prompt greedily, to a newline (the end-of-sequence token) or 24 characters.

Checked on the way (a failed check ends the run with the numbers): the loaded weights
are the saved ones bit for bit; the resumed losses equal those of the run that stayed on
``dp x tp`` ranks (to float32 round-off: the same batches, the loader's position came
with the checkpoint) and its loader ends where that run's did; ``from_pretrained``
reports no missing or unexpected key, and its logits equal the gathered leaves';
``generate()`` gives the tokens of an argmax loop over the gathered leaves.
``DIR/summary.json`` holds the losses and the checks; ``DIR/checkpoint`` the sharded
checkpoint, ``DIR/hf`` the export, ``DIR/finetune.pt`` what phase 1 hands to phase 2 for
the checks, ``DIR/corpus.uint16`` the token file.

Run: python examples/hf_finetune.py [--dp 2] [--tp 2] [--resume-ranks 2] [--steps 100]
     torchrun --nproc-per-node 4 examples/hf_finetune.py [--steps 100] [--out DIR]
Locally each phase gets a world of CPU processes of its own size. Under torchrun the
script joins the launched world (``sf.distributed.initialize()``; rank 0 prints) and
``--phase all`` resumes on that same world: ``sf.checkpoint`` saves and loads with every
rank of the world, so resuming on fewer ranks is a second launch:
     torchrun --nproc-per-node 4 examples/hf_finetune.py --phase finetune --out DIR
     torchrun --nproc-per-node 2 examples/hf_finetune.py --phase resume --out DIR
``--out`` must be a directory every rank sees (default: shardfn-hf-finetune in the
temporary directory).

Output goes through ``sf.log`` (on ``logging``): the job's lines from rank 0 alone, each
rank's own line (what it loaded on resume) tagged with its mesh coordinates, and each
training phase's progress on rank 0 (``sf.log.progress``: a tqdm bar on a terminal, a line
every 10% of the steps in a file or a pipe; ``--no-progress``: none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Literal, NamedTuple

import torch
import transformers

import shardfn as sf

#: the characters the model knows: newline and printable ASCII (96: splits over tp 1, 2, 4)
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
CORPUS = """\
shardfn is a functional sharding library for PyTorch. Parameters are pytrees, a training
step is a pure function, and every collective is explicit and differentiable. A sharded
computation gives the same result as the same function on one process with the whole
batch. The same code runs on a laptop with local CPU processes and under torchrun.
"""
BATCH, SEQ, KV_HEADS = 8, 32, 4
#: windows of SEQ tokens start every STRIDE tokens of the corpus (79 windows: 9 batches
#: an epoch, each epoch in a new order)
STRIDE, DATA_SEED = 4, 0
TOKENS = "corpus.uint16"
Phase = Literal["all", "finetune", "resume"]


class Job(NamedTuple):
    """What every rank runs: the command line, checked.

    Attributes:
        dp, tp: the fine-tune's mesh ``{"dp": dp, "tp": tp}``.
        resume_ranks: the plain FSDP run's world size.
        steps: AdamW steps in all; the checkpoint is written after ``steps // 2``.
        lr: AdamW's learning rate.
        out: the directory of the checkpoint, the export and the summary.
        progress: show each phase's progress on rank 0 (``--no-progress``: False).
    """

    dp: int
    tp: int
    resume_ranks: int
    steps: int
    lr: float
    out: str
    progress: bool = True

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


def _rank() -> int:
    """This process's rank (0 in a world of one, which has no process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


#: the example's logger: ``say`` for the job's lines, ``LOG.info(..., mesh=)`` per rank
LOG = sf.log.get_logger("shardfn-hf-finetune")


def say(text: str) -> None:
    """A line of the job: printed once (rank 0, or the launching process), no prefix."""
    LOG.info(text, main_process_only=True)


def setup_logging() -> None:
    """The example's lines to stdout on this rank (``sf.log.setup``: the job's lines on rank
    0 only, each rank's own lines prefixed with its mesh coordinates)."""
    sf.log.setup(ranks="all", name="shardfn-hf-finetune", stream=sys.stdout)


def encode(text: str) -> torch.Tensor:
    return torch.tensor([VOCAB.index(c) for c in text])


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def build_llama() -> torch.nn.Module:
    """The tiny Llama, the same in every process (seeded; no download)."""
    config = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=2 * SEQ, bos_token_id=None,
                                      eos_token_id=VOCAB.index("\n"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


def write_corpus(job: Job) -> str:
    """Write the corpus as a uint16 token file in ``job.out`` (rank 0; the other ranks of a
    launched world wait for it) and return its path."""
    path = job.path(TOKENS)
    if _rank() == 0:
        os.makedirs(job.out, exist_ok=True)
        sf.data.write_tokens(path, encode(CORPUS))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return path


def make_loader(out: str, mesh: sf.Mesh | None) -> sf.data.MeshLoader:
    """The loader of ``out``'s token file: ``BATCH`` windows a step over all dp ranks, in
    an order drawn from ``DATA_SEED`` (the same on any number of ranks)."""
    windows = sf.data.TokenFile(os.path.join(out, TOKENS), SEQ, stride=STRIDE)
    return sf.data.loader(windows, mesh, data_axes="dp", global_batch=BATCH, seed=DATA_SEED)


def batches(data: sf.data.MeshLoader):
    """``data``'s batches from its position on, epoch after epoch."""
    while True:
        yield from data


def make_optimizer(job: Job):
    """AdamW, as ``torch.optim.AdamW(lr, eps=1e-6, weight_decay=0.01)``. (eps 1e-6, not 1e-8: an
    element whose gradient is at round-off level would otherwise step by about ``lr`` in
    a direction the round-off picks, and two summation orders would part after a step.)"""
    return sf.optim.adamw(job.lr, eps=1e-6, weight_decay=0.01)


def train(model, trainable, rest, opt, opt_state, data, steps: range, loss_of, label: str,
          show: bool = True):
    """AdamW ``steps`` on this rank's shards; each dp rank reads its block of the batch from
    the loader ``data`` (the inputs: the model shifts the labels itself). Rank 0 shows the
    progress (``show``).

    Returns:
        ``(trainable, opt_state, losses)``: the whole batch's loss at each step.
    """
    mesh, losses = model.mesh, []
    grad_and_loss = torch.func.grad_and_value(
        lambda t, ids: loss_of(model.merge(t, rest), ids))   # gradients averaged over dp
    bar = sf.log.progress(len(steps), f"  {label} (steps {steps.start + 1}-{steps.stop})",
                          enabled=show and _rank() == 0, unit="step")
    # zip stops before reading a batch past the last step: data.state is after `steps`
    for _, (inputs, _) in zip(steps, batches(data), strict=False):
        ids = inputs.to(mesh.device)
        grads, loss = grad_and_loss(trainable, ids)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
        losses.append(float(sf.pmean(loss.detach(), "dp", mesh=mesh)))
        bar.update(loss=f"{losses[-1]:.4f}")
    bar.close()
    return trainable, opt_state, losses


def _cpu(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in tree.items()}


def finetune(job: Job) -> None:
    """Phase 1, on every rank of a ``dp x tp`` world: FSDP x TP, a checkpoint halfway."""
    setup_logging()
    llama = build_llama()
    mesh = sf.Mesh({"dp": job.dp, "tp": job.tp})
    plan = {**sf.hf_tp_plan(llama), "lm_head": "colwise"}   # logits split over the vocabulary
    model = sf.shard_params(sf.tensor_split(sf.functional(llama), mesh, "tp", plan), mesh, "dp")
    trainable, rest = model.split_trainable(model.params_from(llama))

    def loss_of(params, ids):
        local_logits = model.apply(params, input_ids=ids).logits
        return sf.vocab_parallel_causal_lm_loss(local_logits, ids, "tp", mesh=mesh)

    opt, half = make_optimizer(job), job.steps // 2
    opt_state = opt.init(trainable)
    write_corpus(job)
    data = make_loader(job.out, mesh)
    say(f"phase 1: finetune with FSDP x TP on {job.dp * job.tp} ranks "
        f"(dp={job.dp} x tp={job.tp})")
    trainable, opt_state, losses = train(model, trainable, rest, opt, opt_state, data,
                                         range(half), loss_of, "finetune", job.progress)
    path = sf.checkpoint.save(job.path("checkpoint"),   # this run's: replaces an earlier one
                              {"params": trainable, "opt": opt_state, "step": half,
                               "data": data.state}, mesh,
                              {"params": model, "opt": opt}, overwrite=True)
    say(f"  checkpoint: {path} (data: epoch {data.state.epoch}, sample {data.state.offset})")
    saved = _cpu(model.gather(trainable))
    _, _, stayed = train(model, trainable, rest, opt, opt_state, data,
                         range(half, job.steps), loss_of, "(staying, for the check)",
                         job.progress)
    if _rank() == 0:   # what the resume checks against
        torch.save({"job": list(job), "losses": losses, "stayed": stayed, "saved": saved,
                    "checkpoint": path, "data_end": list(data.state)}, job.path("finetune.pt"))


def resume(job: Job) -> dict[str, Any] | None:
    """Phase 2, on every rank of a ``resume_ranks`` world: plain FSDP loads and trains on.

    Returns:
        On rank 0: the resumed losses, the loaded and final leaves (gathered), the step.
    """
    setup_logging()
    llama = build_llama()
    mesh = sf.Mesh({"dp": job.resume_ranks})
    model = sf.shard_params(sf.functional(llama), mesh, "dp")
    opt = make_optimizer(job)
    trainable, rest = model.split_trainable(model.init(1))   # overwritten by the load
    data = make_loader(job.out, mesh)                        # its position too
    like = {"params": trainable, "opt": opt.init(trainable), "step": 0, "data": data.state}
    path = job.path("checkpoint")
    say(f"phase 2: resume from {path} with plain FSDP on {job.resume_ranks} ranks")
    state = sf.checkpoint.load(path, like, mesh, {"params": model, "opt": opt})
    data.load_state(state["data"])   # the global order goes on; each rank's block is new
    shards = sum(v.numel() * v.element_size() for v in state["params"].values())
    LOG.info(f"loaded {len(state['params'])} leaves resharded for {job.resume_ranks} ranks: "
             f"{shards / 2**20:.3f} MiB of parameter shards on this rank", mesh=mesh)

    def loss_of(params, ids):
        return model.apply(params, input_ids=ids, labels=ids).loss

    trainable, _, losses = train(model, state["params"], rest, opt, state["opt"], data,
                                 range(state["step"], job.steps), loss_of, "resume",
                                 job.progress)
    sf.checkpoint.save_pretrained(job.path("hf"), model, model.merge(trainable, rest))
    loaded, final = _cpu(model.gather(state["params"])), _cpu(model.gather(trainable))
    if _rank() != 0:
        return None
    return {"losses": losses, "loaded": loaded, "final": final, "step": state["step"],
            "data_end": list(data.state)}


def export_and_generate(job: Job, final: dict[str, torch.Tensor], prompt: str = "shardfn is",
                        new_tokens: int = 24) -> dict[str, Any]:
    """Phase 3, in one process: ``from_pretrained`` the export, compare, ``generate()``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            job.path("hf"), output_loading_info=True)
    llama = build_llama()
    fm = sf.functional(llama)
    trained = {**fm.params_from(llama), **final}   # llama's buffers, the trained weights
    ids = encode(prompt)[None]
    with torch.no_grad():
        got, want = reloaded(ids).logits, fm.apply(trained, input_ids=ids).logits
        tokens = reloaded.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=llama.config.eos_token_id)
        greedy = ids
        for _ in range(new_tokens):   # argmax over the gathered leaves (no KV cache), to EOS
            step_logits = fm.apply(trained, input_ids=greedy).logits[:, -1]
            greedy = torch.cat([greedy, step_logits.argmax(-1, keepdim=True)], dim=1)
            if int(greedy[0, -1]) == llama.config.eos_token_id:
                break
    return {"loading_info": {k: [str(x) for x in v] for k, v in info.items() if v},
            "export_logits_max_abs_diff": float((got - want).abs().max()),
            "generate_equals_greedy": torch.equal(tokens, greedy),
            "sample": decode(tokens[0])}


def report(job: Job, resumed: dict[str, Any]) -> dict[str, Any]:
    """Phase 3 and the checks; writes ``summary.json`` (SystemExit naming what failed)."""
    first = torch.load(job.path("finetune.pt"), weights_only=True)
    saved, loaded = first["saved"], resumed["loaded"]
    saved_equal = saved.keys() == loaded.keys() and all(
        torch.equal(loaded[name], value) for name, value in saved.items())
    stayed = torch.tensor(first["stayed"], dtype=torch.float64)
    got = torch.tensor(resumed["losses"], dtype=torch.float64)
    rel = float(((got - stayed).abs() / stayed.abs()).max())
    say(f"phase 3: save_pretrained -> from_pretrained -> generate()  ({job.path('hf')})")
    summary = {"finetune_mesh": {"dp": job.dp, "tp": job.tp},
               "resume_ranks": job.resume_ranks, "steps": job.steps,
               "checkpoint": first["checkpoint"], "checkpoint_step": resumed["step"],
               "losses": {"finetune": first["losses"], "stayed": first["stayed"],
                          "resumed": resumed["losses"]},
               "loaded_equals_saved": saved_equal, "resumed_vs_stayed_max_rel_diff": rel,
               "data_position": {"stayed": first["data_end"], "resumed": resumed["data_end"]},
               **export_and_generate(job, resumed["final"]), "export": job.path("hf")}
    failures = []
    if not saved_equal:
        failures.append("the loaded weights differ from the saved ones")
    if rel > 1e-4:   # float32 sums over ranks in another order, carried a few steps
        failures.append(f"the resumed losses {resumed['losses']} are {rel:.1e} (relative) "
                        f"from the stayed run's {first['stayed']}; allowed 1e-4")
    if first["data_end"] != resumed["data_end"]:
        failures.append(f"the resumed loader ends at {resumed['data_end']}, the stayed run's "
                        f"at {first['data_end']} (seed, epoch, offset, samples, shuffle)")
    if summary["loading_info"]:
        failures.append(f"from_pretrained reported {summary['loading_info']}")
    if summary["export_logits_max_abs_diff"] > 1e-5:
        failures.append(f"the reloaded logits are {summary['export_logits_max_abs_diff']:.1e}"
                        " from the gathered leaves'")
    if not summary["generate_equals_greedy"]:
        failures.append("generate() differs from an argmax loop over the gathered leaves")
    summary["failures"] = failures
    with open(job.path("summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    losses = summary["losses"]
    say(f"\nfinetune loss {losses['finetune'][0]:.4f} -> {losses['finetune'][-1]:.4f}; "
        f"resumed -> {losses['resumed'][-1]:.4f}")
    say(f"loaded weights equal the saved ones: {'OK' if saved_equal else 'FAILED'}")
    say(f"resumed losses vs staying on {job.dp * job.tp} ranks: {rel:.1e} relative")
    say(f"from_pretrained: logits {summary['export_logits_max_abs_diff']:.1e} from the "
        f"gathered leaves'; generate() = argmax loop: {summary['generate_equals_greedy']}")
    say(f"sample: {summary['sample']!r}")
    say(f"summary: {job.path('summary.json')}")
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("all", "finetune", "resume"), default="all")
    parser.add_argument("--ranks", type=int, default=None,
                        help="the fine-tune's world size, dp x tp (under torchrun: its world "
                             "size)")
    parser.add_argument("--dp", type=int, default=None,
                        help="the fine-tune's FSDP axis (default: ranks / tp)")
    parser.add_argument("--tp", type=int, default=2,
                        help=f"the fine-tune's TP axis (divides the {KV_HEADS} key/value heads)")
    parser.add_argument("--resume-ranks", type=int, default=None,
                        help="the resume's world size (default 2; under torchrun: its world "
                             "size)")
    parser.add_argument("--steps", type=int, default=100, help="AdamW steps in all (>= 2)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=None, help="checkpoint, export and summary.json "
                        "(default: shardfn-hf-finetune in the temporary directory)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress display (by default a bar on a terminal, a line "
                             "every 10%% of the steps when the output is a file or a pipe)")
    return parser.parse_args(argv)


def make_job(args: argparse.Namespace, launched: int | None) -> Job:
    """Check the command line (``launched``: torchrun's world size, or None)."""
    phase: Phase = args.phase
    ranks = args.ranks or (launched if launched and phase != "resume" else None)
    if launched and args.ranks is not None and args.ranks != launched and phase != "resume":
        raise SystemExit(f"--ranks {args.ranks} but torchrun started {launched} processes")
    dp = args.dp or (ranks // args.tp if ranks else 2)
    if ranks is not None and dp * args.tp != ranks:
        raise SystemExit(f"--dp {dp} x --tp {args.tp} must equal the fine-tune's world size "
                         f"{ranks}")
    resume_ranks = args.resume_ranks or (launched if launched else 2)
    if launched and phase != "finetune" and resume_ranks != launched:
        raise SystemExit(f"--resume-ranks {resume_ranks} but torchrun started {launched} "
                         "processes: sf.checkpoint loads with every rank of the world, so "
                         "resuming on fewer ranks is a second launch of that size with "
                         "--phase resume")
    for name, size in (("--dp", dp), ("--tp", args.tp), ("--resume-ranks", resume_ranks)):
        if size < 1 or (name != "--tp" and BATCH % size):
            raise SystemExit(f"{name} {size} must divide the batch of {BATCH} sequences")
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: at least 2 (a checkpoint after half)")
    out = os.path.abspath(args.out or os.path.join(tempfile.gettempdir(),
                                                   "shardfn-hf-finetune"))
    job = Job(dp, args.tp, resume_ranks, args.steps, args.lr, out, args.progress)
    if phase == "resume":   # the fine-tune's mesh and steps are the ones it ran with
        if not os.path.exists(job.path("finetune.pt")):
            raise SystemExit(f"--phase resume: no {job.path('finetune.pt')}; run --phase "
                             "finetune with the same --out first")
        done = Job(*torch.load(job.path("finetune.pt"), weights_only=True)["job"])
        job = job._replace(dp=done.dp, tp=done.tp, steps=done.steps, lr=done.lr)
    return job


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    setup_logging()
    if not args.progress or not sys.stderr.isatty():   # from_pretrained's own tqdm bar
        transformers.utils.logging.disable_progress_bar()
    if sf.distributed.launch_environment() is not None:
        info = sf.distributed.initialize()
        job = make_job(args, info.world_size)
        say(f"joined a torchrun world of {info.world_size} processes ({info.backend}, "
            f"{info.device})")
        if args.phase in ("all", "finetune"):
            finetune(job)
        resumed = resume(job) if args.phase in ("all", "resume") else None
        sf.distributed.shutdown()
    else:
        job = make_job(args, None)
        resumed = None
        if args.phase in ("all", "finetune"):
            say(f"starting a local world of {job.dp * job.tp} CPU processes (gloo) ...")
            with sf.testing.local_world(job.dp * job.tp, timeout=600) as world:
                world.run(finetune, job)
        if args.phase in ("all", "resume"):
            say(f"starting a new local world of {job.resume_ranks} CPU processes ...")
            with sf.testing.local_world(job.resume_ranks, timeout=600) as world:
                resumed = world.run(resume, job)[0]
    if resumed is not None:
        report(job, resumed)
    say(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
