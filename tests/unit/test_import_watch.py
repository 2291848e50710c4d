"""What an import reads of the process's state, as the zygote watches it (in this process: no import runs, the
watched code is a function called inside the watch)."""

from __future__ import annotations

import os
import types

import pytest

from ftrun.worker.import_watch import Guards, Reads, verdict, watching


def test_reads_by_name_are_recorded_and_a_scan_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_TEST_SET", "yes")
    monkeypatch.delenv("FTRUN_TEST_UNSET", raising=False)
    environ_class = type(os.environ)
    with watching() as reads:
        os.environ.get("FTRUN_TEST_SET")
        os.getenv("FTRUN_TEST_UNSET")
        assert "FTRUN_TEST_IN" not in os.environ
        copied = dict(os.environ)  # fsspec's, tqdm's: a scan for a prefix
        scanned = [k for k, v in os.environ.items() if k.startswith("NOTHING_")]
    assert type(os.environ) is environ_class  # nothing left of the watch
    assert copied
    assert not scanned
    assert reads.env == {"FTRUN_TEST_SET": "yes", "FTRUN_TEST_UNSET": None, "FTRUN_TEST_IN": None}


def test_reads_of_a_set_module_attribute_are_recorded() -> None:
    module = types.ModuleType("ftrun_test_cfg")
    module.DEVICE = "cuda"  # type: ignore[attr-defined]
    module.OTHER = 1  # type: ignore[attr-defined]
    with watching({"ftrun_test_cfg.DEVICE": module}) as reads:
        _ = module.OTHER  # type: ignore[attr-defined]
    assert reads.attributes == set()
    with watching({"ftrun_test_cfg.DEVICE": module}) as reads:
        _ = module.DEVICE  # type: ignore[attr-defined]
    assert reads.attributes == {"ftrun_test_cfg.DEVICE"}
    assert type(module) is types.ModuleType


GUARDS = Guards(
    env={"HF_DATASETS_OFFLINE": "train.py:5"},
    varying=frozenset({"LOCAL_RANK"}),
    attributes={"cfg.DEVICE": "train.py:9"},
    files={"yaml": "/job/vendor/yaml/__init__.py"},
)


KEEP = "(to keep it warm, make that setting in the launch environment, or --preload m)"
OFFLINE = f"reads HF_DATASETS_OFFLINE at import, which train.py:5 sets {KEEP}"
RANKS = "reads LOCAL_RANK at import, whose value differs in each worker (no one zygote can import it for all)"


@pytest.mark.parametrize(
    ("reads", "new", "leading", "why"),
    [
        (Reads(env={"HF_HOME": None}), {}, False, ""),
        (Reads(env={"HF_DATASETS_OFFLINE": None}), {}, False, OFFLINE),
        (Reads(env={"HF_DATASETS_OFFLINE": None}), {}, True, ""),  # the leading block runs before the write
        (Reads(env={"LOCAL_RANK": "0"}), {}, True, RANKS),
        (Reads(attributes={"cfg.DEVICE"}), {}, False, f"reads cfg.DEVICE at import, which train.py:9 sets {KEEP}"),
        (Reads(), {"yaml": "/site/yaml/__init__.py"}, True,
         "finds yaml at /site/yaml/__init__.py, where the workers' own import found /job/vendor/yaml/__init__.py"),
        (Reads(), {"yaml": "/job/vendor/yaml/__init__.py"}, False, ""),
    ],
)  # fmt: skip
def test_a_verdict_names_what_would_differ(reads: Reads, new: dict[str, str], leading: bool, why: str) -> None:
    assert verdict("m", reads, GUARDS, new, leading=leading) == why


def test_guards_read_back_from_json_keep_only_what_they_should() -> None:
    doc = {"env": {"A": "t.py:1"}, "varying": ["RANK", 3], "files": {"x": "/x.py", "y": 4}, "other": ""}
    g = Guards.from_json(doc)
    assert g.env == {"A": "t.py:1"}
    assert g.varying == frozenset({"RANK"})
    assert g.files == {"x": "/x.py", "y": None}
    assert Guards.from_json({"varying": "RANK"}).varying == frozenset()
