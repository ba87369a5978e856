"""Guards found by mutation testing (h-mutate3): each test here kills a one-line mutant of
code landed in this session (format-2 saves that exchange no per-rank values, the manager's
shared fallback and retention, the CLI's checks) that the modules' own tests let survive.
The mutant is named in each docstring; applying it makes the test fail."""

from __future__ import annotations

import os

import pytest
import torch

import ckpt

import _mutation_workers3 as W
from _dist import run_ranks


@pytest.mark.multiproc
def test_per_rank_items_in_another_key_order_save_and_each_rank_stages_only_its_own(tmp_path):
    """Ranks may list the state's keys in any order: the per-rank item names they compare
    are sorted (mutant: ``per_rank = list(...)`` refuses this save), and a save without a
    memory tier stages to host only the boxes a rank writes (mutant: ``held`` without
    ``hold_all and`` stages every rank's copy of the replicated "w"). A format-1 save
    whose ranks disagree on their per-rank items is refused on every rank with a
    CheckpointError that says so (it was a bare KeyError: 'blob')."""
    seen = run_ranks(2, W.save_keys_in_rank_order_recording_staged, str(tmp_path), timeout=120)
    assert not (tmp_path / "step-00000005").exists()
    for rank, s in enumerate(seen):
        assert s["mismatch"] and "different per-rank items" in s["mismatch"], (rank, s)
        assert s["step"] == 1 and s["rng_exact"] and s["blob_exact"] and s["w_exact"], (rank, s)
    stages_w = [rank for rank, s in enumerate(seen) if "w" in s["staged"]]
    assert len(stages_w) == 1, seen  # one writer; the other rank holds no copy of it


@pytest.mark.multiproc
def test_a_rank_whose_peer_fails_for_good_on_load_says_so_and_tries_no_older_step(tmp_path):
    """``load()``: one rank's fatal error (here its refusal to unpickle) stops every rank
    on that step; the others name it (mutant: without ``if fatal: raise`` rank 0 skips the
    step as if it were corrupt and reports "no committed step could be loaded")."""
    got = run_ranks(2, W.load_where_one_rank_refuses_pickle, str(tmp_path), timeout=120)
    assert got[1].startswith("UnsupportedValueError: "), got
    assert got[0].startswith("CheckpointError: another rank failed to load step 1: "
                             "UnsupportedValueError"), got


def _two_steps(root) -> None:
    with ckpt.CheckpointManager(root, async_save=False, allow_pickle=True) as mgr:
        mgr.save(1, {"w": torch.arange(8.0)})
        mgr.save(2, {"w": torch.arange(8.0), "odd": {1, 2}})


def test_load_of_a_named_step_raises_that_steps_own_error_and_skips_nothing(tmp_path):
    """``load(step=...)`` raises the step's own error (mutant: dropping ``step is not None
    or`` skips it, so a missing step reads as CorruptCheckpointError "no committed step ...
    could be loaded", not CheckpointNotFoundError, and is recorded in ``mgr.skipped``)."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True, allow_pickle=True) as mgr:
        with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
            mgr.load(step=7)
        assert "could be loaded" not in str(caught.value)
        assert mgr.skipped == []


def test_load_raises_this_ranks_fatal_error_as_it_is(tmp_path):
    """Without ``allow_pickle`` the newest step's pickled value is refused with
    UnsupportedValueError, and no older step is tried (mutant: dropping
    ``_describe(error)[0] == "fatal"`` turns it into "another rank failed to load")."""
    _two_steps(tmp_path)
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError) as caught:
            mgr.load()
        assert "another rank" not in str(caught.value) and mgr.skipped == []


def test_an_odd_lock_owner_file_still_gives_one_line_naming_the_lock(tmp_path, capsys):
    """``gc --yes`` on a root a live writer holds names the holder; a hand-edited owner file
    with a "since" that is no time says "an unknown time" (mutant: ``describe_holder``
    without TypeError among the errors it catches raises it), and one that is no JSON object
    gives no holder (it was AttributeError: 'list' object has no attribute 'get', in gc and
    the manager; the manager raised TypeError on the odd "since")."""
    from verify.cli import main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as writer:
        writer.save(1, {"w": torch.zeros(4)})
        for owner, needle in (('{"host": "h", "pid": 7, "since": "yesterday"}',
                               "(host h, pid 7, since an unknown time)"),
                              ("[1, 2]", "(an unknown process)")):
            (root / ".lock.owner").write_text(owner)
            assert main(["gc", str(root), "--keep-last", "1", "--yes"]) == 2
            err = capsys.readouterr().err
            assert f"is in use by a writer {needle}" in err and "Traceback" not in err, err
            with pytest.raises(ckpt.CheckpointLockedError) as caught:  # the same words
                ckpt.CheckpointManager(root)
            assert f"locked by another writer {needle}" in str(caught.value)
    assert (root / "step-00000001" / "manifest.json").exists()


def test_export_refuses_a_dangling_link_and_tolerances_may_be_zero(tmp_path, capsys):
    """A dangling symbolic link where the export goes is refused, not replaced (mutant:
    ``os.path.exists`` for ``os.path.lexists`` sees no file there and writes over the
    link, even without --force); ``--rtol 0 --atol 0`` (an exact check) is accepted
    (mutant: ``value <= 0`` refuses it)."""
    from verify.cli import build_parser, main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    link = tmp_path / "out.pt"
    link.symlink_to(tmp_path / "missing.pt")
    assert main(["export", str(root), "--to", "torch", str(link)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "missing.pt").exists()
    args = build_parser().parse_args(["verify", str(root), "--rtol", "0", "--atol", "0"])
    assert (args.rtol, args.atol) == (0.0, 0.0)


def test_a_loss_function_that_returns_no_number_is_named(tmp_path, capsys, monkeypatch):
    """``verify --loss`` with a function returning text blames that function (mutant:
    ``_LossCall`` returning ``self.fn(...)`` unconverted lets run_forward's float() fail
    outside it, reported as "the forward pass of the model ... raised")."""
    import sys

    from verify.cli import main
    from test_cli import make_root

    make_root(tmp_path)
    (tmp_path / "userloss3.py").write_text("def text(output, inputs):\n    return 'low'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(["verify", str(tmp_path / "root"), "--level", "forward", "--trust-recorded",
                     "--loss", "userloss3:text"])
    finally:
        sys.modules.pop("userloss3", None)
    out = capsys.readouterr().out
    assert code == 2 and "the loss function userloss3:text raised ValueError" in out, out
    assert "forward pass" not in out


def test_verify_of_one_named_step_its_writer_retires_midway_fails(tmp_path, capsys,
                                                                   monkeypatch):
    """Only ``--all`` passes over a step retired while it is checked; ``verify --step 1``
    says it is gone, exit 2 (mutant: without ``if not args.all: raise`` it printed
    "skipped" and exited 0, having verified nothing)."""
    import verify
    from verify.cli import main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})

        def progress(total: int, label: str):  # made after step 1's manifest was read
            writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            return lambda nbytes: None

        monkeypatch.setattr(verify, "ProgressBar", progress)
        code = main(["verify", str(root), "--step", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "skipped step" not in err, err
    assert "no committed checkpoint at" in err and "step-00000001" in err, err
    assert not (root / "step-00000001").exists()


def test_refused_opens_leave_no_descriptor_and_export_never_writes_through_a_link(
        tmp_path, capsys):
    """The POSIX storage refuses a FIFO or a directory where it reads a file and closes
    what it opened (mutant: without ``os.close(fd)`` before the refusal each one leaks a
    descriptor); export creates its temporary file exclusively (mutant: ``open(tmp, "wb")``
    follows a link planted at that name and overwrites its target)."""
    from verify.cli import main
    from storage_backends import open_storage

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    os.mkfifo(root / "fifo")
    (root / "a-dir").mkdir()
    storage = open_storage(str(root))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        for name in ("fifo", "a-dir"):
            with pytest.raises(OSError):
                storage.read(name)
    assert len(os.listdir("/proc/self/fd")) == before
    victim = tmp_path / "notes.txt"
    victim.write_text("the user's notes")
    target = tmp_path / "model.pt"
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")  # the export's temporary name
    assert main(["export", str(root), "--to", "torch", str(target)]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert victim.read_text() == "the user's notes" and not target.exists()


def test_a_step_retired_while_its_read_fails_is_retired_not_unreadable(tmp_path):
    """A step whose read fails with an I/O error (report.error, not a problem) because its
    writer deleted it meanwhile is reported retired, as a damaged one is (mutant: checking
    only ``report.problems`` calls it "could not be read", exit 2, in a --all run)."""
    import errno

    import verify

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})
        cps = ckpt.inspect.open(str(root))

        def retire_then_fail(step, manifest):  # as an object store answers for a gone key
            writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            raise OSError(errno.EIO, "read failed", str(root / "step-00000001"))

        cps.files = retire_then_fail
        with pytest.raises(ckpt.CheckpointNotFoundError, match="was retired"):
            verify.verify_step(cps, 1, "digest")


def test_a_conjugate_view_restores_its_values_not_their_conjugates(tmp_path):
    """A live complex tensor that is a conjugate view (its bytes hold the conjugate) is
    filled through a copy (mutant: without ``dest.is_conj()`` among the bounce cases the
    reader takes the view's raw bytes, and restore raised torch's RuntimeError "view is not
    supported for conjugate view tensors")."""
    want = torch.complex(torch.arange(64.0), torch.arange(64.0) + 1)
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"z": want})
    live = torch.zeros(64, dtype=torch.complex64).conj()
    assert live.is_conj() and live.is_contiguous()
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.restore({"z": live}) == 1
    assert torch.equal(live, want)


def test_forward_level_names_a_bool_loss_and_a_bad_model_option(tmp_path, capsys,
                                                                      monkeypatch):
    """``verify --level forward`` on a hand-edited probe: a recorded loss of ``true`` is no
    number (mutant: without ``isinstance(loss, bool) or`` it passed as 1.0); a bad
    ``--model`` is the user's error, not the recorded factory's (mutant: without ``if model
    is not recorded: raise`` it said "the probe's recorded factory")."""
    import json

    from verify.cli import main
    from test_cli import make_root

    make_root(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "root"
    manifest = root / "step-00000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["items"]["__probe__"]["tree"]["loss"] = True
    manifest.write_text(json.dumps(doc))
    code = main(["verify", str(root), "--level", "forward", "--trust-recorded", "--step", "2"])
    out = capsys.readouterr().out
    assert code == 1 and "the probe item is damaged: its recorded loss is a bool" in out, out
    assert main(["verify", str(root), "--level", "forward", "--step", "1",
                 "--model", "usermodels:no_such_builder"]) == 2
    out = capsys.readouterr().out
    assert "--model" in out and "no_such_builder" in out and "recorded factory" not in out, out


@pytest.mark.multiproc
def test_an_item_only_one_rank_holds_is_refused_not_dropped(tmp_path):
    """The manifest holds rank 0's items: an item only rank 1 saved (a plain value, a
    tensor) was dropped without a word — the save committed, ``load()`` returned rank 0's
    items only (found by h-mutate3). Now every rank refuses the save, in both formats, and
    nothing is committed (mutant: dropping the "items" comparison commits step 1)."""
    got = run_ranks(2, W.save_an_item_only_rank_1_holds, str(tmp_path), timeout=120)
    for rank, s in enumerate(got):
        assert s["steps"] == [], (rank, s)
        for message in s["refused"]:
            assert message and "ranks save different items" in message, (rank, s)
            assert "'extra', 't1'" in message and "ckpt.PerRank" in message, (rank, s)
