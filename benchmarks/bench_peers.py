"""Against the peers: what an asynchronous save of a GPT-like model + AdamW costs training.

A GPT-like model (token embedding, pre-norm transformer blocks, tied head; ``d_model`` 768)
is trained on the CPU with AdamW; its parameters and the optimizer's two moments make up
the state of each ``--sizes`` (about a third each). Every case saves that state once and
goes on training until the save is durable. The checkpointers, each used the way its own
documentation shows:

* **ckpt**: ``CheckpointManager(async_save=True).save(step, {"model": m, "optim": o})``
  with its default options (writer threads chosen per save, below training's priority:
  docs/guide.md, "Writer threads"), and rows with explicit
  ``SaveOptions(write_threads=N, writer_nice=K)`` (``--ckpt-variants``; by default two
  threads and one thread, both at training's priority);
* **torch_checkpointing** 0.1.1: ``CheckpointManager`` with the async saver, the CPU-only
  stager of its troubleshooting page (no pinned memory, no non-blocking copy) and
  ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its default O_DIRECT fails on
  ext4); ``optimizer.step()`` runs inside ``manager.lock()``. Its writer does **not fsync**:
  its "durable" time is when its subprocess has handed the bytes to the page cache;
* **DCP thread**: ``dcp.async_save(get_state_dict(...), checkpoint_id=...)``;
* **DCP process**: the same with ``async_checkpointer_type=PROCESS`` and a ``DefaultStager``
  (asynchronous staging into shared memory, CPU options), waiting for
  ``staging_completion`` before ``optimizer.step()`` (its "zero-overhead" mode). Process
  mode needs a process group: a world-1 gloo group is set up for the whole run;
* **torch.save** of ``{"model": state_dict, "optim": state_dict}``, then ``os.fsync``
  (synchronous: training waits for both).

Per case (medians over ``--reps`` interleaved repetitions, after one untimed warm-up save
per method, which starts the peers' subprocesses):

* **blocked**: until training may change the state again: the save call, plus the wait
  for staging inside the next ``optimizer.step()`` (torch_checkpointing, DCP process);
* **first step**: the first training step after the save call returned, against the
  median step of the ``no save`` case (steps with nothing in flight), run interleaved;
* **lost**: training time lost over the whole write: wall time from the save call to the
  end of the step during which the save became durable, minus that many steps at the
  no-save median;
* **durable**: from the save call until the checkpointer reported the save complete.

The goals (ckpt's first step at or below every asynchronous peer's, its time lost at or
below every durable peer's) are judged on the medians, and again paired by repetition:
ckpt's default against each peer in the same repetition, its time lost counted against
that repetition's own no-save steps, so that the machine's drift over the run (which moves
the medians 20-40% between runs here) falls on both sides alike.

Run from the repository root (needs the ``bench`` extra: torch_checkpointing)::

    python benchmarks/bench_peers.py [--sizes 256M,1G] [--reps 5] [--ckpt-variants 2:0,1:0]
"""

from __future__ import annotations

import contextlib
import os
import sys
import socket
import threading
import time
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

import ckpt  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning)

D_MODEL, HEADS, CONTEXT, BATCH, SEQ = 768, 12, 256, 1, 32
NO_SAVE = "no save"


# -- the model and its training step -----------------------------------------------------------

class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` pre-norm transformer blocks, a tied head."""

    def __init__(self, vocab: int, layers: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, D_MODEL)
        self.positions = torch.nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(D_MODEL)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tokens.weight.T


def build_gpt(state_bytes: int) -> GPT:
    """A GPT whose parameters plus AdamW's two fp32 moments take about ``state_bytes``: as
    many blocks as fit, the vocabulary filling the rest."""
    params = state_bytes // 12  # fp32 parameter + exp_avg + exp_avg_sq
    per_block = 12 * D_MODEL * D_MODEL + 13 * D_MODEL
    layers = max(1, (params - (4096 + CONTEXT) * D_MODEL) // per_block)
    vocab = max(1024, (params - layers * per_block - CONTEXT * D_MODEL) // D_MODEL)
    return GPT(vocab, layers)


class Training:
    """AdamW on a :class:`GPT`, one batch of ``BATCH`` x ``SEQ`` tokens per step."""

    def __init__(self, state_bytes: int) -> None:
        torch.manual_seed(0)
        self.model = build_gpt(state_bytes)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        vocab = self.model.tokens.num_embeddings
        self.ids = torch.randint(0, vocab, (BATCH, SEQ + 1))
        for _ in range(3):  # creates AdamW's state; warms the allocator and the kernels
            self.step(contextlib.nullcontext)

    def step(self, guard: Callable[[], Any]) -> float:
        """One step; ``guard()`` is the context ``optimizer.step()`` runs in. Its duration."""
        t0 = time.perf_counter()
        logits = self.model(self.ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.ids[0, 1:])
        loss.backward()
        with guard():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def state_bytes(self) -> int:
        tensors = list(self.model.parameters()) + [
            v for s in self.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


# -- the checkpointers -------------------------------------------------------------------------

class Saving:
    """What a save call hands back: when it became durable, and the wait before the next
    ``optimizer.step()`` (staging the peer finishes in the background)."""

    def __init__(self, lock: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.durable_at: float | None = None
        self.staging_wait = 0.0
        self._staging: Callable[[], Any] | None = None
        self._lock = lock

    def completed(self, *_: Any) -> None:
        self.durable_at = time.perf_counter()

    def wait_staging_first(self, wait: Callable[[], Any]) -> None:
        self._staging = wait

    @contextlib.contextmanager
    def guard(self):
        """Around ``optimizer.step()``: waits for the staging still in flight (once), inside
        the peer's lock if it has one."""
        t0 = time.perf_counter()
        if self._staging is not None:
            self._staging()
            self._staging = None
        with self._lock():
            self.staging_wait += time.perf_counter() - t0
            yield


class Ckpt:
    def __init__(self, training: Training, root: str, **options: int) -> None:
        options = ckpt.SaveOptions(**options)
        self.training = training
        self.manager = ckpt.CheckpointManager(
            common.fresh_dir(root), async_save=True, keep_last=1, options=options,
            schedule=ckpt.Schedule(handle_sigterm=False))

    def save(self, step: int) -> Saving:
        saving = Saving()
        handle = self.manager.save(step, {"model": self.training.model,
                                          "optim": self.training.optimizer})
        handle.add_done_callback(saving.completed)
        return saving

    def close(self) -> None:
        self.manager.close()


class TorchCheckpointing:
    def __init__(self, training: Training, root: str) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        cuda = torch.cuda.is_available()
        self.training, self.root = training, common.fresh_dir(root)
        self.manager = CheckpointManager(CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(
                staging_config=CheckpointStagerConfig(use_pinned_memory=cuda,
                                                      use_non_blocking_copy=cuda),
                # its writer process imports torch first: minutes on a busy machine
                process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600)),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def save(self, step: int) -> Saving:
        saving = Saving(self.manager.lock)  # optimizer.step() under manager.lock(), per its docs
        future = self.manager.save(os.path.join(self.root, f"step_{step}"), {
            "model": self.training.model.state_dict(),
            "optimizer": self.training.optimizer.state_dict(), "step": step})
        future.add_done_callback(saving.completed)
        return saving

    def close(self) -> None:
        self.manager.close()


class DCP:
    def __init__(self, training: Training, root: str, process: bool) -> None:
        self.training, self.root, self.process = training, common.fresh_dir(root), process
        # DefaultStager's CPU options: pinned memory and non-blocking copies need CUDA.
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
            use_non_blocking_copy=False)) if process else None

    def save(self, step: int) -> Saving:
        saving = Saving()
        model_sd, optim_sd = get_state_dict(self.training.model, self.training.optimizer)
        path = os.path.join(self.root, f"step_{step}")
        if not self.process:
            dcp.async_save({"model": model_sd, "optim": optim_sd},
                           checkpoint_id=path).add_done_callback(saving.completed)
            return saving
        response = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
        saving.wait_staging_first(response.staging_completion.result)
        response.upload_completion.add_done_callback(saving.completed)
        return saving

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TorchSave:
    def __init__(self, training: Training, root: str) -> None:
        self.training, self.root = training, common.fresh_dir(root)

    def save(self, step: int) -> Saving:
        saving = Saving()
        path = os.path.join(self.root, f"{step}.pt")
        torch.save({"model": self.training.model.state_dict(),
                    "optim": self.training.optimizer.state_dict()}, path)
        common.fsync_path(path)
        saving.completed()
        return saving

    def close(self) -> None:
        pass


# -- one size -----------------------------------------------------------------------------------

PEERS = {
    "tc": ("torch_checkpointing (no fsync)", lambda t, d: TorchCheckpointing(t, d)),
    "dcp_thread": ("DCP async_save, thread", lambda t, d: DCP(t, d, process=False)),
    "dcp_process": ("DCP async_save, process + DefaultStager",
                    lambda t, d: DCP(t, d, process=True)),
    "torch_save": ("torch.save + fsync (sync)", lambda t, d: TorchSave(t, d)),
}


def bench_size(size: int, reps: int, variants: list[dict[str, int]], peers: list[str],
               workdir: str) -> str:
    training = Training(size)
    nbytes = training.state_bytes()
    methods: dict[str, Any] = {"ckpt": Ckpt(training, os.path.join(workdir, "ckpt"))}
    methods["ckpt"].name = "ckpt (default)"
    for i, variant in enumerate(variants):
        key = f"ckpt-{i}"
        methods[key] = Ckpt(training, os.path.join(workdir, key), **variant)
        methods[key].name = "ckpt, " + ", ".join(f"{k}={v}" for k, v in variant.items())
    for key in peers:
        name, make = PEERS[key]
        methods[key] = make(training, os.path.join(workdir, key))
        methods[key].name = name
    step_no = [0]
    idle_steps: list[float] = []

    def one_save(method: Any) -> dict[str, float]:
        step_no[0] += 1
        if not isinstance(method, Ckpt):  # ckpt's keep_last=1 deletes in its background
            for old in os.listdir(method.root):
                common.remove(os.path.join(method.root, old))
        t0 = time.perf_counter()
        saving = method.save(step_no[0])
        returned = time.perf_counter() - t0
        steps: list[float] = []
        while True:
            steps.append(training.step(saving.guard))
            if saving.durable_at is not None or len(steps) >= 500:
                break
        end = time.perf_counter()
        return {"returned": returned, "blocked": returned + saving.staging_wait,
                "first": steps[0], "wall": end - t0, "steps": float(len(steps)),
                "durable": (saving.durable_at or end) - t0}

    for method in methods.values():  # warm-up: subprocesses start, buffers are allocated
        print(f"  [{common.format_size(size)}] warm-up: {method.name}", file=sys.stderr,
              flush=True)
        one_save(method)

    def no_save(rep: int) -> dict[str, float]:
        steps = [training.step(contextlib.nullcontext) for _ in range(4)]
        idle_steps.extend(steps)
        return {"first": steps[0], "base": common.median(steps)}

    cases = [(NO_SAVE, no_save)] + [(key, lambda rep, m=m: one_save(m))
                                    for key, m in methods.items()]
    timings = common.run_interleaved(cases, reps, progress=common.format_size(size))
    for method in methods.values():
        method.close()
    base = common.median(idle_steps)
    rows, summary = [], {}
    for key, method in methods.items():
        t = timings[key]
        lost = [w - n * base for w, n in zip(t["wall"], t["steps"])]
        summary[key] = {"blocked": common.median(t["blocked"]), "first": common.median(t["first"]),
                        "lost": common.median(lost), "durable": common.median(t["durable"])}
        s = summary[key]
        rows.append([method.name, f"{s['blocked'] * 1e3:.0f}",
                     f"{s['first'] * 1e3:.0f}", f"{(s['first'] / base - 1) * 100:+.0f}%",
                     f"{min(t['first']) * 1e3:.0f}..{max(t['first']) * 1e3:.0f}",
                     f"{s['lost'] * 1e3:.0f}", f"{min(lost) * 1e3:.0f}..{max(lost) * 1e3:.0f}",
                     f"{s['durable']:.2f}", f"{common.median(t['steps']):.0f}"])
    ref = summary["ckpt"]
    ratio_rows = [[methods[k].name, *(f"{s[m] / ref[m]:.2f}" if ref[m] > 0 else "-"
                                      for m in ("blocked", "first", "lost", "durable"))]
                  for k, s in summary.items()]
    async_peers = [k for k in ("tc", "dcp_thread", "dcp_process") if k in summary]
    first_goal = all(ref["first"] <= summary[k]["first"] for k in async_peers)
    durable_peers = [k for k in PEERS if k in summary and k != "tc"]
    lost_goal = all(ref["lost"] <= summary[k]["lost"] for k in durable_peers)
    paired = paired_rows(timings, async_peers, durable_peers, methods) if async_peers else []
    model = training.model
    return "\n".join([
        f"### Async save against the peers: {nbytes / common.MiB:.0f} MiB "
        f"(GPT, {len(model.blocks)} blocks, vocabulary {model.tokens.num_embeddings}, + "
        f"AdamW), {reps} reps interleaved", "",
        f"No-save step: median {base * 1e3:.0f} ms "
        f"({min(idle_steps) * 1e3:.0f}..{max(idle_steps) * 1e3:.0f}, {len(idle_steps)} steps).",
        "",
        common.markdown_table(
            ["method", "blocked ms", "first step ms", "vs no save", "first min..max",
             "lost ms", "lost min..max", "durable s", "steps"], rows), "",
        "Ratios to ckpt (default) within this run (below 1: the peer costs less):", "",
        common.markdown_table(["method", "blocked", "first step", "lost", "durable"],
                              ratio_rows), "",
        f"Goals (medians of this run): first step after ckpt's default save <= every async "
        f"peer's: {'met' if first_goal else 'NOT met'}; its training time lost <= every "
        f"durable peer's: {'met' if lost_goal else 'NOT met'}." if async_peers else "", "",
        *(["Paired by repetition (ckpt's default against each peer in the same repetition, "
           "its time lost against that repetition's own no-save steps; the machine drifts "
           "less within a repetition than across the run): in how many repetitions ckpt's "
           "was at or below the peer's, and the median of ckpt / peer.", "",
           common.markdown_table(["peer", "first step: ckpt <= peer", "median ckpt / peer",
                                  "lost: ckpt <= peer", "median ckpt / peer"], paired), ""]
          if paired else []),
    ])


def paired_rows(timings: dict, first_peers: list[str], lost_peers: list[str],
                methods: dict) -> list[list[str]]:
    """Per peer: ckpt's default against the peer repetition by repetition, for the first
    step (async peers) and the training time lost (durable peers); "-" where that goal
    does not compare the two."""
    bases = timings[NO_SAVE]["base"]

    def lost(key: str) -> list[float]:
        t = timings[key]
        return [w - n * b for w, n, b in zip(t["wall"], t["steps"], bases)]

    def compare(mine: list[float], theirs: list[float]) -> tuple[str, str]:
        wins = sum(a <= b for a, b in zip(mine, theirs))
        ratios = [a / b for a, b in zip(mine, theirs) if b > 0]
        return (f"{wins} of {len(mine)}",
                f"{common.median(ratios):.2f}" if ratios else "-")

    rows = []
    for key in dict.fromkeys(first_peers + lost_peers):
        first = (compare(timings["ckpt"]["first"], timings[key]["first"])
                 if key in first_peers else ("-", "-"))
        spent = compare(lost("ckpt"), lost(key)) if key in lost_peers else ("-", "-")
        rows.append([methods[key].name, *first, *spent])
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_variant(text: str) -> dict[str, int]:
    """``"2"`` -> write_threads=2; ``"2:0"`` -> write_threads=2, writer_nice=0."""
    threads, _, nice = text.partition(":")
    return {"write_threads": int(threads), **({"writer_nice": int(nice)} if nice else {})}


def add_options(parser) -> None:
    parser.add_argument("--ckpt-variants", default="2:0,1:0",
                        help="also ckpt rows with explicit options, THREADS[:NICE] each "
                             "(default: 2:0,1:0: two threads, one thread, both at "
                             "training's priority)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"peers to run among {','.join(PEERS)} (default: all)")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=5, extra=add_options)
    variants = [parse_variant(v) for v in args.ckpt_variants.split(",") if v]
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        sys.exit(f"unknown peers {sorted(unknown)}; choose among {', '.join(PEERS)}")
    workdir = common.fresh_dir(os.path.join(args.dir, "peers"))
    # DCP's process mode needs a process group: one gloo rank on loopback
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        import torch_checkpointing
        tc_version = torch_checkpointing.__version__
    except ImportError:
        if "tc" in peers:
            sys.exit("bench_peers.py needs torch_checkpointing: pip install -e '.[bench]'")
        tc_version = "not installed"
    print(f"Machine: {common.machine_description()}")
    print(f"Data directory: {common.describe_dir(workdir)}")
    print(f"ckpt code: commit {common.code_version()}")
    print(f"ckpt {ckpt.SaveOptions()}; torch_checkpointing {tc_version}; "
          f"torch {torch.__version__}")
    print("Training step: GPT (d_model 768) forward, backward, AdamW step, "
          f"batch {BATCH} x {SEQ} tokens, {torch.get_num_threads()} intra-op threads.")
    print(f"Load average at start: {common.load_average()}")
    print()
    for size in args.sizes:
        print(bench_size(size, args.reps, variants, peers, workdir), flush=True)
    print(f"Load average at end: {common.load_average()}")
    print(common.GATE.summary())
    common.remove(workdir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
