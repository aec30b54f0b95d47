"""``import mpistrat as tfd`` stands in for ``tf.distribute``: every public name of TF
2.21's ``tf.distribute`` (tests/unit/data/tf_distribute_2_21_names.txt) resolves at the
same path under mpistrat, as the same object as mpistrat's top-level name, or is listed
as out of scope in docs/strategies.md and then raises a clear ``UnsupportedError``."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import mpistrat
from mpistrat.errors import UnsupportedError

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "tf_distribute_2_21_names.txt"


def _names() -> list[tuple[str, str, bool]]:
    rows = []
    for line in FIXTURE.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path, kind, *seed = line.split()
        rows.append((path, kind, seed == ["seed"]))
    return rows


NAMES = _names()


def _out_of_scope() -> dict[str, str]:
    """``tf.distribute`` path -> what to use instead, from the table "Not available over
    MPI" of docs/strategies.md's migration section."""
    text = (ROOT / "docs" / "strategies.md").read_text(encoding="utf-8")
    section = text.split("## Migrating from tf.distribute", 1)[1].split("\n## ")[0]
    table = section.split("### Not available over MPI", 1)[1].split("\n### ")[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `tf\.distribute\.([\w.]+)` \| (.+) \| (.+) \|$", line)
        if match:
            rows[match.group(1)] = match.group(3)
    return rows


OUT_OF_SCOPE = _out_of_scope()


def _resolve(path: str) -> object:
    obj: object = mpistrat
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_fixture_holds_the_seeds_module_list():
    seed = [(path, kind) for path, kind, is_seed in NAMES if is_seed]
    kinds = [kind for _, kind in seed]
    assert (kinds.count("module"), kinds.count("class"), kinds.count("function")) == (3, 21, 5)
    assert len({path for path, _, _ in NAMES}) == len(NAMES)


@pytest.mark.parametrize("path,kind", [(p, k) for p, k, _ in NAMES], ids=[p for p, _, _ in NAMES])
def test_every_tf_distribute_name_resolves_at_tfs_path(path, kind):
    obj = _resolve(path)
    if kind == "module":
        assert isinstance(obj, types.ModuleType)
        assert importlib.import_module(f"mpistrat.{path}") is obj  # `import mpistrat.X.Y` too
        return
    assert callable(obj), (path, obj)
    name = path.rsplit(".", 1)[-1]
    if path in OUT_OF_SCOPE:
        with pytest.raises(UnsupportedError) as info:
            obj()  # TF's arguments are all optional: the error is the clear one
        assert "use" in str(info.value) and len(str(info.value)) > 80, str(info.value)
        return
    if "." in path and not path.startswith("experimental.rpc.") and hasattr(mpistrat, name):
        assert obj is getattr(mpistrat, name), f"mpistrat.{path} is not mpistrat.{name}"


# where mpistrat keeps the TF names that raise UnsupportedError
UNSUPPORTED_HOMES = {"mpistrat.strategy.tpu", "mpistrat.cluster.unsupported",
                     "mpistrat.experimental.rpc"}


def test_every_name_that_cannot_work_is_in_the_docs_table_and_only_those():
    raising = {path for path, kind, _ in NAMES if kind == "class"
               and getattr(_resolve(path), "__module__", "") in UNSUPPORTED_HOMES}
    assert raising == set(OUT_OF_SCOPE)


def test_out_of_scope_rows_name_tf_names_and_say_what_to_use():
    paths = {path for path, _, _ in NAMES}
    assert OUT_OF_SCOPE, "docs/strategies.md has no 'Not available over MPI' table"
    assert set(OUT_OF_SCOPE) <= paths, set(OUT_OF_SCOPE) - paths
    assert "TPUStrategy" in OUT_OF_SCOPE and "experimental.TPUStrategy" in OUT_OF_SCOPE
    for path, instead in OUT_OF_SCOPE.items():
        assert "mpistrat" in instead or "mpi4py" in instead or "MPI" in instead, (path, instead)


def test_names_that_differ_only_in_spelling_are_one_object():
    assert mpistrat.coordinator.PerWorkerValue is mpistrat.experimental.coordinator.PerWorkerValues
    assert mpistrat.experimental.TPUStrategy is mpistrat.TPUStrategy
    assert mpistrat.experimental.CollectiveCommunication is \
        mpistrat.experimental.CommunicationImplementation
    with pytest.warns(DeprecationWarning, match="CommunicationOptions"):
        hints = mpistrat.experimental.CollectiveHints(bytes_per_pack=1024, timeout_seconds=5)
    assert hints == mpistrat.experimental.CommunicationOptions(1024, 5)


def test_tpu_strategy_is_a_strategy_class_for_isinstance_but_cannot_be_built():
    assert issubclass(mpistrat.TPUStrategy, mpistrat.Strategy)
    assert not isinstance(mpistrat.OneDeviceStrategy("/cpu:0"), mpistrat.TPUStrategy)
    with pytest.raises(UnsupportedError, match="MultiWorkerMirroredStrategy"):
        mpistrat.TPUStrategy(tpu_cluster_resolver=None)


def test_importing_the_namespace_loads_no_parameter_server_code_mpi_or_gpu_library():
    code = ("import sys, mpistrat as tfd; tfd.experimental.CentralStorageStrategy; "
            "tfd.cluster_resolver.TFConfigClusterResolver; tfd.experimental.partitioners; "
            "bad = [m for m in ('cloudpickle', 'mpistrat.ps', 'mpi4py.MPI', 'cupy', 'torch', "
            "'jax') if m in sys.modules]; print(bad); "
            "tfd.coordinator.ClusterCoordinator; print('mpistrat.ps' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["[]", "True"], out


def test_run_options_have_tfs_fields_and_run_accepts_them():
    options = mpistrat.RunOptions()
    assert options == (True, False, None)
    assert options._fields == ("experimental_enable_dynamic_batch_size",
                               "experimental_bucketizing_dynamic_shape",
                               "experimental_xla_options")
    strategy = mpistrat.OneDeviceStrategy("/cpu:0")
    tuned = mpistrat.RunOptions(experimental_enable_dynamic_batch_size=False,
                                experimental_bucketizing_dynamic_shape=True,
                                experimental_xla_options=object())
    for opts in (None, options, tuned):
        assert strategy.run(lambda x: x * 2, args=(np.ones(2),), options=opts).tolist() == [2, 2]
    assert strategy.experimental_run_v2(lambda: 3, options=tuned) == 3


@pytest.mark.parametrize("bad,message", [
    (mpistrat.CommunicationOptions(), "CommunicationOptions go to"),
    ({"experimental_xla_options": None}, "must be an mpistrat.RunOptions"),
    (mpistrat.RunOptions(experimental_enable_dynamic_batch_size="yes"), "True or False"),
])
def test_run_rejects_what_is_not_run_options(bad, message):
    strategy = mpistrat.OneDeviceStrategy("/cpu:0")
    with pytest.raises(TypeError, match=message):
        strategy.run(lambda: None, options=bad)
