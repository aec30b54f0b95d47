"""Random generators in checkpoints (``mpistrat.checkpoint._random``): NumPy's legacy
``RandomState``, ``random.Random``, ``torch.Generator`` and the process's global ones
resume the stream they were saved at, a state restores only into its own kind, and every
forged state is a clear error naming the field, never a generator left half set."""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import pytest

from mpistrat.checkpoint import Checkpoint, CheckpointCorruptError, global_generators
from mpistrat.checkpoint import _random

MPI = pytest.importorskip("mpi4py.MPI")
SELF = MPI.COMM_SELF


def draws(obj, n=5):
    """``n`` draws of each kind of generator (normal ones too: their cached second value
    is state)."""
    if isinstance(obj, np.random.RandomState):
        return [*obj.random_sample(n), obj.standard_normal()]
    if isinstance(obj, random.Random):
        return [obj.random() for _ in range(n)] + [obj.gauss(0, 1)]
    return obj_torch_draws(obj, n)


def obj_torch_draws(generator, n):
    import torch
    return [*torch.rand(n, generator=generator).tolist(),
            *torch.randn(3, generator=generator).tolist()]


def kinds():
    found = [("RandomState", lambda: np.random.RandomState(7)),
             ("random.Random", lambda: random.Random(7))]
    try:
        import torch
    except ImportError:
        return found
    return found + [("torch.Generator", lambda: torch.Generator().manual_seed(7))]


@pytest.mark.parametrize("name, make", kinds(), ids=[k[0] for k in kinds()])
def test_a_generator_resumes_its_stream(tmp_path, name, make):
    rng = make()
    draws(rng, 3)  # (one normal drawn: its pair's second value is cached, and saved)
    path = Checkpoint(comm=SELF, rng=rng).write(str(tmp_path / "g"))
    expected = draws(rng)
    other = make()
    draws(other, 11)
    Checkpoint(comm=SELF, rng=other).restore(path)
    assert draws(other) == expected
    entry = json.load(open(path + ".json"))["entries"][0]
    assert entry["kind"] == "generator" and entry["state"]["bit_generator"] == name


def test_the_global_generators_resume_what_the_run_would_have_drawn(tmp_path):
    random.seed(1)
    np.random.seed(1)
    random.random(), np.random.rand()
    torch = None
    try:
        import torch
        torch.manual_seed(1)
        torch.rand(2)
    except ImportError:
        pass
    ckpt = Checkpoint(comm=SELF, rng=global_generators())
    path = ckpt.write(str(tmp_path / "g"))
    expected = [random.random(), np.random.rand(), np.random.randn()]
    if torch is not None:
        expected.append(torch.rand(1).item())
    random.seed(2)
    np.random.seed(2)
    if torch is not None:
        torch.manual_seed(2)
    ckpt.restore(path)
    got = [random.random(), np.random.rand(), np.random.randn()]
    if torch is not None:
        got.append(torch.rand(1).item())
    assert got == expected
    assert set(global_generators()) == ({"python", "numpy", "torch"} if torch is not None
                                        else {"python", "numpy"})


def test_a_state_restores_only_into_its_own_kind(tmp_path):
    path = Checkpoint(comm=SELF, rng=np.random.RandomState(1)).write(str(tmp_path / "g"))
    target = random.Random(3)
    before = target.getstate()
    with pytest.raises(ValueError, match="'rng' holds a RandomState state, the object is a "
                                         "random.Random") as info:
        Checkpoint(comm=SELF, rng=target).restore(path)
    assert type(info.value) is ValueError and target.getstate() == before


def test_a_torch_state_restores_only_into_a_generator_of_its_size(tmp_path):
    torch = pytest.importorskip("torch")
    path = Checkpoint(comm=SELF, rng=torch.Generator()).write(str(tmp_path / "g"))
    manifest = json.load(open(path + ".json"))
    manifest["entries"][0]["state"]["device"] = "cuda"
    assert _random.mismatch(torch.Generator(), manifest["entries"][0]["state"]) == \
        "holds the state of a torch generator on cuda, the object is on cpu"
    short = dict(manifest["entries"][0]["state"], device="cpu",
                 state=base64.b64encode(bytes(16)).decode())
    assert "holds a torch generator state of 16 bytes, the object's has 5056" in \
        _random.mismatch(torch.Generator(), short)


def _mt(**change):
    state = _random.get_state(np.random.RandomState(0))
    state.update(change)
    return state


def _py(**change):
    state = _random.get_state(random.Random(0))
    state.update(change)
    return state


FORGED = {
    "not an object": ([1, 2], r"\[1, 2\], expected a generator's state"),
    "unknown family": ({"bit_generator": "java.util.Random"},
                       "expected the name of a NumPy bit generator .*'random.Random'"),
    "legacy: missing field": ({"bit_generator": "RandomState", "key": "", "pos": 0},
                              r"\['key', 'pos'\], expected the fields \['gauss', 'has_gauss'"),
    "legacy: extra field": (_mt(extra=1), r"expected the fields"),
    "legacy: short key": (_mt(key=base64.b64encode(bytes(100)).decode()),
                          "expected the base64 of 624 32-bit words"),
    "legacy: long key": (_mt(key=base64.b64encode(bytes(1 << 20)).decode()),
                         "expected base64 text of at most 2496 bytes"),
    "legacy: not base64": (_mt(key="!" * 3328), "expected base64 text"),
    "legacy: key a list": (_mt(key=[1, 2, 3]), "expected base64 text"),
    "legacy: pos too big": (_mt(pos=625), r"625, expected an integer from 0 to 624"),
    "legacy: pos negative": (_mt(pos=-1), "expected an integer from 0 to 624"),
    "legacy: pos a bool": (_mt(pos=True), "expected an integer from 0 to 624"),
    "legacy: has_gauss 2": (_mt(has_gauss=2), r"expected 0 or 1 in \"has_gauss\""),
    "legacy: gauss nan": (_mt(gauss=float("nan")), "expected a finite number"),
    "legacy: gauss text": (_mt(gauss="0.5"), "expected a finite number"),
    "python: short key": (_py(key=""), "expected the base64 of 624 32-bit words"),
    "python: gauss inf": (_py(gauss=float("inf")), "expected a finite number"),
    "torch: bad device": ({"bit_generator": "torch.Generator", "device": "../cpu",
                          "state": ""}, "expected a torch device type"),
    "torch: huge state": ({"bit_generator": "torch.Generator", "device": "cpu",
                          "state": "A" * (4 << 20)}, "expected base64 text of at most"),
}


@pytest.mark.parametrize("forged", list(FORGED))
def test_forged_states_are_refused_naming_the_field(forged):
    state, match = FORGED[forged]

    def bad(value, expected):
        return CheckpointCorruptError(f"state {value!r:.80}, expected {expected}")

    with pytest.raises(CheckpointCorruptError, match=match):
        _random.check_state(json.loads(json.dumps(state)), bad)


def test_a_forged_cpu_torch_state_is_refused_before_any_generator_changes(tmp_path):
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(4)
    path = Checkpoint(comm=SELF, rng=generator).write(str(tmp_path / "g"))
    manifest = json.load(open(path + ".json"))
    manifest["entries"][0]["state"]["state"] = base64.b64encode(bytes(5056)).decode()
    with open(path + ".json", "w") as file:
        json.dump(manifest, file)
    before = generator.get_state().clone()
    with pytest.raises(CheckpointCorruptError):
        Checkpoint(comm=SELF, rng=generator).restore(path)
    assert torch.equal(generator.get_state(), before)


def test_valid_states_pass_their_checks():
    def bad(value, expected):  # pragma: no cover - must not be called
        raise AssertionError(expected)

    for make in [np.random.RandomState, random.Random, np.random.default_rng]:
        state = json.loads(json.dumps(_random.get_state(make(3))))
        assert _random.check_state(state, bad) == state


def test_a_generator_without_state_is_refused_at_construction():
    with pytest.raises(TypeError, match="cannot checkpoint 'rng': a SystemRandom"):
        Checkpoint(comm=SELF, rng=random.SystemRandom())
