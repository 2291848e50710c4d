"""What a zygote may preload ahead of a script: its leading block, read without running it."""

from __future__ import annotations

import textwrap

import pytest

from ftrun.warm.entry_reading import read_entry


def read(source: str, own: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    found = own or {}
    return read_entry(
        textwrap.dedent(source).encode(),
        "train.py",
        lambda name: (found[name].encode(), f"{name}.py") if name in found else None,
    )


def test_literal_environment_writes_are_replayed_in_order_before_the_imports_after_them() -> None:
    r = read("""
        '''A job for an offline cluster.'''
        from __future__ import annotations
        import os
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("HF_HOME", "/data/hf")
        os.environ.update({"A": "1"}, B="2")
        del os.environ["C"]
        LR = 0.1
        import torch
        import transformers
    """)
    assert r.steps == [
        ["import", "os"],
        ["setenv", "HF_HUB_OFFLINE", "1"],
        ["setdefault", "HF_HOME", "/data/hf"],
        ["setenv", "A", "1"],
        ["setenv", "B", "2"],
        ["unsetenv", "C"],
        ["import", "torch"],
        ["import", "transformers"],
    ]
    assert r.stop is None
    assert r.changes.env == {}  # all of them replayed: nothing for a later import to guard against


@pytest.mark.parametrize(
    ("statement", "why"),
    [
        ("os.environ[name] = str(port)", "sets the environment to a computed value"),
        ('sys.path.insert(0, "vendor")', "changes sys.path"),
        ("utils.DEVICE, x = 'cpu', 1", "sets pkg.utils.DEVICE, an attribute of an imported module"),
        ("torch.set_default_dtype(torch.float64)", "sets torch's default dtype"),
        ('warnings.filterwarnings("ignore")', "configures warnings"),
        ("logging.basicConfig(level=logging.INFO)", "configures logging"),
        ("importlib.reload(utils)", "imports by importlib"),
        ("setup()", "calls setup(), which sets the environment to a computed value"),
        ("for k in ('A',): os.environ[k] = '1'", "sets the environment to a computed value"),
    ],
)
def test_the_first_statement_that_cannot_be_replayed_stops_the_preload(statement: str, why: str) -> None:
    r = read(f"""
        import os, sys, torch, warnings, logging, importlib
        import pkg.utils as utils
        def setup():
            os.environ["A"] = str(port)
        port, name = 1, "PORT"
        {statement}
        import transformers
    """)
    assert r.stop is not None
    assert (r.stop.line, r.stop.why, r.stop.text) == (7, why, statement)
    assert r.stop.place == "train.py:7"
    assert "transformers" not in r.imports
    assert r.kept_out == ["transformers"]


def test_harmless_statements_keep_the_block_going() -> None:
    r = read("""
        import logging
        logger = logging.getLogger(__name__)
        parser = print("x")
        if True:
            import numpy
        try:
            import apex
        except ImportError:
            apex = None
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            setup()
        import torch
    """)
    assert r.stop is None
    assert r.imports == ["logging", "numpy", "apex", "typing", "torch"]


def test_the_jobs_own_module_is_a_stop_and_what_it_changes_counts() -> None:
    own = {"config": 'import os\nos.environ["HF_DATASETS_OFFLINE"] = "1"\nimport torch\ntorch.backends.x = 1\n'}
    r = read("import torch\nimport config\nimport datasets\n", own)
    assert r.stop is not None
    assert "job's own module config" in r.stop.why
    assert r.imports == ["torch"]
    assert r.kept_out == ["datasets"]
    assert r.changes.env == {"HF_DATASETS_OFFLINE": "config.py:2"}
    assert r.changes.attributes == {"torch.backends.x": "config.py:4"}


def test_what_the_script_changes_anywhere_is_named_with_its_place() -> None:
    r = read("""
        import os, runpy
        import torch.backends.cudnn as cudnn
        def main():
            os.environ["HF_DATASETS_OFFLINE"] = "1"
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/x")
            cudnn.benchmark = True
            runpy.run_module("pkg")
            import datasets
        main()
    """)
    assert r.imports == ["os", "runpy", "torch.backends.cudnn"]
    assert r.changes.env == {"HF_DATASETS_OFFLINE": "train.py:5", "TORCHINDUCTOR_CACHE_DIR": "train.py:6"}
    assert r.changes.attributes == {"torch.backends.cudnn.benchmark": "train.py:7"}
    assert r.changes.other == ""  # runpy's module is checked as any later import
    assert r.changes.env_unknown == ""


def test_a_change_no_check_can_see_is_named() -> None:
    r = read("import torch\ndef main():\n    torch.set_default_dtype(torch.float64)\n")
    assert r.changes.other == "train.py:3 sets torch's default dtype"
    r = read("import os\ndef main(k):\n    os.environ[k] = '1'\n")
    assert r.changes.env_unknown == "train.py:3"


def test_a_call_of_the_scripts_own_function_is_judged_by_its_body() -> None:
    r = read("""
        import os, time
        def wait_for(path):
            import json
            while not os.path.exists(path):
                time.sleep(0.1)
            if os.environ.get("X"):
                raise SystemExit(3)
        def setup():
            os.environ["HF_HOME"] = "/data"
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            wait_for("ready")
            raise SystemExit(3)
        import torch
        setup()
        import transformers
    """)
    assert r.imports == ["os", "time", "torch"]
    assert r.stop is not None
    assert r.stop.line == 15
    assert r.stop.why == "calls setup(), which sets the environment to a computed value"
    assert r.kept_out == ["transformers"]


def test_past_a_write_the_zygote_can_check_the_later_imports_are_checked_not_kept_out() -> None:
    r = read("""
        import os, sys, time
        os.environ["RUN_TAG"] = str(os.getpid())
        import torch
        os.environ["B"] = "2"
        import transformers
        sys.path.insert(0, "vendor")
        import yaml
    """)
    assert r.imports == ["os", "sys", "time"]
    assert r.later == ["torch", "transformers"]  # checked against RUN_TAG and B, which the script writes
    assert r.changes.env == {"RUN_TAG": "train.py:3", "B": "train.py:5"}
    assert r.stop is not None
    assert r.stop.line == 7
    assert r.kept_out == ["yaml"]
    r = read('import os, pkg.utils as u\nu.DEVICE = "cpu"\nos.environ.setdefault("K", u.DEVICE)\nimport pkg.model\n')
    assert (r.later, r.stop, r.changes.attributes) == (["pkg.model"], None, {"pkg.utils.DEVICE": "train.py:2"})
